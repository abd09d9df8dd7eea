"""Linear layers laid out once, at load, for the matmul kernels that are fastest at inference.

A decode step multiplies a few rows by every weight matrix of the model, so on a CPU its cost is
streaming the weights from memory, and which kernel streams them fastest depends on the CPU, the
dtype, the shape and the number of rows. Measured on a 2-core AMD EPYC (AVX-512 with AVX512-BF16, no
AMX), 2 threads, microseconds per matmul, 12 distinct weights of each of the demo target's shapes
[out, in] (W: F.linear on the weight as stored, MKL in float32; oneDNN: mkldnn's linear on a
prepacked copy):

  float32      rows:  1     5    40   |  bfloat16     1     5    40
  [640, 384]  W      44    83   229   |  W           27    34    77
              oneDNN 45    48   141   |  oneDNN      19    22    59
  [2304, 384] W     504   534   942   |  W          144   152   313
              oneDNN 203  194   497   |  oneDNN      59    66   217
  [8192, 384] W    1829  2594  4331   |  W          435   469  1025
              oneDNN 858  712  1488   |  oneDNN     319   235   717

(On an Intel Xeon with AMX, one thread, float32 one-row calls on the smaller shapes ran 10-30%
faster through MKL with W.T stored contiguous than through oneDNN, whose call costs about 12 us
whatever the size; everything else was oneDNN's, as here.) Hence: on CPU, in float32 and bfloat16,
a oneDNN prepacked copy serves every call, except one-row calls in a compiled graph, which inductor
compiles into a reduction over W as stored, faster still (models/gemv.py). Elsewhere (CUDA, other
dtypes, no oneDNN), F.linear on W.
Each layer's q/k/v projections are one PackedLinear, and so are its gate/up projections: one matmul
instead of three or two.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

_PACKABLE = (torch.float32, torch.bfloat16)
_REGISTRY: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_handles = itertools.count()


def _should_prepack(weight: Tensor) -> bool:  # weight [out, in]
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear:
    """y = x @ W.T + bias (+ residual), W [out, in] the concatenation of several nn.Linear weights.

    Several nn.Linears are concatenated once and their weights (and biases) become views into the
    result: the modules, their parameters and their state_dict stay as they were, with no second copy
    in the old layout, and an in-place change of a parameter changes this layer too. A single
    nn.Linear (a tied lm_head's weight is also the embedding) is used as it is.
    On CPU, in float32 and bfloat16 (where oneDNN computes it), a oneDNN prepacked copy of W serves
    the calls that are not compiled one-row calls: `stale()` tells when the weights changed since, and
    `pack()` makes it again.
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.linears = list(linears)
        self.pack()

    def pack(self) -> None:
        """(Re)build the layouts from the current weights of the nn.Linears."""
        linears = self.linears
        if len(linears) == 1:
            self.weight = linears[0].weight.detach()  # shares the parameter's storage and version counter
            self.bias = linears[0].bias.detach() if linears[0].bias is not None else None
        else:
            self.weight = torch.cat([linear.weight.detach() for linear in linears])  # [out, in]
            self.bias = None
            if any(linear.bias is not None for linear in linears):
                self.bias = torch.cat([linear.bias.detach() if linear.bias is not None
                                       else self.weight.new_zeros(linear.out_features) for linear in linears])
            offset = 0
            for linear in linears:  # the parameters become views into the fused weight
                end = offset + linear.out_features
                grad = linear.weight.requires_grad
                linear.weight = nn.Parameter(self.weight[offset:end], requires_grad=grad)
                if linear.bias is not None:
                    linear.bias = nn.Parameter(self.bias[offset:end], requires_grad=grad)
                offset = end
        self.prepacked = (torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous())
                          if _should_prepack(self.weight) else None)
        self._version = self._weights_version()
        self.handle = next(_handles)
        _REGISTRY[self.handle] = self

    def _weights_version(self) -> int:
        return sum(t._version for t in (self.weight, self.bias) if t is not None and not t.is_inference())

    def stale(self) -> bool:
        """Whether a weight changed in place since `pack()`: the prepacked copy, if any, is out of date
        (the weight itself is the parameters' own storage and follows the change)."""
        return self._version != self._weights_version()

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:  # x [rows, in] -> [rows, out]
        """x @ W.T + bias, plus `residual` ([rows, out]) when given."""
        if self.prepacked is not None:
            if torch.compiler.is_compiling():
                if statically_known_true(x.shape[0] == 1):  # left to inductor: a reduction (gemv.py)
                    return _linear(x, self.weight, self.bias, residual)
                # an opaque op to the compiler, which calls it as it is
                return torch.ops.speculative.prepacked_linear(x, residual, self.handle)
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.prepacked, self.bias, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.prepacked, self.bias, "add")
        return _linear(x, self.weight, self.bias, residual)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    y = F.linear(x, weight, bias)
    return y if residual is None else y.add_(residual)


# The prepacked kernel of PackedLinear number `handle` as one op, for compiled graphs (inductor cannot
# take an opaque oneDNN weight that is not one of its own frozen constants). Defined with
# torch.library.Library rather than custom_op: a call then costs about 1 us more than the kernel
# alone, against 15 us through custom_op's wrappers (a forward makes ~50 such calls).
_LIBRARY = torch.library.Library("speculative", "DEF")
_LIBRARY.define("prepacked_linear(Tensor x, Tensor? residual, int handle) -> Tensor")
_LIBRARY.impl("prepacked_linear", lambda x, residual, handle: _REGISTRY[handle](x, residual), "CPU")


@torch.library.register_fake("speculative::prepacked_linear")
def _(x: Tensor, residual: Tensor | None, handle: int) -> Tensor:
    return x.new_empty(x.shape[0], _REGISTRY[handle].weight.shape[0])
