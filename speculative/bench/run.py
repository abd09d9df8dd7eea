"""The measurement: every method side by side on the same prompts, then the k and batch-size sweeps.

DESIGN.md section 7: one process, same prompts and pair, warm-up discarded, runs interleaved (method A
on prompt 1, method B on prompt 1, ..., then prompt 2), medians over prompts (of each prompt's median
over repeats). Speedups are medians of per-prompt time ratios; a speculative method's speedup bound uses
its measured acceptance and the step times of timing.py; its efficiency divides its speedup over its own
engine's plain decoding (ours: our baseline; HF: HF `generate`) by that bound.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM

from speculative.bench import exactness
from speculative.bench.methods import (
    Generation,
    HFMethod,
    Method,
    OursMethod,
    hf_assistant,
    vllm_method,
    vllm_unavailable,
)
from speculative.bench.plots import write_plots
from speculative.bench.prompts import BUNDLED_DIR, encode, load_jsonl
from speculative.bench.report import print_tables, write_outputs
from speculative.bench.timing import StepTimes, efficiency, measure_step_times, speedup_bound
from speculative.config import SpeculativeConfig
from speculative.demo import DEMO_DIR
from speculative.demo.model_card import machine
from speculative.llm import LLM
from speculative.proposers import NgramProposer

Advance = Callable[[str, int], None]  # (phase description, total runs of the phase): one run done


@dataclass
class BenchConfig:
    """What `speculative bench` measures (the CLI flags, with the same names).

    model / draft_model: the pair (paths or hub ids); draft_model None skips the draft-model methods.
    prompts: JSONL files, one prompt set each, named after the file's stem.
    k: drafts per step of the side-by-side comparison; sweep_k: the k of the k sweep.
    batch_sizes: the batch-size sweep. max_tokens: tokens generated per prompt (EOS ignored).
    num_prompts: prompts per set (None: all); sweep_prompts: prompts per sweep point.
    repeats: timed runs per prompt and method; timing_repeats: rounds of the step-time loops.
    """

    model: str = str(DEMO_DIR / "target")
    draft_model: str | None = str(DEMO_DIR / "draft")
    prompts: list[str] = field(default_factory=lambda: [str(BUNDLED_DIR / f"{n}.jsonl") for n in ("code", "edit")])
    k: int = 4
    sweep_k: list[int] = field(default_factory=lambda: list(range(1, 9)))
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8])
    max_tokens: int = 128
    num_prompts: int | None = None
    sweep_prompts: int = 6
    repeats: int = 1
    timing_repeats: int = 20
    dtype: str = "float32"
    device: str = "cpu"
    model_impl: str = "auto"
    seed: int = 0

    def quick(self) -> BenchConfig:
        """The CI smoke test's settings: 2 prompts a set, 32 tokens, k sweep [1, k] on 1 prompt, batch
        sizes 1 and 2, 1 repeat."""
        return BenchConfig(**{**asdict(self), "sweep_k": [1, self.k], "batch_sizes": [1, 2], "max_tokens": 32,
                              "num_prompts": 2, "sweep_prompts": 1, "repeats": 1, "timing_repeats": 5})


class Pair:
    """The target and draft, loaded once: our engine's models shared by every LLM, and HF's copies."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        spec = (SpeculativeConfig("draft_model", config.k) if config.draft_model else None)
        self.llm = LLM(config.model, draft_model=config.draft_model, speculative_config=spec, dtype=config.dtype,
                       device=config.device, seed=config.seed, model_impl=config.model_impl)
        if self.llm.tokenizer is None:
            raise ValueError(f"{config.model} has no tokenizer: the benchmark's prompts are text")
        self.tokenizer = self.llm.tokenizer
        self.target = self.llm.target.model
        self.draft = self.llm.draft.model if self.llm.draft is not None else None
        dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
        self.hf_target = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype).to(self.device).eval()
        self.hf_draft = (AutoModelForCausalLM.from_pretrained(config.draft_model, dtype=dtype).to(self.device).eval()
                         if config.draft_model else None)
        tok = self.tokenizer
        self.pad_token_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
        self.drafters = ["draft_model", "ngram"] if self.draft is not None else ["ngram"]

    def ours(self, drafter: str | None, k: int) -> OursMethod:
        """Our engine on the shared models: plain decoding (drafter None), draft model or n-gram."""
        if drafter is None:
            return OursMethod("ours_ar", "ours autoregressive", "ours",
                              llm=LLM(self.target, device=self.device, tokenizer=self.tokenizer))
        llm = LLM(self.target, draft_model=self.draft if drafter == "draft_model" else None,
                  speculative_config=SpeculativeConfig(drafter, k), device=self.device, seed=self.config.seed,
                  tokenizer=self.tokenizer)
        short = {"draft_model": "draft", "ngram": "ngram"}[drafter]
        return OursMethod(f"ours_{short}", f"ours {short} k={k}", "ours", drafter, k, llm=llm)

    def hf(self, drafter: str | None, k: int) -> HFMethod:
        """Hugging Face `generate`: greedy, assisted by the draft, or prompt lookup (these two: batch 1)."""
        if drafter is None:
            return HFMethod("hf_generate", "HF generate", "hf", model=self.hf_target, pad_token_id=self.pad_token_id)
        if drafter == "draft_model":
            name, label, options = "hf_assisted", "HF assisted", {"assistant_model": hf_assistant(self.hf_draft, k)}
        else:
            name, label = "hf_prompt_lookup", "HF prompt lookup"
            options = {"prompt_lookup_num_tokens": k,
                       "max_matching_ngram_size": SpeculativeConfig().prompt_lookup_max}
        return HFMethod(name, f"{label} k={k}", "hf", drafter, k, max_batch=1, model=self.hf_target,
                        pad_token_id=self.pad_token_id, options=options)


def load_sets(config: BenchConfig, tokenizer, max_prompt_tokens: int, notes: list[str]) -> dict[str, list[list[int]]]:
    """Each prompt file's first `num_prompts` prompts as token ids, named after the file's stem."""
    sets = {}
    for path in config.prompts:
        records = load_jsonl(path)[: config.num_prompts]
        ids = [encode(tokenizer, r, max_prompt_tokens) for r in records]
        cut = sum(len(encode(tokenizer, r, 10**9)) > max_prompt_tokens for r in records)
        if cut:
            notes.append(f"{Path(path).stem}: {cut} prompt(s) cut to their last {max_prompt_tokens} tokens "
                         f"to fit the models' context")
        sets[Path(path).stem] = ids
    return sets


def interleaved(methods: Sequence[Method], prompts: Sequence[list[int]], max_tokens: int, repeats: int,
                advance: Advance, phase: str, warmup: bool = True) -> dict[str, list[list[Generation]]]:
    """runs[method][prompt] = its timed Generations: every method on prompt 1, then on prompt 2, ...;
    with `warmup`, first one discarded run of each method on the first prompt."""
    total = len(methods) * (len(prompts) * repeats + warmup)
    if warmup:
        for method in methods:
            method.generate([prompts[0]], max_tokens)
            advance(phase, total)
    runs: dict[str, list[list[Generation]]] = {m.name: [[] for _ in prompts] for m in methods}
    for _ in range(repeats):
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


def speculation_stats(method: Method, generations: Sequence[Generation], times: StepTimes) -> dict:
    """Acceptance figures, the speed bound's inputs and the bound of a method's first runs."""
    if method.drafter is None:
        return {"acceptance_rate": None, "mean_accepted_length": 1.0, "acceptance_per_position": None,
                "T_1": times.t_1, "T_v": times.t_1, "T_d": 0.0, "bound": 1.0}
    steps = sum(g.num_steps for g in generations)
    accepted = sum(g.num_accepted for g in generations)
    drafted = sum(g.num_drafted for g in generations) if method.engine == "ours" else None
    per_step = accepted / (steps * method.k) if steps else 0.0  # undrafted slots count as rejected
    per_position = None
    if method.engine == "ours":
        acc = [sum(c) for c in zip(*(g.accepted_per_position for g in generations))]
        dra = [sum(c) for c in zip(*(g.drafted_per_position for g in generations))]
        per_position = [a / d if d else 0.0 for a, d in zip(acc, dra)]
    t_d = times.t_d if method.drafter == "draft_model" else times.t_ngram[method.k] / method.k
    return {"acceptance_rate": accepted / drafted if drafted else per_step,
            "acceptance_per_step_slot": per_step,
            "mean_accepted_length": 1.0 + accepted / steps if steps else None,
            "acceptance_per_position": per_position, "T_1": times.t_1, "T_v": times.t_v[method.k], "T_d": t_d,
            "bound": speedup_bound(per_step, method.k, times.t_1, times.t_v[method.k], t_d)}


def compare_methods(pair: Pair, methods: Sequence[Method], prompts: list[list[int]], times: StepTimes,
                    advance: Advance, phase: str) -> tuple[dict[str, dict], list[list[int]]]:
    """The side-by-side table of one prompt set (one entry per method), and the reference outputs
    (HF `generate`'s greedy tokens of each prompt)."""
    config = pair.config
    runs = interleaved(methods, prompts, config.max_tokens, config.repeats, advance, phase)
    seconds = {name: _seconds(r) for name, r in runs.items()}
    reference = [r[0].token_ids[0] for r in runs["hf_generate"]]
    baselines = {"hf": "hf_generate", "ours": "ours_ar"}
    table = {}
    for method in methods:
        first = [r[0] for r in runs[method.name]]
        tokens = [len(g.token_ids[0]) for g in first]
        verdicts = [exactness.compare(pair.hf_target, p, g.token_ids[0], ref)
                    for p, g, ref in zip(prompts, first, reference)]
        entry = {"label": method.label, "engine": method.engine, "drafter": method.drafter, "k": method.k,
                 "status": "ok", "tokens": sum(tokens), "seconds_median": statistics.median(seconds[method.name]),
                 "tokens_per_s": statistics.median(n / s for n, s in zip(tokens, seconds[method.name])),
                 "speedup_vs_hf": _median_ratio(seconds["hf_generate"], seconds[method.name]),
                 "speedup_vs_ours_ar": _median_ratio(seconds["ours_ar"], seconds[method.name]),
                 **speculation_stats(method, first, times), **exactness.summarize(verdicts)}
        baseline = baselines.get(method.engine)
        own = _median_ratio(seconds[baseline], seconds[method.name]) if baseline else None
        entry["efficiency"] = efficiency(own, entry["bound"]) if own is not None else None
        table[method.name] = entry
    return table, reference


def sweep_k(pair: Pair, ar: OursMethod, drafter: str, prompts: list[list[int]], times: StepTimes,
            advance: Advance, phase: str) -> list[dict]:
    """Ours with `drafter` at every k of the sweep against our baseline, interleaved, on `prompts`."""
    config = pair.config
    methods = [ar] + [pair.ours(drafter, k) for k in config.sweep_k]
    for method in methods[1:]:
        method.name = f"{method.name}_k{method.k}"
    runs = interleaved(methods, prompts, config.max_tokens, 1, advance, phase, warmup=False)
    base = _seconds(runs[ar.name])
    points = []
    for method in methods[1:]:
        first = [r[0] for r in runs[method.name]]
        speedup = _median_ratio(base, _seconds(runs[method.name]))
        stats = speculation_stats(method, first, times)
        points.append({"k": method.k, "speedup_vs_ours_ar": speedup, "efficiency": efficiency(speedup, stats["bound"]),
                       **{key: stats[key] for key in ("acceptance_rate", "mean_accepted_length", "bound")}})
    return points


def sweep_batch(pair: Pair, methods: Sequence[Method], prompts: list[list[int]], reference: list[list[int]],
                advance: Advance, phase: str) -> list[dict]:
    """Throughput (generated tokens / wall time) of each method at each batch size, interleaved per batch,
    over the first max(batch_sizes) prompts (repeated if fewer), with exactness against `reference`."""
    config = pair.config
    count = max(config.batch_sizes)
    indices = [i % len(prompts) for i in range(count)]
    usable = {b: [m for m in methods if m.max_batch is None or b <= m.max_batch] for b in config.batch_sizes}
    total = sum(len(ms) * -(-count // b) for b, ms in usable.items())
    rows = []
    for b in config.batch_sizes:
        totals = {m.name: [0, 0.0, []] for m in usable[b]}
        for start in range(0, count, b):
            chunk = indices[start : start + b]
            for method in usable[b]:
                g = method.generate([prompts[i] for i in chunk], config.max_tokens)
                record = totals[method.name]
                record[0] += sum(len(t) for t in g.token_ids)
                record[1] += g.seconds
                record[2] += [exactness.compare(pair.hf_target, prompts[i], t, reference[i])
                              for i, t in zip(chunk, g.token_ids)]
                advance(phase, total)
        for method in usable[b]:
            tokens, seconds, verdicts = totals[method.name]
            rows.append({"batch_size": b, "method": method.name, "label": method.label,
                         "tokens_per_s": tokens / seconds, **exactness.summarize(verdicts)})
    return rows


NOTES = [
    "HF methods generate with eos_token_id=None and ours with ignore_eos=True: every output has max_tokens "
    "tokens and both follow the target's own greedy text.",
    "HF assisted generation drafts a constant k per step (num_assistant_tokens_schedule='constant', no "
    "confidence threshold), like ours; HF prompt lookup matches n-grams of up to 3 tokens, like ours.",
    "HF acceptance is derived from the target's forward calls (accepted = tokens - calls); its per-position "
    "acceptance is not available.",
    "HF assisted generation and prompt lookup take batch 1 only: the batch sweep leaves them out.",
]


def build_methods(pair: Pair) -> tuple[list[Method], dict[str, dict]]:
    """The methods of the side-by-side table, and those skipped (with why)."""
    config, drafters = pair.config, pair.drafters
    methods: list[Method] = [pair.hf(None, 0)] + [pair.hf(d, config.k) for d in drafters]
    methods += [pair.ours(None, 0)] + [pair.ours(d, config.k) for d in drafters]
    skipped = {}
    if pair.draft is None:
        for name, label in (("hf_assisted", "HF assisted"), ("ours_draft", "ours draft"), ("vllm_draft", "vLLM draft")):
            skipped[name] = {"label": label, "note": "no --draft-model given"}
    why_not = vllm_unavailable(pair.device)
    if why_not is None and pair.draft is not None:
        methods.append(vllm_method(config.model, config.draft_model, config.k, config.dtype))
    elif "vllm_draft" not in skipped:
        skipped["vllm_draft"] = {"label": "vLLM draft", "note": why_not}
    return methods, skipped


def run_bench(config: BenchConfig, advance: Advance) -> dict:
    """Measure everything `config` asks for; returns the results (the content of results.json)."""
    torch.manual_seed(config.seed)
    notes = list(NOTES)
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        notes.append("OMP_WAIT_POLICY is not PASSIVE: on a CPU shared with other processes spinning OpenMP "
                     "threads can slow small ops several-fold; export OMP_WAIT_POLICY=PASSIVE before running.")
    pair = Pair(config)
    ks = sorted(set(config.sweep_k) | {config.k})
    limits = [m.max_length for m in (pair.target, pair.draft) if m is not None]
    max_prompt = min(limits) - config.max_tokens - max(ks) - 2
    if max_prompt < 1:
        raise ValueError(f"max_tokens={config.max_tokens} leaves no room for a prompt in the models' "
                         f"context of {min(limits)} tokens")
    sets = load_sets(config, pair.tokenizer, max_prompt, notes)
    first_name, first_prompts = next(iter(sets.items()))
    context = int(statistics.median(len(p) for p in first_prompts)) + config.max_tokens // 2
    proposer = NgramProposer(SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max)
    times = measure_step_times(pair.target, pair.draft, proposer, first_prompts[0], context, ks,
                               config.timing_repeats, config.seed)
    methods, skipped = build_methods(pair)
    results: dict = {"config": asdict(config), "machine": {**machine(), "device": str(pair.device),
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
                     "step_times": asdict(times), "sets": {}, "sweeps": {"k": {}}, "notes": notes}
    references = {}
    for name, prompts in sets.items():
        table, references[name] = compare_methods(pair, methods, prompts, times, advance,
                                                  f"{name}: methods side by side")
        table.update({m: {**entry, "status": "skipped"} for m, entry in skipped.items()})
        results["sets"][name] = {"num_prompts": len(prompts), "methods": table}
    ar = next(m for m in methods if m.name == "ours_ar")
    for name, prompts in sets.items():
        results["sweeps"]["k"][name] = {d: sweep_k(pair, ar, d, prompts[: config.sweep_prompts], times, advance,
                                                   f"{name}: k sweep, {d}") for d in pair.drafters}
    batch_methods = [m for m in methods if m.engine == "ours" or m.name == "hf_generate"]
    results["sweeps"]["batch"] = sweep_batch(pair, batch_methods, first_prompts, references[first_name], advance,
                                             f"{first_name}: batch sweep")
    results["sweeps"]["batch_set"] = first_name
    return results


def run_and_report(config: BenchConfig, out: Path, console: Console) -> dict:
    """Run the benchmark with a progress bar, print the tables, write results.json, report.md and plots."""
    transformers.logging.set_verbosity_error()  # HF's deprecation chatter from inside assisted generation
    transformers.logging.disable_progress_bar()
    tasks: dict[str, int] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=False) as progress:
        def advance(phase: str, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total)
            progress.advance(tasks[phase])

        results = run_bench(config, advance)
    print_tables(results, console)
    plots = write_plots(results, out)
    paths = write_outputs(results, out, plots)
    console.print(f"wrote {paths['json']}, {paths['report']} and {len(plots)} plots to {out}/")
    return results
