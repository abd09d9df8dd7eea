"""Drafter: token drafting delegated to an Inferencer (a simple interface for drafting by hand; the
engine's DraftModelProposer calls its model directly)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from speculative.inference import Inferencer
from speculative.kv_cache import KVCache
from speculative.sampling import SampleStrategy


class DraftOut(NamedTuple):
    """Output of `Drafter.draft`.

    token_ids: the drafted tokens. Shape [batch, num_drafted], num_drafted <= num_draft_tokens.
    token_logits: the logits each token was sampled from. Shape [batch, num_drafted, vocab].
    """

    token_ids: Tensor
    token_logits: Tensor


class Drafter:
    """Generates draft tokens with a (small) model through its Inferencer."""

    def __init__(self, inferencer: Inferencer) -> None:
        self.inferencer = inferencer

    def draft(
        self,
        query_token_ids: Tensor,
        kv_cache: KVCache,
        num_draft_tokens: int,
        sample_strategy: SampleStrategy,
    ) -> DraftOut:
        """Feed query_token_ids [batch, q >= 1] (a prefill) and draft up to num_draft_tokens (> 0)
        tokens, the first from the prefill, the rest from a decode.

        kv_cache gains the query and every drafted token but the last. Drafting stops early only
        where the inferencer stops at EOS.
        """
        if query_token_ids.shape[1] < 1:
            raise ValueError("query_token_ids must hold at least one token per row")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1; got {num_draft_tokens}")
        first = self.inferencer.prefill(query_token_ids, kv_cache, sample_strategy)
        last = first.token_logits[:, -1:]
        if num_draft_tokens == 1:
            return DraftOut(first.token_ids, last)
        rest = self.inferencer.decode(first.token_ids, kv_cache, num_draft_tokens - 1, sample_strategy)
        return DraftOut(
            torch.cat([first.token_ids, rest.token_ids], dim=1), torch.cat([last, rest.token_logits], dim=1)
        )
