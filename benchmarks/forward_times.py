"""Per-call times of the native forward, eager and compiled: T_1, T_v, T_d and batch 8.

    python benchmarks/forward_times.py [--dtype float32] [--rounds 8] [--context 100]

Every case is timed in interleaved rounds (eager, compiled, next case, ...) on a cache of `context`
tokens that is rolled back after each call; a figure is the median over rounds of each round's median,
with the minimum beside it (the machine is shared: repeat and compare medians). The compiled models'
graphs are all compiled first, and that time is printed too. Fixed seed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch._dynamo.utils import counters

from speculative.demo import DEMO_DIR
from speculative.models.compiled import CompiledCausalLM
from speculative.models.loading import load_model


def call_ms(model, batch: int, q: int, context: int, reps: int) -> float:
    """Median ms of a forward of [batch, q] tokens after `context` cached ones (two calls discarded)."""
    ids = torch.randint(0, model.vocab_size, (batch, context + q), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(batch, context + q)
    model.forward(ids[:, :context], cache, logits_indices=torch.zeros(batch, 1, dtype=torch.long))
    lengths = torch.full((batch,), context)
    times = []
    with torch.inference_mode():
        for i in range(reps + 2):
            start = time.perf_counter()
            model.forward(ids[:, context:], cache)
            if i >= 2:
                times.append(time.perf_counter() - start)
            cache.rollback(lengths, context)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("-k", type=int, default=4, help="drafts per step: T_v is a forward of k + 1 tokens")
    args = parser.parse_args()
    eager = {name: load_model(str(DEMO_DIR / name), args.dtype).model for name in ("target", "draft")}
    models = {"eager": eager, "compiled": {name: CompiledCausalLM(m) for name, m in eager.items()}}
    cases = {
        "T_1": ("target", 1, 1),
        f"T_v(k={args.k})": ("target", 1, args.k + 1),
        "T_d": ("draft", 1, 1),
        "batch 8, q=1": ("target", 8, 1),
        f"batch 8, q={args.k + 1}": ("target", 8, args.k + 1),
    }
    start = time.perf_counter()
    for name, batch, q in cases.values():
        call_ms(models["compiled"][name], batch, q, args.context, 1)
    graphs = counters["stats"]["unique_graphs"]
    print(f"compiling every case: {time.perf_counter() - start:.0f} s, {graphs} graphs")
    samples = {(kind, case): [] for kind in models for case in cases}
    for _ in range(args.rounds):
        for case, (name, batch, q) in cases.items():
            for kind in models:
                reps = 10 if batch == 1 else 3
                samples[kind, case].append(call_ms(models[kind][name], batch, q, args.context, reps))
    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, cache of {args.context} tokens: "
        f"ms per call, median (min)"
    )
    for case in cases:
        eager_ms, compiled_ms = samples["eager", case], samples["compiled", case]
        print(
            f"  {case:14s} eager {statistics.median(eager_ms):6.2f} ({min(eager_ms):6.2f})   compiled "
            f"{statistics.median(compiled_ms):6.2f} ({min(compiled_ms):6.2f})   "
            f"x{statistics.median(eager_ms) / statistics.median(compiled_ms):.2f}"
        )


if __name__ == "__main__":
    main()
