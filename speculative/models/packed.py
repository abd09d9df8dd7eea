"""Linear layers laid out once, at load, for the matmul kernels that are fastest at inference.

A decode step multiplies a few rows by every weight matrix of the model, so on a CPU its cost is
streaming the weights from memory, and which kernel streams them fastest depends on the dtype, the
shape and the number of rows. Measured on the project's CPU (2 cores, AVX-512 + AMX, one thread),
microseconds per matmul, 12 distinct weights of each of the demo target's shapes [out, in]:

  float32      rows:  1     2     5     8    40   |  bfloat16     1     5    40
  [640, 384]  W.T    36    41    42    45   121   |  W.T         51    43    63
              oneDNN 51    51    53    65   149   |  oneDNN      37    37    43
  [2304, 384] W.T   135   161   248   519   506   |  W.T        171   135   186
              oneDNN 170  184   199   311   705   |  oneDNN     100   104   118
  [8192, 384] W     470   477   995  1484  2999   |  W          451   500   642
              oneDNN 503  533   541   708  2455   |  oneDNN     329   318   355

(W.T: x @ W.T with W.T stored contiguous; W: F.linear on W as stored; oneDNN: mkldnn's linear on a
prepacked copy, which costs about 12 us per call whatever the size.) Hence the rule: in bfloat16,
always oneDNN; in float32, W.T, except oneDNN for 2 rows or more on weights of 2048 outputs or more
(not 3: a compiled graph would then need a case of its own for 2 rows).
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

_PACKABLE = (torch.float32, torch.bfloat16)
_WIDE = 2048  # float32 weights of at least this many outputs are prepacked for calls of 2+ rows
_REGISTRY: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_handles = itertools.count()


def _should_prepack(weight: Tensor) -> bool:  # weight [out, in]
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.shape[0] >= _WIDE


class PackedLinear:
    """y = x @ W.T + bias (+ residual), W [out, in] the concatenation of several nn.Linear weights.

    relayout=True stores W.T contiguous ([in, out]) and makes the nn.Linear weights (and biases)
    views into it: the modules, their parameters and their state_dict stay as they were, with no
    second copy in the old layout, and an in-place change of a parameter changes this layer too.
    relayout=False (a tied lm_head, whose weight is also the embedding) keeps W as it is.
    On CPU, in float32 and bfloat16, a oneDNN prepacked copy of W serves the calls that are faster
    with it: `stale()` tells when the weights changed since, and `pack()` makes it again.
    """

    def __init__(self, linears: Sequence[nn.Linear], relayout: bool = True) -> None:
        if not relayout and len(linears) != 1:
            raise ValueError("PackedLinear(relayout=False) takes a single nn.Linear")
        self.linears = list(linears)
        self.relayout = relayout
        self.pack()

    def pack(self) -> None:
        """(Re)build the layouts from the current weights of the nn.Linears."""
        linears = self.linears
        first = linears[0]
        self.weight_t = None
        if self.relayout:
            weight = torch.cat([linear.weight.detach() for linear in linears])  # [out, in]
            self.weight_t = weight.t().contiguous()  # [in, out]
            self.weight = self.weight_t.t()
            self.bias = None
            if any(linear.bias is not None for linear in linears):
                self.bias = torch.cat([linear.bias.detach() if linear.bias is not None
                                       else weight.new_zeros(linear.out_features) for linear in linears])
            offset = 0
            for linear in linears:  # the parameters become views into the new layout
                end = offset + linear.out_features
                grad = linear.weight.requires_grad
                linear.weight = nn.Parameter(self.weight[offset:end], requires_grad=grad)
                if linear.bias is not None:
                    linear.bias = nn.Parameter(self.bias[offset:end], requires_grad=grad)
                offset = end
        else:
            self.weight = first.weight.detach()  # shares the parameter's storage and version counter
            self.bias = first.bias.detach() if first.bias is not None else None
        self.prepacked = (torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous())
                          if _should_prepack(self.weight) else None)
        self.min_prepacked_rows = 2 if self.weight.dtype == torch.float32 else 1
        self._version = self._weights_version()
        self.handle = next(_handles)
        _REGISTRY[self.handle] = self

    def _weights_version(self) -> int:
        tensors = (self.weight, self.bias) if self.weight_t is None else (self.weight_t, self.bias)
        return sum(t._version for t in tensors if t is not None and not t.is_inference())

    def stale(self) -> bool:
        """Whether a weight changed in place since `pack()`: the prepacked copy, if any, is out of date
        (the other layouts are the parameters' own storage and follow the change)."""
        return self._version != self._weights_version()

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:  # x [rows, in] -> [rows, out]
        """x @ W.T + bias, plus `residual` ([rows, out]) when given."""
        if self.prepacked is not None and x.shape[0] >= self.min_prepacked_rows:
            if torch.compiler.is_compiling():  # an opaque op to the compiler, which calls it as it is
                return _prepacked_linear(x, residual, self.handle)
            if residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.prepacked, self.bias, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.prepacked, self.bias, "add")
        if self.weight_t is None:
            y = F.linear(x, self.weight, self.bias)
            return y if residual is None else y.add_(residual)
        if residual is not None:
            y = torch.addmm(residual, x, self.weight_t)
            return y if self.bias is None else y.add_(self.bias)
        return x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)


@torch.library.custom_op("speculative::prepacked_linear", mutates_args=())
def _prepacked_linear(x: Tensor, residual: Tensor | None, handle: int) -> Tensor:
    """The prepacked kernel of PackedLinear number `handle` as one op, for compiled graphs (inductor
    cannot take an opaque oneDNN weight that is not one of its own frozen constants)."""
    return _REGISTRY[handle](x, residual)


@_prepacked_linear.register_fake
def _(x: Tensor, residual: Tensor | None, handle: int) -> Tensor:
    return x.new_empty(x.shape[0], _REGISTRY[handle].weight.shape[0])
