"""The speed bound of speculative decoding, and the efficiency of an engine against it.

With per-token acceptance a and k drafts per step, a step emits E = (1 - a^(k+1)) / (1 - a) tokens on
average (Leviathan et al. 2023, eq. 1). A plain decoding step costs T_1 (the target on 1 token); a
speculative step costs k * T_d (k draft steps) + T_v (the target on k + 1 tokens). No engine can beat
    bound = E * T_1 / (k * T_d + T_v),
and an engine's efficiency is its measured speedup over its own plain decoding divided by that bound.

Which a: in Leviathan's model a is the probability that a draft is accepted given that the drafts before
it were, so E(a) is the expected tokens per step. The "acceptance rate" accepted / drafted (vLLM's) is
smaller, since drafts after a rejection count as drafted and are never accepted: plugging it into E
understates the tokens per step (at k = 4 a rate of 0.63 gives E = 2.4 where 3.5 were measured). The
bound therefore uses a = `acceptance_for_tokens_per_step(measured tokens per step, k)`: the a whose E is
what was measured, so the bound is exactly the measured tokens per step at the measured step costs.
"""

from __future__ import annotations

import math

import torch


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): expected tokens per step with i.i.d. acceptance a (k + 1 at a = 1)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1]; got {acceptance}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def acceptance_for_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """The per-token acceptance a with E(a, k) = tokens_per_step (0 at or below 1 token, 1 at or above
    k + 1)."""
    if tokens_per_step <= 1.0 or tokens_per_step >= k + 1.0:
        return 0.0 if tokens_per_step <= 1.0 else 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_step(mid, k) < tokens_per_step else (low, mid)
    return (low + high) / 2


def speedup_bound(acceptance: float, k: int, t_1: float, t_v: float, t_d: float) -> float:
    """The best speedup over plain decoding a perfect engine reaches: E * T_1 / (k * T_d + T_v)."""
    return expected_tokens_per_step(acceptance, k) * t_1 / (k * t_d + t_v)


def efficiency(speedup: float, bound: float) -> float:
    """Measured speedup over the engine's own plain decoding, as a fraction of the bound."""
    return speedup / bound if bound > 0 else math.nan


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that wall time means work done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bound_figures(
    drafter: str | None, k: int, alpha: float | None, own_speedup: float | None, run: dict | None
) -> dict:
    """T_1, T_v, T_d, the bound and the efficiency of a method (plain decoding: bound 1).

    drafter: Method.drafter ("draft_model", "ngram", an EAGLE head's "eagle", ...) or None; alpha: its
    per-token acceptance; own_speedup: its speedup over its own engine's plain decoding (None: no
    efficiency); run: the step times its runs paid (clock.py: "T_1", "T_v", "T_d", None where not
    recorded; no bound without them; an EAGLE head's T_d is its own forwards, its reading of the
    target's features being in the target's forwards, T_v). An n-gram
    proposal that was not clocked (HF prompt lookup's) counts as free, T_d = 0, which makes its bound
    an upper one (a lookup costs little beside a forward).
    """
    run = run or {}
    t_1, t_v, t_d = run.get("T_1"), run.get("T_v"), run.get("T_d")
    if drafter is None:
        t_v, t_d = t_1, 0.0
    elif drafter == "ngram" and t_d is None:
        t_d = 0.0
    if None in (t_1, t_v, t_d):
        return {"T_1": t_1, "T_v": t_v, "T_d": t_d, "bound": None, "efficiency": None}
    bound = 1.0 if drafter is None else speedup_bound(alpha, k, t_1, t_v, t_d)
    return {
        "T_1": t_1,
        "T_v": t_v,
        "T_d": t_d,
        "bound": bound,
        "efficiency": efficiency(own_speedup, bound) if own_speedup is not None else None,
    }
