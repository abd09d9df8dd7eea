"""The one narrow interface every proposer (drafter) speaks."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from torch import Tensor

from speculative.kv_cache import KVCache
from speculative.prefix_cache import PrefixCache
from speculative.sampling import SampleStrategy


class Proposal(NamedTuple):
    """Draft tokens for one speculative step.

    token_ids: [batch, j] int64, -1 where the proposer has nothing (never accepted). A chain has
        j <= k; a proposer whose rows can come up short may return fewer than the k columns asked
        for, as many as its longest row has (0 when no row has any).
    probs: [batch, j, vocab] float32, the distribution each token was actually drawn from (given its
        earlier siblings, in a tree), or None when the proposer is deterministic (one-hot at each
        token).
    parents: None for a chain (token i follows token i - 1), or a token tree [batch, 1 + j] int64
        over the row's last context token (node 0, the root) and the drafts (node i = token_ids[:,
        i - 1]), in speculative/tree.py's convention: parents[b, i] in [0, i), -1 at the root and at
        padding nodes (token -1). A tree's depth is at most k.
    """

    token_ids: Tensor
    probs: Tensor | None
    parents: Tensor | None = None


@runtime_checkable
class Proposer(Protocol):
    """Proposes k tokens per row (a chain, or a tree of depth k) from the context; told by `on_commit`
    what each step kept.

    The context of the batch is `tokens` [batch, capacity] int64 with `lengths` [batch]: row b's
    context is tokens[b, :lengths[b]] (prompt + output so far); slots beyond are garbage.

    What a proposer can do beyond this is declared by the protocols below (FeatureProposer,
    LearningProposer, PrefixCachingProposer, IntakeTimingProposer, TargetCacheProposer), which the
    engine checks once, at construction.
    """

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        """Add rows after the current ones (a new batch when there are none), whose contexts are
        tokens[b, :lengths[b]] (lengths >= 2: the prompt and at least its first generated token)."""
        ...

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        """Propose `num_tokens` tokens after each row's context. A proposer that samples its drafts
        samples a guided row's (strategy.guides) under the row's grammar (proposers/grammar.py); the
        engine cuts deterministic proposals where a grammar forbids a draft."""
        ...

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        """The engine committed a step: the rows' contexts now have `lengths` ([batch]; host max
        `max_length`) tokens. Called after every step, also after steps that drafted nothing (plain
        steps, k = 0).
        most_kept: the most tokens a row (finished ones included) gained in the step: its accepted
        drafts and the target's token; 1 + the proposal's width means some row kept its whole chain."""
        ...

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        """Rows `rows` ([m] int64) of the batch finished in the step just committed (on_commit has not
        seen it) and are about to leave it (select_rows follows); their final contexts are
        tokens[r, :lengths[r]]. Rows that are aborted are not reported. Proposers that learn from past
        responses (SuffixProposer) read them here; the others do nothing."""
        ...

    def select_rows(self, rows: Tensor) -> None:
        """Keep only `rows` ([n] int64), in that order."""
        ...


@runtime_checkable
class FeatureProposer(Proposer, Protocol):
    """A proposer that drafts from the target's hidden states (EagleProposer).

    hidden_layers: the target forward's argument of that name: the layers whose hidden states it reads.
    The engine runs the target with them and hands over (`observe`) the features of the prefill (before
    add_rows) and of every step (before select_rows and on_commit).
    """

    hidden_layers: tuple[int, ...]

    def observe(self, features: Tensor) -> None:
        """The target forward's features [B, q, F] (EagleProposer.observe says which positions)."""
        ...


@runtime_checkable
class LearningProposer(Proposer, Protocol):
    """A proposer that learns from past responses across generations (SuffixProposer's global cache)."""

    def clear_cache(self) -> None:
        """Forget every past response (a benchmark's new pass over prompts it has answered)."""
        ...


@runtime_checkable
class PrefixCachingProposer(Proposer, Protocol):
    """A proposer whose state of a context (a draft model's K/V) the engine's prefix cache can keep
    beside the target's, so that a prompt found there is not taken in whole by the drafter either."""

    def use_prefix_cache(self, cache: PrefixCache | None) -> None:
        """From now on, start new rows from what `cache` holds of their contexts, and give it this
        proposer's state of the contexts it takes in (blocks the target's K/V made); None: neither."""
        ...


@runtime_checkable
class IntakeTimingProposer(Proposer, Protocol):
    """A proposer that takes in the rows that joined since its last proposal within `propose` (a draft
    model's prefill of their contexts) and says how long that took.

    intake_seconds: host seconds the latest `propose` spent on it (0.0 where no row joined). Adaptive k
    keeps it out of the step's time, as the engine keeps the target's prefill of admitted rows out, and
    charges drafting its mean per step apart: a row that finishes while the steps are plain never joins
    the drafter (engine/draft_length.py).
    """

    intake_seconds: float


@runtime_checkable
class TargetCacheProposer(Proposer, Protocol):
    """A proposer whose model drafts on the target's own KV cache (SelfDraftProposer: a quantized copy
    of the target, of the same layers, heads and head size), keeping none of its own.

    The engine hands it the running batch's cache before every proposal. A proposal may write K/V in
    the slots after each row's cached context (at most the engine's `room` of them) and must leave the
    cache's lengths and host bound as it found them; the verification then writes those slots anew."""

    def use_target_cache(self, cache: KVCache) -> None:
        """The cache the next proposal drafts on (the target's StaticKVCache of the running batch)."""
        ...
