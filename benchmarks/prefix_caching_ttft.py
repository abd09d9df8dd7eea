"""Time to first token, and the draft's time at its first proposal, with and without prefix caching, on
the demo pair (SmolLM2-135M-Instruct with its draft, float32, eager, greedy, batch 1). docs/server.md's
prefix caching table comes from it.

    python benchmarks/prefix_caching_ttft.py [--eagle3 speculative/demo/smollm2_eagle3]

Conversations are replayed turn by turn, the model's own answers as the history: the first 12 of the
bundled chat-multiturn set (its user turns, 64 new tokens a turn), and the 4 requests of about 2,000
tokens of the chunked-prefill report's prompts (summaries of notes) with two follow-up questions (48
new tokens). Every turn runs three times on one LLM in one process, so that all see the same machine:
without prefix caching (no lookup, nothing kept), with it for the target alone, and with it for the
drafter too; each of the last two keeps a cache of its own, so that each finds what the
conversation's earlier turns left. For the draft, "the target alone" means the draft prefills its
whole context at its first proposal; for an EAGLE-3 head (`--eagle3 PATH`), that the engine keeps no
hidden states of the answers, so that a turn finds its last prompt only (the head reads the states
of every position it is given). The answers must be the same, and the last becomes the history.
Prints, per turn, the prompt tokens, those found in the cache, the time to first token and the
drafter's time in the first drafting step (a draft's prefill of the context there, then its drafts),
medians and ranges, with the machine's CPU. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.bench.prompts import resolve_set
from speculative.demo.smollm2 import demo_pair
from speculative.machine import machine
from speculative.prefix_cache import PrefixCache

NOTES = (
    Path(__file__).parents[1]
    / "docs/benchmarks/results-serve-smollm2-epyc-zen4-f32-chunked-prefill/prompts.jsonl"
)
FOLLOW_UPS = ["Which point matters most, in one sentence?", "Write a title for these notes."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eagle3", metavar="PATH", help="an EAGLE-3 head for the demo target, not its draft")
    args = parser.parse_args()
    pair = demo_pair()
    drafter = {"draft_model": str(pair.draft)}
    if args.eagle3:
        drafter = {"draft_model": args.eagle3, "speculative_config": SpeculativeConfig(method="eagle3")}
    llm = LLM(str(pair.target), dtype="float32", enable_prefix_caching=True, **drafter)
    size = llm.engine.prefix_cache.max_blocks * llm.engine.prefix_cache.block_size
    target_only, both, tokenizer = PrefixCache(size), PrefixCache(size), llm.tokenizer
    llm.generate(["warm up"], SamplingParams(max_tokens=8))

    def run(ids: list[int], params: SamplingParams, cache: PrefixCache | None, drafter_too: bool):
        llm.engine.use_prefix_cache(cache)
        if not drafter_too and args.eagle3:
            llm.engine.context_features = None
        elif not drafter_too:
            llm.engine.proposer.use_prefix_cache(None)
        with llm.engine.recording_steps() as steps:
            (out,) = llm.generate([{"prompt_token_ids": ids}], params)
        drafting = next(step.propose_s for step in steps if step.k)
        return out, out.metrics.first_token_s, drafting

    def turn(history: list[dict], max_tokens: int) -> tuple:
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        runs = [run(ids, params, *options) for options in ((None, False), (target_only, False), (both, True))]
        if len({tuple(out.outputs[0].token_ids) for out, _, _ in runs}) > 1:
            raise SystemExit(f"the answers differ with and without the prefix cache: {history}")
        out = runs[-1][0]
        return (
            len(ids),
            out.num_cached_tokens,
            *(r[1] for r in runs),
            *(r[2] for r in runs),
            out.outputs[0].text,
        )

    rows = []
    chats = [json.loads(line)["messages"] for line in resolve_set("chat-multiturn").read_text().splitlines()][
        :12
    ]
    for messages in chats:
        history: list[dict] = []
        for number, message in enumerate(m for m in messages if m["role"] == "user"):
            history.append(message)
            *figures, text = turn(history, 64)
            rows.append(("chat", number, *figures))
            history.append({"role": "assistant", "content": text})
    notes = [json.loads(line)["messages"] for line in NOTES.read_text().splitlines()]
    for messages in [m for m in notes if len(json.dumps(m)) > 4000]:
        history = list(messages)
        for number in range(3):
            *figures, text = turn(history, 48)
            rows.append(("notes", number, *figures))
            history.append({"role": "assistant", "content": text})
            if number < 2:
                history.append({"role": "user", "content": FOLLOW_UPS[number]})
    print(machine())
    for kind in ("chat", "notes"):
        for number in range(3):
            chosen = [r for r in rows if r[:2] == (kind, number)]
            if chosen:
                print(
                    f"{kind} turn {number + 1}: {len(chosen)} turns, "
                    + ", ".join(_column(chosen, i) for i in range(2, 10))
                )
    chat = [r for r in rows if r[0] == "chat"]
    found, given = sum(r[3] for r in chat), sum(r[2] for r in chat)
    print(f"chat: {found} of {given} prompt tokens found; {len(rows)} answers the same")


COLUMNS = [
    "prompt tokens",
    "found",
    "TTFT without (ms)",
    "target's cache",
    "both",
    "drafter's first proposal without (ms)",
    "target's cache",
    "both",
]


def _column(rows: list[tuple], index: int) -> str:
    name = COLUMNS[index - 2]
    values = [r[index] * (1000 if index > 3 else 1) for r in rows]
    return f"{name} {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


if __name__ == "__main__":
    main()
