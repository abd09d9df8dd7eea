"""Inferencer: prefill and decode over a model and a KV cache (naive_speculate's contract)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from speculative.kv_cache import KVCache
from speculative.models.base import LanguageModel
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

    def prefill(self, query_token_ids: Tensor, kv_cache: KVCache,
                sample_strategy: SampleStrategy) -> PrefillOutput:
        """Process query_token_ids [batch, q] in one forward; sample the next token of each row.

        kv_cache holds everything before the query and gains the query's K/V.
        """
        ...

    def decode(self, query_token_ids: Tensor, kv_cache: KVCache, max_new_tokens: int,
               sample_strategy: SampleStrategy) -> DecodeOutput:
        """Feed query_token_ids [batch, 1] and generate autoregressively.

        Each row stops at max_new_tokens (> 0) or at its EOS. kv_cache gains the query and every
        generated token but the last.
        """
        ...


class ModelInferencer:
    """Inferencer over a `LanguageModel`.

    eos_token_ids: the tokens that end a row in `decode` (rows whose strategy ignores EOS go on).
    Passing none lets decode run the full max_new_tokens without a host sync per token, and a greedy
    decode of a model with a `greedy_decode(query_token_ids, kv_cache, steps) -> (token_ids, logits)`
    (CompiledCausalLM) in one call of it.
    """

    def __init__(self, model: LanguageModel, eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.eos_token_ids = torch.tensor(list(eos_token_ids), dtype=torch.long, device=model.device)

    def prefill(self, query_token_ids: Tensor, kv_cache: KVCache, sample_strategy: SampleStrategy,
                num_tokens: Tensor | None = None, all_logits: bool = True) -> PrefillOutput:
        """`Inferencer.prefill`, with two extensions.

        num_tokens: [batch] real tokens per row of a right-padded query (default: all q); the token
            is sampled after each row's last real token.
        all_logits: False returns token_logits [batch, 1, vocab] at that last real position only.
        """
        batch, q = query_token_ids.shape
        if num_tokens is None:
            last = torch.full((batch, 1), q - 1, dtype=torch.long, device=query_token_ids.device)
        else:
            last = (num_tokens - 1)[:, None]
        if all_logits:
            logits = self.model.forward(query_token_ids, kv_cache, num_tokens=num_tokens)  # [batch, q, vocab]
            last_logits = logits.gather(1, last[:, :, None].expand(-1, -1, logits.shape[-1]))[:, 0]
        else:
            logits = self.model.forward(query_token_ids, kv_cache, num_tokens=num_tokens,
                                        logits_indices=last)  # [batch, 1, vocab]
            last_logits = logits[:, 0]
        token_ids = sample_strategy.next_tokens(last_logits)[:, None]
        return PrefillOutput(token_ids, logits)

    def decode(self, query_token_ids: Tensor, kv_cache: KVCache, max_new_tokens: int,
               sample_strategy: SampleStrategy) -> DecodeOutput:
        """`Inferencer.decode`, extended to a query of several tokens: query_token_ids [batch, q >= 1]
        are fed in the first forward, whose logits are taken at the last of them (a prefill and the
        decode after it in one call; kv_cache gains the query and every generated token but the last)."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0; got {max_new_tokens}")
        stops = self.eos_token_ids.numel() > 0  # without EOS: no per-token work beyond the forward
        greedy_decode = getattr(self.model, "greedy_decode", None)  # all steps in one call (compiled)
        if greedy_decode is not None and not stops and sample_strategy.all_greedy:
            return DecodeOutput(*greedy_decode(query_token_ids, kv_cache, max_new_tokens))
        if stops:
            start = kv_cache.lengths.clone()
            finished = torch.zeros(query_token_ids.shape[0], dtype=torch.bool, device=query_token_ids.device)
            ignore_eos = torch.tensor([p.ignore_eos for p in sample_strategy.params], device=finished.device)
        tokens, all_logits = [], []
        batch, q = query_token_ids.shape
        current = query_token_ids
        last = torch.full((batch, 1), q - 1, device=current.device) if q > 1 else None  # first step's logits
        for _ in range(max_new_tokens):
            logits = self.model.forward(current, kv_cache, logits_indices=last)[:, -1]  # [batch, vocab]
            last = None
            new = sample_strategy.next_tokens(logits)  # [batch]
            all_logits.append(logits)
            if stops:
                tokens.append(torch.where(finished, -1, new))
                finished = finished | (torch.isin(new, self.eos_token_ids) & ~ignore_eos)
                if bool(finished.all()):
                    break
            else:
                tokens.append(new)
            current = new[:, None]
        token_ids = torch.stack(tokens, dim=1)  # [batch, n]
        if stops:  # a finished row's cache keeps the query and its tokens before its EOS
            kv_cache.rollback(start + q - 1 + (token_ids >= 0).sum(dim=1))
        return DecodeOutput(token_ids, torch.stack(all_logits, dim=1))
