"""Step times of the engine's own models and the speed bound of DESIGN.md section 4.

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


def acceptance_for_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """The per-token acceptance a with E(a, k) = tokens_per_step (0 at or below 1 token, 1 at or above k + 1)."""
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


@dataclass
class StepTimes:
    """Median seconds of the steps the bound needs, on a cache of `context` tokens (batch 1).

    t_1: target on 1 token; t_v[k]: target on k + 1 tokens; t_d: draft model, per drafted token, drafting
    as the engine does (None without a draft); t_ngram[k]: one n-gram proposal of k tokens (its
    per-token T_d is t_ngram[k] / k).
    """

    context: int
    t_1: float
    t_v: dict[int, float]
    t_d: float | None
    t_ngram: dict[int, float]


# Consecutive one-token target forwards per timed run of plain decoding, of which the first
# PLAIN_WARMUP are discarded, and speculative steps per k and round, of which the first is discarded.
# On the project's CPU the one-token forwards that follow a verification take about 8 calls to reach
# the pace of a decoding loop (the first 8 are 3-7% slower, the rest level), while verification and
# draft steps run at their loop's pace from the second step.
PLAIN_RUN = 24
PLAIN_WARMUP = 8
SPECULATIVE_RUN = 3


def _forward_timer(model: LanguageModel, context: int, capacity: int,
                   seed: int) -> Callable[[Sequence[int]], list[float]]:
    """A function timing consecutive forwards of the given query lengths, each appended after the one
    before on a cache that holds `context` tokens, which is rolled back to `context` afterwards.
    `capacity`: the most tokens one call of it appends in all."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (1, context + capacity), generator=generator).to(model.device)
    cache = model.new_cache(1, context + capacity)
    lengths = torch.tensor([context], device=model.device)
    model.forward(ids[:, :context], cache)

    def timed(queries: Sequence[int]) -> list[float]:
        seconds, position = [], context
        for q in queries:
            synchronize(model.device)
            start = time.perf_counter()
            model.forward(ids[:, position : position + q], cache)
            synchronize(model.device)
            seconds.append(time.perf_counter() - start)
            position += q
        cache.rollback(lengths, context)
        return seconds

    return timed


def _drafting_timer(model: LanguageModel, context: int, capacity: int,
                    seed: int) -> Callable[[int], list[float]]:
    """A function timing a greedy drafting of k tokens from one, as the engine drafts: one
    `greedy_decode` call where the model has one (CompiledCausalLM), else k one-token forwards.
    Returns seconds per drafted token: each forward's, or the call's / k."""
    greedy_decode = getattr(model, "greedy_decode", None)
    if greedy_decode is None:
        forwards = _forward_timer(model, context, capacity, seed)
        return lambda k: forwards([1] * k)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (1, context + 1), generator=generator).to(model.device)
    cache = model.new_cache(1, context + capacity)
    lengths = torch.tensor([context], device=model.device)
    model.forward(ids[:, :context], cache)

    def timed(k: int) -> list[float]:
        synchronize(model.device)
        start = time.perf_counter()
        greedy_decode(ids[:, context:], cache, k)
        synchronize(model.device)
        seconds = time.perf_counter() - start
        cache.rollback(lengths, context)
        return [seconds / k] * k

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


class StepTimer:
    """Times each step the way the engine runs it, in interleaved rounds; `times()` gives the medians of
    all rounds so far.

    A round times, on the same models the methods run:
    - plain decoding: PLAIN_RUN consecutive one-token target forwards (T_1), the first PLAIN_WARMUP
      discarded;
    - for each k, SPECULATIVE_RUN speculative steps in a row: a greedy drafting of k tokens (T_d per
      token: k one-token forwards, or one greedy_decode call of a compiled draft, as the engine drafts)
      and then the target on k + 1 tokens (T_v(k)), the first step discarded;
    - an n-gram proposal of each k.
    The first calls of a run follow calls of another kind, which a decoding loop's calls (128 a prompt
    in the benchmark) almost never do. That matters on a CPU, where a model whose wide weights have two
    layouts (models/packed.py: one for one row, one for several) streams one of them in plain decoding
    and the other in verification, and the caches take a few calls to hold the new one: timed as single
    calls of alternating kinds, T_1 read about 15% slower and T_d 40% slower than in a decoding loop,
    and with only the first call of a run discarded, T_1 still read about 5% slower. Sampling at many
    moments of a long benchmark (before and after the runs, and between them) keeps a passing load on
    a shared machine from skewing the ratios the bound depends on.
    """

    def __init__(self, target: LanguageModel, draft: LanguageModel | None, proposer: NgramProposer,
                 prompt: Sequence[int], context: int, ks: Sequence[int], seed: int = 0) -> None:
        self.ks = list(ks)
        self.context = min(context, target.max_length - max(max(ks) + 1, PLAIN_RUN),
                           draft.max_length - max(ks) if draft is not None else context)
        with torch.inference_mode():
            self.target_steps = _forward_timer(target, self.context, max(max(ks) + 1, PLAIN_RUN), seed)
            self.drafting = _drafting_timer(draft, self.context, max(ks), seed) if draft is not None else None
            self.ngram_step = _ngram_timer(prompt, self.context, target.vocab_size, target.device, proposer)
        self.samples: dict[str, list[float]] = {}
        self.warm = False

    @torch.inference_mode()
    def sample(self, rounds: int) -> None:
        """Time `rounds` rounds of every step (after one discarded round the first time)."""
        for _ in range(rounds + (not self.warm)):
            plain = self.target_steps([1] * PLAIN_RUN)[PLAIN_WARMUP:]
            times: dict[str, list[float]] = {"t_1": plain, "t_d": []}
            for k in self.ks:
                verify = []
                for _ in range(SPECULATIVE_RUN):
                    drafts = self.drafting(k) if self.drafting is not None else []
                    verify += self.target_steps([k + 1])
                    if verify[1:]:  # the first step of the run is discarded
                        times["t_d"] += drafts
                times[f"t_v{k}"] = verify[1:]
                times[f"ngram{k}"] = [self.ngram_step(k)]
            if self.warm:
                for name, seconds in times.items():
                    self.samples.setdefault(name, []).extend(seconds)
            self.warm = True

    def times(self) -> StepTimes:
        """Medians of the rounds sampled so far."""
        median = {name: statistics.median(values) for name, values in self.samples.items() if values}
        return StepTimes(self.context, median["t_1"], {k: median[f"t_v{k}"] for k in self.ks}, median.get("t_d"),
                         {k: median[f"ngram{k}"] for k in self.ks})


def bound_figures(drafter: str | None, k: int, alpha: float | None, own_speedup: float | None,
                  times: StepTimes, run: dict | None = None) -> dict:
    """T_1, T_v, T_d, the bound and the efficiency of a method (plain decoding: bound 1).

    drafter: "draft_model", "ngram" or None; alpha: its per-token acceptance; own_speedup: its speedup
    over its own engine's plain decoding (None: no efficiency); times: StepTimer's; run: the step times
    its runs paid (clock.py: "T_1", "T_v", "T_d", None where not recorded). The figures come from `run`
    where it has them all, else from `times` ("step_times": "runs" or "timer"); an n-gram proposal that
    was not clocked (HF prompt lookup's) costs StepTimer's proposal of k / k. bound_timer and
    efficiency_timer are the same from StepTimer's times alone, as a cross-check.
    """
    def figures(t_1: float, t_v: float | None, t_d: float | None) -> tuple[float, float | None]:
        bound = 1.0 if drafter is None else speedup_bound(alpha, k, t_1, t_v, t_d)
        return bound, efficiency(own_speedup, bound) if own_speedup is not None else None

    timer_t_d = None if drafter is None else times.t_d if drafter == "draft_model" else times.t_ngram[k] / k
    timer = (times.t_1, times.t_1 if drafter is None else times.t_v[k], 0.0 if drafter is None else timer_t_d)
    chosen, source = timer, "timer"
    if run is not None and run.get("T_1") is not None:
        t_d = run.get("T_d") if run.get("T_d") is not None or drafter != "ngram" else timer_t_d
        measured = (run["T_1"], run["T_1"] if drafter is None else run.get("T_v"), 0.0 if drafter is None else t_d)
        if None not in measured:
            chosen, source = measured, "runs"
    bound, eff = figures(*chosen)
    bound_timer, eff_timer = figures(*timer)
    return {"T_1": chosen[0], "T_v": chosen[1], "T_d": chosen[2], "step_times": source, "bound": bound,
            "efficiency": eff, "bound_timer": bound_timer, "efficiency_timer": eff_timer}
