"""Where a compiled run's time goes on a GPU, stage by stage, for a lease too short for the whole
benchmark: each stage's wall time (the first call of a shape compiles it), tokens/s of the calls after
it, the host syncs of one call with the places in the engine that made them, and a profiled call's
kernel time and count a step against its wall time. Every line is flushed as it is made, so a run
stopped by its time limit still says how far it got.

    python3 benchmarks/gpu_probe.py --size 1b --dtype bfloat16 > probe.log     (on a CUDA machine)
    python3 benchmarks/gpu_probe.py --device cpu --size tiny --dtype float32   (a dry run)
"""

from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings

import torch

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.bench.synthetic import build_pair
from speculative.bench.timing import synchronize
from speculative.demo import DEMO_DIR
from speculative.models.compiled import CompiledCausalLM, graphs_compiled

START = time.perf_counter()


def say(text: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {text}", flush=True)


def prompts(batch: int, length: int = 32) -> list[dict]:
    generator = torch.Generator().manual_seed(batch)
    return [
        {"prompt_token_ids": torch.randint(100, 8000, (length + i,), generator=generator).tolist()}
        for i in range(batch)
    ]


def timed(llm: LLM, batch: int, tokens: int, device: torch.device, repeats: int) -> str:
    """The first call (compiling its shapes) and the best of `repeats` more, as one line."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    batch_prompts = prompts(batch)
    graphs = graphs_compiled()
    synchronize(device)
    began = time.perf_counter()
    llm.generate(batch_prompts, params)
    synchronize(device)
    first = time.perf_counter() - began
    best, steps = float("inf"), 0
    for _ in range(repeats):
        began = time.perf_counter()
        outputs = llm.generate(batch_prompts, params)
        synchronize(device)
        best = min(best, time.perf_counter() - began)
        steps = outputs[0].metrics.num_steps
    return (
        f"first call {first:.1f} s ({graphs_compiled() - graphs} graphs compiled); then "
        f"{batch * tokens / best:.1f} tokens/s ({best * 1e3 / tokens:.2f} ms a token of a row, the "
        f"prefill included; row 0: {steps} steps, {tokens / max(steps, 1):.2f} tokens a step)"
    )


def syncs(llm: LLM, tokens: int) -> str:
    """Host syncs of one batch-1 call, counted by torch's sync debug mode, with the engine's frames that
    made them."""
    places: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack() if "/speculative/" in f.filename][-3:]
            places[" < ".join(f"{f.filename.split('/speculative/')[-1]}:{f.lineno}" for f in frames)] += 1

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            output = llm.generate(prompts(1), params)[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"{sum(places.values())} syncs over {output.metrics.num_steps} steps"]
    lines += [f"    {n:4d}  {place}" for place, n in places.most_common(12)]
    return "\n".join(lines)


def kernel_time(llm: LLM, tokens: int, device: torch.device) -> str:
    """Where a batch-1 call's time goes, by torch.profiler: the device's kernel time and kernel count
    a step against the step's wall time (their difference is the host's share, not overlapped), and
    the kernels that take the most."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    synchronize(device)
    began = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profiler:
        output = llm.generate(prompts(1), params)[0]
        synchronize(device)
    wall = time.perf_counter() - began
    steps = max(output.metrics.num_steps, 1)
    events = profiler.key_averages()
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in on_device) / 1e3  # ms
    lines = [
        f"{wall * 1e3 / steps:.3f} ms a step of wall time (profiled), {busy / steps:.3f} ms of kernels, "
        f"{sum(e.count for e in on_device) / steps:.0f} kernels a step, over {steps} steps"
    ]
    top = sorted(on_device, key=lambda e: e.self_device_time_total, reverse=True)[:8]
    for e in top:
        lines.append(f"    {e.self_device_time_total / 1e3 / steps:7.3f} ms  {e.count:6d}x  {e.key[:80]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    say(f"torch {torch.__version__}; building the synthetic pair {args.size!r}")
    pair = build_pair(args.size, dtype, device)
    say(f"built: {pair.describe()}")
    hf_prompt = torch.tensor(prompts(1)[0]["prompt_token_ids"], device=device)[None]
    for tokens in (8, args.tokens):  # the first compiles nothing, but warms the kernels up
        synchronize(device)
        began = time.perf_counter()
        pair.target.generate(hf_prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        synchronize(device)
    say(f"HF generate, batch 1: {tokens / (time.perf_counter() - began):.1f} tokens/s")
    loading = dict(device=device, tokenizer=str(DEMO_DIR / "target"))
    eager = LLM(
        pair.target,
        draft_model=pair.draft,
        speculative_config=SpeculativeConfig("draft_model", args.k),
        **loading,
    )
    say(f"eager draft k={args.k}: " + timed(eager, 1, args.tokens, device, 1))
    target = CompiledCausalLM(eager.target.model)
    draft = CompiledCausalLM(eager.draft.model)
    plain = LLM(target, compile=True, **loading)
    spec = LLM(
        target,
        draft_model=draft,
        speculative_config=SpeculativeConfig("draft_model", args.k),
        compile=True,
        **loading,
    )
    for batch in args.batches:
        say(f"compiled plain, batch {batch}: " + timed(plain, batch, args.tokens, device, 2))
        say(f"compiled draft k={args.k}, batch {batch}: " + timed(spec, batch, args.tokens, device, 2))
        if batch == 1 and device.type == "cuda":
            say("compiled plain, host syncs: " + syncs(plain, 32))
            say(f"compiled draft k={args.k}, host syncs: " + syncs(spec, 32))
        if batch == 1:
            say("compiled plain, profiled: " + kernel_time(plain, 64, device))
            say(f"compiled draft k={args.k}, profiled: " + kernel_time(spec, 64, device))
    say("done")


if __name__ == "__main__":
    main()
