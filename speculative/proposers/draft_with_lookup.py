"""A draft model with prompt lookup first: where a row's context repeats, what followed is proposed.

Each step, a row whose last `prompt_lookup_min` (up to `prompt_lookup_max`) tokens occur earlier in
its context proposes the tokens that followed the most recent such match (NgramProposer's chain);
every other row proposes the draft model's chain. A draft model predicts open text better than a
lookup, and the lookup repeats what the context already says (a pasted text being edited or
summarised, code, a name or phrase said before) better than a small model, so each row takes the
proposal of the kind that tends to be right where it stands (Snowflake's Arctic Speculator also
combines suffix decoding with a trained drafter). The choice is a function of the context alone,
so a row's drafts are drawn from a well-defined distribution at each position: the draft's (its
probabilities) or the lookup's (one-hot at its token), and the acceptance rule stays exact.

With `draft_tokens`, the draft's chain is at most that long while a lookup's runs to k: a small
draft's later drafts are rarely kept, a match's often are (proposals are then ragged, -1 past a
row's chain, never accepted). A batch's verification is as wide as its widest row's chain, so in a
greedy batch of B rows a lookup's chain is at most max(draft_tokens, k // B), shrinking with the batch
as trees do (tree.py's batch_tree); unshrunk, a server under load ran far below plain decoding
(docs/drafters.md, "With prompt lookup first").

The draft model drafts every row every step (one batched call; a row's lookup may stop short of k
tokens or be wrong, and the draft's cache must follow the context anyway). Where a row proposed the
lookup's tokens, the draft's cache holds the K/V of the draft's own tokens at those positions: valid
for as many kept tokens as the two proposals agree on, and cut back to there after the commit
(DraftModelProposer.rewind), the next proposal feeding the rest again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from speculative.prefix_cache import PrefixCache
from speculative.proposers.base import Proposal
from speculative.proposers.draft_model import DraftModelProposer
from speculative.proposers.ngram import NgramProposer
from speculative.sampling import SampleStrategy


class DraftWithLookupProposer:
    """A draft model's chains (DraftModelProposer), replaced row by row by prompt lookup's
    (NgramProposer, a chain) where the row's context has a match (module docstring). draft_tokens: the
    draft's chain at most this long (None: as long as asked)."""

    def __init__(
        self, draft: DraftModelProposer, lookup: NgramProposer, draft_tokens: int | None = None
    ) -> None:
        if lookup.tree_nodes is not None:
            raise ValueError("a draft model with prompt lookup proposes chains: give the lookup no tree")
        self.draft = draft
        self.lookup = lookup
        self.draft_tokens = draft_tokens
        # of the proposal being committed: the rows' context lengths before it [B], the rows that
        # proposed the lookup's tokens [B] bool, and how many leading tokens lookup and draft agree on [B]
        self._step: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def intake_seconds(self) -> float:
        """The draft's prefill of joined rows in the latest proposal (IntakeTimingProposer)."""
        return self.draft.intake_seconds

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        self.draft.add_rows(tokens, lengths)

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        own = num_tokens if self.draft_tokens is None else min(num_tokens, self.draft_tokens)
        # a lookup's chain: k, or beside a shorter draft chain, shrinking with a greedy batch
        longest = num_tokens if self.draft_tokens is None else max(own, num_tokens // strategy.tree_rows)
        drafted = self.draft.propose(tokens, lengths, own, strategy)
        own = drafted.token_ids.shape[1]
        looked = self.lookup.propose(tokens, lengths, longest, strategy).token_ids  # [B, <= longest]
        width = max(own, looked.shape[1])
        looked = F.pad(looked, (0, width - looked.shape[1]), value=-1)
        draft_ids = F.pad(drafted.token_ids, (0, width - own), value=-1)
        chosen = looked[:, 0] >= 0
        token_ids = torch.where(chosen[:, None], looked, draft_ids)
        probs = None
        if drafted.probs is not None:  # a draft row's positions past its chain: token -1, never accepted
            probs = _lookup_one_hot(F.pad(drafted.probs, (0, 0, 0, width - own)), looked, chosen)
        agree = (looked[:, :own] == drafted.token_ids).long().cumprod(dim=1).sum(dim=1)  # [B] leading equal
        self._step = (lengths.clone(), chosen, agree)
        return Proposal(token_ids, probs)

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        self.draft.on_commit(lengths, max_length, most_kept)
        if self._step is None:  # a plain step
            return
        start, chosen, agree = self._step
        self._step = None
        # where a row kept lookup tokens the draft did not propose, its K/V from there on are not the
        # context's: it keeps those of the tokens both proposed and the row kept
        kept = lengths - start - 1
        valid = torch.where(chosen, start + torch.minimum(kept, agree), lengths)
        self.draft.rewind(valid)

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        self.draft.on_finish(tokens, lengths, rows)

    def use_prefix_cache(self, cache: PrefixCache | None) -> None:
        self.draft.use_prefix_cache(cache)

    def select_rows(self, rows: Tensor) -> None:
        self.draft.select_rows(rows)
        if self._step is not None:  # rows that finished in the step leave before its on_commit ...
            self._step = tuple(values[rows] for values in self._step)
            if not len(rows):  # ... which, where none stays, never comes: the next step may be plain
                self._step = None


def _lookup_one_hot(probs: Tensor, looked: Tensor, chosen: Tensor) -> Tensor:
    """The draft's probabilities [B, j, V] with each chosen row's ([B] bool) one-hot at its lookup
    tokens ([B, j], -1 where none: any row there, never accepted), the distribution they were drawn from."""
    one_hot = torch.zeros_like(probs).scatter_(-1, looked.clamp(min=0)[..., None], 1.0)
    return torch.where(chosen[:, None, None], one_hot, probs)
