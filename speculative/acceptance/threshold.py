"""Typical acceptance's threshold (Medusa, section 3.3.1), shared by chains (typical.py) and trees
(tree.py)."""

from __future__ import annotations

import torch


def typical_threshold(
    target_probs: torch.Tensor,  # [..., V]
    posterior_threshold: float,
    posterior_alpha: float,
) -> torch.Tensor:  # [...]
    """The probability a draft drawn after each distribution must exceed to be accepted:
    ``min(posterior_threshold, posterior_alpha * exp(-H))``, H the entropy (see TypicalAcceptanceSampler)."""
    entropy = -(target_probs * torch.log(target_probs + 1e-5)).sum(dim=-1)  # [...]
    return torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
