"""Any Hugging Face `AutoModelForCausalLM` behind the engine's model protocol.

Hugging Face caches keep one length for the whole batch, while the engine's rows each have their
own. `HFKVCache` bridges the two with a validity mask: every forward appends q slots to every row,
a rolled-back or padding slot is masked out of attention (and positions come from `position_ids`,
so a hole changes nothing), and trailing slots that no row uses are cropped. A rollback is thus a
mask and length update; with one row there are never holes. This is the generic path; the native
Llama-family forward (`models/llama.py`) is the fast one.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from speculative.kv_cache import RowLengths


class HFKVCache(RowLengths):
    """A `DynamicCache` plus the per-row validity mask and lengths of the engine's KVCache protocol.

    valid: [batch, slots] bool, which physical slots hold a row's context.
    """

    def __init__(
        self, batch_size: int, max_length: int, device: torch.device, single_row_reason: str | None = None
    ) -> None:
        self.past = DynamicCache()
        self.single_row_reason = single_row_reason  # why this model's cache cannot hold several rows
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.max_length = max_length
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    def rollback(self, lengths: Tensor, max_length: int | None = None) -> None:
        logical_index = self.valid.cumsum(dim=1)  # [batch, slots], 1-based rank among valid slots
        self.valid = self.valid & (logical_index <= lengths[:, None])
        self._lengths = lengths.clone()
        used = self.valid.any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        if keep < self.valid.shape[1]:
            self.past.crop(keep - self.valid.shape[1])  # a negative count removes that many slots
            self.valid = self.valid[:, :keep]

    def append_rows(self, other: HFKVCache) -> None:
        """Concatenate `other`'s rows; the one with fewer slots gets invalid slots at its end (a cache
        that no forward has written yet, none: its rows are empty)."""
        if self.single_row_reason is not None:
            raise ValueError(self.single_row_reason)
        slots = max(self.valid.shape[1], other.valid.shape[1])
        merged = DynamicCache()
        for i in range(max(_layers(self), _layers(other))):
            (my_keys, my_values), (their_keys, their_values) = _kv(self, other, i), _kv(other, self, i)
            keys = torch.cat([_pad_slots(my_keys, slots), _pad_slots(their_keys, slots)])
            values = torch.cat([_pad_slots(my_values, slots), _pad_slots(their_values, slots)])
            merged.update(keys, values, i)
        self.past = merged
        self.valid = torch.cat(
            [
                torch.cat([v, v.new_zeros(v.shape[0], slots - v.shape[1])], dim=1)
                for v in (self.valid, other.valid)
            ]
        )
        self._lengths = torch.cat([self._lengths, other.lengths])
        self.max_length = max(self.max_length, other.max_length)

    def select_rows(self, rows: Tensor) -> None:
        self.past.batch_select_indices(rows)
        self.valid = self.valid.index_select(0, rows)
        self._lengths = self._lengths.index_select(0, rows)


class HFCausalLM:
    """Wraps a transformers `PreTrainedModel` (any causal LM) as a `LanguageModel`."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(
            getattr(config, "max_position_embeddings", None)
            or getattr(config, "n_positions", None)
            or 2**31 - 1
        )
        self.device = model.device
        self.dtype = model.dtype

    def new_cache(self, batch_size: int, max_length: int) -> HFKVCache:
        reason = None
        if getattr(self.config, "sliding_window", None) and getattr(self.config, "use_sliding_window", True):
            reason = (
                f"{self.config.model_type} uses sliding-window attention, which the transformers path "
                "supports one sequence at a time; pass one prompt per generate call"
            )
        if batch_size > 1 and reason is not None:
            raise ValueError(reason)
        return HFKVCache(batch_size, max_length, self.device, reason)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        cache: HFKVCache,
        num_tokens: Tensor | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        batch, q = input_ids.shape
        offsets = torch.arange(q, device=input_ids.device)
        # Slots past a row's real tokens (padding, drafts past the end) get clamped positions:
        # their outputs are never used, and absolute position tables must not be indexed past the end.
        positions = (cache.lengths[:, None] + offsets).clamp(max=self.max_length - 1)  # [batch, q]
        limit = num_tokens[:, None] if num_tokens is not None else q
        real = (offsets[None, :] < limit).expand(batch, q)  # [batch, q]
        mask = torch.cat([cache.valid, torch.ones_like(real)], dim=1).long()  # [batch, slots + q]
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache.past,
            use_cache=True,
        )
        cache.valid = torch.cat([cache.valid, real], dim=1)
        cache._lengths = cache.lengths + (num_tokens if num_tokens is not None else q)
        logits = out.logits.float()  # [batch, q, vocab]
        if logits_indices is not None:
            logits = logits.gather(1, logits_indices[:, :, None].expand(-1, -1, logits.shape[-1]))
        return logits


def _layers(cache: HFKVCache) -> int:
    """Layers the cache holds K/V for (0 before its first forward)."""
    return sum(layer.keys is not None for layer in cache.past.layers)


def _kv(cache: HFKVCache, other: HFKVCache, i: int) -> tuple[Tensor, Tensor]:
    """Layer i's keys and values [batch, heads, slots, dim] of `cache`, or, where it has none yet,
    empty ones (no slots) shaped as `other`'s."""
    if i < _layers(cache):
        layer = cache.past.layers[i]
        return layer.keys, layer.values
    like = other.past.layers[i]
    return tuple(t.new_zeros(cache.batch_size, t.shape[1], 0, t.shape[3]) for t in (like.keys, like.values))


def _pad_slots(t: Tensor, slots: int) -> Tensor:
    """[batch, heads, s, dim] -> [batch, heads, slots, dim], zero (False) padded at the end."""
    missing = slots - t.shape[2]
    return torch.nn.functional.pad(t, (0, 0, 0, missing)) if missing else t
