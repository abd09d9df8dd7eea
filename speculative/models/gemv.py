"""One-row matmuls as inductor reductions on CPU: a compiled decoding step at the memory's speed.

A decode step multiplies one row by every weight matrix, so its cost is streaming the weights from
memory. The BLAS kernels torch calls for one row stream them at a fraction of the machine's bandwidth,
and how large a fraction depends on the CPU and the library: measured on a 2-core AMD EPYC (AVX-512,
copy bandwidth 33 GB/s), the demo target's 49 matmuls of one row in float32 took 6.4 ms through MKL
(14.8 GB/s), 4.5 ms through oneDNN (21 GB/s), and 2.9-3.3 ms as the reduction below (29-33 GB/s; the
same under AVX2 only; bfloat16 weights 1.3-1.5 ms).

`GEMV_PASS`, given to torch.compile as inductor's `post_grad_custom_post_pass`, rewrites every CPU
`mm(x, w)` / `addmm(bias, x, w)` whose x has statically one row into `sum(x[:, :, None] * w, -2)`
(+ bias), which inductor compiles into one loop over w's rows, vectorized along the row that is
contiguous in memory (w is the transposed view of an nn.Linear weight [out, in]), accumulating in
float32 (bfloat16 products included), and parallel over the outputs. x is realized first: left as
an expression, inductor would recompute its whole producer (norms, residual sums) for every output.

It also rewrites `mm(x, w)` of a few rows (2 or more; the caller keeps them few, PackedLinear up to
its REDUCTION_MAX_ROWS) whose w is an int8 tensor converted to float and transposed (a quantized
PackedLinear's weight, models/packed.py) into `sum(x[None] * w.T[:, None], -1).T`: a loop over w's
rows that reads each int8 row once, converting it in the loop, for all rows of x.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import Arg, CallFunction, Match, PatternMatcherPass, register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
_PATTERNS = PatternMatcherPass(pass_name="speculative_gemv")


def _one_cpu_row(x: torch.fx.Node, w: torch.fx.Node) -> bool:
    x, w = x.meta.get("val"), w.meta.get("val")
    return (isinstance(x, Tensor) and isinstance(w, Tensor) and x.dim() == 2 and w.dim() == 2
            and x.device.type == "cpu" and w.device.type == "cpu" and statically_known_true(x.shape[0] == 1))


def _gemv(x: Tensor, w: Tensor) -> Tensor:  # x [1, in], w [in, out] -> [1, out]
    return torch.sum(x[:, :, None] * w[None, :, :], dim=-2).to(x.dtype)


def _int8_cpu_rows(x: torch.fx.Node, w: torch.fx.Node) -> bool:
    """x [rows, in] on CPU, w [in, out] a view or conversion (to float) of an int8 tensor."""
    value = x.meta.get("val")
    if not (isinstance(value, Tensor) and value.dim() == 2 and value.device.type == "cpu"):
        return False
    node = w
    for _ in range(4):  # permute / t / convert_element_type / _to_copy, to the int8 tensor
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(value, Tensor) and value.dtype == torch.int8:
            return True
        if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args
                and node.target in _INT8_VIEWS):
            return False
        node = node.args[0]
    return False


_INT8_VIEWS = (aten.permute.default, aten.t.default, torch.ops.prims.convert_element_type.default,
               aten._to_copy.default)


def _rows(x: Tensor, w: Tensor) -> Tensor:  # x [rows, in], w [in, out] -> [rows, out]
    return torch.sum(x[None, :, :] * w.t()[:, None, :], dim=-1).t().to(x.dtype)


def _replaced(x: torch.fx.Node, kind: str = "gemv") -> None:
    """x, an input of a rewritten matmul, is computed into a buffer of its own (inductor's hint)."""
    x.meta["inductor_realize_to_strides"] = True
    counters["speculative"][kind] += 1


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _mm(match: Match, x: torch.fx.Node, w: torch.fx.Node) -> None:
    if _one_cpu_row(x, w):
        match.replace_by_example(_gemv, [x, w])
        _replaced(x)
    elif _int8_cpu_rows(x, w):
        match.replace_by_example(_rows, [x, w])
        _replaced(x, "int8_rows")


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()), pass_dict=_PATTERNS)
def _addmm(match: Match, bias: torch.fx.Node, x: torch.fx.Node, w: torch.fx.Node) -> None:
    if _one_cpu_row(x, w):
        match.replace_by_example(lambda b, x, w: _gemv(x, w) + b, [bias, x, w])
        _replaced(x)


class _GemvPass(CustomGraphPass):
    """The rewrite as a pass inductor runs after its own post-grad passes."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self) -> bytes:  # inductor's compile cache keys on it: the source of this file
        return get_hash_for_files((__file__,))


GEMV_PASS = _GemvPass()
