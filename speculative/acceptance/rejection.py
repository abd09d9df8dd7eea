"""Lossless speculative sampling (rejection sampling of draft tokens).

Algorithm (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
Speculative Decoding", arXiv:2211.17192; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling", arXiv:2302.01318):

For draft positions i = 1..k with target distribution q_i, draft distribution p_i
and draft token x_i ~ p_i:

* accept x_i with probability min(1, q_i(x_i) / p_i(x_i)), i.e. iff
  ``u_i * p_i(x_i) <= q_i(x_i)`` with u_i ~ U(0, 1] (no division; u > 0, so a
  token with q_i(x_i) = 0 is never accepted);
* at the first rejection emit a token from norm(max(0, q_i - p_i)) and stop;
* if all k are accepted, emit the bonus token, drawn from q_{k+1} by the caller.

The emitted tokens are then distributed exactly as sampling from the target alone.
"""

from __future__ import annotations

import torch

from speculative.sampling import SampleStrategy
from speculative.sampling.context import TokenContext

from ._checks import check_sampler_inputs
from .greedy import assemble_output, count_accepted, greedy_accept
from .tree import tree_greedy_accept, tree_rejection_sample

# Smallest Exp(1) sample we allow: keeps residual / noise finite.
_MIN_NOISE = 1e-10


def rejection_sample(
    target_probs: torch.Tensor,  # [B, k, V] float
    bonus_token_ids: torch.Tensor,  # [B, 1] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] float, or None (deterministic drafter)
    draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = no draft
    uniform_samples: torch.Tensor,  # [B, k] float in (0, 1]
    recovery_noise: torch.Tensor,  # [B, V] float, Exp(1) samples, > 0
) -> torch.Tensor:  # [B, k+1] int64
    """Verify k drafts per row with lossless rejection sampling (see module docstring).

    ``draft_probs=None`` means the drafter is deterministic: p_i is one-hot at x_i, so
    x_i is accepted iff u_i <= q_i(x_i) and the residual is q_i with x_i removed.
    A draft id of -1 ("no draft") is never accepted and its p_i is taken as 0, so
    the recovered token is drawn from q_i itself.

    The recovered token is ``argmax(max(0, q_i - p_i) / noise)`` (an exponential race,
    which samples from the normalised residual without normalising); if the residual
    is all zero, q_i is used instead. Only the first rejection's token is computed.

    Returns int64 [B, k+1]: accepted drafts, then the recovered token (or the bonus
    when all k were accepted), then -1 padding. Pure tensor code: no Python loop over
    rows or positions and no host synchronisation.
    """
    b, k, v = target_probs.shape
    if k == 0:
        return bonus_token_ids.to(torch.int64).clone()
    valid = draft_token_ids >= 0  # [B, k]
    x = draft_token_ids.clamp(min=0).unsqueeze(-1)  # [B, k, 1]
    q_x = target_probs.gather(-1, x).squeeze(-1)  # [B, k]
    if draft_probs is None:
        p_x = valid.to(target_probs.dtype)  # [B, k]
    else:
        p_x = draft_probs.gather(-1, x).squeeze(-1) * valid  # [B, k]
    accepted = valid & (uniform_samples * p_x <= q_x)  # [B, k]
    num_accepted = count_accepted(accepted)  # [B, 1]

    # Residual at the first rejected position only (clamped to k-1 for all-accepted rows,
    # whose recovered token is discarded in favour of the bonus).
    rej = num_accepted.clamp(max=k - 1)  # [B, 1]
    gather_v = rej.unsqueeze(-1).expand(b, 1, v)  # [B, 1, V]
    q_rej = target_probs.gather(1, gather_v).squeeze(1)  # [B, V]
    x_rej = x.squeeze(-1).gather(1, rej)  # [B, 1]
    valid_rej = valid.gather(1, rej)  # [B, 1]
    if draft_probs is None:
        p_rej = torch.zeros_like(q_rej).scatter_(1, x_rej, valid_rej.to(q_rej.dtype))  # [B, V]
    else:
        p_rej = draft_probs.gather(1, gather_v).squeeze(1) * valid_rej  # [B, V]
    residual = (q_rej - p_rej).clamp_min(0)  # [B, V]
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # [B, 1]
    residual = torch.where(empty, q_rej, residual)
    recovered = (residual / recovery_noise).max(dim=-1, keepdim=True).indices  # [B, 1], the first argmax

    next_ids = torch.where(num_accepted >= k, bonus_token_ids.to(torch.int64), recovered)
    return assemble_output(draft_token_ids, num_accepted, next_ids)


class RejectionSampler(torch.nn.Module):
    """Lossless acceptance: :func:`rejection_sample` as a module (vLLM's interface, `forward`) and
    as the engine's AcceptanceRule (`verify`).

    ``strict_mode=True`` validates shapes, dtypes, device, id ranges and probability
    values on every call (this synchronises with the device).
    """

    lossless = True

    def __init__(self, strict_mode: bool = False) -> None:
        super().__init__()
        self.strict_mode = strict_mode

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> torch.Tensor:  # [B, k+1]
        """AcceptanceRule.verify: q_i is each row's processed distribution at position i. A greedy
        batch is the temperature-0 case, greedy acceptance on the processed argmax. Otherwise the
        bonus is drawn from q_{k+1}, then the uniforms and the recovery noise, all from each row's
        own generator (in that order)."""
        if strategy.all_greedy:
            return greedy_accept(strategy.argmax(logits, context), draft_token_ids)
        k, vocab = draft_token_ids.shape[1], logits.shape[-1]
        target_probs = strategy.probs(logits, context)  # [B, k + 1, V]
        bonus = strategy.sample(target_probs[:, -1])[:, None]  # [B, 1]
        return rejection_sample(
            target_probs[:, :k],
            bonus,
            draft_probs,
            draft_token_ids,
            strategy.random.uniform(k),
            strategy.random.exponential(vocab),
        )

    def verify_tree(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor | None,
        strategy: SampleStrategy,
        context: TokenContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, M], [B, M]
        """AcceptanceRule.verify_tree: `tree_rejection_sample` with each node's processed distribution.
        A greedy batch is the temperature-0 case, `tree_greedy_accept` on the processed argmax.
        Otherwise the uniforms [B, M] and then the noise [B, V] are drawn from each row's own
        generator."""
        if strategy.all_greedy:
            return tree_greedy_accept(strategy.argmax(logits, context), tokens, parents)
        m, vocab = tokens.shape[1], logits.shape[-1]
        target_probs = strategy.probs(logits, context)  # [B, M, V]
        uniforms = strategy.random.uniform(m)
        noise = strategy.random.exponential(vocab)
        return tree_rejection_sample(target_probs, draft_probs, tokens, parents, uniforms, noise)

    def forward(
        self,
        target_with_bonus_probs: torch.Tensor,  # [B, k+1, V]
        bonus_token_ids: torch.Tensor,  # [B, 1] int64
        draft_probs: torch.Tensor | None,  # [B, k, V] or None
        draft_token_ids: torch.Tensor,  # [B, k] int64
        *,
        uniform_samples: torch.Tensor | None = None,  # [B, k] in (0, 1]
        recovery_noise: torch.Tensor | None = None,  # [B, V] Exp(1)
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:  # [B, k+1] int64
        """Return [B, k+1] token ids: accepted drafts, one more token, -1 padding.

        Uniforms are drawn as ``1 - torch.rand`` (never 0) and the noise as Exp(1)
        clamped away from 0, both from ``generator`` when they are not given.
        """
        if self.strict_mode:
            check_sampler_inputs(
                target_with_bonus_probs,
                bonus_token_ids,
                draft_probs,
                draft_token_ids,
                uniform_samples,
                recovery_noise,
            )
        b, k_plus_1, v = target_with_bonus_probs.shape
        k = k_plus_1 - 1
        dev, dtype = target_with_bonus_probs.device, target_with_bonus_probs.dtype
        if uniform_samples is None:
            uniform_samples = 1.0 - torch.rand(b, k, device=dev, dtype=dtype, generator=generator)
        if recovery_noise is None:
            recovery_noise = torch.empty(b, v, device=dev, dtype=dtype)
            recovery_noise.exponential_(generator=generator).clamp_(min=_MIN_NOISE)
        return rejection_sample(
            target_with_bonus_probs[:, :k],
            bonus_token_ids,
            draft_probs,
            draft_token_ids,
            uniform_samples,
            recovery_noise,
        )
