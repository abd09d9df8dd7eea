"""One-row matmuls compiled as inductor reductions (models/gemv.py): the same values as F.linear, and the
rewrite really happens (and only for one row)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters

from speculative.models import packed
from speculative.models.gemv import GEMV_PASS
from speculative.models.packed import REDUCTION_MAX_ROWS, STATIC_REDUCTION_MAX_ROWS, STATIC_ROWS_MAX


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, options={"post_grad_custom_post_pass": GEMV_PASS})


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_one_row_linear_with_bias_and_residual(dtype: torch.dtype, tolerance: float) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 72, generator=generator).to(dtype)  # [out, in]: sizes off any vector width
    bias, residual = torch.randn(300, generator=generator).to(dtype), torch.randn(1, 300, generator=generator)
    x = torch.randn(1, 72, generator=generator).to(dtype)
    want = F.linear(F.silu(x.double()), weight.double(), bias.double()) + residual.double()
    with inductor_config.patch(force_disable_caches=True):  # a cached graph would skip the pass
        counters.clear()  # the input computed in the graph (silu): realized, not recomputed per output
        got = _compiled(lambda x, r: F.linear(F.silu(x), weight, bias) + r.to(dtype))(x, residual)
    assert counters["speculative"]["gemv"] == 1
    assert (got.double() - want).abs().max() < tolerance * want.abs().max()


def test_a_few_float32_rows_are_one_reduction_and_more_are_left_to_the_matmul() -> None:
    """Static rows: up to STATIC_ROWS_MAX a reduction per row, up to REDUCTION_MAX_ROWS one over all
    rows, more left to the matmul."""
    weight, bias = torch.randn(40, 16), torch.randn(40)
    with inductor_config.patch(force_disable_caches=True):
        for rows, kind in ((3, "static_rows"), (STATIC_ROWS_MAX + 1, "rows"), (REDUCTION_MAX_ROWS + 1, None)):
            x = torch.randn(rows, 16)
            counters.clear()
            got = _compiled(lambda x: F.linear(x, weight, bias))(x)
            assert dict(counters["speculative"]) == ({kind: 1} if kind else {})
            torch.testing.assert_close(got, F.linear(x, weight, bias))
        counters.clear()  # bfloat16: left to the matmul
        _compiled(lambda x: x @ weight.t().bfloat16())(torch.randn(3, 16).bfloat16())
        assert counters["speculative"]["rows"] == 0


def test_packed_linear_leaves_dynamic_rows_to_oneDNN_without_a_guard_on_them() -> None:
    """A compiled PackedLinear call whose row count is dynamic (a batch) calls the prepacked op, however
    few its rows: no guard on them, so one graph serves 5 rows and 12 (a guard split each kind of call
    into two graphs on AVX2 CPUs, which the warm-up did not compile)."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(48, 80).requires_grad_(False)
    layer = packed.PackedLinear([linear])
    torch._dynamo.reset()
    compiled = torch.compile(layer.__call__, options={"post_grad_custom_post_pass": GEMV_PASS})
    with inductor_config.patch(force_disable_caches=True), torch.inference_mode():
        counters.clear()
        for rows in (5, 12):
            x = torch.randn(rows, 48, generator=generator)
            residual = torch.randn(rows, 80, generator=generator)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(residual, 0)
            torch.testing.assert_close(compiled(x, residual), linear(x) + residual)
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["speculative"]) == {}


def test_packed_linear_leaves_a_few_static_rows_to_the_reduction() -> None:
    """A compiled PackedLinear call of up to STATIC_REDUCTION_MAX_ROWS float32 rows known statically (a
    short batch-1 verification) is a reduction per row; one more static row calls the prepacked op
    (oneDNN's few-row kernel)."""
    linear = torch.nn.Linear(48, 80).requires_grad_(False)
    layer = packed.PackedLinear([linear])
    for rows, kinds in ((STATIC_REDUCTION_MAX_ROWS, {"static_rows": 1}), (STATIC_REDUCTION_MAX_ROWS + 1, {})):
        x, residual = torch.randn(rows, 48), torch.randn(rows, 80)
        with inductor_config.patch(force_disable_caches=True), torch.inference_mode():
            counters.clear()
            got = _compiled(layer.__call__)(x, residual)
        assert dict(counters["speculative"]) == kinds
        torch.testing.assert_close(got, linear(x) + residual)
