"""GreedyAcceptance: an AcceptanceRule for greedy batches only, which the tests run beside the package's rules
(the engine's RejectionSampler accepts greedily on greedy rows itself, so the package has no use for it)."""

from __future__ import annotations

import torch

from speculative.acceptance import greedy_accept, tree_greedy_accept
from speculative.sampling import SampleStrategy
from speculative.sampling.context import TokenContext


class GreedyAcceptance:
    """The AcceptanceRule of a batch that decodes greedily: `greedy_accept` on the target's argmax
    after every processor of each row (a row with temperature > 0 is a ValueError: use
    RejectionSampler, which does the same for greedy batches and samples exactly otherwise)."""

    lossless = True

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> torch.Tensor:  # [B, k+1]
        """See AcceptanceRule.verify."""
        if not strategy.all_greedy:
            raise ValueError(
                "GreedyAcceptance needs temperature 0 in every row; RejectionSampler samples exactly"
            )
        return greedy_accept(strategy.argmax(logits, context), draft_token_ids)

    def verify_tree(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, M], [B, M]
        """See AcceptanceRule.verify_tree: `tree_greedy_accept` on the processed argmax at each node."""
        if not strategy.all_greedy:
            raise ValueError(
                "GreedyAcceptance needs temperature 0 in every row; RejectionSampler samples exactly"
            )
        return tree_greedy_accept(strategy.argmax(logits, context), tokens, parents)
