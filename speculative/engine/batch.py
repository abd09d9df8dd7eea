"""Device-side state of the rows being generated, kept in step with their host-side records."""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.engine.sequence import Sequence
from speculative.kv_cache import KVCache
from speculative.proposers.base import Proposer
from speculative.sampling import SampleStrategy
from speculative.sampling.context import TokenContext
from speculative.transfer import to_device


class Batch:
    """The active rows: one per sequence.

    tokens: [B, width] contexts (prompt + output) with room for a query of `room` + 1 beyond the
    longest (room: the most drafts a step verifies, k for a chain, default k);
    lengths / prompt_lengths: [B]; stop_ids: [B, s] tokens that finish each row (-1 padded).
    host_lengths mirrors lengths on the host, host_stop_ids stop_ids (a set per row).
    host_drafted: each row's length when a proposer last drafted for it (0: not since it joined), so
    that `backlog` counts what a drafter that skipped the steps since would take in.
    """

    def __init__(
        self,
        sequences: list[Sequence],
        eos_token_ids: list[int],
        k: int,
        vocab_size: int,
        device: torch.device,
        generator: torch.Generator,
        room: int | None = None,
    ) -> None:
        room = k if room is None else room
        self.sequences = list(sequences)
        self.eos_token_ids = list(eos_token_ids)
        for s in sequences:
            if len(s.metrics.drafted_per_position) != k:
                s.metrics.drafted_per_position = [0] * k
                s.metrics.accepted_per_position = [0] * k
        contexts = [s.prompt_token_ids + s.output_token_ids for s in sequences]
        self.host_lengths = [len(c) for c in contexts]
        self.host_drafted = [0] * len(contexts)
        self.capacity = max(len(s.prompt_token_ids) + s.max_tokens for s in sequences) + room + 1
        tokens = torch.zeros(len(sequences), self.capacity + room + 1, dtype=torch.long)
        for row, context in enumerate(contexts):
            tokens[row, : len(context)] = torch.tensor(context)
        self.tokens = to_device(tokens, torch.long, device)
        self.lengths = to_device(self.host_lengths, torch.long, device)
        self.prompt_lengths = to_device([len(s.prompt_token_ids) for s in sequences], torch.long, device)
        stops = [
            sorted(set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else set(eos_token_ids)))
            for s in sequences
        ]
        width = max(1, max(len(s) for s in stops))
        self.stop_ids = to_device([s + [-1] * (width - len(s)) for s in stops], torch.long, device)
        self.host_stop_ids = [frozenset(s) for s in stops]
        self.strategy = SampleStrategy(
            [s.params for s in sequences],
            vocab_size,
            device,
            generator,
            generators=[s.generator for s in sequences],
            stop_ids=self.stop_ids,
            bad_words=[s.bad_words_token_ids for s in sequences],
            guides=[s.guide for s in sequences],
        )

    def context(self, block: Tensor | None = None, parents: Tensor | None = None) -> TokenContext | None:
        """The TokenContext of a forward whose positions are separated by `block` [B, q - 1] (None:
        one position, after the context), a chain, or a token tree's nodes with `parents` [B, q] (see
        TokenContext). None when no row's processing depends on its context."""
        if not self.strategy.needs_context:
            return None
        if block is None:
            block = self.tokens.new_empty((len(self.sequences), 0))
        return TokenContext(
            self.tokens, self.lengths, self.prompt_lengths, block, self.strategy.vocab_size, parents
        )

    def backlog(self) -> int:
        """Tokens of the rows' contexts that came after a proposer last drafted for them (a row that
        joined since: all of its context)."""
        return sum(self.host_lengths) - sum(self.host_drafted)

    def append(self, other: Batch) -> None:
        """Add `other`'s rows (same k, vocabulary and device) after these; caches are the caller's."""
        self.sequences += other.sequences
        self.host_lengths += other.host_lengths
        self.host_drafted += other.host_drafted
        self.host_stop_ids += other.host_stop_ids
        self.eos_token_ids += [t for t in other.eos_token_ids if t not in self.eos_token_ids]
        self.capacity = max(self.capacity, other.capacity)
        width = max(self.tokens.shape[1], other.tokens.shape[1])
        self.tokens = torch.cat(
            [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (self.tokens, other.tokens)]
        )
        for name in ("lengths", "prompt_lengths"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.strategy.append(other.strategy)
        self.stop_ids = self.strategy.stop_ids

    def select(self, rows: list[int], caches: list[KVCache], proposer: Proposer | None) -> None:
        """Keep only `rows` (host indices, repeats allowed: a repeated row is copied) everywhere."""
        self.sequences = [self.sequences[i] for i in rows]
        self.host_lengths = [self.host_lengths[i] for i in rows]
        self.host_drafted = [self.host_drafted[i] for i in rows]
        self.host_stop_ids = [self.host_stop_ids[i] for i in rows]
        self.strategy.select_rows(rows)
        index = to_device(rows, torch.long, self.tokens.device)
        for name in ("tokens", "lengths", "prompt_lengths", "stop_ids"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        for cache in caches:
            cache.select_rows(index)
        if proposer is not None:
            proposer.select_rows(index)
