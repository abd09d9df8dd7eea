"""The "eagle" and "eagle3" methods: an EAGLE-1 or EAGLE-3 head (models/eagle.py), loaded from its
checkpoint directory (LLM(draft_model=...)), drafts from the target's hidden states: a chain
(EagleProposer) or EAGLE-2's tree (EagleTreeProposer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speculative.methods.heads import HeadConfig
from speculative.methods.registry import BuildContext, Built, drafter_compiled, register


@register("eagle", "eagle3")
@dataclass
class EagleConfig(HeadConfig):
    """An EAGLE head proposes; no options of its own. The head shares the target's native forward
    (embedding, lm_head, features): the target is neither precompiled nor quantized and runs on one
    rank."""

    drafter: ClassVar[str] = "the EAGLE head"
    compiles_drafter: ClassVar[bool] = True

    def build(self, context: BuildContext) -> Built:
        from speculative.models.compiled import CompiledCausalLM
        from speculative.models.eagle_checkpoint import load_eagle_head
        from speculative.proposers.eagle import EagleProposer
        from speculative.proposers.eagle_tree import EagleTreeProposer

        config, native = context.config, self.native_target(context)
        head = load_eagle_head(context.arguments["draft_model"], config.method, native)
        # a greedy chain's, a tree's drafting
        compiled = CompiledCausalLM(head) if drafter_compiled(context.arguments) else None
        if config.tree is None:
            return Built(EagleProposer(head, compiled))
        return Built(EagleTreeProposer(head, config.tree, config.tree_width, config.tree_nodes, compiled))
