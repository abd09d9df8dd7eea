"""The "suffix" method: suffix decoding (speculative/proposers/suffix.py), no model."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from speculative.fields import check, is_int, is_number
from speculative.methods.registry import BuildContext, Built, MethodConfig, register

if TYPE_CHECKING:
    from speculative.proposers.suffix import SuffixProposer


@register("suffix")
@dataclass
class SuffixConfig(MethodConfig):
    """Suffix decoding's options (vLLM's names).

    suffix_decoding_max_tree_depth: the tries' depth: a match's tokens plus its proposal's. [2, 256].
    suffix_decoding_max_cached_requests: past responses the global cache holds (the oldest evicted
        first); 0 disables it. >= 0. With the cache, a seeded sampled request's drafts, and so its text,
        depend on the responses cached before it (its distribution stays exact).
    suffix_decoding_max_spec_factor: a proposal is at most this times its match's length deep (and k).
        > 0.
    suffix_decoding_min_token_prob: the least estimated probability (frequency shares multiplied down the
        path) a draft needs. [0, 1].
    With SpeculativeConfig.tree, either kind takes the `tree_nodes` most frequent continuations.
    """

    # help: the flag's text; aliases: the flags' earlier spellings, still taken
    suffix_decoding_max_tree_depth: int = field(
        default=24, metadata={"help": "the tries' depth", "aliases": ("--suffix-max-depth",)}
    )
    suffix_decoding_max_cached_requests: int = field(
        default=10000,
        metadata={"help": "past responses cached (0: none)", "aliases": ("--suffix-max-cached-requests",)},
    )
    suffix_decoding_max_spec_factor: float = field(
        default=1.0,
        metadata={
            "help": "drafts at most this times the match's length",
            "aliases": ("--suffix-max-spec-factor",),
        },
    )
    suffix_decoding_min_token_prob: float = field(
        default=0.1,
        metadata={
            "help": "the least estimated probability of a draft",
            "aliases": ("--suffix-min-token-prob",),
        },
    )

    model_free: ClassVar[bool] = True
    suited_tree: ClassVar[str] = "static"

    def __post_init__(self) -> None:
        depth = self.suffix_decoding_max_tree_depth
        _check(
            is_int(depth) and 2 <= depth <= 256,
            "suffix_decoding_max_tree_depth",
            depth,
            "an integer in [2, 256]",
        )
        cached = self.suffix_decoding_max_cached_requests
        _check(
            is_int(cached) and cached >= 0, "suffix_decoding_max_cached_requests", cached, "an integer >= 0"
        )
        factor = self.suffix_decoding_max_spec_factor
        _check(is_number(factor) and factor > 0, "suffix_decoding_max_spec_factor", factor, "a number > 0")
        prob = self.suffix_decoding_min_token_prob
        _check(is_number(prob) and 0 <= prob <= 1, "suffix_decoding_min_token_prob", prob, "in [0, 1]")

    def proposer(self, tree_nodes: int | None = None) -> SuffixProposer:
        """A SuffixProposer with these options: chains, or trees of `tree_nodes` drafts."""
        from speculative.proposers.suffix import SuffixProposer

        return SuffixProposer(
            self.suffix_decoding_max_tree_depth,
            self.suffix_decoding_max_cached_requests,
            self.suffix_decoding_max_spec_factor,
            self.suffix_decoding_min_token_prob,
            tree_nodes,
        )

    def build(self, context: BuildContext) -> Built:
        return Built(self.proposer(context.config.tree_nodes if context.config.tree else None))


_check = functools.partial(check, owner="SuffixConfig")
