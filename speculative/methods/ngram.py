"""The "ngram" method: prompt lookup (speculative/proposers/ngram.py), no model."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

from speculative.fields import check, is_int
from speculative.methods.registry import BuildContext, Built, MethodConfig, register


@register("ngram")
@dataclass
class NgramConfig(MethodConfig):
    """Prompt lookup's options (vLLM's names): the n-gram sizes tried, longest first.
    prompt_lookup_min: >= 1. prompt_lookup_max: >= prompt_lookup_min.
    With SpeculativeConfig.tree, either kind merges every match's continuation into a trie."""

    prompt_lookup_min: int = field(default=1, metadata={"help": "the shortest n-gram looked up"})
    prompt_lookup_max: int = field(default=3, metadata={"help": "the longest n-gram looked up"})

    model_free: ClassVar[bool] = True
    suited_tree: ClassVar[str] = "static"

    def __post_init__(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        _check(is_int(low) and low >= 1, "prompt_lookup_min", low, "an integer >= 1")
        _check(
            is_int(high) and high >= low,
            "prompt_lookup_max",
            high,
            f"an integer >= prompt_lookup_min ({low})",
        )

    def build(self, context: BuildContext) -> Built:
        from speculative.proposers.ngram import NgramProposer

        nodes = context.config.tree_nodes if context.config.tree else None
        return Built(NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max, nodes))


_check = functools.partial(check, owner="NgramConfig")
