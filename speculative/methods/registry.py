"""The registry of speculative methods: name -> the method's MethodConfig.

Imports nothing heavy (no torch), so that the CLI can make flags of every method's options before
anything loads; a method imports its proposers and models in `build`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from speculative.fields import DictRoundTrip

if TYPE_CHECKING:
    import torch

    from speculative.models.base import LanguageModel
    from speculative.models.loading import LoadedModel
    from speculative.proposers.base import Proposer


@dataclass(frozen=True)
class BuildContext:
    """What a method builds its proposer from.

    config: the SpeculativeConfig (its method: the registered name asked for, one MethodConfig may
        serve several, as EagleConfig serves "eagle" and "eagle3"; num_speculative_tokens, tree,
        tree_width, tree_nodes: the shape of the proposals).
    target: the loaded target (its model already quantized and wrapped for compile/precompile).
    arguments: LLM.__init__'s arguments by name, checked (draft_model as given, dtype, draft_dtype,
        model_impl, draft_tokenizer, compile, draft_compile, precompile, quantization, draft_quantization,
        draft_tensor_parallel_size, ...); `drafter_compiled(arguments)` says whether the drafter compiles.
    device: the device the models run on (this rank's). group: this rank's tensor-parallel group (None:
        one process).
    """

    config: Any
    target: LoadedModel
    arguments: dict[str, Any]
    device: torch.device
    group: Any


@dataclass
class Built:
    """A method's proposer and its draft model. draft: the loaded draft model (None: the method has
    none); shares_tokens: whether the draft reads the target's token ids (then its context length
    bounds the requests', and precompile warms it up with the target)."""

    proposer: Proposer
    draft: LoadedModel | None = None
    shares_tokens: bool = False


class MethodConfig(DictRoundTrip):
    """The options of one speculative method (a dataclass whose fields are the options, each with
    metadata "help", its flag's text, and optionally "aliases", more spellings of the flag), with what
    the method needs (class variables) and how it builds its proposer.

    uses_draft_model: LLM(draft_model=...) is required (True) or refused (False).
    reads_hidden_states: the proposer drafts from the target's hidden states (EAGLE heads): its first
        proposal after a prefill feeds the prompt's features.
    model_free: proposals may come narrower than k on a CPU (n-gram, suffix): a precompiled target
        warms up every width.
    trees: whether the method proposes token trees (SpeculativeConfig.tree); suited_tree: the tree
        kind that suits it ("static" or "dynamic"), the benchmark's choice.
    compiles_drafter: its drafter (a draft model, an EAGLE head) runs compiled where
        `drafter_compiled(arguments)`; LLM(draft_compile=...) is refused for the others.
    default_draft_quantization: the drafter's quantization where LLM(draft_quantization=...) gives none
        and the method quantizes one of its own (the self-draft's copy of the target).
    """

    uses_draft_model: ClassVar[bool] = False
    reads_hidden_states: ClassVar[bool] = False
    model_free: ClassVar[bool] = False
    trees: ClassVar[bool] = True
    suited_tree: ClassVar[str] = "dynamic"
    compiles_drafter: ClassVar[bool] = False
    default_draft_quantization: ClassVar[str | None] = None

    def check(self, method: str, arguments: dict[str, Any]) -> None:
        """Refuse LLM arguments the method cannot run with, before anything loads (a ValueError naming
        the argument). `arguments`: LLM.__init__'s, by name. The base checks that a draft model is given
        where it is used, and refuses the draft model's own dtype, tokenizer and quantization
        (DraftModelConfig takes them) and draft_compile where the method has no drafter that compiles."""
        check_draft_model(method, self.uses_draft_model, arguments.get("draft_model"))
        refuse_draft_options(arguments)
        if not self.compiles_drafter:
            refuse_draft_compile(arguments, f'SpeculativeConfig(method="{method}")')

    def build(self, context: BuildContext) -> Built:
        """The method's proposer (and draft model) for the LLM being built."""
        raise NotImplementedError


def check_draft_model(method: str, used: bool, draft: object) -> None:
    """A ValueError unless LLM(draft_model=...) is given exactly when the method uses one."""
    if used and draft is None:
        raise ValueError(f'SpeculativeConfig(method="{method}") needs LLM(draft_model=...)')
    if not used and draft is not None:
        raise ValueError(f'SpeculativeConfig(method="{method}") uses no draft model; drop draft_model')


def refuse_draft_options(arguments: dict[str, Any]) -> None:
    """A ValueError where LLM's arguments give a draft model's dtype, tokenizer or quantization without
    one."""
    for name, what in (
        ("draft_dtype", "dtype"),
        ("draft_tokenizer", "tokenizer"),
        ("draft_quantization", "quantization"),
    ):
        if arguments.get(name) is not None:
            raise ValueError(f"{name} is the draft model's {what}: give it with a draft_model")


def refuse_draft_compile(arguments: dict[str, Any], what: str) -> None:
    """A ValueError where LLM's arguments set draft_compile for `what`, which has no drafter that
    compiles (no speculation, n-gram lookup, suffix decoding, a DFlash drafter)."""
    if arguments.get("draft_compile") is not None:
        raise ValueError(
            f"draft_compile compiles a draft model or an EAGLE head, and {what} has none: drop draft_compile"
        )


def drafter_compiled(arguments: dict[str, Any]) -> bool:
    """Whether the drafter runs compiled: LLM's draft_compile, or its compile where that is None."""
    given = arguments.get("draft_compile")
    return bool(arguments["compile"] if given is None else given)


def require_tree_forward(model: LanguageModel, which: str = "model") -> None:
    """Trees need a forward that takes them (the native one); a ValueError naming `tree` otherwise."""
    from speculative.models.base import TreeForward, require

    require(model, TreeForward, "SpeculativeConfig.tree", which)


METHODS: dict[str, type[MethodConfig]] = {}
"""The registered methods: name -> MethodConfig subclass (in registration order)."""


def register(*names: str) -> Callable[[type[MethodConfig]], type[MethodConfig]]:
    """Class decorator: register a MethodConfig dataclass under `names` (a name taken twice is a
    ValueError)."""

    def add(cls: type[MethodConfig]) -> type[MethodConfig]:
        if not (dataclasses.is_dataclass(cls) and issubclass(cls, MethodConfig)):
            raise TypeError(f"{cls.__name__} must be a dataclass subclassing MethodConfig")
        for name in names:
            if name in METHODS:
                raise ValueError(f"speculative method {name!r} is registered twice")
            METHODS[name] = cls
        return cls

    return add


def method_config(name: str) -> type[MethodConfig]:
    """The MethodConfig class registered as `name`; a ValueError naming the method and the allowed ones."""
    if name not in METHODS:
        allowed = ", ".join(f'"{m}"' for m in sorted(METHODS))
        raise ValueError(f"SpeculativeConfig.method must be one of {allowed}; got {name!r}")
    return METHODS[name]
