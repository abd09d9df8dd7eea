"""The "eagle" and "eagle3" methods: an EAGLE-1 or EAGLE-3 head (models/eagle.py), loaded from its
checkpoint directory (LLM(draft_model=...)), drafts from the target's hidden states: a chain
(EagleProposer) or EAGLE-2's tree (EagleTreeProposer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from speculative.methods.registry import BuildContext, Built, MethodConfig, register


@register("eagle", "eagle3")
@dataclass
class EagleConfig(MethodConfig):
    """An EAGLE head proposes; no options of its own. The head shares the target's native forward
    (embedding, lm_head, features): the target is neither precompiled nor quantized and runs on one
    rank."""

    uses_draft_model: ClassVar[bool] = True
    reads_hidden_states: ClassVar[bool] = True

    def check(self, method: str, arguments: dict[str, Any]) -> None:
        super().check(method, arguments)
        if (
            not isinstance(arguments["draft_model"], str)
            or arguments.get("precompile")
            or arguments.get("quantization")
        ):
            raise ValueError(
                f'SpeculativeConfig(method="{method}") needs LLM(draft_model=<the EAGLE head\'s directory>) '
                "and a target that is neither precompiled nor quantized"
            )
        if arguments.get("tensor_parallel_size", 1) > 1:
            raise ValueError(
                f'SpeculativeConfig(method="{method}") does not run with tensor_parallel_size > 1 yet'
            )

    def build(self, context: BuildContext) -> Built:
        from speculative.models.base import CompiledDrafting
        from speculative.models.compiled import CompiledCausalLM
        from speculative.models.eagle_checkpoint import load_eagle_head
        from speculative.models.llama import NativeCausalLM
        from speculative.proposers.eagle import EagleProposer
        from speculative.proposers.eagle_tree import EagleTreeProposer

        config, native = context.config, context.target.model
        native = native.model if isinstance(native, CompiledDrafting) else native  # the head shares it
        if not isinstance(native, NativeCausalLM):
            raise ValueError(
                f'SpeculativeConfig(method="{config.method}") needs the native forward for the target '
                f"(model types llama, mistral, qwen2, qwen3); got {type(native).__name__}"
            )
        head = load_eagle_head(context.arguments["draft_model"], config.method, native)
        compiled = (
            CompiledCausalLM(head) if context.arguments["compile"] else None
        )  # a greedy chain's, a tree's drafting
        if config.tree is None:
            return Built(EagleProposer(head, compiled))
        return Built(EagleTreeProposer(head, config.tree, config.tree_width, config.tree_nodes, compiled))
