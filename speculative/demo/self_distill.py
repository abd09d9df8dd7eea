"""Text a target generates itself, to distill a draft on: `generate_chats` and its JSONL file.

The target answers chats (speculative.demo.instructions) greedily through the engine, with continuous
batching: up to `batch` requests run at once and a finished one makes room for the next. Each answer
is one JSON line {"prompt": [ids], "response": [ids]} (the chat template's prompt, then the target's
tokens up to and including its EOS, or `max_tokens` of them), appended as it finishes, so that a run
that stops goes on where it left off (the lines already written are skipped by their order).

Greedy answers are exactly what a draft must predict to be accepted under greedy decoding: every
response token is the target's argmax given everything before it.

Templates give a narrow set of requests, written requests (speculative.demo.instructions) a set of
ones written one by one in users' own words. `sampled_requests` widens them the way Magpie does (Xu et al.
2024, arXiv:2406.08464): given only the chat template's opening of a user turn, an instruction-tuned
target writes a request itself, sampled, in the words and on the topics its users' requests have.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from speculative.demo.instructions import first_turns, follow_ups, written_requests
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


def user_turn_opening(tokenizer) -> tuple[list[int], int]:
    """The chat template's tokens before a user's words (its default system prompt included, where it
    has one), and the token that ends the user's turn. Raises ValueError where the template does not
    write a user's words verbatim or ends the turn with no token of its own."""
    marker = "\u2063MARKER\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    before, found, after = text.partition(marker)
    end = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    if not found or not end or end[0] not in tokenizer.all_special_ids:
        raise ValueError("the chat template does not end a user's turn with a special token")
    return tokenizer(before, add_special_tokens=False)["input_ids"], end[0]


@torch.inference_mode()
def sampled_requests(
    llm: LLM, count: int, path: str | Path, batch: int = 48, seed: int = 0, max_tokens: int = 96
) -> list[str]:
    """`count` distinct requests the target writes itself (module docstring), appended to `path` as
    JSON lines {"request": text, "sample": i} and resumed after its last sample. A sample is kept
    where it ends its turn within `max_tokens` tokens, is 12-800 characters long, mostly ASCII
    letters, and new. Sample i is drawn with seed `seed` + i (temperature 1, top_p 0.95), `batch` at
    once with continuous batching, so a run gives about the same requests again (which finish first
    decides their order). Raises RuntimeError where 10 `count` samples (and a batch) gave fewer than
    `count`."""
    path = Path(path)
    kept = read_answers(path)
    done = [r["request"] for r in kept]
    if len(done) >= count:
        return done[:count]
    opening, end = user_turn_opening(llm.tokenizer)
    seen, engine, tried = set(done), llm.engine, kept[-1]["sample"] + 1 if kept else 0
    engine.reset()
    bar = tqdm(total=count, initial=len(done), desc="requests")
    with path.open("a", encoding="utf-8") as out, bar:
        while len(done) < count:  # continuous batching: a finished sample makes room for the next
            if tried >= 10 * count + batch:
                kept_of = f"{len(done)} usable requests of {count}"
                raise RuntimeError(f"the target wrote {kept_of} in {tried} samples")
            asked = []
            while len(engine.sequences) + len(asked) < batch:
                params = SamplingParams(
                    temperature=1, top_p=0.95, seed=seed + tried, max_tokens=max_tokens, stop_token_ids=[end]
                )
                asked += llm.make_sequences(opening, params, tried)
                tried += 1
            for s in (engine.add(asked) if asked else []) + engine.step():
                ids = s.output_token_ids
                text = llm.tokenizer.decode(ids[:-1]).strip() if ids and ids[-1] == end else ""
                if _usable(text) and text not in seen and len(done) < count:
                    seen.add(text)
                    done.append(text)
                    out.write(json.dumps({"request": text, "sample": s.prompt_index}) + "\n")
                    out.flush()
                    bar.update(1)
    engine.reset()
    return done


def _usable(request: str) -> bool:
    """Whether a request is 12-800 characters long, at least 60% of them ASCII letters."""
    letters = sum(c.isascii() and c.isalpha() for c in request)
    return 12 <= len(request) <= 800 and letters >= 0.6 * len(request)


def self_distilled(
    llm: LLM,
    folder: str | Path,
    count: int,
    followed: int,
    max_tokens: int = 192,
    batch: int = 48,
    seed: int = 0,
    sampled: int = 0,
    written: int = 0,
    written_followed: int = 0,
) -> list[dict]:
    """The target's answers to `count` first-turn chats (`folder`/first.jsonl), then to two follow-up
    chats of each of the first `followed` (`folder`/second.jsonl: a further question in the
    conversation, and a request over the answer pasted in, whose long prompts cost more to answer
    than first turns do), then to `sampled` requests it wrote itself (`folder`/requests.jsonl and
    sampled.jsonl), then to the first `written` of the bundled written requests (written.jsonl) and
    two follow-ups of each of the first `written_followed` of those (written-second.jsonl); every
    answer, in that order. Resumes what an earlier run left."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = llm.tokenizer

    def answered(chats: list[list[dict]], name: str, description: str) -> list[dict]:
        prompts = [chat_prompt(tokenizer, c) for c in chats]
        return generate_chats(llm, prompts, folder / name, max_tokens, batch, description)

    def followed_up(chats: list[list[dict]], answers: list[dict], name: str) -> list[dict]:
        rng, seconds = random.Random(seed), []
        for chat, answer in zip(chats, answers):
            seconds += follow_ups(chat, tokenizer.decode(answer["response"], skip_special_tokens=True), rng)
        return answered(seconds, name, "follow-ups")

    chats = first_turns(count, seed)
    first = answered(chats, "first.jsonl", "first turns")
    answers = first + followed_up(chats[:followed], first, "second.jsonl")
    if sampled:
        requests = sampled_requests(llm, sampled, folder / "requests.jsonl", batch, seed)
        answers += answered([[{"role": "user", "content": r}] for r in requests], "sampled.jsonl", "sampled")
    if written:
        chats = written_requests(written)
        first = answered(chats, "written.jsonl", "written requests")
        answers += first + followed_up(chats[:written_followed], first, "written-second.jsonl")
    return answers
