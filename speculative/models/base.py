"""The one protocol every model of the engine speaks, native or Hugging Face."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from speculative.kv_cache import KVCache


@runtime_checkable
class LanguageModel(Protocol):
    """A causal LM that appends tokens to a per-row KV cache and returns logits.

    Contract of `forward(input_ids, cache, num_tokens=None, logits_indices=None)`:
      input_ids:      [batch, q] token ids; row b's tokens go to positions
                      cache.lengths[b] .. cache.lengths[b] + q - 1.
      num_tokens:     [batch] int64, how many of the q tokens of each row are real (right padding
                      after them); default q for every row. The cache's lengths advance by it.
      logits_indices: [batch, n] int64 indices into the q query positions whose logits are wanted;
                      default all q.
      returns:        logits [batch, n, vocab_size], float32 or the model's dtype.
    """

    vocab_size: int
    max_length: int  # the longest context the model accepts (max_position_embeddings)
    device: torch.device
    dtype: torch.dtype

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty cache for `batch_size` rows of at most `max_length` tokens each."""
        ...

    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache,
        num_tokens: Tensor | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor: ...
