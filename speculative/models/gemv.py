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
chain after the other (see packed.STATIC_ROWS_MAX for what it gains). With packed.INT8_WORDS (AVX2
CPUs), a matmul of up to STATIC_ROWS_MAX static rows by an int8 weight converted to float reads that
weight as int32 words instead (_words), four int8 columns a load. PackedLinear leaves
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

from speculative.models import packed
from speculative.models.packed import REDUCTION_MAX_ROWS, STATIC_ROWS_MAX

aten = torch.ops.aten
prims = torch.ops.prims
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


def _few_static_cpu_rows(x: torch.fx.Node, w: torch.fx.Node) -> bool:
    """_few_cpu_rows, with rows statically <= STATIC_ROWS_MAX."""
    return _few_cpu_rows(x, w) and statically_known_true(x.meta["val"].shape[0] <= STATIC_ROWS_MAX)


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
    _replace_realizing(match, example, args)
    _replaced(
        x, "static_rows" if statically_known_true(x.meta["val"].shape[0] <= STATIC_ROWS_MAX) else "rows"
    )


def _replace_realizing(match: Match, example, args: list[torch.fx.Node]) -> None:
    """Replace the matched matmul by `example`, each contiguous copy it makes realized as such
    (inductor's hint) rather than recomputed where it is read."""
    graph = match.graph
    before = set(graph.nodes)
    match.replace_by_example(example, args)
    for node in graph.nodes:
        if node not in before and node.target == aten.clone.default:
            node.meta["inductor_realize_to_strides"] = True


def _replaced(x: torch.fx.Node, kind: str = "gemv") -> None:
    """x, an input of a rewritten matmul, is computed into a buffer of its own (inductor's hint)."""
    x.meta["inductor_realize_to_strides"] = True
    counters["speculative"][kind] += 1


def _int8_source(w: torch.fx.Node) -> torch.fx.Node | None:
    """The int8 [out, in] tensor whose float conversion, transposed, w is (a quantized PackedLinear's
    weight as F.linear takes it), if packed.INT8_WORDS reads such weights as words and `in` is a
    multiple of 4; else None."""
    if not packed.INT8_WORDS or w.target != aten.permute.default:
        return None
    converted = w.args[0]
    if not isinstance(converted, torch.fx.Node) or converted.target != prims.convert_element_type.default:
        return None
    q = converted.args[0]
    val = q.meta.get("val") if isinstance(q, torch.fx.Node) else None
    if isinstance(val, Tensor) and val.dtype == torch.int8 and val.dim() == 2 and val.shape[1] % 4 == 0:
        return q
    return None


def _words(x: Tensor, q: Tensor) -> Tensor:  # x [rows, in] float32, q [out, in] int8 -> x @ q.T [rows, out]
    """The product of a few static rows with q read as int32 words [out, in / 4], word j holding
    columns 4j to 4j + 3 (little-endian: x86), each byte sign-extended by two shifts; x de-interleaved
    once into [rows, 4, in / 4], so that every load is contiguous and inductor's loop is vectorized
    along the words, with an accumulator per row (each word decoded once for all rows)."""
    words = q.view(torch.int32)
    xt = x.view(x.shape[0], -1, 4).transpose(1, 2).contiguous()  # xt[r, b, j] = x[r, 4j + b]
    decoded = [((words << (24 - 8 * b)) >> 24).float() for b in range(4)]  # byte b of each word

    def row_product(row: int) -> Tensor:  # [out]
        total = xt[row, 0] * decoded[0]
        for b in range(1, 4):
            total = total + xt[row, b] * decoded[b]
        return total.sum(-1)

    return torch.stack([row_product(row) for row in range(x.shape[0])])


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _mm(match: Match, x: torch.fx.Node, w: torch.fx.Node) -> None:
    if (q := _int8_source(w)) is not None and _few_static_cpu_rows(x, w):
        _replace_realizing(match, _words, [x, q])
        _replaced(x, "words")
    elif _one_cpu_row(x, w):
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

    def uuid(self) -> bytes:  # inductor's compile cache keys on it: the source of this file, the layout
        return get_hash_for_files((__file__,)) + bytes([packed.INT8_WORDS])


GEMV_PASS = _GemvPass()
