"""The target's hidden states of each running row's context, kept for the prefix cache where the
proposer reads them (an EAGLE head, a block drafter): a finished row's blocks then hold the hidden
states of its generated tokens too, so that a conversation's next turn finds its last answer, not only
its last prompt.

A row's record starts at its prompt's first position past the prompt's whole blocks (those went into
the prefix cache with their states at the prefill; a resumed row's record starts there too, from the
states of its rebuilt context) and grows by each step's states of the tokens it kept: a step's query
holds the row's last context token and its drafts, so the states of its first n positions, where the
row kept n tokens, are those of context positions the target has now seen in order. The state of a
row's last token is never known (the next step computes it), as the cache never holds its K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from speculative.engine.sequence import Sequence


@dataclass
class _Record:
    """Hidden states [n, F] of context positions [start, start + n), in pieces."""

    start: int
    pieces: list[Tensor] = field(default_factory=list)


class ContextFeatures:
    """Per running sequence (by identity), the hidden states of its context from where the prefix
    cache's blocks of its prompt end (module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._records: dict[int, _Record] = {}

    def begin(self, sequences: list[Sequence], features: Tensor, known: list[int]) -> None:
        """After the prefill and first token of `sequences`, or their caches rebuilt to resume them
        (features [B, width, F]: row b's states at its first known[b] context positions): start the
        record of each that did not finish."""
        for row, (s, end) in enumerate(zip(sequences, known)):
            if not s.finished:
                start = len(s.prompt_token_ids) // self.block_size * self.block_size
                self._records[id(s)] = _Record(start, [features[row, start:end].clone()])

    def extend(self, sequences: list[Sequence], features: Tensor, kept: list[int]) -> None:
        """After a step: row b kept kept[b] tokens, and features [B, q, F] are the step's states along
        the path it kept (its last context token's first)."""
        for row, (s, n) in enumerate(zip(sequences, kept)):
            record = self._records.get(id(s))
            if record is not None and n:
                record.pieces.append(features[row, :n].clone())

    def take(self, s: Sequence) -> tuple[int, Tensor] | None:
        """The sequence's record, which it leaves: where its states start and the states [n, F]."""
        record = self._records.pop(id(s), None)
        if record is None:
            return None
        return record.start, torch.cat(record.pieces)

    def drop(self, sequences: list[Sequence]) -> None:
        for s in sequences:
            self._records.pop(id(s), None)

    def clear(self) -> None:
        self._records.clear()
