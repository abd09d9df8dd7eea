"""The "self_draft" method: the target drafts for itself through a copy of its own weights quantized
(LLM(draft_quantization=...), w8a8 by default), on the target's own KV cache (SelfDraftProposer). No
draft model to give, train or load, and no draft cache: the copy adds its quantized weights alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from speculative.methods.registry import (
    BuildContext,
    Built,
    MethodConfig,
    check_draft_model,
    drafter_compiled,
    register,
)


@register("self_draft")
@dataclass
class SelfDraftConfig(MethodConfig):
    """A quantized copy of the target proposes chains of k tokens on the target's KV cache; no options.
    The target runs the native forward on a CPU (the quantized kernels are CPU ones), unquantized (the
    copy is made from its float weights), on one rank and not precompiled; LLM(draft_quantization=...)
    is the copy's quantization (default_draft_quantization where it is None), draft_compile compiles
    the copy."""

    default_draft_quantization: ClassVar[str | None] = "w8a8"
    compiles_drafter: ClassVar[bool] = True
    trees: ClassVar[bool] = False

    def check(self, method: str, arguments: dict[str, Any]) -> None:
        check_draft_model(method, False, arguments.get("draft_model"))
        for name, what in (("draft_dtype", "dtype"), ("draft_tokenizer", "tokenizer")):
            if arguments.get(name) is not None:
                raise ValueError(
                    f'{name} is a draft model\'s {what}; SpeculativeConfig(method="{method}") drafts '
                    "with the target's own (drop it)"
                )
        for name, given in (
            ("quantization", arguments.get("quantization") is not None),
            ("precompile", arguments.get("precompile") is not None),
            ("tensor_parallel_size", arguments.get("tensor_parallel_size", 1) > 1),
        ):
            if given:
                raise ValueError(
                    f'SpeculativeConfig(method="{method}") needs a float target on one rank, not '
                    "precompiled (its copy is quantized from the target's float weights and drafts on its "
                    f"cache): drop {name}"
                )

    def build(self, context: BuildContext) -> Built:
        from speculative.models.base import CompiledDrafting
        from speculative.models.compiled import prepare_model
        from speculative.models.llama import NativeCausalLM
        from speculative.models.loading import LoadedModel
        from speculative.proposers.self_draft import SelfDraftProposer

        config, target = context.config, context.target
        if config.tree is not None:
            raise ValueError(
                f'SpeculativeConfig.tree is not supported with method="{config.method}" (the copy drafts '
                "chains); use tree=None"
            )
        native = target.model.model if isinstance(target.model, CompiledDrafting) else target.model
        if not isinstance(native, NativeCausalLM) or native.device.type != "cpu":
            where = type(native).__name__ if not isinstance(native, NativeCausalLM) else f"on {native.device}"
            raise ValueError(
                f'SpeculativeConfig(method="{config.method}") needs the native forward on a CPU for the '
                "target (model types llama, mistral, qwen2, qwen3; its copy's quantized kernels are CPU "
                f"ones); the target runs {where}"
            )
        quantization = context.arguments["draft_quantization"] or self.default_draft_quantization
        copy = prepare_model(native.quantized_copy(quantization), drafter_compiled(context.arguments), None)
        name = f"{target.name} ({quantization} copy)"
        draft = LoadedModel(copy, target.tokenizer, target.eos_token_ids, name, target.dtype)
        return Built(SelfDraftProposer(copy), draft, shares_tokens=True)
