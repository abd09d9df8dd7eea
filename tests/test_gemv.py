"""One-row matmuls compiled as inductor reductions (models/gemv.py): the same values as F.linear, and the
rewrite really happens (and only for one row)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters

from speculative.models.gemv import GEMV_PASS


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


def test_several_rows_are_left_to_the_matmul() -> None:
    weight, x = torch.randn(40, 16), torch.randn(3, 16)
    with inductor_config.patch(force_disable_caches=True):
        counters.clear()
        got = _compiled(lambda x: x @ weight.t())(x)
    assert counters["speculative"]["gemv"] == 0
    torch.testing.assert_close(got, x @ weight.t())
