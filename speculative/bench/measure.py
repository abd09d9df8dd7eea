"""The measurements: interleaved runs, the side-by-side table of one prompt set, the k and batch sweeps.

Runs are interleaved (method A on prompt 1, method B on prompt 1, ..., then prompt 2); a prompt's time
is its median over repeats, and a method's figures are medians over prompts (speedups: medians of
per-prompt time ratios). Exactness is checked on every output against HF `generate`'s greedy output.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from speculative.bench import exactness
from speculative.bench.clock import run_step_times
from speculative.bench.methods import Generation, Method, OursMethod
from speculative.bench.timing import acceptance_for_tokens_per_step

Advance = Callable[[str, int], None]  # (phase description, total runs of the phase): one run done


class Pair(Protocol):
    """What the measurements take of run.py's Pair (run.py imports this module, not the reverse): its
    BenchConfig (`config`: max_tokens, repeats, sweep_k, batch_sizes), HF's target (`hf_target`, the
    exactness reference) and our engine with a drafter at k (`ours`)."""

    config: Any
    hf_target: Any

    def ours(self, drafter: str | None, k: int) -> OursMethod: ...


def interleaved(
    methods: Sequence[Method],
    prompts: Sequence[list[int]],
    max_tokens: int,
    repeats: int,
    advance: Advance,
    phase: str,
    warmup: bool,
) -> dict[str, list[list[Generation]]]:
    """runs[method][prompt] = its timed Generations: every method on prompt 1, then on prompt 2, ...;
    with `warmup`, first two discarded runs of each method, on the first prompt and on it less its last
    token: torch.compile makes a prefill's length dynamic only at its second length, a graph compiled
    otherwise inside the first timed run of another length. Each pass over the prompts starts from
    reset methods (Method.reset), so that a method learns only from the prompts before the current one
    in its pass (suffix decoding's multi-turn case)."""
    warm_ups = [p for p in (prompts[0], prompts[0][:-1]) if p] if warmup else []
    total = len(methods) * (len(prompts) * repeats + len(warm_ups))
    for prompt in warm_ups:
        for method in methods:
            method.generate([prompt], max_tokens)
            advance(phase, total)
    runs: dict[str, list[list[Generation]]] = {m.name: [[] for _ in prompts] for m in methods}
    for _ in range(repeats):
        for method in methods:
            method.reset()
        for i, prompt in enumerate(prompts):
            for method in methods:
                runs[method.name][i].append(method.generate([prompt], max_tokens))
                advance(phase, total)
    return runs


def _seconds(runs: list[list[Generation]]) -> list[float]:
    """Each prompt's median seconds over its repeats."""
    return [statistics.median(g.seconds for g in repeats) for repeats in runs]


def _median_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def speculation_stats(method: Method, generations: Sequence[Generation]) -> dict:
    """Acceptance figures of a method's runs.

    acceptance_rate: accepted / drafted (ours, llama.cpp; HF does not say what it drafted). alpha: the
    per-token acceptance whose E is the measured tokens per step (timing.py says why the bound needs it).
    acceptance_per_position: ours only.
    """
    if method.drafter is None:
        return {
            "acceptance_rate": None,
            "alpha": None,
            "mean_accepted_length": 1.0,
            "acceptance_per_position": None,
        }
    steps = sum(g.num_steps for g in generations)
    accepted = sum(g.num_accepted for g in generations)
    tokens_per_step = 1.0 + accepted / steps if steps else 1.0
    rate, per_position = None, None
    if all(g.num_drafted is not None for g in generations):
        rate = accepted / max(1, sum(g.num_drafted for g in generations))
    if method.engine.startswith("ours"):
        acc = [sum(c) for c in zip(*(g.accepted_per_position for g in generations))]
        dra = [sum(c) for c in zip(*(g.drafted_per_position for g in generations))]
        per_position = [a / d if d else 0.0 for a, d in zip(acc, dra)]
    return {
        "acceptance_rate": rate,
        "alpha": acceptance_for_tokens_per_step(tokens_per_step, method.k),
        "mean_accepted_length": tokens_per_step,
        "acceptance_per_position": per_position,
    }


def engine_timings(runs: list[list[Generation]], tokens: list[int]) -> dict:
    """The engine's own prefill / decode split of a method's runs, where it reports one (llama.cpp's;
    ours: the time outside its decoding steps / the steps'):
    prefill_ms (median over prompts), decode_tokens_per_s (tokens / decode time, the engine's own
    decode-only speed) and engine_tokens_per_s (tokens / (prefill + decode): the call without the
    transport), medians over prompts of each prompt's median over repeats; {} where it reports none."""
    if any(g.decode_seconds is None for repeats in runs for g in repeats):
        return {}
    prefill = [statistics.median(g.prefill_seconds for g in repeats) for repeats in runs]
    decode = [statistics.median(g.decode_seconds for g in repeats) for repeats in runs]
    return {
        "prefill_ms": statistics.median(p * 1e3 for p in prefill),
        "decode_tokens_per_s": statistics.median(n / d for n, d in zip(tokens, decode)),
        "engine_tokens_per_s": statistics.median(n / (p + d) for n, p, d in zip(tokens, prefill, decode)),
    }


def run_times(method: Method, runs: list[list[Generation]], baseline_runs: list[list[Generation]]) -> dict:
    """The step times of the bound as a method's runs paid them (clock.py): T_v and T_d from its own
    runs, T_1 from its engine's plain decoding's runs. A tree method's T_v, suffix decoding's (whose
    proposals are as long as its counts justify, seldom k) and a ragged one's (OursMethod.ragged) is
    over all its verifications."""
    calls = [g.calls for repeats in runs for g in repeats if g.calls is not None]
    every = (
        getattr(method, "tree", None) is not None
        or method.drafter == "suffix"
        or getattr(method, "ragged", False)
    )
    own = run_step_times(calls, method.k, tree=every)
    plain = run_step_times([g.calls for repeats in baseline_runs for g in repeats if g.calls is not None], 0)
    return {**own, "T_1": plain["T_1"]}


def compare_methods(
    pair: Pair,
    methods: Sequence[Method],
    prompts: list[list[int]],
    advance: Advance,
    phase: str,
    warmup: bool,
) -> tuple[dict, list[list[int]], dict]:
    """The side-by-side table of one prompt set (one entry per method, bounds to come: `own_speedup` is
    the speedup over the method's own engine's plain decoding, `run_times` the step times its runs
    paid), the reference outputs (HF `generate`'s greedy tokens of each prompt) and the runs
    themselves (see `interleaved`). speedup_vs_llamacpp: against llama.cpp's plain decoding, where it ran."""
    config = pair.config
    runs = interleaved(methods, prompts, config.max_tokens, config.repeats, advance, phase, warmup)
    seconds = {name: _seconds(r) for name, r in runs.items()}
    reference = [r[0].token_ids[0] for r in runs["hf_generate"]]
    baselines = {"hf": "hf_generate", "ours": "ours_ar", "ours_compiled": "ours_ar_compiled"}
    table = {}
    for method in methods:
        first = [r[0] for r in runs[method.name]]
        tokens = [len(g.token_ids[0]) for g in first]
        verdicts = [
            exactness.compare(pair.hf_target, p, g.token_ids[0], ref)
            for p, g, ref in zip(prompts, first, reference)
        ]
        baseline = baselines.get(method.engine)
        table[method.name] = {
            "label": method.label,
            "engine": method.engine,
            "drafter": method.drafter,
            "k": method.k,
            "adaptive": getattr(method, "adaptive", False),
            "tree": getattr(method, "tree", None),
            "status": "ok",
            "tokens": sum(tokens),
            "seconds_median": statistics.median(seconds[method.name]),
            "tokens_per_s": statistics.median(n / s for n, s in zip(tokens, seconds[method.name])),
            "speedup_vs_hf": _median_ratio(seconds["hf_generate"], seconds[method.name]),
            "speedup_vs_ours_ar": _median_ratio(seconds["ours_ar"], seconds[method.name]),
            "speedup_vs_llamacpp": (
                _median_ratio(seconds["llamacpp"], seconds[method.name]) if "llamacpp" in seconds else None
            ),
            "own_speedup": _median_ratio(seconds[baseline], seconds[method.name]) if baseline else None,
            "run_times": run_times(method, runs[method.name], runs[baseline]) if baseline else None,
            **speculation_stats(method, first),
            **exactness.summarize(verdicts),
            **engine_timings(runs[method.name], tokens),
        }
    return table, reference, runs


def sweep_k(
    pair: Pair, ar: OursMethod, drafter: str, prompts: list[list[int]], advance: Advance, phase: str
) -> list[dict]:
    """Ours with `drafter` at every k of the sweep against our baseline, interleaved, on `prompts`
    (bounds to come, as in `compare_methods`; T_1 from this sweep's runs of the baseline)."""
    config = pair.config
    methods = [ar] + [pair.ours(drafter, k) for k in config.sweep_k]
    for method in methods[1:]:
        method.name = f"{method.name}_k{method.k}"
    runs = interleaved(methods, prompts, config.max_tokens, 1, advance, phase, warmup=False)
    base = _seconds(runs[ar.name])
    points = []
    for method in methods[1:]:
        speedup = _median_ratio(base, _seconds(runs[method.name]))
        stats = speculation_stats(method, [r[0] for r in runs[method.name]])
        points.append(
            {
                "k": method.k,
                "drafter": drafter,
                "speedup_vs_ours_ar": speedup,
                "own_speedup": speedup,
                "run_times": run_times(method, runs[method.name], runs[ar.name]),
                **{key: stats[key] for key in ("acceptance_rate", "alpha", "mean_accepted_length")},
            }
        )
    return points


def sweep_batch(
    pair: Pair,
    methods: Sequence[Method],
    prompts: list[list[int]],
    reference: list[list[int]],
    batch1: dict[str, list[list[Generation]]],
    advance: Advance,
    phase: str,
) -> list[dict]:
    """Throughput (generated tokens / wall time) of each method at each batch size over every prompt,
    cycled to fill a whole number of the largest batch (12 prompts, batch 8: 16, two batches of 8), so
    that each batch size gets more than one timed call; interleaved per batch, with exactness against
    `reference`, after one discarded call of each method at each size (a compiled method's first call
    of a batch size compiles its shapes: it made batch 4 slower than batch 1). Batch size 1 reuses
    `batch1`, the side-by-side runs of the same prompts. Every call starts from reset methods
    (Method.reset): the cycled prompts come back, and would otherwise be drafted from their own earlier
    responses."""
    config = pair.config
    largest = max(config.batch_sizes)
    count = -(-len(prompts) // largest) * largest
    indices = [i % len(prompts) for i in range(count)]
    sizes = [b for b in config.batch_sizes if b > 1]
    total = sum(-(-count // b) * sum(m.max_batch is None or b <= m.max_batch for m in methods) for b in sizes)
    measured: dict[tuple[int, str], list] = {}  # (batch size, method) -> [seconds, outputs in index order]
    for m in methods:
        if 1 in config.batch_sizes:
            measured[1, m.name] = [
                sum(_seconds(batch1[m.name])[i] for i in indices),
                [batch1[m.name][i][0].token_ids[0] for i in indices],
            ]
    for b in sizes:
        usable = [m for m in methods if m.max_batch is None or b <= m.max_batch]
        for method in usable:  # a discarded call: the first of a batch size compiles its shapes
            method.reset()
            method.generate([prompts[i] for i in indices[:b]], config.max_tokens)
        for start in range(0, count, b):
            chunk = [prompts[i] for i in indices[start : start + b]]
            for method in usable:
                method.reset()
                g = method.generate(chunk, config.max_tokens)
                record = measured.setdefault((b, method.name), [0.0, []])
                record[0] += g.seconds
                record[1] += g.token_ids
                advance(phase, total)
    labels = {m.name: m.label for m in methods}
    rows = []
    for (b, name), (seconds, outputs) in measured.items():
        verdicts = [
            exactness.compare(pair.hf_target, prompts[i], out, reference[i])
            for i, out in zip(indices, outputs)
        ]
        rows.append(
            {
                "batch_size": b,
                "method": name,
                "label": labels[name],
                "tokens_per_s": sum(len(out) for out in outputs) / seconds,
                **exactness.summarize(verdicts),
            }
        )
    return rows
