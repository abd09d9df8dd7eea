"""Text a target generates itself, to distill a draft on: `generate_chats` and its JSONL file.

The target answers chats (speculative.demo.instructions) greedily through the engine, with continuous
batching: up to `batch` requests run at once and a finished one makes room for the next. Each answer
is one JSON line {"prompt": [ids], "response": [ids]} (the chat template's prompt, then the target's
tokens up to and including its EOS, or `max_tokens` of them), appended as it finishes, so that a run
that stops goes on where it left off (the lines already written are skipped by their order).

Greedy answers are exactly what a draft must predict to be accepted under greedy decoding: every
response token is the target's argmax given everything before it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from speculative.demo.instructions import first_turns, follow_ups
from speculative.llm import LLM
from speculative.sampling_params import SamplingParams


def chat_prompt(tokenizer, chat: list[dict]) -> list[int]:
    """The token ids of `chat` in the tokenizer's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def read_answers(path: str | Path) -> list[dict]:
    """The answers written so far to `path` (none if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@torch.inference_mode()
def generate_chats(
    llm: LLM,
    prompts: Sequence[list[int]],
    path: str | Path,
    max_tokens: int = 256,
    batch: int = 32,
    description: str = "target answers",
) -> list[dict]:
    """Answer every prompt (token ids) greedily with `llm`, `batch` at a time, appending each answer to
    `path` in the order of `prompts` (module docstring); returns every answer, those of earlier runs
    included. A prompt is cut to its last tokens where prompt + max_tokens exceeds the context."""
    path = Path(path)
    done = read_answers(path)
    todo = list(enumerate(prompts))[len(done) :]
    if not todo:
        return done
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    room = llm.inputs.max_length - max_tokens
    engine, results = llm.engine, {}
    waiting = [(i, list(p)[-room:]) for i, p in todo]
    waiting.reverse()
    position = 0  # the next of `todo` to write: answers are written in the prompts' order
    engine.reset()
    with path.open("a", encoding="utf-8") as out, tqdm(total=len(todo), desc=description) as bar:
        while waiting or engine.sequences:
            admit = []
            while waiting and len(engine.sequences) + len(admit) < batch:
                i, ids = waiting.pop()
                admit += llm.make_sequences(ids, params, i)
            finished = engine.add(admit) if admit else []
            for s in finished + engine.step():
                results[s.prompt_index] = {"prompt": s.prompt_token_ids, "response": s.output_token_ids}
            while position < len(todo) and todo[position][0] in results:
                out.write(json.dumps(results.pop(todo[position][0])) + "\n")
                out.flush()
                position += 1
                bar.update(1)
    engine.reset()
    return read_answers(path)


def self_distilled(
    llm: LLM,
    folder: str | Path,
    count: int,
    followed: int,
    max_tokens: int = 192,
    batch: int = 48,
    seed: int = 0,
) -> list[dict]:
    """The target's answers to `count` first-turn chats (`folder`/first.jsonl), then to two follow-up
    chats of each of the first `followed` (`folder`/second.jsonl: a further question in the
    conversation, and a request over the answer pasted in, whose long prompts cost more to answer
    than first turns do); every answer, first turns first. Resumes what an earlier run left."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = llm.tokenizer
    chats = first_turns(count, seed)
    prompts = [chat_prompt(tokenizer, c) for c in chats]
    first = generate_chats(llm, prompts, folder / "first.jsonl", max_tokens, batch, "first turns")
    rng = random.Random(seed)
    seconds = []
    for chat, answer in zip(chats[:followed], first):
        seconds += follow_ups(chat, tokenizer.decode(answer["response"], skip_special_tokens=True), rng)
    prompts = [chat_prompt(tokenizer, c) for c in seconds]
    return first + generate_chats(llm, prompts, folder / "second.jsonl", max_tokens, batch, "follow-ups")
