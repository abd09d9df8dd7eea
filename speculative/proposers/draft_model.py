"""A draft model as proposer: k autoregressive steps of a small model sharing the target's vocabulary.

Cache invariant: before a proposal the draft cache holds every context token but the last `missing`
(1 or 2), and the first draft forward feeds those. After a step in which every row rejected a draft
(or was cut short), the draft has already computed the K/V of every kept token but the recovered
one, so the cache is rolled back to all but the last token and the next step feeds that one alone.
When some row kept its whole block (all k drafts and the bonus), the draft has not seen x_k: every
row then feeds its last two tokens (for the others the first of them is recomputed, identically).
Rollback is a length change. After plain steps (k = 0: no proposal) the cache is left `behind` by one
token per step, the same for every row; the next proposal feeds those too.

Rows join lazily: `add_rows` gives them empty rows in the cache (`pending`), and the first proposal
after it runs their prefill, so that rows which join while speculation is off (adaptive k = 0, a
server under heavy load) cost the draft nothing. That proposal first feeds the running rows what
plain steps left `behind`, then prefills the pending rows up to the same point (all but their last
`missing` tokens) and puts them in their places; the seconds that took are its `intake_seconds`
(IntakeTimingProposer), which adaptive k keeps out of the step's time.

With the engine's prefix cache (`use_prefix_cache`), that prefill starts each row from the draft's K/V
of the blocks the cache holds of its context, and gives the cache the draft's K/V of what it fed; a
finished row gives it the K/V of its whole context that the draft cache holds (`on_finish`), so that
the next turn of a conversation is not prefilled whole by the draft either.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from speculative.kv_cache import KVCache, StaticKVCache
from speculative.models.base import GreedyDecoding, LanguageModel, decode
from speculative.models.prefill import prefill_groups
from speculative.prefix_cache import PrefixCache, PrefixMatch, tokens_after
from speculative.proposers.base import Proposal
from speculative.proposers.grammar import GrammarWalk
from speculative.sampling import SampleStrategy


def draft_chain(
    model: LanguageModel,
    query: Tensor,
    cache: KVCache,
    num_tokens: int,
    strategy: SampleStrategy,
    greedy_decoding: bool,
) -> Proposal:
    """`num_tokens` drafts a row from `model`, fed `query` [B, q] on `cache` first (the cache gains q +
    num_tokens - 1 tokens a row): each row sampled with its own parameters, a guided row under its
    grammar (`GrammarWalk`), and a greedy batch without grammars, where `greedy_decoding` (the model is
    a GreedyDecoding one), in one call of its `greedy_decode`; with the distributions they were drawn
    from."""
    if strategy.any_guided:
        walk = GrammarWalk(strategy.guides, model.vocab_size)
        token_ids, logits = decode(model, query, cache, num_tokens, walk.choose(strategy.next_tokens))
        logits = walk.masked(logits)
    elif strategy.all_greedy and greedy_decoding:
        token_ids, logits = model.greedy_decode(query, cache, num_tokens)
    else:
        token_ids, logits = decode(model, query, cache, num_tokens, strategy.next_tokens)
    return Proposal(token_ids, strategy.draft_probs(logits))


class DraftModelProposer:
    """Proposes tokens sampled from a draft model with each row's own sampling parameters (temperature,
    min_p, top-k, top-p: the rule only needs the distribution each draft was drawn from), a guided row
    under its grammar's mask (`GrammarWalk`: one host read per drafted token while a batch has guided
    rows). Drafting never stops early at EOS (that would need a host sync per token); a greedy batch
    without grammars on a GreedyDecoding model (CompiledCausalLM) drafts all k tokens in one call of its
    `greedy_decode`."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.greedy_decoding = isinstance(model, GreedyDecoding)  # its k greedy drafts in one call
        self.cache = None
        self.missing = 1  # the context's last tokens that the next proposal feeds (1 or 2) ...
        self.behind = 0  # ... and before them, tokens the cache lacks after plain steps
        self._proposed = 0  # the width of the proposal being committed (0: none, a plain step)
        self.pending: list[int] = []  # rows whose prefill waits for the next proposal (empty in the cache)
        self.intake_seconds = 0.0  # the latest proposal's prefill of pending rows (IntakeTimingProposer)
        self._bound: int | None = None  # a host bound of the cache's lengths (None before a proposal)
        self._short = False  # since a rewind, rows lack more than `behind` tokens (_refill feeds them)
        self._roots: Tensor | None = None  # the rows' context lengths at the proposal being committed
        self.prefix_cache: PrefixCache | None = None

    def use_prefix_cache(self, cache: PrefixCache | None) -> None:
        self.prefix_cache = cache

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        empty = self.model.new_cache(tokens.shape[0], 1)  # placeholders: _add_pending makes their room
        if self.cache is None or self.cache.batch_size == 0:
            self.cache, self.behind, self.missing, self.pending, self._short = empty, 0, 1, [], False
        else:
            self.cache.append_rows(empty)
        joined = self.cache.batch_size
        self.pending += range(joined - tokens.shape[0], joined)

    def _add_pending(self, tokens: Tensor, lengths: Tensor) -> None:
        """Prefill the pending rows to the running rows' state (module docstring)."""
        rows = torch.tensor(self.pending, device=tokens.device)
        if len(self.pending) == self.cache.batch_size:  # all new: the prefill's cache is the cache
            self.cache, _ = self._prefill(tokens, lengths)
            self.behind, self.missing, self.pending = 0, 1, []
            return
        self._catch_up(tokens, lengths)
        cache, width = self._prefill(tokens[rows], lengths[rows])
        cache.rollback(lengths[rows] - self.missing, width + 1 - self.missing)
        running = self.cache.batch_size
        self.cache.append_rows(cache)
        order = list(range(running))
        for i, row in enumerate(self.pending):  # each pending row's place takes its prefilled row
            order[row] = running + i
        self.cache.select_rows(torch.tensor(order, device=tokens.device))
        self.pending = []

    def _prefill(self, tokens: Tensor, lengths: Tensor) -> tuple[KVCache, int]:
        """A new cache of the rows' contexts but their last tokens, and its host max length. On a CPU,
        rows of different lengths go in a few forwards of similar lengths (`prefill_groups`), not all
        padded to the longest: a long prompt that joined beside short ones costs its own tokens. With a
        prefix cache, each row starts after the draft's K/V the cache holds of its context."""
        fed = (lengths - 1).tolist()  # the prefill feeds all but the last token
        contexts, matches = None, [None] * len(fed)
        if self.prefix_cache is not None:
            contexts = [tokens[row, :n].tolist() for row, n in enumerate(fed)]
            matches = [self.prefix_cache.match_draft(c) for c in contexts]
        cached = [m.num_tokens if m is not None else 0 for m in matches]
        rows, left = list(range(len(fed))), [n - c for n, c in zip(fed, cached)]
        groups = prefill_groups(left) if tokens.device.type == "cpu" else [rows]
        cache = None
        for group in groups:  # the cache's rows: the groups' rows one after the other
            index = torch.tensor(group, device=tokens.device)
            part = self.model.new_cache(len(group), tokens.shape[1])
            starts = self._load_prefixes(part, [matches[i] for i in group])
            start = torch.tensor(starts, device=tokens.device) if any(starts) else 0
            self.model.forward(
                tokens_after(tokens[index], starts, max(fed[i] - c for i, c in zip(group, starts))),
                part,
                num_tokens=lengths[index] - 1 - start,
                logits_indices=torch.zeros_like(index)[:, None],
            )
            if contexts and isinstance(part, StaticKVCache):
                for row, i in enumerate(group):
                    self.prefix_cache.attach_draft(contexts[i], part, row, fed[i])
            if cache is None:
                cache = part
            else:
                cache.append_rows(part)
        order = [row for group in groups for row in group]
        if order != rows:
            place = {row: i for i, row in enumerate(order)}
            cache.select_rows(torch.tensor([place[row] for row in rows], device=tokens.device))
        return cache, max(fed)

    def _load_prefixes(self, part: KVCache, matches: list[PrefixMatch | None]) -> list[int]:
        """Each row's cached prefix loaded into the new `part` (where the draft's caches can hold one);
        returns where each row's prefill starts."""
        if self.prefix_cache is None or not isinstance(part, StaticKVCache):
            return [0] * len(matches)
        return self.prefix_cache.load_rows(part, matches, draft=True)

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        if self._short:
            self._refill(tokens, lengths)
        self.intake_seconds = 0.0
        if self.pending:
            start = time.perf_counter()
            self._add_pending(tokens, lengths)
            self.intake_seconds = time.perf_counter() - start
        greedy = strategy.all_greedy and self.greedy_decoding and not strategy.any_guided
        if greedy and self.behind:  # the compiled drafting then takes 1 or 2 tokens, whatever the plain steps
            self._catch_up(tokens, lengths)
        fed = self.missing + self.behind
        query = tokens.gather(1, lengths[:, None] - fed + torch.arange(fed, device=tokens.device))  # [B, fed]
        proposal = draft_chain(self.model, query, self.cache, num_tokens, strategy, self.greedy_decoding)
        self.behind, self._proposed, self._roots = 0, num_tokens, lengths.clone()
        return proposal

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        if self._proposed:  # the cache holds the context before the step and the drafts but the last
            self.missing = 2 if most_kept > self._proposed else 1
            self._bound = max_length - self.missing
            self.cache.rollback(lengths - self.missing, self._bound)
        else:  # a plain step: every row gained one token that the cache has not seen
            self.behind += 1
            self._tighten(max_length)
        self._proposed = 0

    def rewind(self, lengths: Tensor) -> None:
        """After on_commit: cut each row's cache to at most lengths[b] tokens ([batch]); the next
        proposal first feeds each row what was cut (`_refill`), then drafts as usual. For a caller that
        proposed other tokens than this draft's in some rows (DraftWithLookupProposer), whose cache
        then holds K/V of tokens that are not the context's. (Fed in a call of its own rather than in
        the drafting's query, whose length, compiled, has a graph of its own at batch 1.)"""
        have = self.cache.lengths
        if bool((lengths < have).any()):
            self.cache.rollback(torch.minimum(have, lengths), self._bound)
            self._short = True

    def _refill(self, tokens: Tensor, lengths: Tensor) -> None:
        """Feed every running row what `rewind` cut from its cache beyond the invariant (its context but
        the last `missing + behind` tokens), each row its own number of tokens."""
        want = lengths - self.missing - self.behind
        if self.pending:  # joined since: empty until their prefill
            want[self.pending] = 0
        have = self.cache.lengths
        lack = want - have
        width = int(lack.max())
        self._short = False
        if not width:  # the rows that lacked tokens have left
            return
        positions = (have[:, None] + torch.arange(width, device=tokens.device)).clamp(max=tokens.shape[1] - 1)
        query = tokens.gather(1, positions)
        first = torch.zeros_like(lengths)[:, None]
        self.model.forward(query, self.cache, num_tokens=lack, logits_indices=first)

    def _tighten(self, max_length: int) -> None:
        """After a plain step (counted in `behind`), with `max_length` the host bound of the contexts:
        the cache's host bound of its lengths, which rows that have left kept high since the last
        proposal, becomes what the rows left can hold (their contexts less what plain steps added;
        pending rows hold nothing), so that feeding what they lack never looks like an overflow."""
        if self._bound is not None and self.cache is not None:
            self._bound = min(self._bound, max_length - self.behind)
            self.cache.rollback(self.cache.lengths, self._bound)

    def _catch_up(self, tokens: Tensor, lengths: Tensor) -> None:
        """Feed every row the tokens plain steps left `behind` (pending rows get garbage, which their
        prefill replaces: their start is clamped to the context)."""
        if self.behind:
            start = (lengths[:, None] - self.missing - self.behind).clamp(min=0)
            query = tokens.gather(1, start + torch.arange(self.behind, device=tokens.device))
            self.model.forward(query, self.cache, logits_indices=torch.zeros_like(lengths)[:, None])
        self.behind = 0

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        """With a prefix cache, give it the draft's K/V of the finished rows' contexts: what the cache
        holds of them, less the step's drafts (a proposal's tokens past the context it was made from
        need not be the context's)."""
        if self.prefix_cache is None or not isinstance(self.cache, StaticKVCache):
            return
        held = self.cache.lengths[rows]
        if self._proposed:
            held = torch.minimum(held, self._roots[rows])
        for row, n, length in zip(rows.tolist(), held.tolist(), lengths[rows].tolist()):
            self.prefix_cache.attach_draft(tokens[row, :length].tolist(), self.cache, row, n)

    def select_rows(self, rows: Tensor) -> None:
        if self._proposed:  # rows that finished in the step being committed leave first ...
            self._roots = self._roots[rows]
            if not rows.numel():  # ... and where none stays there is no commit: the next step may be plain
                self._proposed = 0
        if not rows.numel():  # the batch emptied: the cache's buffers go with it, as the target's do
            self.cache, self.pending, self._bound, self._short = None, [], None, False
            return
        if self.cache is not None:
            self.cache.select_rows(rows)
        if self.pending:
            pending = set(self.pending)
            self.pending = [i for i, row in enumerate(rows.tolist()) if row in pending]
