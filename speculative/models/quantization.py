"""Quantization of the native forward's projections, on CPU: int8 and int4 weight-only, w8a8 and w4a8.

`LLM(..., quantization="int8" | "int4" | "w8a8" | "w4a8")` quantizes the target's and the draft's q/k/v,
o, gate/up and down projections (and the lm_head, see `NativeCausalLM.quantize`) after loading; the
embeddings, norms and biases stay as they are, and so do the activations: a quantized matmul is
x @ dequantized(W).T computed in the model's dtype (float32 accumulation), with W read as int8 (or
int4) from memory. Output stays exactly the quantized target's: speculative decoding is lossless with
respect to whatever model verifies, quantized or not.

The kernels are torch's own (PackedLinear, models/packed.py, calls them):
  int8  `torch._weight_int8pack_mm(x [rows, in], w [out, in] int8, scales [out])`, scales in x's
        dtype (CPU, torch 2.13: float32, bfloat16 or float16, scales of the same dtype). On x86 it
        is vectorized (AVX2 / AVX-512) for bfloat16 only, where it needs `in` % 16 == 0 and x
        32-byte aligned (else NaNs or a crash: PackedLinear copies x when it is not); for float32 it
        is a scalar loop. In a compiled graph, one-row calls are an inductor reduction over the int8
        weight instead (models/gemv.py).
  int4  `torch._convert_weight_to_int4pack_for_cpu(q [out, in] int32 in [0, 16), 1)` -> uint8
        [out, in / 2] in a layout of the CPU's vector width (pack and call in the same process), and
        `torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros [in / group, out,
        2])`, which dequantizes (q - 8) * scale + zero, scales and zeros in x's dtype; group_size in
        {32, 64, 128, 256} dividing `in`, `out` % 16 == 0. Vectorized on x86 for bfloat16 only, so
        int4 needs a bfloat16 model (in float32 it is a scalar loop, slower than the float model).

The scales are computed here rather than with torchao: torchao 0.18.0 installs beside torch 2.13.0
without pulling another torch, but its compiled extensions do not load against it (it prints load
errors at import) and the math is a dozen lines: per-output-channel symmetric absmax for int8 (what
`_weight_int8pack_mm` takes), and for int4 torchao's own group-wise asymmetric scheme for this kernel
(`get_groupwise_affine_qparams` / `groupwise_affine_quantize_tensor`: scale = (max - min) / 15, zero =
min + 8 * scale, q = round((w - min) / scale)), with q computed from the scales and zeros as rounded
to the model's dtype, so that dequantization reproduces the nearest representable weights.

"w8a8" keeps int8's weights and quantizes the activations too, per blocks of 32 values, inside the
matmul (models/int8_activations.py: a C++ kernel built on first use); the activations outside the
matmuls stay in the model's dtype. "w4a8" does the same with 4-bit weights in llama.cpp's Q4_1 scheme
(`quantize_q4_1`), on every CPU and in every dtype (its kernel computes in float32). Layers whose
in_features is not a multiple of 32 are "int8" under either.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8")
Q4_BLOCK = 32  # weights of a row that share a Q4_1 scale and minimum
INT4_GROUP_SIZES = (64, 32)  # the first that divides a layer's in_features is its group size


def check_quantization(quantization: object, name: str = "quantization") -> str | None:
    """`quantization` if it is None or one of QUANTIZATIONS; a ValueError naming `name` otherwise."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"{name} must be None, 'int8', 'int4', 'w8a8' or 'w4a8'; got {quantization!r}")
    return quantization


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: weight [out, in] -> (q [out, in] int8 in [-127, 127],
    scales [out] in weight's dtype), weight ~= q * scales[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def int4_group_size(out_features: int, in_features: int) -> int | None:
    """The int4 group size for a weight [out, in], or None where torch's int4pack kernel takes no
    group size (out not a multiple of 16, or in divisible by none of INT4_GROUP_SIZES)."""
    if out_features % 16:
        return None
    return next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise asymmetric int4 (groups of `group_size` along in): weight [out, in] -> (q [out, in]
    int32 in [0, 15], scales [out, in / group], zeros [out, in / group]; both in weight's dtype), with
    weight ~= (q - 8) * scale + zero in each group."""
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
    scales = ((high - low).clamp(min=1e-6) / 15).to(weight.dtype)
    zeros = (low + 8 * scales.float()).to(weight.dtype)
    minimum = zeros.float() - 8 * scales.float()
    q = torch.round((w - minimum[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    return q.to(torch.int32).reshape(out_features, in_features), scales, zeros


def pack_int4(q: Tensor, scales: Tensor, zeros: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_int4's output in the layouts of torch's CPU kernel: (packed [out, in / 2] uint8,
    scales_and_zeros [in / group, out, 2] in the scales' dtype)."""
    packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    return packed, scales_and_zeros


def quantize_q4_1(weight: Tensor) -> tuple[Tensor, Tensor]:
    """llama.cpp's Q4_1 over blocks of Q4_BLOCK weights along in (in % Q4_BLOCK == 0): weight [out, in]
    -> (qweight [out, in / 2] uint8, scales_and_mins [out, 2, in / Q4_BLOCK] float16: each row's block
    scales, then its block minimums), weight ~= q *
    scale + minimum in each block, q in [0, 15] the nearest level to the weight given the float16
    scale ((max - min) / 15) and minimum as rounded; byte j of a block's 16 holds its weight j in the low
    four bits and its weight j + 16 in the high four (Q4_1's layout)."""
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(out_features, in_features // Q4_BLOCK, Q4_BLOCK)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # [out, blocks]
    scales, minimums = ((high - low) / 15).half(), low.half()
    inverse = torch.where(scales > 0, 1 / scales.float(), torch.zeros_like(low))
    q = torch.round((w - minimums.float()[..., None]) * inverse[..., None]).clamp_(0, 15).to(torch.uint8)
    half = Q4_BLOCK // 2
    packed = (q[..., :half] | (q[..., half:] << 4)).reshape(out_features, in_features // 2)
    return packed.contiguous(), torch.stack([scales, minimums], dim=1).contiguous()


@runtime_checkable
class PackedLayers(Protocol):
    """A module whose forward runs PackedLinears (NativeCausalLM): `packed_linears()` lists them."""

    def packed_linears(self) -> list[Any]: ...


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of the distinct tensor storages a module holds: its parameters and buffers, and for a
    NativeCausalLM (PackedLayers) its PackedLinears' weights, prepacked copies and quantized weights."""
    tensors = [*module.parameters(), *module.buffers()]
    for packed in module.packed_linears() if isinstance(module, PackedLayers) else []:
        tensors.extend(packed.tensors())
    seen, total = set(), 0
    for tensor in tensors:
        if tensor.is_mkldnn:  # an opaque oneDNN tensor: no storage to look at
            total += tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
