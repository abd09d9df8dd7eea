"""Eager float32 decoding with and without the few-row kernel (models/few_rows.py), in one process.

    python benchmarks/few_rows.py [--rounds 8] [--context 200] [--tokens 96] [--prompts 3]

On the demo pair (SmolLM2-135M-Instruct and its draft, fetched as `speculative generate` fetches
them), float32, eager: the target's 121 matmuls alone at 1 / 2 / 5 / 8 / 16 / 32 rows, the target's
forward of 1 and k + 1 = 5 tokens and the draft's of 1 (a cache of `context` tokens, rolled back after
each call), and greedy generation of `tokens` tokens for `prompts` chat prompts, plain and with the
draft at k = 4, each with the kernel (PackedLinear.few_rows on) and with oneDNN (off), interleaved in
rounds; a figure is the median over rounds, with the minimum beside it. Outputs with and without
the kernel are compared token for token. Needs a CPU the kernel serves (AVX2-only, or Intel; elsewhere
oneDNN keeps these calls).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from forward_times import call_ms

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.bench.prompts import BUNDLED_DIR
from speculative.demo.smollm2 import demo_pair
from speculative.models import few_rows
from speculative.prompts import encode, load_jsonl


def set_kernel(models, on: bool) -> None:
    for model in models:
        for linear in model.packed_linears():
            linear.few_rows = on


def matmuls_ms(model, rows: int, reps: int = 5) -> float:
    """Median ms of one call of each of the model's PackedLinears on `rows` rows."""
    widths = {linear.weight.shape[1] for linear in model.packed_linears()}
    inputs = {width: torch.randn(rows, width) for width in widths}
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            start = time.perf_counter()
            for linear in model.packed_linears():
                linear(inputs[linear.weight.shape[1]])
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def generate_tps(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens a second of greedy generation, prompt by prompt, and the outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    return len(prompts) * tokens / (time.perf_counter() - start), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=3)
    args = parser.parse_args()
    pair = demo_pair()
    plain = LLM(str(pair.target), dtype="float32")
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=4)
    drafted = LLM(str(pair.target), draft_model=str(pair.draft), speculative_config=config, dtype="float32")
    target, draft = plain.target.model, drafted.draft.model
    if not target._lm_head.few_rows:
        raise SystemExit("the kernel serves AVX2-only CPUs and Intel ones, not this one: nothing to compare")
    records = load_jsonl(BUNDLED_DIR / "chat.jsonl")[: args.prompts]
    prompts = [encode(plain.tokenizer, record, 2048) for record in records]
    models = [target, drafted.target.model, draft]
    cases = {
        **{f"matmuls, {n} rows": lambda n=n: matmuls_ms(target, n) for n in (1, 2, 5, 8, 16, 32)},
        "target forward, 1 token": lambda: call_ms(target, 1, 1, args.context, 10),
        "target forward, 5 tokens": lambda: call_ms(target, 1, 5, args.context, 10),
        "draft forward, 1 token": lambda: call_ms(draft, 1, 1, args.context, 10),
    }
    samples: dict[tuple[str, bool], list[float]] = {(case, on): [] for case in cases for on in (True, False)}
    outputs: dict[tuple[str, bool], list[list[int]]] = {}
    for _ in range(args.rounds):
        for on in (True, False):
            set_kernel(models, on)
            for case, run in cases.items():
                samples[case, on].append(run())
            for name, llm in (("plain", plain), ("draft k=4", drafted)):
                tps, outputs[name, on] = generate_tps(llm, prompts, args.tokens)
                samples.setdefault((f"generate {name}, tokens/s", on), []).append(tps)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    print(f"{cpu}, {torch.get_num_threads()} threads, float32, eager, kernel rows <= {few_rows.ROWS_MAX}")
    print(f"{'case':28s} {'kernel':>16s} {'oneDNN':>16s}  ratio   (ms unless said; median (min) of rounds)")
    for case in dict.fromkeys(case for case, _ in samples):
        on, off = samples[case, True], samples[case, False]
        best = max if "tokens/s" in case else min
        ratio = statistics.median(on) / statistics.median(off)
        print(
            f"{case:28s} {statistics.median(on):8.2f} ({best(on):6.2f}) {statistics.median(off):8.2f} "
            f"({best(off):6.2f})  x{ratio if 'tokens/s' in case else 1 / ratio:.2f}"
        )
    for name in ("plain", "draft k=4"):
        same = outputs[name, True] == outputs[name, False]
        print(f"{name}: outputs with and without the kernel {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
