"""int8 weights times int8 activations on CPU: `quantization="w8a8"`, the arithmetic of llama.cpp's Q8_0.

A decoding step's matmuls read every weight once, so on a CPU their cost is the bytes read, and int8
weights are a quarter of float32's. But converting each int8 weight to float before multiplying costs
more instructions than the memory saves where the vector ISA is AVX2 (models/packed.py's int8 paths).
Here the activations are quantized instead, per row and per block of 32 values (an int8 each and one
float32 scale a block, the scheme of llama.cpp's Q8_0 dot products), and each block's 32 products are
summed exactly in integers by two instructions (AVX2's maddubs and madd), then scaled: a block of 32
weights costs about six instructions, where converting them to float costs four or five a weight.
The weights are models/quantization.py's int8, symmetric per output channel (`quantize_int8`), as
for "int8".

The kernel (w8a8.cpp, beside this file) is a C++ extension built with torch.utils.cpp_extension the
first time a model is quantized "w8a8" (about a minute; kept in torch's extensions cache, so later
processes load it at once); building needs a C++ compiler and ninja, both there wherever torch.compile
works. It computes every row's results by the same instructions whatever the number of rows, so a
verification's rows are bitwise a one-row step's and speculative decoding stays exact against the
w8a8 target. Compiled graphs call it as an opaque op (its fake implementation gives the shape).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32  # activation values quantized together (a scale each): in_features must be a multiple
_SOURCE = Path(__file__).with_name("w8a8.cpp")
_lock = threading.Lock()
_loaded = False

# The op's schema, in the namespace of models/packed.py's prepacked_linear; w8a8.cpp registers its CPU
# kernel when it is loaded.
_LIBRARY = torch.library.Library("speculative", "FRAGMENT")
_LIBRARY.define(
    "w8a8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, Tensor? residual) -> Tensor"
)


@torch.library.register_fake("speculative::w8a8_linear")
def _(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU builds
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":  # "AVX2" or "AVX512": the CPU has AVX2
        flags += ["-mavx2", "-mfma"]
    return flags


def load() -> None:
    """Build (the first time on this machine) and load the kernel. RuntimeError naming what is missing
    where it cannot be built (no C++ compiler, no ninja)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        try:
            cpp_extension.load(
                name="speculative_w8a8",
                sources=[str(_SOURCE)],
                extra_cflags=_flags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
        except (RuntimeError, OSError, ImportError) as error:
            raise RuntimeError(
                "quantization='w8a8' builds a C++ kernel on first use and could not: it needs a C++ "
                f"compiler (g++) and ninja (`pip install ninja`). The build said: {error}"
            ) from error
        _loaded = True


def linear(
    x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """x [rows, in] @ (qweight [out, in] int8 * scales [out, 1]).T (+ bias [out]) (+ residual [rows,
    out]) -> [rows, out] in x's dtype, x quantized to int8 per blocks of BLOCK values (in % BLOCK ==
    0); computed in float32 (scales float32). `load()` must have run."""
    if x.dtype == torch.float32:
        return torch.ops.speculative.w8a8_linear(x, qweight, scales, bias, residual)
    y = torch.ops.speculative.w8a8_linear(
        x.float(),
        qweight,
        scales,
        None if bias is None else bias.float(),
        None if residual is None else residual.float(),
    )
    return y.to(x.dtype)
