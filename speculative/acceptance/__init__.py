"""Acceptance rules for speculative decoding: greedy, lossless rejection sampling,
and typical acceptance (not lossless), each an AcceptanceRule (`verify`) over a pure
tensor function. Token-id outputs are int64 [B, k+1]: accepted drafts, one more token,
then -1 padding."""

from .base import AcceptanceRule
from .greedy import GreedyAcceptance, greedy_accept
from .rejection import RejectionSampler, rejection_sample
from .typical import TypicalAcceptanceSampler, typical_accept

__all__ = [
    "AcceptanceRule",
    "GreedyAcceptance",
    "RejectionSampler",
    "TypicalAcceptanceSampler",
    "greedy_accept",
    "rejection_sample",
    "typical_accept",
]
