"""Host values to a device without the host waiting for the device.

On CUDA, a copy from ordinary (pageable) host memory makes the host wait until the copy is done, and
so until every kernel queued before it has run: a host sync that stalls the queue of work the host
has run ahead with. A copy from pinned (page-locked) memory, queued with `non_blocking`, runs in
stream order while the host goes on; torch's pinned allocator keeps the host buffer until the copy
has run. The engine's small per-step and per-admission tensors (tokens kept, lengths, row indices,
sampling parameters) go through `to_device`, so that a decoding step's one host sync is its read of
the step's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(values: Sequence | Tensor, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device` (values: nested lists of numbers, or a CPU
    tensor), queued without a host sync on CUDA (pinned memory, a non-blocking copy); elsewhere a
    plain tensor."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    if isinstance(values, Tensor):
        return values.to(dtype).pin_memory().to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
