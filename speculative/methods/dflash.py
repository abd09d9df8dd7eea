"""The "dflash" method: a DFlash block drafter (models/dflash.py), loaded from its directory
(LLM(draft_model=...)), drafts a chain of k tokens, or a tree k deep, in one forward from the
target's hidden states (DFlashProposer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speculative.methods.heads import HeadConfig
from speculative.methods.registry import BuildContext, Built, register


@register("dflash")
@dataclass
class DFlashConfig(HeadConfig):
    """A DFlash block drafter proposes k tokens (a chain, or a tree of depth k) in one forward; no
    options of its own (the block size is the drafter's). It shares the target's native forward
    (embedding, lm_head, features): the target is neither precompiled nor quantized and runs on one
    rank; k below the block."""

    drafter: ClassVar[str] = "the DFlash drafter"

    def build(self, context: BuildContext) -> Built:
        from speculative.models.dflash_checkpoint import load_dflash
        from speculative.proposers.dflash import DFlashProposer

        config, native = context.config, self.native_target(context)
        drafter = load_dflash(context.arguments["draft_model"], native)
        k = config.num_speculative_tokens
        if k > drafter.block_size - 1:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens must be at most the DFlash drafter's block_size "
                f"- 1 = {drafter.block_size - 1}; got {k}"
            )
        return Built(DFlashProposer(drafter, config.tree, config.tree_width, config.tree_nodes))
