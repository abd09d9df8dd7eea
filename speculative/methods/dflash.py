"""The "dflash" method: a DFlash block drafter (models/dflash.py), loaded from its directory
(LLM(draft_model=...)), drafts a chain of k tokens in one forward from the target's hidden states
(DFlashProposer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from speculative.methods.registry import BuildContext, Built, MethodConfig, register


@register("dflash")
@dataclass
class DFlashConfig(MethodConfig):
    """A DFlash block drafter proposes k tokens in one forward; no options of its own (the block size is
    the drafter's). It shares the target's native forward (embedding, lm_head, features): the target is
    neither precompiled nor quantized and runs on one rank; chains only (no tree), k below the block."""

    uses_draft_model: ClassVar[bool] = True
    reads_hidden_states: ClassVar[bool] = True
    trees: ClassVar[bool] = False

    def check(self, method: str, arguments: dict[str, Any]) -> None:
        super().check(method, arguments)
        if (
            not isinstance(arguments["draft_model"], str)
            or arguments.get("precompile")
            or arguments.get("quantization")
        ):
            raise ValueError(
                f'SpeculativeConfig(method="{method}") needs LLM(draft_model=<the DFlash drafter\'s '
                "directory>) and a target that is neither precompiled nor quantized"
            )
        if arguments.get("tensor_parallel_size", 1) > 1:
            raise ValueError(
                f'SpeculativeConfig(method="{method}") does not run with tensor_parallel_size > 1 yet'
            )

    def build(self, context: BuildContext) -> Built:
        from speculative.models.base import CompiledDrafting
        from speculative.models.dflash import load_dflash
        from speculative.models.llama import NativeCausalLM
        from speculative.proposers.dflash import DFlashProposer

        config, native = context.config, context.target.model
        native = native.model if isinstance(native, CompiledDrafting) else native  # the drafter shares it
        if not isinstance(native, NativeCausalLM):
            raise ValueError(
                f'SpeculativeConfig(method="{config.method}") needs the native forward for the target '
                f"(model types llama, mistral, qwen2, qwen3); got {type(native).__name__}"
            )
        if config.tree is not None:
            raise ValueError(
                f'SpeculativeConfig(method="{config.method}") drafts chains only: tree must be None'
            )
        drafter = load_dflash(context.arguments["draft_model"], native)
        k = config.num_speculative_tokens
        if k > drafter.block_size - 1:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens must be at most the DFlash drafter's block_size "
                f"- 1 = {drafter.block_size - 1}; got {k}"
            )
        return Built(DFlashProposer(drafter))
