"""What the methods whose drafter reads the target's hidden states share ("eagle", "eagle3",
"dflash"): the drafter, loaded from its directory (LLM(draft_model=...)), shares the target's native
forward (its embedding, lm_head and features), so the target is neither precompiled nor quantized,
runs on one rank, and must be a NativeCausalLM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from speculative.methods.registry import BuildContext, MethodConfig

if TYPE_CHECKING:
    from speculative.models.llama import NativeCausalLM


class HeadConfig(MethodConfig):
    """A method whose drafter is a head on the target's native forward. drafter: what its directory
    holds, as its errors name it ("the EAGLE head")."""

    uses_draft_model: ClassVar[bool] = True
    reads_hidden_states: ClassVar[bool] = True
    drafter: ClassVar[str]

    def check(self, method: str, arguments: dict[str, Any]) -> None:
        super().check(method, arguments)
        if (
            not isinstance(arguments["draft_model"], str)
            or arguments.get("precompile")
            or arguments.get("quantization")
        ):
            raise ValueError(
                f'SpeculativeConfig(method="{method}") needs LLM(draft_model=<{self.drafter}\'s '
                "directory>) and a target that is neither precompiled nor quantized"
            )
        if arguments.get("tensor_parallel_size", 1) > 1:
            raise ValueError(
                f'SpeculativeConfig(method="{method}") does not run with tensor_parallel_size > 1 yet'
            )

    @staticmethod
    def native_target(context: BuildContext) -> NativeCausalLM:
        """The target's native forward, which the drafter shares (under a compiled target's wrapper)."""
        from speculative.models.base import CompiledDrafting
        from speculative.models.llama import NativeCausalLM

        native = context.target.model
        native = native.model if isinstance(native, CompiledDrafting) else native
        if not isinstance(native, NativeCausalLM):
            raise ValueError(
                f'SpeculativeConfig(method="{context.config.method}") needs the native forward for the '
                f"target (model types llama, mistral, qwen2, qwen3); got {type(native).__name__}"
            )
        return native
