"""Typical acceptance of draft tokens (Medusa, section 3.3.1; vLLM v0's sampler).

NOT lossless: the output is not distributed as sampling from the target. It trades
exactness for a higher acceptance rate and is deterministic given the drafts.
"""

from __future__ import annotations

import torch

from speculative.sampling import SampleStrategy
from speculative.sampling.context import TokenContext

from ._checks import check_sampler_inputs
from .greedy import assemble_output, count_accepted
from .threshold import typical_threshold
from .tree import tree_typical_accept


def typical_accept(
    target_with_bonus_probs: torch.Tensor,  # [B, k+1, V]
    bonus_token_ids: torch.Tensor,  # [B, 1] int64
    draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = no draft
    posterior_threshold: float,
    posterior_alpha: float,
) -> torch.Tensor:  # [B, k+1] int64
    """Typical acceptance (see TypicalAcceptanceSampler): accepted drafts, then argmax q at the first
    rejection (or the bonus when all k were accepted), then -1 padding. Deterministic, not lossless."""
    k = draft_token_ids.shape[1]
    target_probs = target_with_bonus_probs[:, :k]  # [B, k, V]
    valid = draft_token_ids >= 0  # [B, k]
    q_x = target_probs.gather(-1, draft_token_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, k]
    threshold = typical_threshold(target_probs, posterior_threshold, posterior_alpha)  # [B, k]
    num_accepted = count_accepted(valid & (q_x > threshold))  # [B, 1]
    recovered = target_probs.max(dim=-1).indices  # [B, k], the first argmax
    candidates = torch.cat([recovered, bonus_token_ids.to(torch.int64)], dim=1)  # [B, k+1]
    next_ids = candidates.gather(1, num_accepted)  # [B, 1]
    return assemble_output(draft_token_ids, num_accepted, next_ids)


class TypicalAcceptanceSampler(torch.nn.Module):
    """Entropy-adaptive acceptance (Cai et al. 2024, "MEDUSA: Simple LLM Inference
    Acceleration Framework with Multiple Decoding Heads", arXiv:2401.10774, 3.3.1).

    For draft position i with target distribution q_i and draft token x_i::

        H_i         = -sum_v q_i(v) * log(q_i(v) + 1e-5)
        threshold_i = min(posterior_threshold, posterior_alpha * exp(-H_i))
        accept x_i  iff  q_i(x_i) > threshold_i   (and every earlier draft was accepted)

    At the first rejection argmax q_i is emitted; if all k drafts are accepted the
    bonus token follows. A -1 draft ("no draft") is never accepted.

    This rule is NOT lossless: emitted text is not distributed as sampling from the
    target model. It is deterministic given the drafts (no randomness is drawn).
    `forward` is vLLM's interface; `verify` the engine's AcceptanceRule.
    """

    lossless = False

    def __init__(self, posterior_threshold: float, posterior_alpha: float, strict_mode: bool = False) -> None:
        super().__init__()
        if not 0.0 <= posterior_threshold <= 1.0:
            raise ValueError(f"posterior_threshold must be in [0, 1], got {posterior_threshold}")
        if not posterior_alpha >= 0.0:
            raise ValueError(f"posterior_alpha must be >= 0, got {posterior_alpha}")
        self.posterior_threshold = float(posterior_threshold)
        self.posterior_alpha = float(posterior_alpha)
        self.strict_mode = strict_mode

    def forward(
        self,
        target_with_bonus_probs: torch.Tensor,  # [B, k+1, V]
        bonus_token_ids: torch.Tensor,  # [B, 1] int64
        draft_probs: torch.Tensor | None,  # [B, k, V]; unused, may be None
        draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = no draft
    ) -> torch.Tensor:  # [B, k+1] int64
        """Return [B, k+1] token ids: accepted drafts, then argmax q at the first
        rejection (or the bonus when all k were accepted), then -1 padding."""
        if self.strict_mode:
            check_sampler_inputs(target_with_bonus_probs, bonus_token_ids, draft_probs, draft_token_ids)
        return typical_accept(
            target_with_bonus_probs,
            bonus_token_ids,
            draft_token_ids,
            self.posterior_threshold,
            self.posterior_alpha,
        )

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> torch.Tensor:  # [B, k+1]
        """AcceptanceRule.verify: q_i is each row's processed distribution; the bonus is drawn from
        q_{k+1} with the row's own generator."""
        target_probs = strategy.probs(logits, context)  # [B, k + 1, V]
        bonus = strategy.sample(target_probs[:, -1])[:, None]  # [B, 1]
        return self.forward(target_probs, bonus, draft_probs, draft_token_ids)

    def verify_tree(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, M], [B, M]
        """AcceptanceRule.verify_tree: `tree_typical_accept` with each node's processed distribution
        (draft_probs unused); a bonus is drawn at every node, by exponential race with noise [B, M, V]
        from the row's own generator (as `verify` draws its one bonus)."""
        target_probs = strategy.probs(logits, context)  # [B, M, V]
        noise = strategy.random.exponential(*target_probs.shape[1:])  # [B, M, V]
        bonus = (target_probs / noise).max(dim=-1).indices  # [B, M]
        return tree_typical_accept(
            target_probs, tokens, parents, bonus, self.posterior_threshold, self.posterior_alpha
        )
