"""`speculative serve` without --model: the demo model's draft chooses k per step (adaptive k), since at
its fixed k it runs slower than plain decoding under load, and runs compiled (its graphs compiling in
the background: tests/server/test_serve_draft_compile.py), and prefixes are cached, unless the flags
say otherwise. The demo
model itself is not fetched here: its pair stands in for it (the toy pair's folders), and nothing
compiles."""

from __future__ import annotations

import shutil

import pytest

from speculative import cli
from speculative.demo import DEMO_DIR, smollm2
from speculative.models.compiled import CompiledCausalLM
from speculative.server import app


@pytest.fixture
def demo_stand_in(monkeypatch, tmp_path) -> None:
    """The toy pair as the demo pair, its draft declaring what the demo's draft declares."""
    monkeypatch.delenv(smollm2.DEMO_ENV)
    draft = tmp_path / "draft"
    draft.mkdir()
    for file in (DEMO_DIR / "draft").iterdir():
        (draft / file.name).symlink_to(file)
    (draft / "generation_config.json").unlink()
    shutil.copy(smollm2.DRAFT_PACKAGE / "generation_config.json", draft)
    pair = smollm2.DemoPair(DEMO_DIR / "target", draft, DEMO_DIR / "model.gguf")
    monkeypatch.setattr(smollm2, "demo_pair", lambda: pair)


@pytest.fixture
def compiles_nothing(monkeypatch) -> None:
    monkeypatch.setattr(app, "_compile_ahead", lambda llm: None)


# flags, adaptive, the draft compiled, k, the draft's own chain (None: k): as declared, 4 and 1
CASES = [
    ([], True, True, 4, None),
    (["--no-adaptive"], False, True, 4, None),
    (["--adaptive", "-k", "2"], True, True, 2, None),
    (["-k", "3", "--num-assistant-tokens", "2"], True, True, 3, 2),
    (["--no-draft-compile"], True, False, 4, 1),
    (["--model-impl", "transformers"], True, False, 4, 1),
    (["--tree", "static"], False, False, 1, None),
]


@pytest.mark.parametrize(
    "flags, cached",
    [([], True), (["--no-enable-prefix-caching"], False), (["--model-impl", "transformers"], False)],
)
def test_the_demo_server_caches_prefixes_unless_told_otherwise(
    demo_stand_in, compiles_nothing, flags, cached
):
    """On the native forward the demo server keeps prompts' K/V (a chat's next turn prefills only its
    new message); a server of a given model does not unless asked."""
    llm = app.serve_app(*cli.serve_args(flags)).state.scheduler.llm
    assert (llm.engine.prefix_cache is not None) is cached


@pytest.mark.parametrize("flags,adaptive,compiled,k,own", CASES)
def test_the_demo_servers_draft_chooses_k_and_compiles_unless_told_otherwise(
    demo_stand_in, compiles_nothing, flags, adaptive, compiled, k, own
) -> None:
    llm = app.serve_app(*cli.serve_args(flags)).state.scheduler.llm
    assert llm.speculative_config.adaptive is adaptive
    assert llm.engine.draft_length.adaptive is adaptive
    assert isinstance(llm.draft.model, CompiledCausalLM) is compiled
    assert not isinstance(llm.target.model, CompiledCausalLM)
    assert llm.speculative_config.num_speculative_tokens == k
    assert getattr(llm.engine.proposer, "draft_tokens", None) == own


def test_a_server_of_a_given_model_keeps_its_k_and_its_eager_draft(model_dirs, compiles_nothing) -> None:
    flags = ["--model", model_dirs["target"], "--draft-model", model_dirs["draft"]]
    llm = app.serve_app(*cli.serve_args(flags)).state.scheduler.llm
    assert llm.speculative_config.adaptive is False
    assert not isinstance(llm.draft.model, CompiledCausalLM)
    assert llm.engine.prefix_cache is None
