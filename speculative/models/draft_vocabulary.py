"""A draft model's draft vocabulary, read from its checkpoint folder.

A draft folder may hold `draft_vocabulary.json`, {"token_ids": [...]}: the tokens the draft may
propose (FR-Spec, Zhao et al. 2025, arXiv:2502.14856; `python -m speculative.demo.train_draft` writes
one). Loaded on the native forward, the draft's lm_head keeps only those rows
(NativeCausalLM.restrict_vocabulary): each drafted token costs that many rows of the lm_head instead
of the whole vocabulary's, and the output stays exact. Other loaders (transformers' forward, a draft
split over ranks) ignore the file, and nothing else reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from speculative.models.llama import NativeCausalLM
from speculative.models.tensor_parallel import TensorParallelCausalLM

VOCABULARY_FILE = "draft_vocabulary.json"


def read_draft_vocabulary(folder: str | Path) -> torch.Tensor | None:
    """[n] int64, the draft vocabulary in `folder`'s VOCABULARY_FILE; None where `folder` is not a
    folder or holds none. ValueError naming the file when it is not {"token_ids": [ints]}."""
    path = Path(folder) / VOCABULARY_FILE
    if not path.is_file():
        return None
    ids = json.loads(path.read_text(encoding="utf-8")).get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError(f'{path} must hold {{"token_ids": [...]}}, a non-empty list of token ids')
    return torch.tensor(ids, dtype=torch.long)


def apply_draft_vocabulary(model, folder: str | Path | object) -> bool:
    """Restrict `model` (a draft) to the draft vocabulary of `folder` where it has one and `model` runs
    on the whole native forward; whether it did."""
    if not isinstance(folder, (str, Path)) or not isinstance(model, NativeCausalLM):
        return False
    if isinstance(model, TensorParallelCausalLM):
        return False
    vocabulary = read_draft_vocabulary(folder)
    if vocabulary is None:
        return False
    model.restrict_vocabulary(vocabulary)
    return True
