"""Regenerate the toy demo's bundled prompt sets `code.jsonl`, `edit.jsonl` and `multiturn.jsonl` in
speculative/bench/prompt_sets/.

    python benchmarks/make_prompts.py [--count 20]

Deterministic for a given Python standard library (the demo corpus); see `speculative.bench.prompts`.
The chat sets for instruction-tuned models in the same folder (`chat.jsonl`, `code-chat.jsonl`,
`summarize.jsonl`, `chat-multiturn.jsonl`) are written by hand and committed: this script never
regenerates or touches them.
"""

from __future__ import annotations

import argparse

from speculative.bench.prompts import write_bundled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--count",
        type=int,
        default=20,
        help="prompts per set (multiturn: whole conversations, at least as many)",
    )
    args = parser.parse_args()
    for name, path in write_bundled(count=args.count).items():
        print(f"{name}: {sum(1 for _ in path.open())} prompts -> {path}")


if __name__ == "__main__":
    main()
