"""Benchmark prompt sets: JSONL loading, encoding, and the bundled sets built from the demo corpus.

A prompt file is JSONL, one object per line, either `{"prompt": "..."}` (with an optional "id") or a
Spec-Bench question `{"question_id": ..., "turns": ["...", ...]}`, of which the first turn is used and
wrapped in the tokenizer's chat template when it has one.

The bundled sets (`BUNDLED_DIR`: `prompt_sets/code.jsonl`, `edit.jsonl` and `multiturn.jsonl`, the
package's data) are cut
from the held-out files of the demo corpus (`speculative.demo.corpus`), which the demo models never saw
in training:
- code: the few hundred characters before a function or class definition plus its `def`/`class` line;
  the model continues with the body (plain code continuation).
- edit: a whole function, then a comment saying that the same code follows again, then its first line;
  a model that copies it gives an answer that repeats much of the prompt (where n-gram lookup shines).
- multiturn: conversations of TURNS requests about one definition each: its header line after a
  different stretch of its file each time (the lines before it, the file's opening, the lines after
  the definition). A model answers every turn with much the same body, so later responses repeat
  earlier ones, which the request's own prompt does not hold (where suffix decoding's cache of past
  responses shines and prompt lookup has nothing). A conversation's turns are consecutive lines, ids
  "<file>:<line>/<turn>".
All are drawn deterministically (`random.Random` seeded by the file's path); the stdlib differs between
Python versions, so `benchmarks/make_prompts.py` regenerates them and the files are committed.
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path

from speculative.demo import corpus

BUNDLED_DIR = Path(__file__).resolve().parent / "prompt_sets"
"""The bundled sets' folder, shipped with the package."""
EDIT_COMMENT = "# The same code again, unchanged:"


@dataclass
class PromptRecord:
    """One benchmark prompt. chat: wrap `text` in the tokenizer's chat template (Spec-Bench turns)."""

    id: str
    text: str
    chat: bool = False


def load_jsonl(path: str | Path) -> list[PromptRecord]:
    """The prompts of a JSONL file: objects with "prompt", or Spec-Bench objects with "turns"."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        obj = json.loads(line)
        ident = str(obj.get("id", obj.get("question_id", number)))
        if isinstance(obj.get("prompt"), str):
            records.append(PromptRecord(ident, obj["prompt"]))
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            records.append(PromptRecord(ident, obj["turns"][0], chat=True))
        else:
            raise ValueError(
                f'{path}:{number}: expected an object with a string "prompt" or a list of '
                f'"turns" (Spec-Bench)'
            )
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return records


def encode(tokenizer, record: PromptRecord, max_tokens: int) -> list[int]:
    """The prompt's token ids, at most `max_tokens` of them (the leftmost dropped if longer).

    Chat prompts (Spec-Bench turns) go through the tokenizer's chat template when it has one.
    """
    if record.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": record.text}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(record.text)["input_ids"]
    return ids[-max_tokens:]


def _definitions(text: str) -> list[ast.AST]:
    """Function and class definitions of a Python source, in line order ([] if it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return sorted((n for n in ast.walk(tree) if isinstance(n, kinds)), key=lambda n: n.lineno)


def _line_starts(text: str) -> list[int]:
    """Character offset of the start of each line (index 0 is line 1)."""
    starts, offset = [], 0
    for line in text.splitlines(keepends=True):
        starts.append(offset)
        offset += len(line)
    return starts


def code_prompt(rel: str, text: str, context_chars: int = 500) -> dict | None:
    """A continuation prompt: ~`context_chars` before a definition plus its header line, or None."""
    starts = _line_starts(text)
    lines = text.splitlines()
    candidates = [
        n
        for n in _definitions(text)
        if starts[n.lineno - 1] >= context_chars and n.end_lineno - n.lineno >= 4
    ]
    if not candidates:
        return None
    node = random.Random(f"code:{rel}").choice(candidates)
    header_start = starts[node.lineno - 1]
    begin = next(s for s in starts if s >= header_start - context_chars)
    prompt = text[begin:header_start] + lines[node.lineno - 1].rstrip()
    return {"id": f"{rel}:{node.lineno}", "prompt": prompt}


def edit_prompt(rel: str, text: str, min_chars: int = 250, max_chars: int = 900) -> dict | None:
    """A copy prompt: a whole function, a comment that it follows again, its first line; or None."""
    lines = text.splitlines()
    candidates = []
    for node in _definitions(text):
        if isinstance(node, ast.ClassDef) or node.decorator_list:
            continue
        chunk = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        if min_chars <= len(chunk) <= max_chars:
            candidates.append((node.lineno, chunk))
    if not candidates:
        return None
    lineno, chunk = random.Random(f"edit:{rel}").choice(candidates)
    prompt = f"{chunk}\n\n\n{EDIT_COMMENT}\n{chunk.splitlines()[0]}"
    return {"id": f"{rel}:{lineno}", "prompt": prompt}


TURNS = 3  # requests per multiturn conversation


def multiturn_prompts(rel: str, text: str, context_chars: int = 400) -> list[dict] | None:
    """A conversation (module docstring): TURNS prompts ending with the same definition header after
    ~`context_chars` of different text each, or None."""
    starts = _line_starts(text)
    lines = text.splitlines()
    candidates = [
        n
        for n in _definitions(text)
        if starts[n.lineno - 1] >= 2 * context_chars
        and n.end_lineno - n.lineno >= 4
        and len(text) - starts[n.end_lineno - 1] >= 2 * context_chars
    ]
    if not candidates:
        return None
    node = random.Random(f"multiturn:{rel}").choice(candidates)
    header = lines[node.lineno - 1].strip()
    before = text[: starts[node.lineno - 1]]
    after = text[starts[node.end_lineno] if node.end_lineno < len(starts) else len(text) :]
    last = before[-context_chars:]
    contexts = [  # whole lines
        last[last.find("\n") + 1 :],
        before[: before.rfind("\n", 0, context_chars) + 1],
        after[: after.rfind("\n", 0, context_chars) + 1],
    ]
    return [
        {"id": f"{rel}:{node.lineno}/{turn}", "prompt": f"{context.rstrip()}\n\n\n{header}"}
        for turn, context in enumerate(contexts[:TURNS], start=1)
    ]


def build_bundled(count: int = 20) -> dict[str, list[dict]]:
    """The bundled sets: `count` prompts each (fewer if too few files qualify), at most one per held-out
    file, from files spread evenly over the held-out split's sorted list."""
    _, heldout = corpus.split_files(corpus.list_files())
    texts = corpus.read_texts(heldout)
    sets = {}
    for name, make in (("code", code_prompt), ("edit", edit_prompt)):
        eligible = [p for p in (make(rel, text) for rel, text in zip(heldout, texts)) if p is not None]
        step = max(1.0, len(eligible) / count)
        sets[name] = [eligible[int(i * step)] for i in range(min(count, len(eligible)))]
    conversations = [c for c in (multiturn_prompts(r, t) for r, t in zip(heldout, texts)) if c is not None]
    wanted = -(-count // TURNS)
    step = max(1.0, len(conversations) / wanted)
    picked = [conversations[int(i * step)] for i in range(min(wanted, len(conversations)))]
    sets["multiturn"] = [turn for conversation in picked for turn in conversation]
    return sets


def write_bundled(out_dir: Path = BUNDLED_DIR, count: int = 20) -> dict[str, Path]:
    """Regenerate the bundled sets as `<out_dir>/<name>.jsonl`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, prompts in build_bundled(count).items():
        paths[name] = out_dir / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    return paths
