"""Weights times activations quantized to int8 on CPU: `quantization="w8a8"` and `"w4a8"`, the arithmetic
of llama.cpp's Q8_0 and Q4_1 dot products.

A decoding step's matmuls read every weight once, so on a CPU their cost is the bytes read, and int8
weights are a quarter of float32's, 4-bit ones an eighth (plus a scale and a minimum a block). But
converting each weight to float before multiplying costs more instructions than the memory saves where
the vector ISA is AVX2 (models/packed.py's int8 paths). Here the activations are quantized instead, per
row and per block of 32 values (an int8 each and one float32 scale a block, the scheme of llama.cpp's
Q8_0 and Q8_1), and each block's 32 products are summed exactly in integers by two instructions
(AVX2's maddubs and madd), then scaled: a block of 32 weights costs about six instructions (eight for
4-bit weights, which are unpacked first), where converting them to float costs four or five a weight.

- "w8a8": the weights are models/quantization.py's int8, symmetric per output channel
  (`quantize_int8`), as for "int8".
- "w4a8": 4-bit weights in llama.cpp's Q4_1 scheme (`quantization.quantize_q4_1`): per block of 32
  weights of a row, w = q * scale + minimum, q in [0, 15], scale and minimum float16 (5 bits a weight
  in all, against Q4_1's same 5). A block's dot product is scale * d * (the integer dot product) +
  minimum * (d times the sum of the block's int8 activations).

The kernels (int8_activations.cpp, beside this file) are part of the project's C++ extension
(models/cpu_kernels.py), built the first time a machine needs them (it needs a C++ compiler and
ninja). They compute every row's results by the same
instructions whatever the number of rows, so a verification's rows are bitwise a one-row step's
and speculative decoding stays exact against the quantized target. Compiled graphs call them as
opaque ops (their fake implementations give the shapes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.models import cpu_kernels

BLOCK = 32  # activation values quantized together (a scale each): in_features must be a multiple

# The ops' schemas, in the namespace of models/packed.py's prepacked_linear; int8_activations.cpp
# registers their CPU kernels when it is loaded.
_LIBRARY = torch.library.Library("speculative", "FRAGMENT")
_LIBRARY.define(
    "w8a8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, Tensor? residual) -> Tensor"
)
_LIBRARY.define(
    "w4a8_linear(Tensor x, Tensor qweight, Tensor scales_and_mins, Tensor? bias, Tensor? residual) -> Tensor"
)


@torch.library.register_fake("speculative::w8a8_linear")
def _(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.register_fake("speculative::w4a8_linear")
def _(
    x: Tensor, qweight: Tensor, scales_and_mins: Tensor, bias: Tensor | None, residual: Tensor | None
) -> Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def load(quantization: str = "w8a8") -> None:
    """Build (the first time on this machine) and load the kernels (models/cpu_kernels.py).
    RuntimeError naming what is missing where they cannot be built, and `quantization`."""
    cpu_kernels.load(f"quantization={quantization!r}")


def _in_float32(op, x: Tensor, weights: tuple[Tensor, Tensor], bias: Tensor | None, residual: Tensor | None):
    if x.dtype == torch.float32:
        return op(x, *weights, bias, residual)
    y = op(
        x.float(),
        *weights,
        None if bias is None else bias.float(),
        None if residual is None else residual.float(),
    )
    return y.to(x.dtype)


def w8a8_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """x [rows, in] @ (qweight [out, in] int8 * scales [out, 1]).T (+ bias [out]) (+ residual [rows,
    out]) -> [rows, out] in x's dtype, x quantized to int8 per blocks of BLOCK values (in % BLOCK ==
    0); computed in float32 (scales float32). `load()` must have run."""
    return _in_float32(torch.ops.speculative.w8a8_linear, x, (qweight, scales), bias, residual)


def w4a8_linear(
    x: Tensor,
    qweight: Tensor,
    scales_and_mins: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """x [rows, in] @ W.T (+ bias [out]) (+ residual [rows, out]) -> [rows, out] in x's dtype, W the
    Q4_1 weight `quantization.quantize_q4_1` gives (qweight [out, in / 2] uint8, scales_and_mins [out,
    2, in / BLOCK] float16), x quantized to int8 per blocks of BLOCK values; computed in float32.
    `load()` must have run."""
    return _in_float32(torch.ops.speculative.w4a8_linear, x, (qweight, scales_and_mins), bias, residual)
