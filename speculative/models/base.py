"""The one protocol every model of the engine speaks, native or Hugging Face."""

from __future__ import annotations

from collections.abc import Callable
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


def first_argmax(logits: Tensor) -> Tensor:  # [batch, vocab] -> [batch]
    """The first maximal index of each row (greedy decoding's choice)."""
    return logits.max(dim=-1).indices


def decode_steps(
    step: Callable[[Tensor, int], Tensor],
    steps: int,
    input_ids: Tensor,
    choose: Callable[[Tensor], Tensor] = first_argmax,
    until: Callable[[Tensor], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """Up to `steps` autoregressive steps from input_ids [batch, q]: `step(ids, i)` feeds step i's ids
    (the query at i = 0, then the token chosen last) and returns logits [batch, n, vocab] whose last
    position `choose` ([batch, vocab] -> [batch]) picks the next token from; `until(tokens [batch])`,
    if given, ends the loop early when it returns True. Returns the tokens [batch, n_steps] and the
    logits [batch, n_steps, vocab] each was chosen from."""
    tokens, logits, current = [], [], input_ids
    for i in range(steps):
        out = step(current, i)[:, -1]
        current = choose(out)[:, None]
        tokens.append(current)
        logits.append(out)
        if until is not None and until(current[:, 0]):
            break
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def decode(
    model: LanguageModel,
    input_ids: Tensor,
    cache: KVCache,
    steps: int,
    choose: Callable[[Tensor], Tensor] = first_argmax,
    until: Callable[[Tensor], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """`decode_steps` through `model.forward`: the query input_ids [batch, q] first (logits at its last
    token only), then one token a step. The cache gains the query and every token but the last."""
    batch, q = input_ids.shape
    last = torch.full((batch, 1), q - 1, device=input_ids.device) if q > 1 else None

    def step(ids: Tensor, i: int) -> Tensor:
        return model.forward(ids, cache, logits_indices=last if i == 0 else None)

    return decode_steps(step, steps, input_ids, choose, until)
