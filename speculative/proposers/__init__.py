"""Proposers: whatever proposes draft tokens, behind one interface."""

from speculative.proposers.base import (
    FeatureProposer,
    IntakeTimingProposer,
    LearningProposer,
    PrefixCachingProposer,
    Proposal,
    Proposer,
)
from speculative.proposers.cross_tokenizer import CrossTokenizerProposer
from speculative.proposers.draft_model import DraftModelProposer
from speculative.proposers.draft_tree import DraftTreeProposer
from speculative.proposers.draft_with_lookup import DraftWithLookupProposer
from speculative.proposers.drafter import Drafter, DraftOut
from speculative.proposers.eagle import EagleProposer
from speculative.proposers.eagle_tree import EagleTreeProposer
from speculative.proposers.ngram import NgramProposer
from speculative.proposers.suffix import SuffixProposer

__all__ = [
    "CrossTokenizerProposer",
    "DraftModelProposer",
    "DraftOut",
    "DraftTreeProposer",
    "DraftWithLookupProposer",
    "Drafter",
    "EagleProposer",
    "EagleTreeProposer",
    "FeatureProposer",
    "IntakeTimingProposer",
    "LearningProposer",
    "NgramProposer",
    "PrefixCachingProposer",
    "Proposal",
    "Proposer",
    "SuffixProposer",
]
