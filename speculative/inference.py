"""Inferencer: prefill and decode over a model and a KV cache, one generation at a time.

The engine itself works at a lower level (models/base.py's `decode`, the proposers); an Inferencer is
the simple interface for driving a model by hand, and what a `Drafter` drafts through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from speculative.kv_cache import KVCache
from speculative.models.base import LanguageModel, decode
from speculative.sampling import SampleStrategy


class PrefillOutput(NamedTuple):
    """Output of `Inferencer.prefill`.

    token_ids: the token sampled after the query. Shape [batch, 1].
    token_logits: the logits at the query positions. Shape [batch, num_query_tokens, vocab].
    """

    token_ids: Tensor
    token_logits: Tensor


class DecodeOutput(NamedTuple):
    """Output of `Inferencer.decode`.

    token_ids: the newly generated tokens, -1 after a row's EOS. Shape [batch, num_generated].
    token_logits: the logits each token was sampled from. Shape [batch, num_generated, vocab].
    """

    token_ids: Tensor
    token_logits: Tensor


@runtime_checkable
class Inferencer(Protocol):
    """Processes token sequences with a KV cache and generates new tokens."""

    def prefill(
        self, query_token_ids: Tensor, kv_cache: KVCache, sample_strategy: SampleStrategy
    ) -> PrefillOutput:
        """Process query_token_ids [batch, q] in one forward; sample the next token of each row.

        kv_cache holds everything before the query and gains the query's K/V.
        """
        ...

    def decode(
        self, query_token_ids: Tensor, kv_cache: KVCache, max_new_tokens: int, sample_strategy: SampleStrategy
    ) -> DecodeOutput:
        """Feed query_token_ids [batch, 1] and generate autoregressively.

        Each row stops at max_new_tokens (> 0) or at its EOS. kv_cache gains the query and every
        generated token but the last.
        """
        ...


class ModelInferencer:
    """Inferencer over a `LanguageModel`.

    eos_token_ids: the tokens that end a row in `decode` (rows whose strategy ignores EOS go on); with
    none, decode runs the full max_new_tokens without a host sync per token.
    The engine does not go through an Inferencer: its draft proposer calls the model itself.
    """

    def __init__(self, model: LanguageModel, eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.eos_token_ids = torch.tensor(list(eos_token_ids), dtype=torch.long, device=model.device)

    def prefill(
        self, query_token_ids: Tensor, kv_cache: KVCache, sample_strategy: SampleStrategy
    ) -> PrefillOutput:
        """`Inferencer.prefill`."""
        logits = self.model.forward(query_token_ids, kv_cache)  # [batch, q, vocab]
        return PrefillOutput(sample_strategy.next_tokens(logits[:, -1])[:, None], logits)

    def decode(
        self, query_token_ids: Tensor, kv_cache: KVCache, max_new_tokens: int, sample_strategy: SampleStrategy
    ) -> DecodeOutput:
        """`Inferencer.decode`: after a row's EOS its tokens are -1 and its cache ends before the EOS."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0; got {max_new_tokens}")
        if self.eos_token_ids.numel() == 0:
            return DecodeOutput(
                *decode(self.model, query_token_ids, kv_cache, max_new_tokens, sample_strategy.next_tokens)
            )
        start = kv_cache.lengths.clone()
        ignore_eos = torch.tensor([p.ignore_eos for p in sample_strategy.params], device=start.device)
        finished = torch.zeros_like(ignore_eos)

        def all_finished(tokens: Tensor) -> bool:  # tokens [batch], the step's
            finished.logical_or_(torch.isin(tokens, self.eos_token_ids) & ~ignore_eos)
            return bool(finished.all())

        token_ids, logits = decode(
            self.model,
            query_token_ids,
            kv_cache,
            max_new_tokens,
            sample_strategy.next_tokens,
            until=all_finished,
        )
        is_eos = torch.isin(token_ids, self.eos_token_ids) & ~ignore_eos[:, None]  # [batch, n]
        after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
        token_ids = token_ids.masked_fill(after_eos, -1)
        kv_cache.rollback(start + query_token_ids.shape[1] - 1 + (token_ids >= 0).sum(dim=1))
        return DecodeOutput(token_ids, logits)
