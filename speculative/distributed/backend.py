"""torch.distributed's backend and timeout for every process group of the tensor-parallel ranks."""

from __future__ import annotations

from datetime import timedelta

TIMEOUT = timedelta(minutes=5)
"""The longest a collective waits for its peers (a rank that exits is noticed at once, by its closed
connections; this bounds a rank that hangs)."""


def backend(device_type: str) -> str:
    """torch.distributed's backend for a device type: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device_type == "cuda" else "gloo"
