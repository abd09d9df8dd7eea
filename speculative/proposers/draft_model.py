"""A draft model as proposer: k autoregressive steps of a small model sharing the target's vocabulary.

Cache invariant: before a proposal the draft cache holds every context token but the last two
(length = context length - 2), and the first draft forward feeds those two. This one shape covers
both outcomes of the previous step: after a rejection only the recovered token is new (the token
before it is fed again, recomputing identical K/V), and after full acceptance the draft has not yet
seen x_k nor the bonus token. Rollback after verification is a length change. After plain steps (k = 0: no proposal) the cache
is left `behind` by one token per step, the same for every row; the next proposal feeds those too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.inference import ModelInferencer
from speculative.models.base import LanguageModel
from speculative.proposers.base import Proposal
from speculative.proposers.drafter import Drafter
from speculative.sampling import SampleStrategy


class DraftModelProposer:
    """Proposes tokens sampled from a draft model with each row's own sampling parameters."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.drafter = Drafter(ModelInferencer(model))  # no EOS: drafting never syncs to stop early
        self.cache = None
        self.behind = 0  # context tokens beyond the last two that the cache lacks (plain steps)
        self._proposed = False

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        cache = self.model.new_cache(tokens.shape[0], tokens.shape[1])
        width = int(lengths.max()) - 1  # the prefill feeds all but the last token, then forgets one more
        self.model.forward(tokens[:, :width], cache, num_tokens=lengths - 1,
                           logits_indices=torch.zeros_like(lengths)[:, None])
        cache.rollback(lengths - 2, width - 1)
        if self.cache is None or self.cache.batch_size == 0:
            self.cache, self.behind = cache, 0
        else:
            self.cache.append_rows(cache)

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int,
                strategy: SampleStrategy) -> Proposal:
        fed = 2 + self.behind
        query = tokens.gather(1, lengths[:, None] - fed + torch.arange(fed, device=tokens.device))
        out = self.drafter.draft(query, self.cache, num_tokens, strategy)
        self.behind, self._proposed = 0, True
        probs = None if strategy.all_greedy else strategy.probs(out.token_logits)
        return Proposal(out.token_ids, probs)

    def accept(self, lengths: Tensor, max_length: int) -> None:
        if self._proposed:
            self.cache.rollback(lengths - 2, max_length - 2)
        else:  # a plain step: every row gained one token that the cache has not seen
            self.behind += 1
        self._proposed = False

    def catch_up(self, tokens: Tensor, lengths: Tensor) -> None:
        if self.behind and self.cache is not None and self.cache.batch_size:
            query = tokens.gather(1, lengths[:, None] - 2 - self.behind + torch.arange(self.behind, device=tokens.device))
            self.model.forward(query, self.cache, logits_indices=torch.zeros_like(lengths)[:, None])
        self.behind = 0

    def select_rows(self, rows: Tensor) -> None:
        if self.cache is not None:
            self.cache.select_rows(rows)
