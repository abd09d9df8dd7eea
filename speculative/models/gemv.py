"""One-row matmuls as inductor reductions on CPU: a compiled decoding step at the memory's speed.

A decode step multiplies one row by every weight matrix, so its cost is streaming the weights from
memory. The BLAS kernels torch calls for one row stream them at a fraction of the machine's bandwidth,
and how large a fraction depends on the CPU and the library; the reduction below streams them at
about the speed of a large copy (docs/internals.md#measured-choices).

`GEMV_PASS`, given to torch.compile as inductor's `post_grad_custom_post_pass`, rewrites every CPU
`mm(x, w)` / `addmm(bias, x, w)` whose x has statically one row into `sum(x[:, :, None] * w, -2)`
(+ bias), which inductor compiles into one loop over w's rows, vectorized along the row that is
contiguous in memory (w is the transposed view of an nn.Linear weight [out, in]), accumulating in
float32 (bfloat16 products included), and parallel over the outputs. x is realized first: left as
an expression, inductor would recompute its whole producer (norms, residual sums) for every output.

It also rewrites `mm(x, w)` of a few rows (2 to packed.REDUCTION_MAX_ROWS, statically known: the
caller's guard) whose w is float32, or an int8 tensor converted to float (a quantized PackedLinear's
weight), into
`sum(x[None] * w.T[:, None], -1).T`: a loop over w's rows that reads each row once (an int8 row
converted in the loop) and multiplies it by every row of x while it is in cache. Where the number of
rows is static, it is one `sum(x[r] * w.T, -1)` per row r instead, which inductor fuses into one loop
over w with an accumulator per row: independent chains of additions, where the loop over rows had one
chain after the other (see packed.STATIC_ROWS_MAX for what it gains). PackedLinear leaves
such a matmul in a compiled graph only where this reduction is the faster kernel (models/packed.py).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

from speculative.models.packed import REDUCTION_MAX_ROWS, STATIC_ROWS_MAX

aten = torch.ops.aten
_PATTERNS = PatternMatcherPass(pass_name="speculative_gemv")


def _one_cpu_row(x: torch.fx.Node, w: torch.fx.Node) -> bool:
    x, w = x.meta.get("val"), w.meta.get("val")
    return (
        isinstance(x, Tensor)
        and isinstance(w, Tensor)
        and x.dim() == 2
        and w.dim() == 2
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and statically_known_true(x.shape[0] == 1)
    )


def _gemv(x: Tensor, w: Tensor) -> Tensor:  # x [1, in], w [in, out] -> [1, out]
    return torch.sum(x[:, :, None] * w[None, :, :], dim=-2).to(x.dtype)


def _few_cpu_rows(x: torch.fx.Node, w: torch.fx.Node) -> bool:
    """x [rows, in] and w [in, out] float32 on CPU (w as stored, or converted from int8), with rows
    statically <= REDUCTION_MAX_ROWS."""
    x, w = x.meta.get("val"), w.meta.get("val")
    return (
        isinstance(x, Tensor)
        and isinstance(w, Tensor)
        and x.dim() == 2
        and w.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == w.dtype == torch.float32
        and statically_known_true(x.shape[0] <= REDUCTION_MAX_ROWS)
    )


def _rows(x: Tensor, w: Tensor) -> Tensor:  # x [rows, in], w [in, out] -> [rows, out]
    if statically_known_true(x.shape[0] <= STATIC_ROWS_MAX):  # static and few: a reduction per row, fused
        return torch.stack([torch.sum(x[row, None, :] * w.t(), dim=-1) for row in range(x.shape[0])]).to(
            x.dtype
        )
    return torch.sum(x[None, :, :] * w.t()[:, None, :], dim=-1).t().contiguous().to(x.dtype)


def _replace_rows(match: Match, example, args: list[torch.fx.Node], x: torch.fx.Node) -> None:
    """Replace the matched matmul by `example` (made of _rows), whose reduction comes out [out, rows]
    (unless the rows are static and few): its contiguous copy [rows, out] is realized as such
    (inductor's hint). Left to inductor, every
    consumer would read the [out, rows] buffer instead, vectorized and parallel along rows, which are
    few: one thread doing the residual adds and norms with strided loads."""
    graph = match.graph
    before = set(graph.nodes)
    match.replace_by_example(example, args)
    for node in graph.nodes:
        if node not in before and node.target == aten.clone.default:
            node.meta["inductor_realize_to_strides"] = True
    _replaced(
        x, "static_rows" if statically_known_true(x.meta["val"].shape[0] <= STATIC_ROWS_MAX) else "rows"
    )


def _replaced(x: torch.fx.Node, kind: str = "gemv") -> None:
    """x, an input of a rewritten matmul, is computed into a buffer of its own (inductor's hint)."""
    x.meta["inductor_realize_to_strides"] = True
    counters["speculative"][kind] += 1


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _mm(match: Match, x: torch.fx.Node, w: torch.fx.Node) -> None:
    if _one_cpu_row(x, w):
        match.replace_by_example(_gemv, [x, w])
        _replaced(x)
    elif _few_cpu_rows(x, w):
        _replace_rows(match, _rows, [x, w], x)


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()), pass_dict=_PATTERNS)
def _addmm(match: Match, bias: torch.fx.Node, x: torch.fx.Node, w: torch.fx.Node) -> None:
    if _one_cpu_row(x, w):
        match.replace_by_example(lambda b, x, w: _gemv(x, w) + b, [bias, x, w])
        _replaced(x)
    elif _few_cpu_rows(x, w):
        _replace_rows(match, lambda b, x, w: _rows(x, w) + b, [bias, x, w], x)


class _GemvPass(CustomGraphPass):
    """The rewrite as a pass inductor runs after its own post-grad passes."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self) -> bytes:  # inductor's compile cache keys on it: the source of this file
        return get_hash_for_files((__file__,))


GEMV_PASS = _GemvPass()
