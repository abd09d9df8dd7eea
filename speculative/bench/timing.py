"""Step times of the engine's own models and the speed bound of DESIGN.md section 4.

With acceptance rate a and k drafts per step, a step emits E = (1 - a^(k+1)) / (1 - a) tokens on average
(Leviathan et al. 2023, eq. 1). A plain decoding step costs T_1 (the target on 1 token); a speculative
step costs k * T_d (k draft steps) + T_v (the target on k + 1 tokens). No engine can beat
    bound = E * T_1 / (k * T_d + T_v),
and an engine's efficiency is its measured speedup over its own plain decoding divided by that bound.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from speculative.models.base import LanguageModel
from speculative.proposers import NgramProposer
from speculative.sampling import SampleStrategy


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): expected tokens per step with i.i.d. acceptance a (k + 1 at a = 1)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1]; got {acceptance}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


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


@dataclass
class StepTimes:
    """Median seconds of the steps the bound needs, on a cache of `context` tokens (batch 1).

    t_1: target on 1 token; t_v[k]: target on k + 1 tokens; t_d: draft model on 1 token (None without
    a draft); t_ngram[k]: one n-gram proposal of k tokens (its per-token T_d is t_ngram[k] / k).
    """

    context: int
    t_1: float
    t_v: dict[int, float]
    t_d: float | None
    t_ngram: dict[int, float]


def _forward_timer(model: LanguageModel, context: int, max_query: int, seed: int) -> Callable[[int], float]:
    """A function timing one forward of q tokens on a cache that holds `context` tokens (then rolled back)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (1, context + max_query), generator=generator).to(model.device)
    cache = model.new_cache(1, context + max_query)
    lengths = torch.tensor([context], device=model.device)
    model.forward(ids[:, :context], cache)

    def timed(q: int) -> float:
        synchronize(model.device)
        start = time.perf_counter()
        model.forward(ids[:, context : context + q], cache)
        synchronize(model.device)
        seconds = time.perf_counter() - start
        cache.rollback(lengths, context)
        return seconds

    return timed


def _ngram_timer(prompt: Sequence[int], context: int, vocab_size: int, device: torch.device,
                 proposer: NgramProposer) -> Callable[[int], float]:
    """A function timing one n-gram proposal of k tokens after a context of `context` tokens."""
    capacity = context + 64
    tokens = torch.zeros(1, capacity, dtype=torch.long, device=device)
    filler = (list(prompt) * (context // max(1, len(prompt)) + 1))[:context]
    tokens[0, :context] = torch.tensor(filler, dtype=torch.long)
    lengths = torch.tensor([context], device=device)
    strategy = SampleStrategy.greedy(1, vocab_size, device)

    def timed(k: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        proposer.propose(tokens, lengths, k, strategy).token_ids.tolist()  # .tolist(): the engine's sync
        return time.perf_counter() - start

    return timed


@torch.inference_mode()
def measure_step_times(target: LanguageModel, draft: LanguageModel | None, proposer: NgramProposer,
                       prompt: Sequence[int], context: int, ks: Sequence[int], repeats: int,
                       seed: int = 0) -> StepTimes:
    """Medians over `repeats` interleaved rounds of every step time, after one discarded round."""
    max_k = max(ks)
    context = min(context, target.max_length - max_k - 1,
                  draft.max_length - 1 if draft is not None else context)
    target_step = _forward_timer(target, context, max_k + 1, seed)
    draft_step = _forward_timer(draft, context, 1, seed) if draft is not None else None
    ngram_step = _ngram_timer(prompt, context, target.vocab_size, target.device, proposer)
    samples: dict[str, list[float]] = {}
    for round_ in range(repeats + 1):
        times = {"t_1": target_step(1), **{f"t_v{k}": target_step(k + 1) for k in ks},
                 **{f"ngram{k}": ngram_step(k) for k in ks}}
        if draft_step is not None:
            times["t_d"] = draft_step(1)
        if round_ > 0:
            for name, seconds in times.items():
                samples.setdefault(name, []).append(seconds)
    median = {name: statistics.median(values) for name, values in samples.items()}
    return StepTimes(context, median["t_1"], {k: median[f"t_v{k}"] for k in ks}, median.get("t_d"),
                     {k: median[f"ngram{k}"] for k in ks})
