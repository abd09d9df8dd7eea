"""LLM: the public entry point, shaped like vLLM's."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import nullcontext
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from speculative.acceptance import RejectionSampler
from speculative.config import GenerationConfig, ParallelConfig, SpeculativeConfig, with_draft_defaults
from speculative.distributed.draft_length import RankZeroDraftLength
from speculative.distributed.group import TensorParallelGroup, connect
from speculative.distributed.mirror import LeaderEngine
from speculative.engine.engine import Engine
from speculative.engine.inputs import InputProcessor, PromptType
from speculative.engine.outputs import CompletionOutput, RequestOutput
from speculative.engine.sequence import Sequence
from speculative.engine.state import SampleState, unpack_generator
from speculative.fields import check
from speculative.kv_cache import StaticKVCache
from speculative.methods.acceptance import acceptance_rule
from speculative.methods.registry import (
    BuildContext,
    Built,
    refuse_draft_compile,
    refuse_draft_options,
    require_tree_forward,
)
from speculative.models.base import LanguageModel
from speculative.models.compiled import prepare_model, warm_up_pair
from speculative.models.loading import ModelImpl, load_model, quantize_model
from speculative.models.quantization import check_quantization
from speculative.models.tensor_parallel import check_model
from speculative.precompile import PreCompileConfig
from speculative.prefix_cache import PREFIX_BLOCK_SIZE, PrefixCache, check_prefix_caching
from speculative.sampling_params import SamplingParams


class LLM:
    """A target model, optionally with a drafter, that generates text speculatively and exactly.

    model / draft_model: a hub id or local path, a transformers PreTrainedModel, or a LanguageModel.
        A draft whose vocabulary differs from the target's drafts across tokenizers
        (CrossTokenizerProposer: a chain, greedy drafting; both tokenizers needed, fast ones; no
        tree, compile, draft_compile, precompile or tensor parallelism).
    speculative_config: how to speculate; None decodes plainly with the target (the baseline),
        except that giving a draft_model alone speculates with SpeculativeConfig()'s defaults.
    dtype: "auto", "float32", "bfloat16", "float16" or a torch.dtype; device: "cpu", "cuda", ... "auto" is
        the checkpoint's dtype, except on a CPU without native support for it (bfloat16 needs
        AVX512-BF16 or AMX), where it is float32. `llm.target.dtype` (and `llm.draft.dtype`) say which
        dtype was taken and why.
    draft_dtype: the draft model's dtype (None: `dtype`). What the lossless rule generates does not
        depend on it (only how often drafts are accepted); on a CPU a float32 draft beside a
        bfloat16 target can draft faster, its one-row matmuls being quicker in float32.
    seed: seeds the generator of requests that have no seed of their own.
    model_impl: "auto" (native forward for Llama/Mistral/Qwen2/Qwen3), "native" or "transformers".
    tokenizer: overrides the tokenizer found beside the model (a path or a tokenizer object).
    draft_tokenizer: overrides the one found beside the draft model (Hugging Face's
        `assistant_tokenizer`): a draft whose vocabulary differs from the target's needs one.
    compile: run the native forward compiled with torch.compile (models/compiled.py): inductor on
        CPU, CUDA graphs on CUDA. Each kind of call compiles on its first use, unless `precompile`
        warms it up here.
    draft_compile: compile the drafter (a draft model, an EAGLE head) or not; None: as `compile`.
        True beside compile=False compiles the small drafter alone: on a CPU an eager draft model's
        forward is mostly the cost of dispatching its ops, while the target's eager forward, bound by
        its weights, costs about the same for 1 to k + 1 tokens (docs/models.md#fast-path).
        Refused (a ValueError) where the method has no such drafter.
    precompile: a PreCompileConfig: prompts are padded to its prefill buckets (a prompt longer than
        every bucket is a ValueError naming the largest), and each of its standalone (batch_size,
        prefill_length) shapes is run once here, compiled when `compile`.
    quantization: None, "int8", "int4" (vLLM's names: weight-only), "w8a8" (int8 weights and
        activations, llama.cpp's Q8_0 arithmetic) or "w4a8" (4-bit weights in llama.cpp's Q4_1 scheme,
        int8 activations: its Q4_1 arithmetic): quantization of the target's and the draft's
        projections after loading (models/quantization.py; CPU and the native forward only, int4 for
        bfloat16 models only, a ValueError otherwise). Output is exactly the quantized
        target's own, as always: the draft's quantization changes only how often drafts are accepted.
    draft_quantization: the draft model's quantization alone (None: `quantization`), one of the same
        values; with SpeculativeConfig(method="self_draft"), the quantization of the target's own copy
        that drafts on its KV cache (None: "w8a8"), which keeps most of its drafts at a fraction of a
        float forward's cost on a CPU (docs/drafters.md, "A quantized copy of the target").
    tensor_parallel_size: split the target over this many ranks (ParallelConfig; speculative/distributed/
        says how the ranks start and agree): its attention heads, key/value heads and MLP columns,
        each rank's KV cache holding its own heads. It must divide them (a ValueError names the
        allowed values), and the target is given as a hub id, a path or a PreTrainedModel (each rank
        builds the LLM from these arguments); not with `compile`. A target on the native forward is
        split natively (models/tensor_parallel.py), one on transformers' forward by transformers'
        own tensor parallelism where it has a plan for the model type, on the CPU or the machine's
        accelerator (models/hf_tensor_parallel.py); a ValueError otherwise.
        Spawned here, the ranks make every engine call this LLM makes: drive it through `generate`,
        `stream`, `resume` or its engine, not its models by hand. An error on any rank stops them
        all, and every later call raises a RuntimeError saying what happened.
    draft_tensor_parallel_size: 1 (the whole draft on every rank) or tensor_parallel_size.
    enable_prefix_caching: keep the target's K/V of prompts and finished requests (prefix_cache.py)
        so that a prompt beginning as an earlier one did (a shared system prompt, a conversation's next
        turn) prefills only the rest; a draft model keeps its own K/V beside them; on the native
        forward, not with `precompile` (a ValueError).
    prefix_cache_tokens: the most tokens whose K/V it keeps (each 2 x layers x kv_heads x head_dim
        elements of the model's dtype, and of the draft's), in blocks of 16; the least recently used
        go first.
    """

    def __init__(
        self,
        model: str | PreTrainedModel | LanguageModel,
        draft_model: str | PreTrainedModel | LanguageModel | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        draft_dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
        model_impl: ModelImpl = "auto",
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | str | None = None,
        compile: bool = False,
        draft_compile: bool | None = None,
        precompile: PreCompileConfig | None = None,
        quantization: str | None = None,
        draft_quantization: str | None = None,
        tensor_parallel_size: int = 1,
        draft_tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = False,
        prefix_cache_tokens: int = 16384,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name != "self"}  # for other ranks
        speculative_config = _speculative_config(speculative_config, draft_model)
        check_quantization(quantization)
        check_quantization(draft_quantization, "draft_quantization")
        ok = draft_compile is None or isinstance(draft_compile, bool)
        check(ok, "draft_compile", draft_compile, "None, True or False", owner="LLM")
        check_prefix_caching(enable_prefix_caching, prefix_cache_tokens, precompile)
        parallel = ParallelConfig(tensor_parallel_size, draft_tensor_parallel_size)
        if speculative_config is None:
            refuse_draft_options(arguments)
            refuse_draft_compile(arguments, "decoding without speculation")
        else:
            speculative_config.options.check(speculative_config.method, arguments)
        self.quantization = quantization
        self.draft_quantization = (  # a draft model's (or the self-draft's copy's), where there is one
            draft_quantization
            or quantization
            or (speculative_config.options.default_draft_quantization if speculative_config else None)
        )
        self.speculative_config = speculative_config
        self.precompile = precompile
        self.device = torch.device(device)
        self.tensor_parallel: TensorParallelGroup | None = None
        if parallel.tensor_parallel_size > 1:
            for name, given in (("compile", compile), ("draft_compile", draft_compile)):
                if given:
                    raise ValueError(f"{name}=True does not run with tensor_parallel_size > 1 yet")
            size = parallel.tensor_parallel_size
            check_model(model, model_impl, size, "target", "tensor_parallel_size", self.device)
            if parallel.draft_tensor_parallel_size > 1:
                name = "draft_tensor_parallel_size"
                check_model(draft_model, model_impl, size, "draft model", name, self.device)
            self.tensor_parallel = connect(parallel.tensor_parallel_size, self.device)
            self.device = self.tensor_parallel.device(device)
        ranks = self.tensor_parallel.ranks if self.tensor_parallel is not None else None
        with ranks.building(arguments) if ranks is not None else nullcontext() as handle:
            engine = Engine if ranks is None else functools.partial(LeaderEngine, ranks, handle)
            self._build(arguments, engine)
        if ranks is not None:
            weakref.finalize(self, ranks.drop, handle)

    def _build(self, arguments: dict[str, Any], engine: Callable[..., Engine]) -> None:
        """Load the models (this rank's share of them), make the proposer, the engine (with `engine`:
        Engine, or rank 0's LeaderEngine) and the inputs' checker, and warm up the precompile shapes
        (`arguments`: __init__'s, by name, checked)."""
        config, precompile = self.speculative_config, self.precompile
        self.target = load_model(
            arguments["model"],
            arguments["dtype"],
            self.device,
            arguments["model_impl"],
            arguments["tokenizer"],
            tensor_parallel=self.tensor_parallel,
        )
        quantize_model(self.target.model, self.quantization, "target")
        self.target.model = prepare_model(self.target.model, arguments["compile"], precompile)
        self.tokenizer = self.target.tokenizer
        built = Built(None)
        if config is not None:
            if config.tree:
                require_tree_forward(self.target.model)
            context = BuildContext(config, self.target, arguments, self.device, self.tensor_parallel)
            built = config.options.build(context)
        self.draft = built.draft
        self.generator = torch.Generator(device=self.device).manual_seed(arguments["seed"])
        k = config.num_speculative_tokens if config else 0
        adaptive = bool(config and config.adaptive)
        limit = config.disable_by_batch_size if config else None
        prefix_cache = None
        if arguments["enable_prefix_caching"]:
            if not isinstance(self.target.model.new_cache(1, 1), StaticKVCache):  # blocks of its buffers
                raise ValueError(
                    "LLM.enable_prefix_caching needs the native forward (model_impl 'native'); this "
                    f"model ({type(self.target.model).__name__}) runs on another"
                )
            prefix_cache = PrefixCache(arguments["prefix_cache_tokens"], PREFIX_BLOCK_SIZE)
        self.engine = engine(
            self.target.model,
            built.proposer,
            k,
            self.target.eos_token_ids,
            self.generator,
            acceptance_rule(config) if config is not None else RejectionSampler(),
            self.detokenize if self.tokenizer is not None else None,
            adaptive=adaptive,
            disable_by_batch_size=limit,
            room=_room(config),
            prefix_cache=prefix_cache,
        )
        if self.tensor_parallel is not None and adaptive:  # every rank drafts rank 0's choice
            self.engine.draft_length = RankZeroDraftLength(k, self.device, limit)
        shared = self.draft if built.shares_tokens else None
        context_length = min(m.model.max_length for m in (self.target, shared) if m)
        self.inputs = InputProcessor(
            self.tokenizer, self.target.model.vocab_size, context_length, self.device, precompile
        )
        if precompile is not None:
            draft = shared.model if shared else None
            warm_up_pair(
                self.target.model,
                draft,
                precompile,
                k,
                every_width=bool(config and (config.options.model_free or config.adaptive)),
                every_draft_length=bool(config and config.adaptive),
            )

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for each prompt.

        prompts: a string, a list of token ids, {"prompt_token_ids": [...]}, or a list of these.
        sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
        Returns one RequestOutput per prompt, in order. All inputs are checked before any work.
        """
        texts, token_ids, params, sequences = self.inputs.prepare(prompts, sampling_params)
        if sequences:
            self.engine.run(sequences)
        by_prompt: list[list[Sequence]] = [[] for _ in token_ids]
        for s in sequences:
            by_prompt[s.prompt_index].append(s)
        return [
            self._output(i, texts[i], token_ids[i], params[i], by_prompt[i]) for i in range(len(token_ids))
        ]

    def stream(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        config: GenerationConfig | None = None,
    ) -> Iterator[SampleState]:
        """Generate like `generate`, yielding a SampleState every `config.streaming_chunks` target
        steps (and a last one when all sequences have finished), each with the new text of every
        sequence. sampling_params default to `config.request_params()`."""
        config = config or GenerationConfig()
        if config.bos_token_id is not None:
            bos = config.bos_token_id
            prompts = [p if p[:1] == [bos] else [bos, *p] for p in self.inputs.encode(prompts)[1]]
        sequences = self.inputs.prepare(prompts, sampling_params or config.request_params()).sequences
        yield from self._stream(sequences, config, [""] * len(sequences), 0.0)

    def resume(self, state: SampleState, config: GenerationConfig | None = None) -> Iterator[SampleState]:
        """Go on from a SampleState (of this process or another), yielding states as `stream` does.

        The caches are rebuilt from the state's tokens; the generators continue from their saved
        states, so the tokens are those of a run that never stopped."""
        sequences = self.inputs.restore(state)
        self.generator.set_state(unpack_generator(state.prng_key["default"], self.device).get_state())
        config = config or GenerationConfig()
        yield from self._stream(sequences, config, state.text, state.time_spent_computing)

    def _stream(
        self, sequences: list[Sequence], config: GenerationConfig, previous: list[str], elapsed: float
    ) -> Iterator[SampleState]:
        start = time.perf_counter()
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        for current in self.engine.generate(sequences, config.streaming_chunks, config.eos_token_ids):
            texts = [self._stream_text(s) for s in current]
            yield SampleState.capture(
                current, self.generator, previous, elapsed + time.perf_counter() - start, texts, pad
            )
            previous = texts

    def _stream_text(self, s: Sequence) -> str:
        """A sequence's text so far; while it runs, without a trailing incomplete character."""
        if s.text is not None:
            return s.text
        text = self.detokenize(s.output_token_ids, s.params)
        return text if s.finished else text.rstrip("\ufffd")

    def make_sequences(self, ids: list[int], p: SamplingParams, index: int = 0) -> list[Sequence]:
        """The engine's sequences for one prompt of token ids (InputProcessor.sequences)."""
        return self.inputs.sequences(ids, p, index)

    def _output(
        self,
        index: int,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        sequences: list[Sequence],
    ) -> RequestOutput:
        if params.sampled_sequences > params.n:  # best_of: the n most likely sequences
            sequences = sorted(sequences, key=lambda r: r.cumulative_logprob, reverse=True)[: params.n]
        completions = []
        for r in sequences:
            if r.error is not None:
                raise RuntimeError(f"prompt {index} failed: {r.error}")
        for i, r in enumerate(sequences):
            text = r.text if r.text is not None else self.detokenize(r.output_token_ids, params)
            completions.append(
                CompletionOutput(
                    i,
                    text,
                    r.output_token_ids,
                    r.cumulative_logprob,
                    r.logprobs,
                    r.finish_reason,
                    r.stop_reason,
                )
            )
        metrics = sequences[0].metrics
        for r in sequences[1:]:
            metrics.merge(r.metrics)
        first = sequences[0]
        return RequestOutput(
            str(index),
            prompt,
            prompt_ids,
            completions,
            first.prompt_logprobs,
            True,
            metrics,
            first.num_cached_tokens,
        )

    def detokenize(self, ids: list[int], params: SamplingParams | None) -> str:
        """Token ids -> text with the request's detokenize options ("" without a tokenizer or
        with detokenize=False; params None: plain decoding)."""
        if self.tokenizer is None or (params is not None and not params.detokenize):
            return ""
        if params is None:
            return self.tokenizer.decode(ids)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )


def _speculative_config(
    config: SpeculativeConfig | dict | None, draft_model: object
) -> SpeculativeConfig | None:
    """LLM's speculative_config: a SpeculativeConfig, vLLM's flat dict of one (SpeculativeConfig.from_dict),
    or None: plain decoding, or the draft model's SpeculativeConfig where a draft_model is given. A dict
    without num_speculative_tokens, and None, take the k that the draft model's folder declares
    (config.with_draft_defaults)."""
    if config is None and draft_model is not None:
        config = {"method": "draft_model"}
    if isinstance(config, dict):
        return SpeculativeConfig.from_dict(with_draft_defaults(config, draft_model))
    if config is not None and not isinstance(config, SpeculativeConfig):
        raise TypeError(
            f"speculative_config must be a SpeculativeConfig, a dict or None; got {type(config).__name__}"
        )
    return config


def _room(config: SpeculativeConfig | None) -> int | None:
    """The cache room a step needs beyond the context: a tree's nodes, or the most a draft feeds
    while growing one (its root and `tree_width` nodes at each depth but the last); None: k."""
    if config is None or config.tree is None:
        return None
    return max(config.tree_nodes, config.tree_width * config.num_speculative_tokens)
