"""The "draft_model" method: a small model drafts, a chain (DraftModelProposer) or a tree
(DraftTreeProposer); a draft with a tokenizer of its own drafts across tokenizers (CrossTokenizerProposer:
chains only; no compile, precompile or tensor parallelism)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from speculative.methods.registry import (
    BuildContext,
    Built,
    MethodConfig,
    check_draft_model,
    register,
    require_tree_forward,
)

if TYPE_CHECKING:
    from speculative.models.loading import LoadedModel
    from speculative.proposers.cross_tokenizer import CrossTokenizerProposer


@register("draft_model")
@dataclass
class DraftModelConfig(MethodConfig):
    """A draft model (LLM(draft_model=...), with draft_dtype and draft_tokenizer) proposes; no options
    of its own."""

    uses_draft_model: ClassVar[bool] = True

    def check(self, method: str, arguments: dict[str, Any]) -> None:
        check_draft_model(method, True, arguments.get("draft_model"))
        if arguments.get("draft_dtype") is not None:
            from speculative.models.dtypes import check_dtype

            check_dtype(arguments["draft_dtype"], "draft_dtype")

    def build(self, context: BuildContext) -> Built:
        from speculative.models.compiled import prepare_model
        from speculative.models.draft_vocabulary import apply_draft_vocabulary
        from speculative.models.loading import load_model, quantize_model
        from speculative.proposers.draft_model import DraftModelProposer
        from speculative.proposers.draft_tree import DraftTreeProposer

        given = context.arguments
        dtype_name = "dtype" if given["draft_dtype"] is None else "draft_dtype"
        draft = load_model(
            given["draft_model"],
            given[dtype_name],
            context.device,
            given["model_impl"],
            given["draft_tokenizer"],
            dtype_name=dtype_name,
            tensor_parallel=context.group if given["draft_tensor_parallel_size"] > 1 else None,
            tensor_parallel_name="draft_tensor_parallel_size",
        )
        apply_draft_vocabulary(draft.model, given["draft_model"])
        quantize_model(draft.model, given["quantization"], "draft model", dtype_name)
        draft.model = prepare_model(draft.model, given["compile"], given["precompile"])
        if not _same_vocabulary(context.target, draft):
            return Built(_cross_tokenizer_proposer(context, draft), draft, shares_tokens=False)
        config = context.config
        if config.tree is None:
            return Built(DraftModelProposer(draft.model), draft, shares_tokens=True)
        require_tree_forward(draft.model, "draft model")
        tree = DraftTreeProposer(draft.model, config.tree, config.tree_width, config.tree_nodes)
        return Built(tree, draft, shares_tokens=True)


def _same_vocabulary(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether the draft shares the target's vocabulary: the same size and, where both have a tokenizer,
    the same tokenizer vocabulary (a draft of another size where one has no tokenizer is a ValueError:
    it cannot draft across tokenizers)."""
    vt, vd = target.model.vocab_size, draft.model.vocab_size
    if target.tokenizer is not None and draft.tokenizer is not None:
        return vt == vd and target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    if vt != vd:
        raise ValueError(
            f"the draft model's vocabulary ({vd} tokens) differs from the target's ({vt}) and the "
            f"{'draft' if draft.tokenizer is None else 'target'} has no tokenizer: drafting across "
            "tokenizers needs both (give LLM(tokenizer=...) or a draft directory with its tokenizer)"
        )
    return True


def _cross_tokenizer_proposer(context: BuildContext, draft: LoadedModel) -> CrossTokenizerProposer:
    """The proposer of a draft with its own tokenizer: a chain, without compile, precompile or tensor
    parallelism (a ValueError naming the argument)."""
    if context.config.tree is not None:
        raise ValueError(
            "SpeculativeConfig.tree is not supported with a draft model that has its own tokenizer "
            "(drafting across tokenizers proposes chains); use tree=None"
        )
    for name, given in (
        ("compile", context.arguments["compile"]),
        ("precompile", context.arguments["precompile"] is not None),
        ("tensor_parallel_size", context.group is not None),
    ):
        if given:
            raise ValueError(
                f"{name} is not supported with a draft model that has its own tokenizer (drafting across "
                "tokenizers)"
            )
    from speculative.proposers.cross_tokenizer import CrossTokenizerProposer

    return CrossTokenizerProposer(draft.model, draft.tokenizer, context.target.tokenizer)
