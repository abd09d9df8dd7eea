"""What the logits processors see of each row at each query position of a forward.

A forward scores q positions per row. Position j of row b predicts the token that follows
    tokens[b, :lengths[b]] + block[b, :j]
(the context so far, then the block's first j tokens: the draft tokens before that position).
Processors that depend on the context (penalties, bad words, min_tokens, user processors, grammars)
must use exactly this per-position context, or the rejection rule stops being lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass
class TokenContext:
    """tokens: [B, S] prompt + output (garbage at and beyond lengths); lengths: [B] context lengths;
    prompt_lengths: [B]; block: [B, q - 1] tokens between the query positions (the drafts), with -1
    where there is none (such positions are never used); vocab_size: V."""

    tokens: Tensor
    lengths: Tensor
    prompt_lengths: Tensor
    block: Tensor
    vocab_size: int

    @property
    def num_positions(self) -> int:
        """q: positions scored per row."""
        return self.block.shape[1] + 1

    @cached_property
    def _block_counts(self) -> Tensor:
        """[B, q, V] float32: occurrences of each token in block[:, :j] (exclusive prefix counts)."""
        batch, width = self.block.shape
        counts = torch.zeros(batch, width + 1, self.vocab_size, device=self.block.device)
        if width:
            one_hot = torch.zeros(batch, width, self.vocab_size, device=self.block.device)
            one_hot.scatter_(2, self.block.clamp(min=0)[:, :, None], (self.block >= 0).float()[:, :, None])
            counts[:, 1:] = one_hot.cumsum(dim=1)
        return counts

    def _region_counts(self, start: Tensor, end: Tensor) -> Tensor:
        """[B, V] float32: occurrences of each token in tokens[b, start[b]:end[b]]."""
        index = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        inside = ((index >= start[:, None]) & (index < end[:, None])).float()  # [B, S]
        counts = torch.zeros(self.tokens.shape[0], self.vocab_size, device=self.tokens.device)
        return counts.scatter_add_(1, self.tokens.clamp(0, self.vocab_size - 1), inside)

    @cached_property
    def output_counts(self) -> Tensor:
        """[B, q, V] float32: how often each token occurs in the output part of each position's context."""
        output = self._region_counts(self.prompt_lengths, self.lengths)
        return output[:, None, :] + self._block_counts

    @cached_property
    def seen(self) -> Tensor:
        """[B, q, V] bool: the token occurs in the prompt or the output of each position's context."""
        prompt = self._region_counts(torch.zeros_like(self.lengths), self.prompt_lengths)
        return (prompt[:, None, :] + self.output_counts) > 0

    @cached_property
    def num_generated(self) -> Tensor:
        """[B, q] int64: output tokens in each position's context."""
        offsets = torch.arange(self.num_positions, device=self.lengths.device)
        return (self.lengths - self.prompt_lengths)[:, None] + offsets

    def tail(self, n: int) -> Tensor:
        """[B, q, n] int64: the last n tokens of each position's context (-1 before its start)."""
        batch, width = self.block.shape
        extended = torch.cat(
            [self.tokens, torch.full((batch, width), -1, dtype=self.tokens.dtype, device=self.tokens.device)],
            dim=1,
        )
        if width:
            slots = self.lengths[:, None] + torch.arange(width, device=self.lengths.device)
            extended.scatter_(1, slots, self.block)
        ends = self.lengths[:, None] + torch.arange(width + 1, device=self.lengths.device)  # [B, q]
        index = ends[:, :, None] - n + torch.arange(n, device=ends.device)  # [B, q, n]
        values = extended.gather(1, index.clamp(min=0).flatten(1)).view(batch, width + 1, n)
        return torch.where(index >= 0, values, -1)

    def row_context(self, row: int, position: int) -> tuple[list[int], list[int]]:
        """(prompt ids, output ids) of one row's context at one position, on the host."""
        prompt_length, length = int(self.prompt_lengths[row]), int(self.lengths[row])
        ids = self.tokens[row, :length].tolist() + self.block[row, :position].tolist()
        return ids[:prompt_length], ids[prompt_length:]
