"""The target drafting for itself through a quantized copy of its weights, on the target's own KV cache.

The copy (NativeCausalLM.quantized_copy) has the target's layers, heads and head size, so its forward
reads and writes the target's cache: it attends to the target's own keys and values of the context,
and keeps no cache of its own. Rows that join cost it no prefill, plain steps (adaptive k at 0) leave
it nothing to catch up on, and a batch that switches to drafting pays no intake.

Before a proposal the target's cache holds each row's context but its last token (the engine's
invariant: a step's verification feeds that token first). The copy feeds it and then each draft but
the last, writing their K/V (the copy's, approximate) in the k slots after the context, and the cache's
lengths are set back. The verification that follows feeds the same last token and the drafts at the
same positions, so it overwrites every slot the copy wrote before any forward of the target reads one.

A copy whose matmuls round their activations (w8a8, w4a8) attends query by query (QueryByQueryAttention)
so that a row's drafts are bitwise what they would be alone: that keeps a seeded sampled row's text
independent of the rows beside it. Only such a row needs it (a greedy row's output is the target's
whatever its drafts; an unseeded sampled row's depends on its batch anyway, through the generator it
shares), and one batched call a layer costs less than one a query, so an eager copy drafts a batch
without one on batched attention (FusedAttention).
"""

from __future__ import annotations

from torch import Tensor

from speculative.kv_cache import StaticKVCache
from speculative.models.attention import AttentionBackend, FusedAttention
from speculative.models.base import CompiledDrafting, GreedyDecoding, LanguageModel
from speculative.proposers.base import Proposal
from speculative.proposers.draft_model import draft_chain
from speculative.sampling import SampleStrategy


class SelfDraftProposer:
    """Proposes a chain of k tokens per row from `model`, a quantized copy of the target (or a model
    of the same layers, heads and head size), drawn as a draft model's are (`draft_chain`: each row
    with its own sampling parameters, a guided row under its grammar, a greedy batch on a compiled
    model in one call); it drafts on the cache the engine hands it before each proposal
    (`use_target_cache`, TargetCacheProposer)."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.greedy_decoding = isinstance(model, GreedyDecoding)  # its k greedy drafts in one call
        self.cache: StaticKVCache | None = None
        # (model to switch, its row-exact backend, its batched one); None: one backend whatever the rows,
        # as for a compiled copy, whose graphs attend as they were traced (an assignment to the model
        # would also cost its graphs' guard checks their shortcut: models/compiled.py)
        switch = not isinstance(model, CompiledDrafting) and getattr(model, "rounds_activations", False)
        self._backends: tuple[LanguageModel, AttentionBackend, AttentionBackend] | None = (
            (model, model.attention_backend, FusedAttention()) if switch else None
        )

    def use_target_cache(self, cache: StaticKVCache) -> None:
        self.cache = cache

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        cache = self.cache
        before, bound = cache.lengths.clone(), cache.host_max_length  # [B]: each context but its last token
        if self._backends is not None:
            native, row_exact, batched = self._backends
            seeded = any(p.seed is not None and not p.greedy for p in strategy.params)
            wanted = row_exact if seeded else batched
            if native.attention_backend is not wanted:
                native.attention_backend = wanted
        try:
            query = tokens.gather(1, lengths[:, None] - 1)  # [B, 1]
            return draft_chain(self.model, query, cache, num_tokens, strategy, self.greedy_decoding)
        finally:  # the verification writes the same slots anew
            cache.rollback(before, bound)

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        """Nothing to take in: the target's prefill made the new rows' K/V."""

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        """Nothing to keep: the target's cache holds what the step kept."""

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        """Nothing learnt from finished rows."""

    def select_rows(self, rows: Tensor) -> None:
        """The engine keeps the target cache's rows; the next proposal is handed the cache anew."""
        if not rows.numel():
            self.cache = None
