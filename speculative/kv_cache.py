"""KV caches with per-row lengths.

Every row of a batch has its own number of cached tokens (`lengths`), because rows of one batch
have prompts of different lengths and accept different numbers of draft tokens at each step.
A model's forward writes the K/V of its q query tokens of row b at positions
`lengths[b] .. lengths[b] + q - 1` and then advances `lengths[b]` by that row's number of real
(non-padding) tokens. Rolling back a rejected draft is a length change, never a copy: positions at
or beyond `lengths[b]` are ignored by attention and overwritten by the next write.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class KVCache(Protocol):
    """Key/value tensors of past tokens for every transformer layer, with per-row lengths."""

    @property
    def lengths(self) -> Tensor:
        """Number of cached tokens per row. Shape [batch], int64, on the model's device."""
        ...

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        ...

    def rollback(self, lengths: Tensor, max_length: int | None = None) -> None:
        """Forget every cached token of row b at or beyond `lengths[b]`.

        lengths: [batch] int64, each <= the current length of its row.
        max_length: optional host-side `int(lengths.max())`, saving a device sync.
        """
        ...

    def select_rows(self, rows: Tensor) -> None:
        """Keep only `rows` ([n] int64 indices into the batch), in that order."""
        ...

    def append_rows(self, other: KVCache) -> None:
        """Add the rows of `other` (a cache of the same kind and model) after this cache's rows."""
        ...


class RowLengths:
    """`lengths` and `batch_size` of a cache that keeps its per-row lengths in `_lengths` [batch]."""

    _lengths: Tensor

    @property
    def lengths(self) -> Tensor:
        return self._lengths

    @property
    def batch_size(self) -> int:
        return self._lengths.shape[0]


class StaticKVCache(RowLengths):
    """Preallocated per-layer K/V buffers written at per-row positions.

    keys[layer], values[layer]: [batch, num_kv_heads, max_length, head_dim], the first `batch` rows of
    buffers that keep the most rows the cache has held (`capacity`): under continuous batching rows
    leave by moving the kept ones forward and join by filling the free rows, in place, rather than by
    reallocating every layer's buffers (which copies them whole and churns the C heap).
    `lengths` is the only state that says what is valid; `rollback` just sets it.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self._buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
        self._view(batch_size)
        self.max_length = max_length
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Host-side upper bound of lengths.max(): attention reads only keys[:, :, :bound].
        self.host_max_length = 0

    def positions(self, num_query_tokens: int) -> Tensor:
        """Positions the next forward writes: [batch, q] = lengths[:, None] + arange(q)."""
        offsets = torch.arange(num_query_tokens, device=self._lengths.device)
        return self._lengths[:, None] + offsets

    def check_room(self, num_query_tokens: int) -> None:
        """Raise if a forward of q tokens could write past `max_length`."""
        if self.host_max_length + num_query_tokens > self.max_length:
            raise ValueError(
                f"KV cache overflow: {self.host_max_length} cached + {num_query_tokens} new tokens "
                f"> max_length={self.max_length}"
            )

    def advance(self, num_tokens: Tensor | int, max_num_tokens: int) -> None:
        """Add `num_tokens` ([batch] or int) to the lengths after a forward of q = max_num_tokens."""
        self._lengths += num_tokens
        self.host_max_length = min(self.host_max_length + max_num_tokens, self.max_length)

    def rollback(self, lengths: Tensor, max_length: int | None = None) -> None:
        self._lengths.copy_(lengths)
        if max_length is not None:
            self.host_max_length = max_length

    def keep_path(self, start: Tensor, path: Tensor) -> None:
        """Keep one path of a tree forward (NativeCausalLM.forward_tree) as if it had been fed as a chain.

        start: [batch] int64, the lengths before the tree forward (its node i sits at slot start + i);
        path: [batch, n] int64 node indices, increasing, -1 after a row's last kept node (n <= the
        tree's M). Row b's K/V at slots start_b + path[b, j] are copied to slots start_b + j in every
        layer (gathered first, then written), and the row's length becomes start_b + its number of
        kept nodes: no rollback is needed after. A path that starts with the root (node 0) keeps the
        root's K/V, which a verification must (the root is the last context token).
        """
        offsets = torch.arange(path.shape[1], device=path.device)
        destination = start[:, None] + offsets  # [batch, n]
        kept = path >= 0
        source = torch.where(kept, start[:, None] + path, destination)  # not kept: copied onto itself
        rows = torch.arange(path.shape[0], device=path.device)[:, None]
        for buffer in (*self.keys, *self.values):  # [batch, kv_heads, max_length, head_dim]
            buffer[rows, :, destination] = buffer[rows, :, source]  # [batch, n, kv_heads, head_dim]
        self._lengths.copy_(start + kept.sum(1))

    def _view(self, batch_size: int) -> None:
        """keys and values: the first `batch_size` rows of the buffers (keys then values)."""
        half = len(self._buffers) // 2
        self.keys = [b[:batch_size] for b in self._buffers[:half]]
        self.values = [b[:batch_size] for b in self._buffers[half:]]

    @property
    def capacity(self) -> int:
        """Rows the buffers hold."""
        return self._buffers[0].shape[0]

    def append_rows(self, other: StaticKVCache) -> None:
        """Concatenate `other`'s rows: into the free rows of the buffers where they fit (`other` no
        longer than max_length), else into new buffers, the shorter padded to the longer max_length."""
        batch, joined = self.batch_size, self.batch_size + other.batch_size
        if joined <= self.capacity and other.max_length <= self.max_length:
            with torch.inference_mode():  # the buffers may be inference tensors (made by a forward)
                for buffer, theirs in zip(self._buffers, (*other.keys, *other.values)):
                    buffer[batch:joined, :, : theirs.shape[2]] = theirs
        else:
            self.max_length = max(self.max_length, other.max_length)
            self._buffers = [
                torch.cat([_pad_length(a[:batch], self.max_length), _pad_length(b, self.max_length)])
                for a, b in zip(self._buffers, (*other.keys, *other.values))
            ]
        self._view(joined)
        self._lengths = torch.cat([self._lengths, other.lengths])
        self.host_max_length = max(self.host_max_length, other.host_max_length)

    def select_rows(self, rows: Tensor) -> None:
        """Keep `rows`, in that order (a row may repeat), as the first rows of the buffers: only the rows
        whose place changes are copied, unless there are more of them than the buffers hold."""
        if rows.shape[0] > self.capacity:
            self._buffers = [buffer.index_select(0, rows) for buffer in self._buffers]
        elif rows.shape[0]:  # with no row kept there is nothing to move, nor an index to sync on
            moved = rows != torch.arange(rows.shape[0], device=rows.device)
            sources, destinations = rows[moved], moved.nonzero().squeeze(1)
            with torch.inference_mode():  # the buffers may be inference tensors (made by a forward)
                for buffer in self._buffers if destinations.numel() else ():
                    buffer[destinations] = buffer[sources]  # the right side is gathered first
        self._view(rows.shape[0])
        self._lengths = self._lengths.index_select(0, rows)


def _pad_length(buffer: Tensor, max_length: int) -> Tensor:
    """[batch, heads, length, dim] -> [batch, heads, max_length, dim], zero padded."""
    missing = max_length - buffer.shape[2]
    return torch.nn.functional.pad(buffer, (0, 0, 0, missing)) if missing else buffer
