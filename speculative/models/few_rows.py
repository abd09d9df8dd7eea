"""float32 matmuls of a few rows on CPU by the project's own kernel: eager decoding steps and
verifications at about the speed of reading the weights.

A decoding step multiplies one row (a batch: a few rows; a verification: k + 1) by every weight
matrix, so its cost is reading the weights. Where the CPU's vector ISA is AVX2 (no AVX-512), oneDNN's
kernels for a few rows read them at about half the speed of a large copy (on an Intel CPU with
AVX-512, at about two thirds of it), and the eager forward is where a user without `compile=True`
spends its time. few_rows.cpp's kernel gives each thread a share of the outputs and reads each of their
weight rows once for up to 6 rows of x at a time (measured: docs/internals.md#measured-choices). Every
row's result comes from the same instructions whatever the number of rows and threads, so a
verification's rows are bitwise a one-row step's.

PackedLinear (models/packed.py) calls it for float32 calls of at most ROWS_MAX rows, eager (and the
compiled graphs' opaque calls of a dynamic batch), where `usable` says so: the ISA is AVX2, or AVX-512
on a CPU whose kernels prefetch their weights (an Intel one: cpu_kernels.prefetches; an AMD CPU with
AVX-512 keeps oneDNN, the kernel unmeasured against it there), and the kernel built
(models/cpu_kernels.py; where it cannot be built, one warning and oneDNN as before).
Compiled one-row and static few-row calls stay inductor's reductions (models/gemv.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from speculative.models import cpu_kernels

ROWS_MAX = 8  # beyond, oneDNN's kernel (docs/internals.md#measured-choices)


def serves(capability: str, prefetches: bool) -> bool:
    """Whether the kernel takes the few-row calls on a CPU of ATen's vector ISA `capability` ("DEFAULT",
    "AVX2", "AVX512") whose kernels are built to prefetch their weights or not (cpu_kernels.prefetches):
    the CPUs whose eager few-row calls it was measured to speed up (docs/internals.md#measured-choices)."""
    return capability == "AVX2" or (capability != "DEFAULT" and prefetches)


_SERVES_THIS_CPU = serves(torch.backends.cpu.get_cpu_capability(), cpu_kernels.prefetches())
_usable: bool | None = None  # None: not tried yet

_LIBRARY = torch.library.Library("speculative", "FRAGMENT")
_LIBRARY.define("few_rows_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor")


@torch.library.register_fake("speculative::few_rows_linear")
def _(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def usable(weight: Tensor) -> bool:
    """Whether calls by `weight` ([out, in]) of at most ROWS_MAX rows take the kernel: float32 on CPU,
    contiguous (else each call would copy it), in a multiple of 32, a CPU it serves (the module's
    docstring) and the kernel built (the first call builds or loads it)."""
    global _usable
    if not (
        _SERVES_THIS_CPU
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and weight.shape[1] % 32 == 0
    ):
        return False
    if _usable is None:
        try:
            cpu_kernels.load("float32 decoding of a few rows")
            _usable = True
        except RuntimeError as error:
            warnings.warn(f"{error}; float32 matmuls of a few rows stay oneDNN's", stacklevel=2)
            _usable = False
    return _usable


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias [out]) (+ residual [rows, out]) -> [rows, out], all
    float32, in % 32 == 0. The extension must be loaded (`usable` or cpu_kernels.load)."""
    return torch.ops.speculative.few_rows_linear(x, weight, bias, residual)
