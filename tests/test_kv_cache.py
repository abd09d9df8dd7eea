"""StaticKVCache's rows under continuous batching: rows leave and join in place, in the buffers the
cache already holds, and the K/V each row keeps are exactly its own."""

from __future__ import annotations

import torch

from speculative.kv_cache import StaticKVCache


def filled(batch: int, max_length: int, first: int) -> StaticKVCache:
    """A 2-layer cache whose row b holds the value first + b everywhere, its length first + b."""
    cache = StaticKVCache(2, batch, 1, max_length, 4, torch.float32, "cpu")
    for buffer in (*cache.keys, *cache.values):
        buffer.copy_(torch.arange(first, first + batch, dtype=torch.float32)[:, None, None, None])
    cache.rollback(torch.arange(first, first + batch))
    return cache


def rows_of(cache: StaticKVCache, length: int | None = None) -> list[float]:
    """Each row's value (checking that every layer and position of the row, up to `length`, agrees)."""
    values = []
    for b in range(cache.batch_size):
        buffers = (*cache.keys, *cache.values)
        row = {float(x) for buffer in buffers for x in buffer[b, :, :length].flatten()}
        assert len(row) == 1, row
        values.append(row.pop())
    return values


def test_rows_leave_and_join_in_the_buffers_the_cache_holds() -> None:
    cache = filled(4, 8, 0)
    storage = [buffer.data_ptr() for buffer in (*cache.keys, *cache.values)]
    cache.select_rows(torch.tensor([3, 1]))
    assert rows_of(cache) == [3, 1] and cache.lengths.tolist() == [3, 1] and cache.capacity == 4
    cache.append_rows(filled(2, 6, 10))  # shorter rows fit: into the free rows, the rest left as it was
    assert rows_of(cache, 6) == [3, 1, 10, 11] and cache.lengths.tolist() == [3, 1, 10, 11]
    assert [buffer.data_ptr() for buffer in (*cache.keys, *cache.values)] == storage
    assert all(buffer.shape == (4, 1, 8, 4) for buffer in (*cache.keys, *cache.values))


def test_more_rows_or_longer_ones_than_the_buffers_hold_take_new_buffers() -> None:
    cache = filled(2, 8, 0)
    cache.select_rows(torch.tensor([1, 1, 0]))  # a prompt's row shared by two sequences
    assert rows_of(cache) == [1, 1, 0] and cache.capacity == 3
    cache.append_rows(filled(1, 12, 5))  # longer than max_length: padded with zeros, all rows kept
    assert cache.max_length == 12 and cache.capacity == 4
    assert rows_of(cache, 8) == [1, 1, 0, 5]
    assert float(cache.keys[0][:3, :, 8:].abs().sum()) == 0.0
    cache.select_rows(torch.tensor([], dtype=torch.long))
    assert cache.batch_size == 0 and cache.capacity == 4
    cache.append_rows(filled(2, 4, 7))
    assert rows_of(cache, 4) == [7, 8] and cache.capacity == 4


def test_rows_move_inside_inference_tensors_outside_inference_mode() -> None:
    with torch.inference_mode():
        cache = filled(3, 4, 0)
    cache.select_rows(torch.tensor([2, 0]))  # the engine aborts rows outside inference mode
    assert rows_of(cache) == [2, 0]
