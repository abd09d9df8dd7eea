"""The "draft_model" method: a small model drafts, a chain (DraftModelProposer) or a tree
(DraftTreeProposer), or a chain with prompt lookup first (DraftWithLookupProposer, `prompt_lookup_min`);
a draft with a tokenizer of its own drafts across tokenizers (CrossTokenizerProposer: chains only; no
compile, precompile or tensor parallelism)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from speculative.fields import check, is_int
from speculative.methods.registry import (
    BuildContext,
    Built,
    MethodConfig,
    check_draft_model,
    drafter_compiled,
    register,
    require_tree_forward,
)

if TYPE_CHECKING:
    from speculative.models.loading import LoadedModel
    from speculative.proposers.cross_tokenizer import CrossTokenizerProposer
    from speculative.proposers.draft_model import DraftModelProposer
    from speculative.proposers.draft_with_lookup import DraftWithLookupProposer


@register("draft_model")
@dataclass
class DraftModelConfig(MethodConfig):
    """A draft model (LLM(draft_model=...), with draft_dtype, draft_tokenizer and draft_quantization)
    proposes.

    prompt_lookup_min: 0 (the draft alone) or an integer >= 1: each step, a row whose last
    prompt_lookup_min to prompt_lookup_max tokens occur earlier in its context proposes what followed
    the most recent such match (the "ngram" method's chain) instead of the draft's tokens
    (proposers/draft_with_lookup.py); chains only, a draft sharing the target's tokenizer. Where LLM
    builds the config, a draft model's folder may set it (config.with_draft_defaults).
    prompt_lookup_max: >= max(prompt_lookup_min, 1).
    num_assistant_tokens: with prompt_lookup_min, the draft's own chain drafts at most this many tokens
        a step while a lookup match proposes up to num_speculative_tokens (transformers' name for an
        assistant model's tokens a step): a weak draft's drafts pay only near the front of a chain,
        a lookup's repeat whole phrases. 0: num_speculative_tokens for both. [0, 32]."""

    prompt_lookup_min: int = field(default=0, metadata={"help": "the shortest n-gram looked up"})
    prompt_lookup_max: int = field(default=3, metadata={"help": "the longest n-gram looked up"})
    num_assistant_tokens: int = field(
        default=0,
        metadata={"help": "with prompt lookup: the draft's own chain at most this long (0: k)"},
    )

    uses_draft_model: ClassVar[bool] = True
    compiles_drafter: ClassVar[bool] = True

    def __post_init__(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        _check(is_int(low) and low >= 0, "prompt_lookup_min", low, "0 (off) or an integer >= 1")
        _check(
            is_int(high) and high >= max(low, 1),
            "prompt_lookup_max",
            high,
            f"an integer >= prompt_lookup_min ({max(low, 1)})",
        )
        own = self.num_assistant_tokens
        _check(is_int(own) and 0 <= own <= 32, "num_assistant_tokens", own, "an integer in [0, 32]")
        _check(
            not own or low,
            "num_assistant_tokens",
            own,
            "0 without prompt_lookup_min (the draft's chain is then num_speculative_tokens long)",
        )

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
        quantization = given["draft_quantization"] or given["quantization"]
        quantize_model(draft.model, quantization, "draft model", dtype_name)
        draft.model = prepare_model(draft.model, drafter_compiled(given), given["precompile"])
        if not _same_vocabulary(context.target, draft):
            if self.prompt_lookup_min:
                raise ValueError(
                    "prompt_lookup_min is not supported with a draft model that has its own tokenizer "
                    "(the lookup proposes the target's tokens); use prompt_lookup_min=0"
                )
            return Built(_cross_tokenizer_proposer(context, draft), draft, shares_tokens=False)
        config = context.config
        if self.prompt_lookup_min:
            proposer = self._with_lookup(config, DraftModelProposer(draft.model))
            return Built(proposer, draft, shares_tokens=True)
        if config.tree is None:
            return Built(DraftModelProposer(draft.model), draft, shares_tokens=True)
        require_tree_forward(draft.model, "draft model")
        tree = DraftTreeProposer(draft.model, config.tree, config.tree_width, config.tree_nodes)
        return Built(tree, draft, shares_tokens=True)

    def _with_lookup(self, config: Any, draft: DraftModelProposer) -> DraftWithLookupProposer:
        """The draft's chains with prompt lookup first; a ValueError naming `tree` for a tree."""
        if config.tree is not None:
            raise ValueError(
                "SpeculativeConfig.tree is not supported with prompt_lookup_min (a draft model with prompt "
                "lookup proposes chains); use tree=None"
            )
        from speculative.proposers.draft_with_lookup import DraftWithLookupProposer
        from speculative.proposers.ngram import NgramProposer

        lookup = NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)
        return DraftWithLookupProposer(draft, lookup, self.num_assistant_tokens or None)


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
    arguments = context.arguments
    for name, given in (
        ("compile", arguments["compile"]),
        ("draft_compile", arguments.get("draft_compile")),
        ("precompile", arguments["precompile"] is not None),
        ("tensor_parallel_size", context.group is not None),
    ):
        if given:
            raise ValueError(
                f"{name} is not supported with a draft model that has its own tokenizer (drafting across "
                "tokenizers)"
            )
    from speculative.proposers.cross_tokenizer import CrossTokenizerProposer

    return CrossTokenizerProposer(draft.model, draft.tokenizer, context.target.tokenizer)


_check = functools.partial(check, owner="DraftModelConfig")
