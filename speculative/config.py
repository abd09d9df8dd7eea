"""Engine configuration dataclasses, validated at construction."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from speculative.fields import DictRoundTrip, check, is_int, is_number
from speculative.methods import MethodConfig, method_config
from speculative.methods.acceptance import RULES
from speculative.sampling_params import SamplingParams


@dataclass
class SpeculativeConfig:
    """How the engine speculates (vLLM's `speculative_config`).

    method: a registered speculative method (speculative/proposers/registry.py): "draft_model" (a small
        model, `LLM(draft_model=...)`), "ngram" (prompt lookup), "suffix" (suffix decoding over the
        request and past responses), or "eagle" / "eagle3": an EAGLE-1 / EAGLE-3 head
        (`LLM(draft_model=<its directory>)`) drafting a chain or a tree from the target's hidden states.
    num_speculative_tokens: k, tokens proposed per step. 1 <= k <= 32. Where LLM builds the config
        (no speculative_config, or a dict without it), a draft model's folder may set it
        (`with_draft_defaults`).
    acceptance: a registered acceptance rule (speculative/acceptance/registry.py): "rejection" (lossless:
        the output follows the target's distribution exactly) or "typical" (Medusa's typical
        acceptance: faster at temperature > 0, NOT lossless).
    posterior_threshold: typical acceptance's upper bound on the acceptance threshold. [0, 1].
    posterior_alpha: typical acceptance's entropy scale: threshold = min(posterior_threshold,
        posterior_alpha * exp(-entropy)). >= 0.
    adaptive: choose k per step in [0, num_speculative_tokens] from the measured acceptance and
        step times (`speculative.engine.draft_length`); 0 switches speculation off where it does not
        pay. The output stays exact, but a seeded sampled request's text then depends on timing.
    disable_by_batch_size: None (speculate at every batch size), or the batch size from which a step
        decodes plainly: a step of at least this many running rows drafts nothing (vLLM's option of
        the name), whatever k or `adaptive` would choose. Under load a verification of k + 1 tokens
        a row is a large forward, and a row whose drafts are all rejected waits for it to get one
        token: the guard keeps plain decoding's inter-token latency where the batch is that large.
        An integer >= 2.
    tree: None (a chain of k drafts), or a token tree of depth <= k verified in one forward:
        "dynamic" (the draft model's or EAGLE head's tree follows its confidence, as EAGLE-2's) or
        "static" (a fixed topology); for "ngram" either one merges every match's continuation into a
        trie, for "suffix" either one takes the most frequent continuations. Trees need the native
        forward (model types llama, mistral, qwen2, qwen3) and exclude `adaptive`.
    tree_width: a draft-model tree's candidates per expanded node and nodes expanded per depth. [1, 16].
    tree_nodes: drafts per tree. [1, 128]. Both are a row's at batch 1: a greedy batch of B rows grows
        trees of width tree_width // B (n-gram and suffix tries: of breadth up to their nodes) and
        tree_nodes // B nodes (at least the batch-1 tree's chain; tree.py's batch_tree), and chains,
        verified as such, where that leaves width 1 or no more nodes than the chain. A sampled batch
        keeps its trees, so that a seeded row's draws never depend on its neighbours.
    options: the method's own options, an instance of its MethodConfig (NgramConfig's prompt_lookup_min
        and _max, SuffixConfig's suffix_decoding_*; the others have none); None: the method's defaults.

    `from_dict` takes vLLM's flat form, the method's options beside the rest:
    `SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 5})`, as does
    `LLM(speculative_config=...)`.
    """

    method: str = "draft_model"
    num_speculative_tokens: int = 4
    acceptance: str = "rejection"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    adaptive: bool = False
    disable_by_batch_size: int | None = None
    tree: Literal["static", "dynamic"] | None = None
    tree_width: int = 2
    tree_nodes: int = 8
    options: MethodConfig | None = None

    def __post_init__(self) -> None:
        options = method_config(self.method)
        if self.options is None:
            self.options = options()
        _check(
            isinstance(self.options, options),
            "options",
            self.options,
            f'a {options.__name__} (method "{self.method}"\'s options) or None',
        )
        k = self.num_speculative_tokens
        _check(is_int(k) and 1 <= k <= 32, "num_speculative_tokens", k, "an integer in [1, 32]")
        _check(
            self.acceptance in RULES,
            "acceptance",
            self.acceptance,
            "one of " + ", ".join(f'"{name}"' for name in RULES),
        )
        _check(
            is_number(self.posterior_threshold) and 0 <= self.posterior_threshold <= 1,
            "posterior_threshold",
            self.posterior_threshold,
            "in [0, 1]",
        )
        _check(
            is_number(self.posterior_alpha) and self.posterior_alpha >= 0,
            "posterior_alpha",
            self.posterior_alpha,
            ">= 0",
        )
        _check(isinstance(self.adaptive, bool), "adaptive", self.adaptive, "True or False")
        limit = self.disable_by_batch_size
        _check(
            limit is None or (is_int(limit) and limit >= 2),
            "disable_by_batch_size",
            limit,
            "None or an integer >= 2",
        )
        _check(self.tree in (None, "static", "dynamic"), "tree", self.tree, 'None, "static" or "dynamic"')
        _check(not (self.tree and self.adaptive), "adaptive", self.adaptive, "False with a tree")
        _check(
            is_int(self.tree_width) and 1 <= self.tree_width <= 16,
            "tree_width",
            self.tree_width,
            "an integer in [1, 16]",
        )
        _check(
            is_int(self.tree_nodes) and 1 <= self.tree_nodes <= 128,
            "tree_nodes",
            self.tree_nodes,
            "an integer in [1, 128]",
        )

    def to_dict(self) -> dict[str, Any]:
        """vLLM's flat form: the fields, the method's options among them."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return {**data, **self.options.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """The inverse of to_dict: the method's options may sit beside the other fields (vLLM's form). A
        key that is neither a field nor an option of the method is a ValueError naming it."""
        data = dict(data)
        options = method_config(data.get("method", "draft_model"))
        own = {f.name for f in dataclasses.fields(options)}
        given = options.from_dict({name: data.pop(name) for name in list(data) if name in own})
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "options"]
        if unknown := sorted(set(data) - set(fields)):
            raise ValueError(
                f"SpeculativeConfig has no field(s) {unknown}: the fields are {fields}, and method "
                f"{data.get('method', 'draft_model')!r} takes the options {sorted(own)}"
            )
        return cls(**data, options=given)


_check = functools.partial(check, owner="SpeculativeConfig")

# transformers' field for the tokens an assistant (draft) model drafts per step, in its generation config
DECLARED_K = "num_assistant_tokens"
# ours, beside it: the draft's prompt lookup first (DraftModelConfig.prompt_lookup_min; 0: none)
DECLARED_LOOKUP = "prompt_lookup_min"
# transformers' field for the tokens a prompt lookup proposes per step: with the lookup on, its chain
# may be longer than the draft's own (DraftModelConfig.num_assistant_tokens)
DECLARED_LOOKUP_K = "prompt_lookup_num_tokens"


def with_draft_defaults(data: dict[str, Any], draft_model: object) -> dict[str, Any]:
    """SpeculativeConfig.from_dict's `data`, with what a draft model's folder declares where `data` gives
    none and its method is "draft_model", which the one who trained the draft measured as what pays:
    num_speculative_tokens, as `num_assistant_tokens` in its generation_config.json (the field
    transformers' assisted generation reads), and DraftModelConfig's prompt_lookup_min, as
    `prompt_lookup_min` there, for chains (SpeculativeConfig's defaults where the draft is not a folder
    or its file sets none). Where the lookup is on and the file also says `prompt_lookup_num_tokens`
    (transformers' field for a lookup's tokens a step) above `num_assistant_tokens`, the lookup's
    chain is that long (num_speculative_tokens) and the draft's its own (DraftModelConfig's
    num_assistant_tokens); where `data` gives the draft's own chain, k is the longer of the two. A
    ValueError naming the file where such a value is out of range ([1, 32];
    0 or more)."""
    if data.get("method", "draft_model") != "draft_model":
        return data
    path = Path(draft_model) / "generation_config.json" if isinstance(draft_model, (str, Path)) else None
    if path is None or not path.is_file():
        return data
    declared = json.loads(path.read_text(encoding="utf-8"))
    k, low, longer = (declared.get(name) for name in (DECLARED_K, DECLARED_LOOKUP, DECLARED_LOOKUP_K))
    if low is not None and DECLARED_LOOKUP not in data and data.get("tree") is None:  # lookup: chains
        check(is_int(low) and low >= 0, DECLARED_LOOKUP, low, "0 (off) or an integer >= 1", str(path))
        data = {**data, DECLARED_LOOKUP: low}
    if k is not None and "num_speculative_tokens" not in data:
        check(is_int(k) and 1 <= k <= 32, DECLARED_K, k, "an integer in [1, 32]", str(path))
        data = {**data, "num_speculative_tokens": k}
        if longer is not None and data.get(DECLARED_LOOKUP):
            check(
                is_int(longer) and 1 <= longer <= 32,
                DECLARED_LOOKUP_K,
                longer,
                "an integer in [1, 32]",
                str(path),
            )
            given = data.get(DECLARED_K)  # the draft's own chain as the user asked (0: the whole k)
            chain = max(longer, k if given is None else given)
            if chain > k:
                data = {**data, "num_speculative_tokens": chain, DECLARED_K: k if given is None else given}
    return data


@dataclass
class ParallelConfig:
    """How the models are split over processes: tensor parallelism (speculative/distributed/).

    tensor_parallel_size: the ranks the target's attention heads, key/value heads and MLP columns are
        split over (Megatron-LM's split, models/tensor_parallel.py); 1: one process, nothing split.
        It must divide the target's heads, key/value heads and MLP columns (LLM names the values that
        do); a target on transformers' forward is split by transformers' own tensor parallelism
        (models/hf_tensor_parallel.py), where it has a plan for the model type. >= 1.
    draft_tensor_parallel_size: 1 (the whole draft model on every rank, the default: a small draft
        gains less from the split than its collectives cost) or tensor_parallel_size (split as the
        target).
    """

    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        check(is_int(size) and size >= 1, "tensor_parallel_size", size, "an integer >= 1", "ParallelConfig")
        draft = self.draft_tensor_parallel_size
        check(
            is_int(draft) and draft in (1, size),
            "draft_tensor_parallel_size",
            draft,
            f"1 or tensor_parallel_size ({size})",
            "ParallelConfig",
        )


@dataclass
class GenerationConfig(DictRoundTrip):
    """How `LLM.stream` runs a generation (after EasyDeL's vInferenceConfig).

    max_new_tokens: tokens generated at most per sequence (sets SamplingParams.max_tokens). >= 1.
    streaming_chunks: target steps per yielded SampleState. >= 1.
    num_return_sequences: sequences per prompt (sets SamplingParams.n). >= 1.
    pad_token_id: the id `SampleState.padded` pads with (default 0).
    bos_token_id: prepended to every prompt that does not start with it; None adds nothing.
    eos_token_id: one id or several that end a sequence, replacing the model's; None keeps the model's.
    sampling_params: the rest of the sampling parameters (default: SamplingParams()).
    """

    max_new_tokens: int = 64
    streaming_chunks: int = 16
    num_return_sequences: int = 1
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sampling_params: SamplingParams | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "streaming_chunks", "num_return_sequences"):
            value = getattr(self, name)
            _check(is_int(value) and value >= 1, name, value, "an integer >= 1", owner="GenerationConfig")
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            _check(
                value is None or (is_int(value) and value >= 0),
                name,
                value,
                "None or an integer >= 0",
                owner="GenerationConfig",
            )
        eos = self.eos_token_id
        _check(
            eos is None
            or (is_int(eos) and eos >= 0)
            or (isinstance(eos, (list, tuple)) and eos and all(is_int(t) and t >= 0 for t in eos)),
            "eos_token_id",
            eos,
            "None, an integer >= 0 or a non-empty list of them",
            owner="GenerationConfig",
        )
        _check(
            self.sampling_params is None or isinstance(self.sampling_params, SamplingParams),
            "sampling_params",
            self.sampling_params,
            "a SamplingParams or None",
            owner="GenerationConfig",
        )

    @property
    def eos_token_ids(self) -> list[int] | None:
        """eos_token_id as a list, or None."""
        eos = self.eos_token_id
        return None if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def request_params(self) -> SamplingParams:
        """The SamplingParams each prompt runs with."""
        base = self.sampling_params or SamplingParams()
        return dataclasses.replace(
            base,
            max_tokens=self.max_new_tokens,
            n=self.num_return_sequences,
            best_of=None if base.best_of is None else max(base.best_of, self.num_return_sequences),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, sampling_params as its own to_dict."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.sampling_params is not None:
            data["sampling_params"] = self.sampling_params.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationConfig:
        """The inverse of to_dict."""
        data = dict(data)
        if data.get("sampling_params") is not None:
            data["sampling_params"] = SamplingParams.from_dict(data["sampling_params"])
        return super().from_dict(data)
