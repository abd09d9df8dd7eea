"""Benchmark prompt sets: the bundled sets, which of them a model runs, and how the toy ones are made.

A prompt set is a JSONL file of plain prompts, Spec-Bench turns or chats; reading and encoding one is
speculative/prompts.py's (`load_jsonl`, `encode`, `PromptRecord`).

The bundled sets (`BUNDLED_DIR`, `prompt_sets/`, the package's data) come in two families, and
`default_sets` picks the family by the tokenizer: CHAT_SETS where it has a chat template (an
instruction-tuned model), TOY_SETS otherwise. The toy demo's tokenizer has a template too,
`corpus.CHAT_TEMPLATE`, which turns requests into Python comments for a model that writes code: it
counts as none there (`instruction_tuned`). `--prompts NAME|PATH` runs any set, a bundled one by its
name (`resolve_set`).

TOY_SETS, for the toy demo models (plain Python continuation, no chat): `code.jsonl`,
`multiturn.jsonl` and `edit.jsonl`, cut from the held-out files of the demo corpus
(`speculative.demo.corpus`), which the demo models never saw in training:
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
They are drawn deterministically (`random.Random` seeded by the file's path); the stdlib differs between
Python versions, so `benchmarks/make_prompts.py` regenerates them and the files are committed.

CHAT_SETS, for instruction-tuned models (chat records, 24 each): written by hand for this project,
committed, and never regenerated (make_prompts.py leaves them alone):
- chat: open requests to an assistant (explanations, advice, how-tos, comparisons, short creative
  writing) on varied topics.
- code-chat: programming requests: write a function or a small tool, explain a pasted snippet, fix a
  bug in pasted code, convert pasted code to another language (Python, JavaScript, Go, Rust, C, SQL,
  shell).
- summarize: a text of 80-200 words pasted into the request (news item, email, product text, story,
  notes, README) to proofread, rewrite, reformat, shorten or summarise: answers copy much of the
  prompt (where prompt lookup shines).
- chat-multiturn: conversations of 2 or 3 user turns, the earlier assistant turns written out, ending
  on a user turn; many ask to revise the previous answer, whose text the new answer repeats.
They are a held-out set for drafts distilled on `speculative.demo.instructions`' chats: none is an
instance of its templates (tests/test_bench_prompts.py checks), and their topics mostly lie outside
its lists.
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
from pathlib import Path

from speculative.demo import corpus
from speculative.prompts import PLAIN_SETS, has_chat_template

BUNDLED_DIR = Path(__file__).resolve().parent / "prompt_sets"
"""The bundled sets' folder, shipped with the package."""
TOY_SETS = PLAIN_SETS
"""The bundled sets run by default for a model that is not `instruction_tuned` (build_bundled's)."""
CHAT_SETS = ("chat", "code-chat", "summarize", "chat-multiturn")
"""The bundled sets run by default for an `instruction_tuned` model (hand-written chats)."""
EDIT_COMMENT = "# The same code again, unchanged:"


def instruction_tuned(tokenizer) -> bool:
    """Whether the tokenizer's model takes chats: it has a chat template, other than the toy demo's
    (corpus.CHAT_TEMPLATE: requests as Python comments for a code model, which is no chat model)."""
    return has_chat_template(tokenizer) and tokenizer.chat_template != corpus.CHAT_TEMPLATE


def default_sets(tokenizer) -> list[Path]:
    """The bundled sets a model runs unless told otherwise: CHAT_SETS where it is instruction-tuned (its
    tokenizer has a chat template, not the toy demo's), TOY_SETS (plain code continuation) otherwise."""
    names = CHAT_SETS if instruction_tuned(tokenizer) else TOY_SETS
    return [BUNDLED_DIR / f"{name}.jsonl" for name in names]


def resolve_set(name_or_path: str | Path) -> Path:
    """A prompt set's file: the path itself where it is a file, else the bundled set of that name
    ("chat" or "chat.jsonl": BUNDLED_DIR/chat.jsonl). FileNotFoundError naming the bundled sets else."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = BUNDLED_DIR / (path.name if path.suffix == ".jsonl" else f"{path.name}.jsonl")
    if path.parent == Path(".") and bundled.is_file():
        return bundled
    names = ", ".join(sorted(p.stem for p in BUNDLED_DIR.glob("*.jsonl")))
    raise FileNotFoundError(
        f"no prompt set {str(name_or_path)!r}: give a JSONL file or a bundled set ({names})"
    )


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
