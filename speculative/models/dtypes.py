"""The dtype a model runs in: names, checks, and what "auto" means on each device.

On a GPU "auto" is the checkpoint's own dtype. On a CPU it is the checkpoint's dtype only where the CPU
computes that dtype natively, float32 otherwise: a bfloat16 matmul on a CPU without AVX512-BF16 or AMX
runs in slow generic code, several times slower than float32, while with them bfloat16 halves the
bytes that every decoding step streams from memory (docs/internals.md#measured-choices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why: `reason` is one line for a person ("auto: ...")."""

    dtype: torch.dtype
    reason: str

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"


def check_dtype(dtype: str | torch.dtype, name: str = "dtype") -> None:
    """ValueError naming the parameter `name` unless dtype is "auto", a known dtype name or a torch.dtype."""
    if not isinstance(dtype, torch.dtype) and dtype != "auto" and dtype not in DTYPES:
        raise ValueError(
            f"{name} must be 'auto', {', '.join(map(repr, DTYPES))} or a torch.dtype; got {dtype!r}"
        )


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU runs `dtype` matmuls in hardware: float32 (and float64) always; bfloat16 with
    AVX512-BF16 or AMX (and ATen's AVX-512 kernels and oneDNN's bfloat16 path enabled: ATEN_CPU_CAPABILITY and
    ONEDNN_MAX_CPU_ISA can turn them off); float16 with AMX-FP16."""
    if dtype in (torch.float32, torch.float64):
        return True
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        return False
    if dtype == torch.bfloat16:
        has_unit = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return has_unit and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.cpu._is_amx_fp16_supported() and torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def cpu_features() -> str:
    """The CPU features that decide the dtype, as torch uses them, in one phrase: "AVX512 with
    AVX512-BF16", "AVX2", ..."""
    capability = torch.backends.cpu.get_cpu_capability()
    units = [
        name
        for name, present in (
            ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
            ("AMX", torch.cpu._is_amx_tile_supported()),
        )
        if present
    ]
    return (
        f"{capability} with {' and '.join(units)}"
        if units and capability in ("AVX512", "AMX")
        else capability
    )


def resolve_dtype(
    requested: str | torch.dtype, checkpoint: torch.dtype | None, device: torch.device, name: str = "dtype"
) -> DtypeChoice:
    """The dtype to run in for `requested` ("auto", a name or a torch.dtype; ValueError naming `name`
    otherwise), given the checkpoint's dtype (None: it names none) and the device."""
    check_dtype(requested, name)
    if requested != "auto":
        dtype = requested if isinstance(requested, torch.dtype) else DTYPES[requested]
        return DtypeChoice(dtype, f"{name}={str(dtype).removeprefix('torch.')!r} as asked")
    stored = str(checkpoint).removeprefix("torch.") if checkpoint is not None else None
    if checkpoint is None or not checkpoint.is_floating_point:
        return DtypeChoice(torch.float32, "auto: the checkpoint names no dtype")
    if device.type != "cpu" or checkpoint in (torch.float32, torch.float64):
        return DtypeChoice(checkpoint, "auto: the checkpoint's dtype")
    if cpu_computes_natively(checkpoint):
        return DtypeChoice(
            checkpoint, f"auto: the checkpoint's dtype, which this CPU ({cpu_features()}) computes natively"
        )
    return DtypeChoice(
        torch.float32,
        f"auto: the checkpoint is {stored}, but this CPU ({cpu_features()}) has "
        f"no native {stored}, where float32 is faster",
    )
