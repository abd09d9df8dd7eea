"""The memory bound of plain decoding on this machine.

A one-token forward at batch 1 reads every weight of the model once, and on a CPU (or a GPU at small
batch) reading them is what it costs. So no engine decodes faster than
    T_bound = (bytes of weights a forward reads) / (memory bandwidth),
the bandwidth measured as a large copy moves data (bytes read + bytes written, per second). The
fraction of it a method reaches, T_bound * tokens per second, says how close to the hardware it runs.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from speculative.bench.timing import synchronize

COPY_BYTES = 256 * 2**20  # far larger than any CPU's last-level cache


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, repeats: int = 7) -> float:
    """Bytes per second (read + written) of a copy of `nbytes` between two filled buffers: the median
    of `repeats` copies after two discarded."""
    source = torch.rand(nbytes // 4, device=device)
    target = torch.rand(nbytes // 4, device=device)  # written: its pages exist before the timing
    seconds = []
    for i in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        if i >= 2:
            seconds.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(seconds)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a one-token forward reads: every parameter and buffer tensor of the module,
    each storage counted once (a tied LM head and embedding are one), less an input embedding that
    is not also the LM head (a forward reads one of its rows)."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers()]
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    untied = embedding is not None and head is not None and head.weight is not embedding
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        if key in seen or (untied and tensor is embedding):
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


def memory_bound(nbytes: int, bandwidth: float) -> dict:
    """The bound for `nbytes` of weights at `bandwidth` bytes/s: its forward time and tokens per second."""
    seconds = nbytes / bandwidth
    return {
        "weight_mb": nbytes / 1e6,
        "bandwidth_gb_s": bandwidth / 1e9,
        "forward_ms": seconds * 1e3,
        "tokens_per_second": 1.0 / seconds,
    }
