"""Engine configuration dataclasses, validated at construction."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal

from speculative.fields import DictRoundTrip, check, is_int
from speculative.sampling_params import SamplingParams


@dataclass
class SpeculativeConfig:
    """How the engine speculates (vLLM's `speculative_config`).

    method: "draft_model" (a small model, `LLM(draft_model=...)`), "ngram" (prompt lookup), "suffix"
        (suffix decoding over the request and past responses, speculative/proposers/suffix.py), or
        "eagle" / "eagle3": an EAGLE-1 / EAGLE-3 head (`LLM(draft_model=<its directory>)`) drafting a
        chain or a tree from the target's hidden states (models/eagle.py; the native forward; with
        `compile`, a greedy chain's or a tree's whole drafting is one compiled call of the head).
    num_speculative_tokens: k, tokens proposed per step. 1 <= k <= 32.
    acceptance: "rejection" (lossless: the output follows the target's distribution exactly) or
        "typical" (Medusa's typical acceptance: faster at temperature > 0, NOT lossless).
    posterior_threshold: typical acceptance's upper bound on the acceptance threshold. [0, 1].
    posterior_alpha: typical acceptance's entropy scale: threshold = min(posterior_threshold,
        posterior_alpha * exp(-entropy)). >= 0.
    prompt_lookup_min / prompt_lookup_max: n-gram sizes tried by the "ngram" method, longest first.
        1 <= min <= max.
    adaptive: choose k per step in [0, num_speculative_tokens] from the measured acceptance and
        step times (`speculative.engine.draft_length`); 0 switches speculation off where it does not
        pay. The output stays exact, but a seeded sampled request's text then depends on timing.
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
    suffix_decoding_max_tree_depth: the "suffix" tries' depth: a match's tokens plus its proposal's.
        [2, 256].
    suffix_decoding_max_cached_requests: past responses the "suffix" global cache holds (the oldest
        evicted first); 0 disables it. >= 0. With the cache, a seeded sampled request's drafts, and
        so its text, depend on the responses cached before it (its distribution stays exact).
    suffix_decoding_max_spec_factor: a "suffix" proposal is at most this times its match's length
        deep (and k). > 0.
    suffix_decoding_min_token_prob: the least estimated probability (frequency shares multiplied down
        the path) a "suffix" draft needs. [0, 1].
    """

    method: Literal["draft_model", "ngram", "suffix", "eagle", "eagle3"] = "draft_model"
    num_speculative_tokens: int = 4
    acceptance: Literal["rejection", "typical"] = "rejection"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    adaptive: bool = False
    tree: Literal["static", "dynamic"] | None = None
    tree_width: int = 2
    tree_nodes: int = 8
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        _check(
            self.method in ("draft_model", "ngram", "suffix", "eagle", "eagle3"),
            "method",
            self.method,
            '"draft_model", "ngram", "suffix", "eagle" or "eagle3"',
        )

        k = self.num_speculative_tokens
        _check(is_int(k) and 1 <= k <= 32, "num_speculative_tokens", k, "an integer in [1, 32]")
        _check(
            self.acceptance in ("rejection", "typical"),
            "acceptance",
            self.acceptance,
            '"rejection" or "typical"',
        )
        _check(
            isinstance(self.posterior_threshold, (int, float)) and 0 <= self.posterior_threshold <= 1,
            "posterior_threshold",
            self.posterior_threshold,
            "in [0, 1]",
        )
        _check(
            isinstance(self.posterior_alpha, (int, float)) and self.posterior_alpha >= 0,
            "posterior_alpha",
            self.posterior_alpha,
            ">= 0",
        )
        _check(
            is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
            "prompt_lookup_min",
            self.prompt_lookup_min,
            "an integer >= 1",
        )
        _check(
            is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            self.prompt_lookup_max,
            f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})",
        )
        _check(isinstance(self.adaptive, bool), "adaptive", self.adaptive, "True or False")
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
        depth = self.suffix_decoding_max_tree_depth
        _check(
            is_int(depth) and 2 <= depth <= 256,
            "suffix_decoding_max_tree_depth",
            depth,
            "an integer in [2, 256]",
        )
        cached = self.suffix_decoding_max_cached_requests
        _check(
            is_int(cached) and cached >= 0, "suffix_decoding_max_cached_requests", cached, "an integer >= 0"
        )
        factor = self.suffix_decoding_max_spec_factor
        _check(
            isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0,
            "suffix_decoding_max_spec_factor",
            factor,
            "a number > 0",
        )
        prob = self.suffix_decoding_min_token_prob
        _check(
            isinstance(prob, (int, float)) and not isinstance(prob, bool) and 0 <= prob <= 1,
            "suffix_decoding_min_token_prob",
            prob,
            "in [0, 1]",
        )


_check = functools.partial(check, owner="SpeculativeConfig")


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
