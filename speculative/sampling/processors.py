"""Logits processors, vectorized over rows that each have their own parameters.

Every processor maps logits [batch, q, vocab] to logits of the same shape, with per-row parameters
as [batch] tensors, and is the identity for a row whose parameter disables it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits / t per row. logits: [batch, q, vocab]; temperature: [batch], > 0 (greedy rows use 1)."""
    return logits / temperature[:, None, None]


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor | None) -> Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus.

    logits: [batch, q, vocab]; top_k: [batch] int64 (vocab = disabled); top_p: [batch] float32
    (1 = disabled), or None when no row uses it. The nucleus is the smallest set of top tokens, among the top-k, whose probability
    reaches top_p (HF's and vLLM's rule). At least one token always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [batch, q, vocab]
    ranks = torch.arange(vocab, device=logits.device)
    removed = ranks >= top_k[:, None, None]  # [batch, 1, vocab]
    if top_p is not None:
        probs = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        removed = removed | (mass_before >= top_p[:, None, None])
    sorted_logits = sorted_logits.masked_fill(removed, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)
