"""Suffix decoding against n-gram lookup, the draft model and plain decoding: the bench's side-by-side
measurement (interleaved runs, exactness against HF greedy) restricted to those methods, on the bundled
code, multiturn and edit sets. The README's suffix figures come from it.

    python benchmarks/suffix_compare.py [--num-prompts 6] [--max-tokens 96] [-k 4] [--more-k 24] \
        [--more-spec-factor 4.0]

Methods: HF generate, ours AR, ours with each drafter at k (suffix with vLLM's defaults), and ours
n-gram and suffix at a larger k (suffix with a larger max_spec_factor too). Prints one line per set
and method: tokens per step, tokens/s and the speedup over ours AR.
"""

from __future__ import annotations

import argparse

from speculative.bench.measure import compare_methods
from speculative.bench.prompts import BUNDLED_DIR
from speculative.bench.run import BenchConfig, Pair, load_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--num-prompts", type=int, default=6, help="prompts per set (multiturn: 3 a conversation)"
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=4, help="drafts per step of every drafter")
    parser.add_argument(
        "--more-k",
        type=int,
        default=24,
        help="k of the second n-gram and suffix methods (24: the tries' depth)",
    )
    parser.add_argument("--more-spec-factor", type=float, default=4.0, help="the second suffix's factor")
    args = parser.parse_args()
    sets = [str(BUNDLED_DIR / f"{name}.jsonl") for name in ("multiturn", "edit", "code")]
    config = BenchConfig(
        prompts=sets, k=args.k, max_tokens=args.max_tokens, num_prompts=args.num_prompts, heads={}
    )
    pair = Pair(config)
    methods = [pair.hf(None, 0), pair.ours(None, 0)] + [pair.ours(d, args.k) for d in pair.drafters]
    methods += [
        pair.ours("ngram", args.more_k),
        pair.ours("suffix", args.more_k, suffix_decoding_max_spec_factor=args.more_spec_factor),
    ]
    methods[-2].name += f"_k{args.more_k}"
    methods[-1].name += f"_k{args.more_k}_f{args.more_spec_factor:g}"
    for i, (name, prompts) in enumerate(load_sets(config, pair.tokenizer, 1024, []).items()):
        table = compare_methods(pair, methods, prompts, lambda *_: None, name, warmup=i == 0)[0]
        for method, entry in table.items():
            print(
                f"{name:10} {method:18} tokens/step {entry['mean_accepted_length']:.2f}  "
                f"{entry['tokens_per_s']:6.1f} tok/s  x{entry['speedup_vs_ours_ar']:.2f} vs ours AR  "
                f"identical {entry['identical_fraction']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
