"""Tensor parallelism on this CPU: what a forward's collectives cost against its compute, at TP=2.

    python benchmarks/tensor_parallel.py [--dtype float32] [--context 100] [--reps 20] [--rounds 5]

Two ranks (torch.multiprocessing, gloo, one thread each), each holding half of the demo target
(TensorParallelCausalLM), time per forward of [batch, q] tokens after `context` cached ones: the whole
forward; the same forward with its collectives made no-ops (its compute: each rank's matmuls and
attention; communication = the difference, waiting for the other rank included); one all-reduce of
[batch * q, hidden] alone (the forward makes 2 a layer and one for the embedding: 25 for the demo
target); and the lm_head both ways, split by vocabulary (this rank's half of the matmul, then the
all-gather of the logits) or replicated (the whole matmul, no collective). In the same rounds, rank 0
alone times the whole target on 1 and on 2 threads. Then `LLM.generate` end to end (plain and with
the draft model, k = 4) at tensor_parallel_size 1 (2 threads) and 2 (1 thread a rank), in alternating
rounds. Figures: the median over rounds of each round's median, with the best round beside it (the
machine is shared: compare within one run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from forward_times import call_ms

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import DEMO_DIR
from speculative.distributed import shutdown
from speculative.distributed.group import TensorParallelGroup
from speculative.models.dtypes import cpu_features
from speculative.models.llama import NativeCausalLM
from speculative.models.loading import load_model
from speculative.models.packed import PackedLinear
from speculative.models.tensor_parallel import TensorParallelCausalLM

# (batch, q): a decoding step, a k=4 verification, both at batch 8, a prefill
CASES = [(1, 1), (1, 5), (8, 1), (8, 5), (1, 128)]


def _timed_ms(call, reps: int) -> float:
    """Median ms of `call()` (two calls discarded)."""
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        call()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _no_collectives():
    """all_reduce and all_gather_single made no-ops (for the forward's compute alone); returns the undo."""
    saved = dist.all_reduce, dist.all_gather_single
    dist.all_reduce = lambda *args, **kwargs: None
    dist.all_gather_single = lambda *args, **kwargs: None

    def undo() -> None:
        dist.all_reduce, dist.all_gather_single = saved

    return undo


def _rank(rank: int, port: int, dtype: str, context: int, reps: int, rounds: int, results) -> None:
    """One rank's measurements, `rounds` rounds of every case (both ranks make the same calls, but for
    the whole target, which rank 0 times alone while rank 1 waits); rank 0 puts {case: {figure: [ms
    per round]}} in `results`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hf = load_model(str(DEMO_DIR / "target"), dtype, model_impl="transformers").model.model
    model = TensorParallelCausalLM.from_hf(hf, TensorParallelGroup(rank, 2, rank))
    whole = NativeCausalLM.from_hf(hf) if rank == 0 else None
    whole_head = PackedLinear([hf.lm_head])
    figures = {case: {} for case in CASES}
    with torch.inference_mode():
        for _ in range(rounds):
            for batch, q in CASES:
                n = reps if batch * q <= 40 else max(3, reps // 5)
                activations = torch.randn(batch * q, hf.config.hidden_size, dtype=model.dtype)
                measured = {"forward": call_ms(model, batch, q, context, n)}
                undo = _no_collectives()
                measured["compute"] = call_ms(model, batch, q, context, n)
                undo()
                measured["all_reduce"] = _timed_ms(lambda a=activations: dist.all_reduce(a.clone()), n)
                measured["head_split"] = _timed_ms(lambda a=activations: model._lm_head(a), n)
                measured["head_replicated"] = _timed_ms(lambda a=activations: whole_head(a), n)
                if rank == 0:
                    for threads in (1, 2):
                        torch.set_num_threads(threads)
                        measured[f"whole_{threads}"] = call_ms(whole, batch, q, context, n)
                    torch.set_num_threads(1)
                dist.barrier()
                for name, ms in measured.items():
                    figures[batch, q].setdefault(name, []).append(ms)
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def _generate_seconds(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def _shown(values: list[float], digits: int = 2) -> str:
    """ "median (min)" of per-round figures."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=20, help="calls per case and round (big ones: a fifth)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt of the end-to-end runs")
    args = parser.parse_args()
    print(f"{cpu_features()}; torch {torch.__version__}; {args.dtype}; cache of {args.context} tokens")
    results = mp.get_context("spawn").SimpleQueue()
    arguments = (29533, args.dtype, args.context, args.reps, args.rounds, results)
    mp.start_processes(_rank, arguments, nprocs=2, start_method="spawn")
    figures = results.get()
    layers = load_model(str(DEMO_DIR / "target"), args.dtype).model.config.num_hidden_layers
    collectives = 2 * layers + 1
    print(f"demo target, {layers} layers; ms per forward, median over {args.rounds} rounds (min)")
    print(
        f"batch x q | TP=2 forward | its compute | communication | 1 all-reduce (x {collectives}) "
        "| lm_head split / replicated | TP=1, 1 thread | TP=1, 2 threads"
    )
    for (batch, q), f in figures.items():
        comm = [whole - compute for whole, compute in zip(f["forward"], f["compute"])]
        share = statistics.median(comm) / statistics.median(f["forward"])
        print(
            f"{batch} x {q} | {_shown(f['forward'])} | {_shown(f['compute'])} | {_shown(comm)}, {share:.0%} "
            f"| {_shown(f['all_reduce'], 3)} | {statistics.median(f['head_split']):.3f} / "
            f"{statistics.median(f['head_replicated']):.3f} | {_shown(f['whole_1'])} | {_shown(f['whole_2'])}"
        )
    prompts = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm_up = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    print(f"LLM.generate, 4 prompts x {args.max_tokens} tokens, greedy: tokens/s, median over rounds (max)")
    for name, options in (("plain", {}), ("draft model, k=4", {"draft_model": str(DEMO_DIR / "draft")})):
        config = SpeculativeConfig(num_speculative_tokens=4) if options else None
        llms = {
            size: LLM(
                str(DEMO_DIR / "target"),
                speculative_config=config,
                dtype=args.dtype,
                tensor_parallel_size=size,
                **options,
            )
            for size in (1, 2)
        }
        speeds: dict[int, list[float]] = {1: [], 2: []}
        for round in range(args.rounds + 1):  # round 0 warms up
            for size, llm in llms.items():
                torch.set_num_threads(2 if size == 1 else 1)  # the whole machine, or each rank's share
                seconds = _generate_seconds(llm, prompts, params if round else warm_up)
                if round:
                    speeds[size].append(len(prompts) * args.max_tokens / seconds)
        for size, values in speeds.items():
            shown = f"{statistics.median(values):.1f} ({max(values):.1f})"
            print(f"  tensor_parallel_size={size}, {name}: {shown}")
        shutdown()


if __name__ == "__main__":
    main()
