"""Greedy (temperature-0) verification of draft tokens, and the output layout
shared by every acceptance rule."""

from __future__ import annotations

import torch


def count_accepted(accepted: torch.Tensor) -> torch.Tensor:  # [B, k] bool -> [B, 1] int64
    """Length of the all-True prefix of each row (acceptance stops at the first rejection)."""
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1, keepdim=True)


def assemble_output(
    draft_token_ids: torch.Tensor,  # [B, k] int64
    num_accepted: torch.Tensor,  # [B, 1] int64 in [0, k]
    next_token_ids: torch.Tensor,  # [B, 1] int64: recovered token, or the bonus if num_accepted == k
) -> torch.Tensor:  # [B, k+1] int64
    """Lay out ``[accepted drafts..., next token, -1, ...]`` for each row."""
    b, k = draft_token_ids.shape
    pos = torch.arange(k + 1, device=draft_token_ids.device).unsqueeze(0)  # [1, k+1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((b, 1), -1)], dim=1)  # [B, k+1]
    out = torch.where(pos < num_accepted, padded, next_token_ids.to(torch.int64))
    return torch.where(pos <= num_accepted, out, torch.full_like(out, -1))


def greedy_accept(
    target_token_ids: torch.Tensor,  # [B, k+1] int64, argmax of each target position
    draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = no draft
) -> torch.Tensor:  # [B, k+1] int64
    """Accept drafts while they equal the target's argmax.

    Position i is accepted iff every earlier one was and
    ``draft_token_ids[:, i] == target_token_ids[:, i]``. At the first mismatch the
    target's argmax there is emitted; when all k match, ``target_token_ids[:, k]``
    (the bonus) follows. Remaining slots are -1. A -1 draft never matches
    (target ids are >= 0).

    This is the temperature-0 case of lossless speculative sampling (Leviathan et
    al. 2023; Chen et al. 2023): the output is exactly what greedy decoding of the
    target produces.

    Returns int64 [B, k+1]: accepted drafts, one target token, then -1 padding.
    """
    k = draft_token_ids.shape[1]
    num_accepted = count_accepted(draft_token_ids == target_token_ids[:, :k])  # [B, 1]
    # the accepted drafts are the target's own tokens there: the output is its tokens up to the next one
    positions = torch.arange(k + 1, device=target_token_ids.device)
    return torch.where(positions <= num_accepted, target_token_ids, -1)
