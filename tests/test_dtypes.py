"""What dtype="auto" means on each device, and that the CLI says which dtype it took and why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_cli import readme_command, run

from speculative import LLM
from speculative.demo import DEMO_DIR
from speculative.models import dtypes
from speculative.models.dtypes import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_an_explicit_dtype_always_wins(monkeypatch) -> None:
    monkeypatch.setattr(dtypes, "cpu_computes_natively", lambda dtype: False)
    choice = resolve_dtype("bfloat16", torch.float32, CPU)
    assert choice.dtype == torch.bfloat16 and "as asked" in choice.reason
    assert resolve_dtype(torch.float16, None, CPU, "draft_dtype").reason == "draft_dtype='float16' as asked"


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_a_cpu_takes_half_precision_only_where_it_is_native(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(dtypes, "cpu_computes_natively", lambda dtype: native)
    choice = resolve_dtype("auto", torch.bfloat16, CPU)
    assert choice.dtype == (torch.bfloat16 if native else torch.float32)
    assert ("computes natively" if native else "no native bfloat16") in choice.reason
    assert resolve_dtype("auto", torch.bfloat16, CUDA).dtype == torch.bfloat16  # a GPU: the checkpoint's
    assert resolve_dtype("auto", torch.float32, CPU).dtype == torch.float32
    assert resolve_dtype("auto", None, CPU).dtype == torch.float32


def test_bad_dtype_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="draft_dtype must be 'auto'"):
        resolve_dtype("int8", None, CPU, "draft_dtype")


def test_avx2_only_cpu_has_no_native_bfloat16() -> None:
    """ATen's and oneDNN's AVX2 code paths (as on a CPU without AVX-512): bfloat16 is not native."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = (
        "import torch; from speculative.models.dtypes import cpu_computes_natively as n; "
        "print(n(torch.bfloat16), n(torch.float32))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_the_demo_pair_loads_in_the_dtype_auto_chooses() -> None:
    llm = LLM(str(DEMO_DIR / "target"), draft_model=str(DEMO_DIR / "draft"))
    want = torch.bfloat16 if dtypes.cpu_computes_natively(torch.bfloat16) else torch.float32
    for loaded in (llm.target, llm.draft):
        assert loaded.dtype.dtype == want == loaded.model.dtype
        assert loaded.dtype.reason.startswith("auto: ")


def test_the_cli_says_which_dtype_and_why() -> None:
    result = run(readme_command("demo") + ["--max-tokens", "4"])
    assert result.returncode == 0, result.stderr
    assert "speculative: target and draft in " in result.stderr and "(auto: " in result.stderr
