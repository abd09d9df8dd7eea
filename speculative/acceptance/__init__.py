"""Acceptance rules for speculative decoding: lossless rejection sampling (greedy acceptance on
greedy rows) and typical acceptance (not lossless), each an AcceptanceRule (`verify`) over a pure
tensor function (greedy_accept, rejection_sample, typical_accept). Token-id outputs are int64
[B, k+1]: accepted drafts, one more token, then -1 padding. Over token trees (`verify_tree`;
speculative.acceptance.tree) the same layout at width M, with the accepted path's node indices
beside it."""

from .base import AcceptanceRule
from .greedy import greedy_accept
from .rejection import RejectionSampler, rejection_sample
from .tree import (
    assemble_tree_output,
    path_from_mask,
    tree_greedy_accept,
    tree_rejection_sample,
    tree_typical_accept,
)
from .typical import TypicalAcceptanceSampler, typical_accept

__all__ = [
    "AcceptanceRule",
    "RejectionSampler",
    "TypicalAcceptanceSampler",
    "assemble_tree_output",
    "greedy_accept",
    "path_from_mask",
    "rejection_sample",
    "tree_greedy_accept",
    "tree_rejection_sample",
    "tree_typical_accept",
    "typical_accept",
]
