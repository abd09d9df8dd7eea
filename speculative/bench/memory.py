"""The memory bound of plain decoding on this machine.

A one-token forward at batch 1 reads every weight of the model once, and on a CPU (or a GPU at small
batch) reading them is what it costs. So no engine decodes faster than
    T_bound = (bytes of weights a forward reads) / (memory bandwidth),
the bandwidth measured as a large copy moves data (bytes read + bytes written, per second). The
fraction of it a method reaches, T_bound * tokens per second, says how close to the hardware it runs.

Each engine has a bound of its own, from the bytes it really reads: HF the float model's, ours its own
(quantized or not) model's, llama.cpp its GGUF's tensors, at the one measured bandwidth (engine_bounds).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from speculative.bench.gguf_cache import gguf_module
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
    """Bytes of the weights a one-token forward of `model` reads, each storage counted once, less an
    input embedding that is not also the LM head (a forward reads one of its rows; a tied head reads
    it whole, once).

    A Hugging Face model (or any module): every parameter and buffer. Our NativeCausalLM
    (models/llama.py): what its PackedLinears read, quantized or not (int8 / int4 weights with their
    scales; a float weight once, not also its prepacked oneDNN copy, the same numbers in another
    layout), and its other parameters and buffers (norms, RoPE frequencies). Quantizing a tied lm_head
    gives it a copy of its own: the float embedding is then only looked up, and not counted."""
    tensors = [*model.parameters(), *model.buffers()]
    packed = model.packed_linears() if hasattr(model, "packed_linears") else []
    if packed:
        for layer in packed:
            tensors += [t for t in layer.tensors() if t is not layer.prepacked]
        embedding, head = model.model.embed_tokens.weight, packed[-1].tensors()  # the lm_head comes last
    else:
        embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head = [output.weight] if output is not None and output.weight is not None else []
    skipped = None
    if embedding is not None:
        key = embedding.untyped_storage().data_ptr()
        if all(t.is_mkldnn or t.untyped_storage().data_ptr() != key for t in head):
            skipped = key  # not the LM head: a forward reads one row
    seen, total = {skipped}, 0
    for tensor in tensors:
        if tensor.is_mkldnn:
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


def gguf_weight_bytes(path: str | Path, checkout: str | Path | None = None) -> int:
    """Bytes of the weights llama.cpp reads per token of a GGUF model: every tensor's, in its own type,
    less token_embd where the file has an output matrix of its own (token_embd is then only looked
    up; without one, llama.cpp reads token_embd whole as the output matrix, counted once).
    `checkout`: a llama.cpp checkout whose gguf-py is used where the gguf package is not installed."""
    reader = gguf_module(checkout).GGUFReader(path)
    sizes = {tensor.name: int(tensor.n_bytes) for tensor in reader.tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def memory_bound(nbytes: int, bandwidth: float) -> dict:
    """The bound for `nbytes` of weights at `bandwidth` bytes/s: its forward time and tokens per second."""
    seconds = nbytes / bandwidth
    return {
        "weight_mb": nbytes / 1e6,
        "bandwidth_gb_s": bandwidth / 1e9,
        "forward_ms": seconds * 1e3,
        "tokens_per_second": 1.0 / seconds,
    }


def engine_bounds(bandwidth: float, weights: dict[str, tuple[str, int]]) -> dict:
    """The memory bound of each engine's plain decoding at one measured `bandwidth` (bytes/s):
    `weights` maps an engine ("hf", "ours", "llama.cpp") to (what its weights are, e.g. "float32",
    "int8" or "Q8_0 GGUF"; the bytes a forward reads: weight_bytes, gguf_weight_bytes). Returns
    {"bandwidth_gb_s", "engines": {engine: {"weights", **memory_bound(bytes, bandwidth)}}}."""
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "engines": {
            engine: {"weights": kind, **memory_bound(nbytes, bandwidth)}
            for engine, (kind, nbytes) in weights.items()
        },
    }
