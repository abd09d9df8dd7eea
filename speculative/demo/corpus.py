"""The demo corpus: the Python standard library's own source, split, tokenized and batched.

Every machine that runs the project has this corpus. The files are the `.py` files under
`sysconfig.get_paths()["stdlib"]` (site-packages excluded), sorted by relative path. A file is held out
when a hash of its relative path falls below `HELDOUT_FRACTION`, so the split is fixed across runs and
machines and training never sees a held-out file. Token streams put `<|endoftext|>` before every file and
after the last one; the tokenizer's post-processor adds that token in front of every encoded text, so a
prompt encoded with `add_special_tokens=True` starts the way every training file does.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOT = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '\n' + message.content + '\n\n' }}"
    "{%- else %}{{- '# ' + message.content | replace('\n', '\n# ') + '\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\n' }}{%- endif %}"
)
"""The demo tokenizer's chat template, for models that write Python: the system's and the user's
messages become comment lines, the assistant's code follows them after a blank line (the generation
prompt), and a blank line closes it."""
HELDOUT_FRACTION = 0.04


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the `.py` files under `root` (default: the stdlib), sorted, no
    site-packages."""
    root = stdlib_root() if root is None else root
    rels = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(r.as_posix() for r in rels if "site-packages" not in r.parts)


def is_heldout(rel: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether the file at relative path `rel` belongs to the held-out split (by SHA-256 of the path)."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split_files(files: list[str], fraction: float = HELDOUT_FRACTION) -> tuple[list[str], list[str]]:
    """(train, heldout): the files of `files`, in their order, on either side of the fixed split."""
    train = [f for f in files if not is_heldout(f, fraction)]
    heldout = [f for f in files if is_heldout(f, fraction)]
    return train, heldout


def read_texts(files: list[str], root: Path | None = None) -> list[str]:
    """The text of each file; bytes that are not UTF-8 (a few test files) become U+FFFD."""
    root = stdlib_root() if root is None else root
    return [(root / f).read_bytes().decode("utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, `<|endoftext|>` (id 0) as its bos, eos and pad, with
    CHAT_TEMPLATE."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1", special_tokens=[(EOT, eot_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def encode_files(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, `<|endoftext|>` first (the tokenizer's post-processor puts it there)."""
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def token_stream(encoded: list[list[int]], eos_id: int) -> torch.Tensor:
    """One flat int64 stream: every file's ids (each opening with eos) and a closing eos."""
    flat = [t for ids in encoded for t in ids]
    flat.append(eos_id)
    return torch.tensor(flat, dtype=torch.int64)


def random_windows(
    stream: torch.Tensor | tuple[torch.Tensor, ...], batch: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    """[batch, seq_len + 1] windows of `stream` at offsets drawn from `gen` (inputs and shifted labels).
    A tuple of streams (a mixture) gives each stream an equal share of the batch, the first ones one
    window more where `batch` does not divide."""
    streams = stream if isinstance(stream, tuple) else (stream,)
    windows = []
    for i, part in enumerate(streams):
        count = batch // len(streams) + (i < batch % len(streams))
        starts = torch.randint(0, len(part) - seq_len - 1, (count,), generator=gen)
        windows += [part[s : s + seq_len + 1] for s in starts.tolist()]
    return torch.stack(windows)


def even_windows(stream: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """[count, seq_len + 1] windows spread evenly over `stream` (a fixed evaluation set)."""
    last = len(stream) - seq_len - 1
    starts = torch.linspace(0, last, count).long() if count > 1 else torch.zeros(1, dtype=torch.long)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
