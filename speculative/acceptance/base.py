"""The one interface of every acceptance rule the engine is given.

A speculative step hands the rule the target's raw logits at the k + 1 verified positions, the k
drafts and the distributions they were drawn from; the rule returns, per row, the drafts it keeps,
one token of the target's own (recovered at the first rejection, or the bonus after the last draft)
and -1 padding: int64 [B, k + 1]. The rule turns logits into distributions through the batch's
SampleStrategy (every processor of each row's SamplingParams, each position with its own context)
and draws its randomness from the strategy's per-row generators, so a seeded row's output does not
depend on its neighbours. The tensor algorithms themselves are pure functions beside each rule
(`greedy_accept`, `rejection_sample`, `typical_accept`), with their randomness passed in.

`verify_tree` does the same over a token tree (speculative.tree): the rule keeps one root-to-node path
and adds one token of the target's own after it (`tree_greedy_accept`, `tree_rejection_sample`,
`tree_typical_accept` in speculative.acceptance.tree).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from speculative.sampling import SampleStrategy
from speculative.sampling.context import TokenContext


@runtime_checkable
class AcceptanceRule(Protocol):
    """Decides which drafts of a step each row keeps."""

    lossless: bool
    """Whether the output is distributed exactly as the target's own (greedy: token-identical)."""

    def verify(
        self,
        logits: Tensor,
        draft_token_ids: Tensor,
        draft_probs: Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> Tensor:
        """The kept tokens of each row.

        logits: [B, k + 1, V] the target's raw logits at the last context token and at each draft.
        draft_token_ids: [B, k] int64, -1 where the proposer had nothing (never accepted).
        draft_probs: [B, k, V] the distributions the drafts were drawn from, or None for a
            deterministic proposer (one-hot at each draft).
        strategy: the batch's sampling (processors, temperatures, per-row generators).
        context: the positions' contexts for context-dependent processors (None when none is used).
        Returns int64 [B, k + 1]: accepted drafts, one more token, then -1.
        """
        ...

    def verify_tree(
        self,
        logits: Tensor,
        tokens: Tensor,
        parents: Tensor,
        draft_probs: Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> tuple[Tensor, Tensor]:
        """The kept path of each row's token tree (speculative.tree's convention).

        logits: [B, M, V] the target's raw logits at each node (node i's: the token after the path
            root .. i).
        tokens: [B, M] int64 the nodes' tokens (tokens[:, 0] the root's: the last context token; -1 at
            padding nodes).
        parents: [B, M] int64 each node's parent, -1 for the root and padding nodes.
        draft_probs: [B, M, V] row i the distribution node i's token was drawn from (given its path and
            its earlier siblings; row 0 unused), or None for deterministic drafts (one-hot at each token).
        strategy: the batch's sampling (processors, temperatures, per-row generators).
        context: the nodes' contexts for context-dependent processors (None when none is used), passed to
            the strategy unchanged.
        Returns (emitted, path), each int64 [B, M]: the accepted drafts' tokens in path order, one more
        token, then -1; and the accepted path's node indices from the root (0), then -1.
        """
        ...
