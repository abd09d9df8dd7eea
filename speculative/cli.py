"""The `speculative` command line: `speculative generate ...`."""

from __future__ import annotations

import argparse
import sys

from speculative.config import SpeculativeConfig
from speculative.engine.outputs import RequestOutput
from speculative.llm import LLM
from speculative.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculative", description="Fast, exact speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text from prompts and print acceptance figures")
    gen.add_argument("--model", required=True, help="target model: hub id or local path")
    drafter = gen.add_mutually_exclusive_group()
    drafter.add_argument("--draft-model", help="draft model sharing the target's vocabulary")
    drafter.add_argument("--ngram", action="store_true", help="draft by n-gram prompt lookup")
    gen.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="draft tokens per step")
    gen.add_argument("--acceptance", choices=["rejection", "typical"], default="rejection",
                     help="rejection is lossless; typical is not")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--model-impl", choices=["auto", "native", "transformers"], default="auto")
    return parser


def generate(args: argparse.Namespace) -> int:
    config = None
    if args.ngram or args.draft_model:
        config = SpeculativeConfig(method="ngram" if args.ngram else "draft_model",
                                   num_speculative_tokens=args.num_speculative_tokens,
                                   acceptance=args.acceptance)
    llm = LLM(args.model, draft_model=args.draft_model, speculative_config=config, dtype=args.dtype,
              device=args.device, model_impl=args.model_impl)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for output in llm.generate(args.prompt, params):
        print(_report(output, config))
    return 0


def _report(output: RequestOutput, config: SpeculativeConfig | None) -> str:
    completion, m = output.outputs[0], output.metrics
    method = f"{config.method}, k={config.num_speculative_tokens}" if config else "autoregressive"
    lines = [f"{output.prompt}{completion.text}", "",
             f"[{method}] {m.num_generated} tokens in {m.num_steps} steps, {m.tokens_per_second:.1f} tokens/s, "
             f"finish: {completion.finish_reason}"]
    if config:
        per_position = " ".join(f"{a:.2f}" for a in m.acceptance_per_position)
        lines.append(f"acceptance rate {m.acceptance_rate:.2f} ({m.num_accepted}/{m.num_drafted} drafts), "
                     f"mean accepted length {m.mean_accepted_length:.2f}, per position: {per_position}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return generate(args)
    except (ValueError, TypeError, OSError) as error:
        print(f"speculative: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
