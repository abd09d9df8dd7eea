"""Input validation shared by the acceptance samplers (their ``strict_mode``).

These checks read tensor values back to the host (range, finiteness), so they
synchronise with the device: they are meant for tests and debugging, not for the
hot path. Every error names the offending argument and says what was expected.
"""

from __future__ import annotations

import torch


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")


def _check_ids(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise TypeError(f"{name} must have dtype torch.int64, got {t.dtype}")


def _check_probs_values(name: str, t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains non-finite values (nan or inf)")
    if bool((t < 0).any()):
        raise ValueError(f"{name} contains negative probabilities (min {t.min().item():g})")


def _check_id_range(name: str, t: torch.Tensor, low: int, vocab_size: int) -> None:
    if t.numel() == 0:
        return
    lo, hi = int(t.min().item()), int(t.max().item())
    if lo < low or hi >= vocab_size:
        raise ValueError(
            f"{name} must lie in [{low}, {vocab_size}) (vocab_size={vocab_size}), got values in [{lo}, {hi}]"
        )


def check_sampler_inputs(
    target_with_bonus_probs: torch.Tensor,  # [B, k+1, V]
    bonus_token_ids: torch.Tensor,  # [B, 1]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    draft_token_ids: torch.Tensor,  # [B, k]
    uniform_samples: torch.Tensor | None = None,  # [B, k]
    recovery_noise: torch.Tensor | None = None,  # [B, V]
) -> None:
    """Validate a sampler call: dtypes, shapes (B, k, V consistent), one device,
    token-id ranges (drafts in [-1, V), bonus in [0, V)), probabilities finite and >= 0.

    Raises TypeError for a wrong type or dtype, ValueError for anything else.
    """
    _check_float("target_with_bonus_probs", target_with_bonus_probs)
    _check_ids("bonus_token_ids", bonus_token_ids)
    _check_ids("draft_token_ids", draft_token_ids)
    if draft_probs is not None:
        _check_float("draft_probs", draft_probs)
    if uniform_samples is not None:
        _check_float("uniform_samples", uniform_samples)
    if recovery_noise is not None:
        _check_float("recovery_noise", recovery_noise)

    if target_with_bonus_probs.dim() != 3:
        raise ValueError(
            f"target_with_bonus_probs must be 3-D [B, k+1, V], got shape {_shape(target_with_bonus_probs)}"
        )
    b, k_plus_1, v = target_with_bonus_probs.shape
    k = k_plus_1 - 1
    if k < 0:
        raise ValueError("target_with_bonus_probs must have k+1 >= 1 positions, got 0")

    expected = {
        "draft_token_ids": (draft_token_ids, (b, k)),
        "bonus_token_ids": (bonus_token_ids, (b, 1)),
        "draft_probs": (draft_probs, (b, k, v)),
        "uniform_samples": (uniform_samples, (b, k)),
        "recovery_noise": (recovery_noise, (b, v)),
    }
    for name, (t, shape) in expected.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape [{', '.join(map(str, shape))}] to match "
                f"target_with_bonus_probs {_shape(target_with_bonus_probs)} (B={b}, k={k}, V={v}), "
                f"got {_shape(t)}"
            )

    device = target_with_bonus_probs.device
    for name, (t, _) in expected.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but target_with_bonus_probs is on {device}; "
                "all inputs must be on one device"
            )

    _check_id_range("draft_token_ids", draft_token_ids, -1, v)
    _check_id_range("bonus_token_ids", bonus_token_ids, 0, v)
    _check_probs_values("target_with_bonus_probs", target_with_bonus_probs)
    if draft_probs is not None:
        _check_probs_values("draft_probs", draft_probs)
    if uniform_samples is not None and uniform_samples.numel():
        if not bool(((uniform_samples > 0) & (uniform_samples <= 1)).all()):
            raise ValueError("uniform_samples must lie in (0, 1]")
    if recovery_noise is not None and recovery_noise.numel():
        if not bool(((recovery_noise > 0) & torch.isfinite(recovery_noise)).all()):
            raise ValueError("recovery_noise must be finite and > 0 (Exp(1) samples)")
