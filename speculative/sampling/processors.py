"""Logits processors, vectorized over rows that each have their own parameters.

Each maps logits [B, q, V] to logits of the same shape, with per-row parameters as [B] tensors,
and is the identity for a row whose parameter disables it. SampleStrategy applies them in the order
of its docstring.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.sampling.context import TokenContext

NEG_INF = float("-inf")


def apply_allowed(logits: Tensor, allowed: Tensor) -> Tensor:
    """Keep only allowed tokens. allowed: [B, V] or [B, q, V] bool (all True for unrestricted rows)."""
    mask = allowed if allowed.dim() == 3 else allowed[:, None, :]
    return logits.masked_fill(~mask, NEG_INF)


def apply_bad_words(logits: Tensor, context: TokenContext, words: list[tuple[Tensor, list[int]]]) -> Tensor:
    """Ban the last token of each bad word where the context ends with the rest of the word.

    words: (rows [n] int64, token ids of the word) pairs; a one-token word is banned everywhere.
    """
    banned = torch.zeros_like(logits, dtype=torch.bool)  # [B, q, V]
    for rows, ids in words:
        *prefix, last = ids
        if prefix:
            tail = context.tail(len(prefix))[rows]  # [n, q, len(prefix)]
            banned[rows, :, last] |= (tail == torch.tensor(prefix, device=tail.device)).all(dim=-1)
        else:
            banned[rows, :, last] = True
    return logits.masked_fill(banned, NEG_INF)


def apply_min_tokens(logits: Tensor, context: TokenContext, min_tokens: Tensor, stop_ids: Tensor) -> Tensor:
    """Ban each row's stop tokens (EOS and stop_token_ids; stop_ids [B, s], -1 padded) at positions
    whose context has fewer than min_tokens [B] generated tokens."""
    early = context.num_generated < min_tokens[:, None]  # [B, q]
    stops = torch.zeros(logits.shape[0], logits.shape[-1] + 1, dtype=torch.bool, device=logits.device)
    stops.scatter_(1, torch.where(stop_ids >= 0, stop_ids, logits.shape[-1]), True)
    banned = early[:, :, None] & stops[:, None, :-1]  # [B, q, V]
    return logits.masked_fill(banned, NEG_INF)


def apply_penalties(
    logits: Tensor, context: TokenContext, presence: Tensor, frequency: Tensor, repetition: Tensor
) -> Tensor:
    """vLLM's penalties, with each position's own context (drafts before it included).

    repetition [B]: tokens in the prompt or output: positive logits / r, negative * r.
    frequency [B]: minus f * occurrences in the output; presence [B]: minus p if in the output.
    """
    r = repetition[:, None, None]
    penalized = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(context.seen, penalized, logits)
    counts = context.output_counts
    logits = logits - frequency[:, None, None] * counts
    return logits - presence[:, None, None] * (counts > 0).float()


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits / t per row. temperature: [B], > 0 (greedy rows use 1)."""
    return logits / temperature[:, None, None]


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p [B] times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor | None) -> Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus.

    top_k: [B] int64 (V = disabled); top_p: [B] float32 (1 = disabled), or None when no row uses it.
    The nucleus is the smallest set of top tokens, among the top-k, whose probability reaches top_p
    (HF's and vLLM's rule). At least one token always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, q, V]
    ranks = torch.arange(vocab, device=logits.device)
    removed = ranks >= top_k[:, None, None]  # [B, 1, V]
    if top_p is not None:
        probs = sorted_logits.masked_fill(removed, NEG_INF).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        removed = removed | (mass_before >= top_p[:, None, None])
    sorted_logits = sorted_logits.masked_fill(removed, NEG_INF)
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)
