"""Prompt files and their token ids: JSONL records (plain prompts, Spec-Bench turns, chats) and their
encoding through the tokenizer's chat template, cut to a length.

A prompt file is JSONL, one object per line (each with an optional "id"), of one of three kinds:
- `{"prompt": "..."}`: plain text, tokenized as it is;
- a Spec-Bench question `{"question_id": ..., "turns": ["...", ...]}`, of which the first turn is used
  and wrapped in the tokenizer's chat template when it has one (as it is otherwise);
- a chat `{"messages": [{"role": "user", "content": "..."}, ...]}` (roles system, user, assistant;
  ending on a user turn), rendered by the tokenizer's chat template with the generation prompt added.
  A tokenizer without chat template cannot run it: `encode` raises ValueError naming the set.

Shared by the benchmark's prompt sets (speculative/bench/prompts.py: the bundled sets, which a model
runs) and the draft recipe's evaluation prompts (speculative/demo/train_draft.py `--eval-prompts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PLAIN_SETS = ("code", "multiturn", "edit")
"""The bundled sets of plain prompts (bench.prompts.TOY_SETS), which `encode` suggests where a chat
record meets a tokenizer without chat template."""
ROLES = ("system", "user", "assistant")


@dataclass
class PromptRecord:
    """One benchmark prompt. chat: wrap `text` in the tokenizer's chat template (Spec-Bench turns).

    messages: a chat record's messages (then `text` is its last user turn and `chat` is True); source:
    the file it came from, which errors name (not compared).
    """

    id: str
    text: str
    chat: bool = False
    messages: list[dict] | None = None
    source: str = field(default="", compare=False)


def load_jsonl(path: str | Path) -> list[PromptRecord]:
    """The prompts of a JSONL file: objects with "prompt", Spec-Bench objects with "turns", or chats with
    "messages" (module docstring)."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        obj = json.loads(line)
        ident = str(obj.get("id", obj.get("question_id", number)))
        if isinstance(obj.get("prompt"), str):
            records.append(PromptRecord(ident, obj["prompt"], source=str(path)))
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            records.append(PromptRecord(ident, obj["turns"][0], chat=True, source=str(path)))
        elif "messages" in obj:
            messages = obj["messages"]
            if not (
                isinstance(messages, list)
                and messages
                and all(
                    isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                    for m in messages
                )
                and messages[-1]["role"] == "user"
            ):
                raise ValueError(
                    f'{path}:{number}: "messages" must be a list of {{"role", "content"}} objects (roles '
                    f"{', '.join(ROLES)}) ending on a user turn"
                )
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            records.append(PromptRecord(ident, messages[-1]["content"], True, messages, str(path)))
        else:
            raise ValueError(
                f'{path}:{number}: expected an object with a string "prompt", a list of "turns" '
                f'(Spec-Bench) or a list of chat "messages"'
            )
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return records


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer has a chat template (then chat records can be rendered)."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, record: PromptRecord, max_tokens: int) -> list[int]:
    """The prompt's token ids, at most `max_tokens` of them.

    Plain prompts, and Spec-Bench turns on a tokenizer without chat template, are tokenized as they are
    and keep their last `max_tokens` tokens (the leftmost dropped). Chats ("messages" records, and
    Spec-Bench turns on a tokenizer with a chat template) go through the chat template with the
    generation prompt added and are never cut inside it: the whole chat where it fits, else the chat
    without its leading messages, dropped whole, a turn at a time (the kept part starts on a user turn;
    a leading system message stays); where even the last user turn alone does not fit, that turn's
    content keeps only its last tokens, in a whole template; only where the template's own tokens
    exceed `max_tokens` are its leftmost tokens dropped. A "messages" record on a tokenizer without
    chat template: ValueError naming its set.
    """
    if record.messages is not None and not has_chat_template(tokenizer):
        name = Path(record.source).stem if record.source else "a prompt set"
        raise ValueError(
            f"prompt set {name} (prompt {record.id}) holds chat messages, which need a tokenizer with "
            f"a chat template; this tokenizer has none (run a set of plain prompts, e.g. "
            f"{', '.join(PLAIN_SETS)})"
        )
    if record.chat and has_chat_template(tokenizer):
        messages = record.messages or [{"role": "user", "content": record.text}]
        return _fit_chat(tokenizer, messages, max_tokens)
    ids = tokenizer(record.text)["input_ids"]
    return ids[-max_tokens:]


def _render(tokenizer, messages: list[dict]) -> list[int]:
    """The chat's token ids through the tokenizer's chat template, generation prompt added."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _fit_chat(tokenizer, messages: list[dict], max_tokens: int) -> list[int]:
    """The chat rendered in at most `max_tokens` tokens, cut as `encode` says."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = [i for i, m in enumerate(messages) if m["role"] == "user" and i > len(system)]
    kept = messages
    for start in [None, *turns]:
        kept = messages if start is None else system + messages[start:]
        ids = _render(tokenizer, kept)
        if len(ids) <= max_tokens:
            return ids
    content = tokenizer(kept[-1]["content"], add_special_tokens=False)["input_ids"]
    for _ in range(4):  # decoding and tokenizing again may not round-trip exactly: a few tries
        over = len(ids) - max_tokens
        if over <= 0:
            return ids
        if over >= len(content):
            break
        content = content[over:]
        last = {"role": "user", "content": tokenizer.decode(content)}
        ids = _render(tokenizer, [*kept[:-1], last])
    return ids[-max_tokens:]
