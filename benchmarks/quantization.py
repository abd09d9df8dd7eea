"""Weight-only quantization on the demo pair: float against int8 / int4, measured side by side.

    python benchmarks/quantization.py forward  --dtype float32 --modes float,int8 [--rounds 8]
    python benchmarks/quantization.py generate --dtype bfloat16 --modes float,int8,int4 [--rounds 3]

`forward`: per-call ms of the demo target, 1 and 5 query tokens on a cache of 100 (as
benchmarks/forward_times.py times them), eager and compiled, every mode and kind in turn in each
round; medians over rounds of each round's median, with the minimum. Also the bytes of the tensors
the model holds, before and after quantizing.
`generate`: the demo pair on the first prompts of the bundled code set, 128 tokens each (EOS
ignored, greedy, k=4), plain (the target alone) and speculative (with the draft), eager and compiled;
one prompt of every configuration in turn; tokens/s of each round (medians, min-max), acceptance
and tokens per step, and whether speculative output equals plain output.

Modes: float, int8, int4 (bfloat16 only), and int8-nohead / int4-nohead (lm_head left in float).
The machine is shared: a round during which other processes kept more than --others-limit cores
busy (from /proc/stat) is discarded and run again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from forward_times import call_ms

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.bench.prompts import BUNDLED_DIR
from speculative.demo import DEMO_DIR
from speculative.models.compiled import CompiledCausalLM
from speculative.models.loading import load_model
from speculative.models.quantization import tensor_bytes

PROMPTS = BUNDLED_DIR / "code.jsonl"


def _busy_seconds() -> tuple[float, float]:
    """CPU seconds every process and this one have spent (Linux /proc/stat)."""
    values = [int(v) for v in open("/proc/stat").readline().split()[1:9]]
    busy = (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system


def quiet_rounds(run_round, rounds: int, limit: float) -> list:
    """The results of `rounds` calls of run_round() during which other processes kept fewer than
    `limit` cores busy on average (others are discarded and run again, up to 4 x rounds calls)."""
    results, attempts = [], 0
    while len(results) < rounds and attempts < 4 * rounds:
        attempts += 1
        start, (busy, own) = time.perf_counter(), _busy_seconds()
        result = run_round()
        wall, (busy_end, own_end) = time.perf_counter() - start, _busy_seconds()
        others = max(0.0, (busy_end - busy) - (own_end - own)) / wall
        if others < limit:
            results.append(result)
        else:
            print(f"  (a round discarded: other processes kept {others:.2f} cores busy)", flush=True)
            time.sleep(10)
    return results


def _quantized(dtype: str, mode: str):
    model = load_model(str(DEMO_DIR / "target"), dtype).model
    before = tensor_bytes(model)
    if mode != "float":
        model.quantize(mode.split("-")[0], lm_head=not mode.endswith("nohead"))
    print(
        f"{mode}: the target's tensors {before / 2**20:.1f} -> {tensor_bytes(model) / 2**20:.1f} MiB",
        flush=True,
    )
    return model


def forward(args: argparse.Namespace) -> None:
    models = {}
    for mode in args.modes.split(","):
        model = _quantized(args.dtype, mode)
        models[mode, "eager"] = model
        if not args.eager_only:
            models[mode, "compiled"] = CompiledCausalLM(model)
    start = time.perf_counter()
    for model in models.values():
        for q in (1, 5):
            call_ms(model, 1, q, args.context, 1)  # compiles
    print(f"warm-up (compiling): {time.perf_counter() - start:.0f} s", flush=True)
    rounds = quiet_rounds(
        lambda: {(key, q): call_ms(m, 1, q, args.context, 10) for q in (1, 5) for key, m in models.items()},
        args.rounds,
        args.others_limit,
    )
    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
        f"cache of "
        f"{args.context} tokens: ms per call, median (min) of {len(rounds)} rounds"
    )
    for q in (1, 5):
        for key in models:
            samples = [r[key, q] for r in rounds]
            print(
                f"  q={q}  {key[0]:12s} {key[1]:8s} {statistics.median(samples):7.2f} ({min(samples):6.2f})"
            )


def generate(args: argparse.Namespace) -> None:
    prompts = [json.loads(line)["prompt"] for line in open(PROMPTS)][: args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    target, draft = str(DEMO_DIR / "target"), str(DEMO_DIR / "draft")
    llms = {}
    start = time.perf_counter()
    for kind in ("eager",) if args.eager_only else ("eager", "compiled"):
        for mode in args.modes.split(","):
            speculative = LLM(
                target,
                draft_model=draft,
                dtype=args.dtype,
                quantization=None if mode == "float" else mode,
                compile=kind == "compiled",
                speculative_config=SpeculativeConfig(num_speculative_tokens=4),
            )
            plain = LLM(speculative.target.model, tokenizer=speculative.tokenizer)  # the same target
            llms[mode, kind, "plain"], llms[mode, kind, "speculative"] = plain, speculative
            for llm in (plain, speculative):  # warm-up: compiles every graph the runs use
                llm.generate([prompts[0], prompts[-1]], params)
    print(f"built and warmed up in {time.perf_counter() - start:.0f} s", flush=True)
    outputs = {}

    def run_round() -> dict:
        tokens, seconds = dict.fromkeys(llms, 0), dict.fromkeys(llms, 0.0)
        for i, prompt in enumerate(prompts):
            for key, llm in llms.items():
                start = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                seconds[key] += time.perf_counter() - start
                tokens[key] += len(out.outputs[0].token_ids)
                outputs[key, i] = out
        return {key: tokens[key] / seconds[key] for key in llms}

    rounds = quiet_rounds(run_round, args.rounds, args.others_limit)
    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
        f"{len(prompts)} code prompts x 128 tokens, k=4: tokens/s, median (min-max) of {len(rounds)} rounds"
    )
    for key in llms:
        mode, kind, method = key
        samples = [r[key] for r in rounds]
        spread = f"({min(samples):.1f}-{max(samples):.1f})"
        line = f"  {mode:11s} {kind:8s} {method:11s} {statistics.median(samples):6.1f} {spread}"
        if method == "speculative":
            metrics = [outputs[key, i].metrics for i in range(len(prompts))]
            accepted, drafted = sum(m.num_accepted for m in metrics), sum(m.num_drafted for m in metrics)
            steps = sum(m.num_steps for m in metrics)
            same = all(
                outputs[key, i].outputs[0].token_ids == outputs[(mode, kind, "plain"), i].outputs[0].token_ids
                for i in range(len(prompts))
            )
            line += (
                f"  acceptance {accepted / drafted:.3f}, {(accepted + steps) / steps:.2f} tokens/step, "
                f"{'the same tokens as plain' if same else 'OUTPUT DIFFERS FROM PLAIN'}"
            )
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["forward", "generate"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--modes", default="float,int8")
    parser.add_argument("--rounds", type=int, default=None, help="forward: 8, generate: 3")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--others-limit", type=float, default=0.2, help="cores other processes may keep busy")
    args = parser.parse_args()
    args.rounds = args.rounds or (8 if args.what == "forward" else 3)
    (forward if args.what == "forward" else generate)(args)


if __name__ == "__main__":
    main()
