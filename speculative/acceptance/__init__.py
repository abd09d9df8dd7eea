"""Acceptance rules for speculative decoding: greedy, lossless rejection sampling,
and typical acceptance (not lossless). Token-id outputs are int64 [B, k+1]:
accepted drafts, one more token, then -1 padding."""

from .greedy import greedy_accept
from .rejection import RejectionSampler, rejection_sample
from .typical import TypicalAcceptanceSampler

__all__ = ["greedy_accept", "rejection_sample", "RejectionSampler", "TypicalAcceptanceSampler"]
