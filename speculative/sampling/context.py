"""What the logits processors see of each row at each query position of a forward.

A forward scores q positions per row. Position j of row b predicts the token that follows
    tokens[b, :lengths[b]] + block[b, :j]
(the context so far, then the block's first j tokens: the draft tokens before that position).
Processors that depend on the context (penalties, bad words, min_tokens, user processors, grammars)
must use exactly this per-position context, or the rejection rule stops being lossless.

A tree forward (speculative.tree's convention) scores the q nodes of a token tree per row instead:
node 0 is the root (the context's last token), node i >= 1 carries the draft token block[b, i - 1],
and node i predicts the token that follows
    tokens[b, :lengths[b]] + the tokens of the path's nodes 1 .. i
(its ancestors except the root, in order, then itself). A chain is the tree parents = [-1, 0, ..., q - 2],
whose node j's path is nodes 1 .. j: the chain's block[:j]. A padding node (parent -1, i > 0) is never
used; its context is defined as the row's context alone (an empty path).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from speculative.tree import tree_ancestors


@dataclass
class TokenContext:
    """tokens: [B, S] prompt + output (garbage at and beyond lengths); lengths: [B] context lengths;
    prompt_lengths: [B]; block: [B, q - 1] tokens between the query positions (the drafts), with -1
    where there is none (such positions are never used); vocab_size: V.

    parents: None for a chain (position j's context is the context + block[:j]), or [B, q] int64, a
    token tree over the q positions (speculative.tree's convention; block[:, i - 1] is node i's token,
    -1 for a padding node): position i's context is the context + the tokens of its path's nodes 1 .. i.
    Chains never go through the tree code."""

    tokens: Tensor
    lengths: Tensor
    prompt_lengths: Tensor
    block: Tensor
    vocab_size: int
    parents: Tensor | None = None

    def __post_init__(self) -> None:
        expected = (self.block.shape[0], self.num_positions)
        if self.parents is not None and tuple(self.parents.shape) != expected:
            raise ValueError(f"parents must be [B, q] = {expected}; got {tuple(self.parents.shape)}")

    @property
    def num_positions(self) -> int:
        """q: positions scored per row."""
        return self.block.shape[1] + 1

    # -- trees ---------------------------------------------------------------------------------------------

    @cached_property
    def _paths(self) -> Tensor:
        """Tree only: [B, q, q] bool, [b, i, j] iff node j is on node i's path: an ancestor-or-self of i
        other than the root, and a real node (so a padding node's path is empty)."""
        real = self.parents >= 0  # [B, q]: False for the root and for padding nodes
        return tree_ancestors(self.parents) & real[:, None, :]

    @cached_property
    def _depths(self) -> Tensor:
        """Tree only: [B, q] int64, the length of each node's path (the root's and padding's 0)."""
        return self._paths.sum(-1)

    @cached_property
    def _node_tokens(self) -> Tensor:
        """Tree only: [B, q] each node's token (-1 for the root and for padding nodes)."""
        root = self.block.new_full((self.block.shape[0], 1), -1)
        return torch.where(self.parents >= 0, torch.cat([root, self.block], dim=1), -1)

    @cached_property
    def _path_tokens(self) -> Tensor:
        """Tree only: [B, q, q + 1], [b, i, t] = the token of the t-th node of node i's path for t <
        depth[b, i], -1 after (the path in index order is the path in depth order: parents precede)."""
        batch, q = self.parents.shape
        slot = torch.where(self._paths, self._paths.long().cumsum(-1) - 1, q)  # [B, q, q]; off-path -> q
        out = torch.full((batch, q, q + 1), -1, dtype=self.block.dtype, device=self.block.device)
        out.scatter_(2, slot, self._node_tokens[:, None, :].expand(batch, q, q))
        out[:, :, q] = -1  # (the off-path dump column)
        return out

    @cached_property
    def _host_parents(self) -> list[list[int]]:
        return self.parents.tolist()

    def real_nodes(self, row: int) -> list[int]:
        """Tree only: one row's real nodes (the root and every node with a parent), on the host."""
        return [i for i, parent in enumerate(self._host_parents[row]) if i == 0 or parent >= 0]

    def leaves(self, row: int) -> list[int]:
        """Tree only: one row's real nodes without a child (the root when it has none), on the host."""
        parents = self._host_parents[row]
        has_child = [False] * len(parents)
        for parent in parents:
            if parent >= 0:
                has_child[parent] = True
        return [i for i in self.real_nodes(row) if not has_child[i]]

    def path_nodes(self, row: int, position: int) -> list[int]:
        """The nodes whose tokens follow the context in one position's context, in order, on the host:
        [1, ..., position] for a chain; for a tree, the path's nodes from depth 1 down to `position`
        (empty for the root and for a padding node)."""
        if self.parents is None:
            return list(range(1, position + 1))
        parents = self._host_parents[row]
        path = []
        while parents[position] >= 0:
            path.append(position)
            position = parents[position]
        return path[::-1]

    # -- per-position quantities --------------------------------------------------------------------------

    @cached_property
    def _block_counts(self) -> Tensor:
        """[B, q, V] float32: occurrences of each token in block[:, :j] (exclusive prefix counts); for a
        tree, in the tokens of each node's path."""
        if self.parents is not None:
            tokens = self._node_tokens
            one_hot = torch.zeros(*tokens.shape, self.vocab_size, device=tokens.device)
            one_hot.scatter_(2, tokens.clamp(min=0)[:, :, None], (tokens >= 0).float()[:, :, None])
            return torch.bmm(self._paths.float(), one_hot)
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
        """[B, q] int64: output tokens in each position's context (for a tree: plus the node's depth)."""
        if self.parents is not None:
            return (self.lengths - self.prompt_lengths)[:, None] + self._depths
        offsets = torch.arange(self.num_positions, device=self.lengths.device)
        return (self.lengths - self.prompt_lengths)[:, None] + offsets

    def tail(self, n: int) -> Tensor:
        """[B, q, n] int64: the last n tokens of each position's context (-1 before its start)."""
        if self.parents is not None:
            return self._tree_tail(n)
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

    def _tree_tail(self, n: int) -> Tensor:
        """tail(n) of a tree: slot p of node i's context is tokens[p] for p < L, else the path's token
        p - L (L: the row's length; the context has L + depth[i] tokens)."""
        batch, q = self.parents.shape
        lengths = self.lengths[:, None, None]
        index = lengths + self._depths[:, :, None] - n + torch.arange(n, device=lengths.device)  # [B, q, n]
        width = self.tokens.shape[1]
        from_context = self.tokens.gather(1, index.clamp(0, width - 1).flatten(1)).view(batch, q, n)
        from_path = self._path_tokens.gather(2, (index - lengths).clamp(0, q))
        values = torch.where(index >= lengths, from_path.to(from_context.dtype), from_context)
        return torch.where(index >= 0, values, -1)

    def row_context(self, row: int, position: int) -> tuple[list[int], list[int]]:
        """(prompt ids, output ids) of one row's context at one position, on the host."""
        prompt_length, length = int(self.prompt_lengths[row]), int(self.lengths[row])
        if self.parents is None:
            drafts = self.block[row, :position].tolist()
        else:
            drafts = self.block[row].tolist()
            drafts = [drafts[node - 1] for node in self.path_nodes(row, position)]
        ids = self.tokens[row, :length].tolist() + drafts
        return ids[:prompt_length], ids[prompt_length:]
