"""The bench's chat prompt sets: chat records through a chat template, the sets a model runs by default,
truncation that keeps the template whole, and the hand-written sets held out from the draft's recipe."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import CHATML, byte_tokenizer
from transformers import AutoTokenizer

from speculative.bench.prompts import (
    BUNDLED_DIR,
    CHAT_SETS,
    TOY_SETS,
    default_sets,
    resolve_set,
)
from speculative.bench.run import BenchConfig, load_sets
from speculative.demo import DEMO_DIR, corpus, instructions
from speculative.prompts import PromptRecord, encode, load_jsonl

GENERATION_PROMPT = "<|im_start|>assistant\n"


def chat_tokenizer():
    """The byte tokenizer with a ChatML template, as SmolLM2-Instruct's."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def chatml(messages: list[dict]) -> str:
    return (
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + GENERATION_PROMPT
    )


def chat_records() -> dict[str, list[PromptRecord]]:
    return {name: load_jsonl(BUNDLED_DIR / f"{name}.jsonl") for name in CHAT_SETS}


def test_bundled_chat_sets_load_and_render_through_the_chat_template() -> None:
    tokenizer = chat_tokenizer()
    sets = chat_records()
    assert set(CHAT_SETS) == {"chat", "code-chat", "summarize", "chat-multiturn"}
    assert not set(CHAT_SETS) & set(TOY_SETS)
    ids = [r.id for records in sets.values() for r in records]
    assert len(ids) == len(set(ids)) == 4 * 24
    for name, records in sets.items():
        assert len(records) == 24, name
        for r in records:
            assert (
                r.chat
                and r.messages
                and r.messages[-1]["role"] == "user"
                and r.text == r.messages[-1]["content"]
            )
            assert all(m["content"].strip() == m["content"] and m["content"] for m in r.messages), r.id
            assert tokenizer.decode(encode(tokenizer, r, 10**6)) == chatml(r.messages), r.id
    for r in sets["chat"] + sets["code-chat"] + sets["summarize"]:
        assert [m["role"] for m in r.messages] == ["user"], r.id
    for r in sets["chat-multiturn"]:  # 2 or 3 user turns, assistant turns between them
        assert [m["role"] for m in r.messages] in (["user", "assistant"] * n + ["user"] for n in (1, 2)), r.id
    for r in sets["summarize"]:  # an instruction, then a pasted text of 80 to 200 words
        instruction, pasted = r.text.split("\n\n", 1)
        assert 80 <= len(pasted.split()) <= 200 and len(instruction.split()) < 40, r.id


def test_chat_records_need_a_chat_template(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    record = load_jsonl(BUNDLED_DIR / "summarize.jsonl")[0]
    with pytest.raises(ValueError, match=r"prompt set summarize .*needs? a tokenizer with a chat template"):
        encode(tokenizer, record, 100)
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"prompt set mine .*chat template"):
        encode(tokenizer, load_jsonl(path)[0], 100)
    # the other kinds still run without one, and a Spec-Bench turn goes through a template when there is one
    assert tokenizer.decode(encode(tokenizer, PromptRecord("1", "hello", chat=True), 100)) == "hello"
    record = PromptRecord("1", "hello", chat=True)
    assert chat_tokenizer().decode(encode(chat_tokenizer(), record, 100)) == chatml(
        [{"role": "user", "content": "hello"}]
    )


def test_load_jsonl_checks_messages(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    for messages in (
        [],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],  # ends on the answer
        [{"role": "robot", "content": "hi"}],
        [{"role": "user", "content": 3}],
    ):
        path.write_text(json.dumps({"id": "x", "messages": messages}) + "\n")
        with pytest.raises(ValueError, match="messages"):
            load_jsonl(path)


def test_chat_truncation_drops_whole_leading_turns_and_keeps_the_template() -> None:
    tokenizer = chat_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question " * 5},
        {"role": "assistant", "content": "first answer " * 5},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "second answer"},
        {"role": "user", "content": "third question"},
    ]
    record = PromptRecord("c", messages[-1]["content"], True, messages)
    full = encode(tokenizer, record, 10**6)
    assert tokenizer.decode(full) == chatml(messages)
    assert encode(tokenizer, record, len(full)) == full
    # one token short: the first exchange goes, the system message stays
    cut = tokenizer.decode(encode(tokenizer, record, len(full) - 1))
    assert cut == chatml(messages[:1] + messages[3:])
    last_only = len(tokenizer(chatml(messages[:1] + messages[5:]))["input_ids"])
    assert tokenizer.decode(encode(tokenizer, record, last_only)) == chatml(messages[:1] + messages[5:])
    # even the last turn alone is too long: its content loses its first tokens, in a whole template
    ids = encode(tokenizer, record, last_only - 4)
    assert len(ids) == last_only - 4
    assert tokenizer.decode(ids) == chatml(messages[:1] + [{"role": "user", "content": "d question"}])
    # the template alone is longer than allowed: only then its leftmost tokens go
    assert tokenizer.decode(encode(tokenizer, record, 5)) == GENERATION_PROMPT[-5:]
    # every bundled conversation, cut by a token, still starts on a whole turn and ends on the prompt
    for r in load_jsonl(BUNDLED_DIR / "chat-multiturn.jsonl"):
        text = tokenizer.decode(encode(tokenizer, r, len(encode(tokenizer, r, 10**6)) - 1))
        assert text.startswith("<|im_start|>user\n") and text.endswith(f"<|im_end|>\n{GENERATION_PROMPT}")
        assert text == chatml(r.messages[2:]), r.id


def test_default_sets_follow_the_tokenizer(tmp_path: Path) -> None:
    assert default_sets(byte_tokenizer()) == [
        BUNDLED_DIR / f"{n}.jsonl" for n in ("code", "multiturn", "edit")
    ]
    assert default_sets(chat_tokenizer()) == [BUNDLED_DIR / f"{n}.jsonl" for n in CHAT_SETS]
    toy = byte_tokenizer()  # the toy demo's template makes comments for a code model: no chat model
    toy.chat_template = corpus.CHAT_TEMPLATE
    assert default_sets(toy) == default_sets(byte_tokenizer())
    if (DEMO_DIR / "target").is_dir():
        demo = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
        assert demo.chat_template and default_sets(demo) == default_sets(byte_tokenizer())
    config = BenchConfig(num_prompts=2)
    assert config.prompts is None  # chosen by the pair's tokenizer when the sets load
    assert list(load_sets(config, byte_tokenizer(), 10**6, [])) == list(TOY_SETS)
    notes: list[str] = []
    sets = load_sets(config, chat_tokenizer(), 10**6, notes)
    assert list(sets) == list(CHAT_SETS) and all(len(ids) == 2 for ids in sets.values())
    assert not notes
    # --prompts NAME|PATH: a bundled set by name (either family), or any file
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    assert resolve_set("summarize") == resolve_set("summarize.jsonl") == BUNDLED_DIR / "summarize.jsonl"
    assert resolve_set(str(path)) == path
    config = BenchConfig(prompts=["edit", str(path), "chat"], num_prompts=1)
    assert list(load_sets(config, chat_tokenizer(), 10**6, notes)) == ["edit", "mine", "chat"]
    with pytest.raises(FileNotFoundError, match="chat-multiturn"):  # lists the bundled sets
        resolve_set("no-such-set")
    load_sets(BenchConfig(num_prompts=1), chat_tokenizer(), 40, notes)
    assert any("leading messages dropped" in note for note in notes)


def template_patterns() -> list[re.Pattern]:
    """A regex for every request template of speculative.demo.instructions (its placeholders match any
    text): the *_TEMPLATES lists, PASTED, FOLLOW_UPS, and the email request built in first_turns."""
    templates = list(instructions.PASTED) + list(instructions.FOLLOW_UPS)
    templates.append("Write a short email to {recipient} about {subject}.")
    for name in dir(instructions):
        if name.endswith("TEMPLATES"):
            templates += [t if isinstance(t, str) else t[0] for t in getattr(instructions, name)]
    assert len(templates) > 40 and "What is {x}?" in templates and "Compare {x} and {y}." in templates
    patterns = []
    for template in templates:
        parts = re.split(r"\{\w+\}", template)
        regex = "(.+)".join(re.escape(" ".join(p.split())) for p in parts)
        patterns.append(re.compile(regex.replace(r"\ ", r"\s+"), re.IGNORECASE | re.DOTALL))
    return patterns


def test_chat_sets_are_held_out_from_the_draft_recipe() -> None:
    patterns = template_patterns()
    assert patterns[0].fullmatch(instructions.PASTED[0].format(text="Some pasted\n\ntext."))
    tasks = [" ".join(t.split()).lower() for t in instructions.TASKS + instructions.MORE_TASKS if t.strip()]
    generated = {m["content"] for chat in instructions.first_turns(10**6, seed=0) for m in chat}
    for records in chat_records().values():
        for r in records:
            for message in r.messages:
                if message["role"] != "user":
                    continue
                text = message["content"].strip()
                assert not any(p.fullmatch(text) for p in patterns), (r.id, text)
                assert not any(task in " ".join(text.split()).lower() for task in tasks), (r.id, text)
                assert text not in generated, r.id


def word_runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Every run of `n` consecutive words of `text` (lowercased, letters and digits only)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_chat_sets_are_held_out_from_the_written_requests() -> None:
    written = [chat[0]["content"] for chat in instructions.written_requests()]
    assert len(written) == len(set(written)) >= 1000
    assert word_runs("One two three four five six seven eight nine.") == {
        ("one", "two", "three", "four", "five", "six", "seven", "eight"),
        ("two", "three", "four", "five", "six", "seven", "eight", "nine"),
    }
    runs = set().union(*(word_runs(text) for text in written))
    for records in chat_records().values():
        for r in records:
            for message in r.messages:
                if message["role"] == "user":
                    shared = word_runs(message["content"]) & runs
                    assert message["content"].strip() not in written and not shared, (r.id, shared)
    with pytest.raises(ValueError, match="count"):
        instructions.written_requests(len(written) + 1)
