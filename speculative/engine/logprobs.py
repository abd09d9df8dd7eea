"""The target's log-probabilities of chosen and top tokens, as vLLM reports them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from speculative.engine.outputs import Logprob


def token_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> list[Tensor]:
    """Log-probabilities from raw logits [B, q, V] of token_ids [B, q] (-1 allowed, ignored).

    Returns [chosen [B, q], rank [B, q], top values [B, q, num_top], top ids [B, q, num_top]]:
    rank 1 is the most likely token.
    """
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, token_ids.clamp(min=0)[..., None])  # [B, q, 1]
    rank = (logp > chosen).sum(dim=-1) + 1
    top = logp.topk(num_top, dim=-1) if num_top else (logp[..., :0], token_ids[..., None][..., :0])
    return [chosen[..., 0], rank, top[0], top[1]]


def as_dicts(
    token_ids: list[int],
    chosen: list[float],
    rank: list[int],
    top_values: list[list[float]],
    top_ids: list[list[int]],
    num_top: int,
    decode: Callable[[int], str | None],
) -> list[dict[int, Logprob]]:
    """Host lists for n tokens -> one {token id: Logprob} per token (the chosen one and the top num_top)."""
    out = []
    for token, lp, r, values, ids in zip(token_ids, chosen, rank, top_values, top_ids):
        entry = {token: Logprob(lp, r, decode(token))}
        for i, (value, top_id) in enumerate(zip(values[:num_top], ids[:num_top])):
            entry.setdefault(top_id, Logprob(value, i + 1, decode(top_id)))
        out.append(entry)
    return out


def prompt_logprobs(
    logits: Tensor, prompt: list[int], num_top: int, decode: Callable[[int], str | None]
) -> list[dict[int, Logprob] | None]:
    """vLLM's prompt_logprobs from the prefill logits [L, V] of one prompt: None for the first token."""
    if len(prompt) < 2:
        return [None]
    targets = torch.tensor(prompt[1:], device=logits.device)[None]
    values = [t[0].tolist() for t in token_logprobs(logits[None, : len(prompt) - 1], targets, num_top)]
    return [None, *as_dicts(prompt[1:], *values, num_top, decode)]
