"""LLM: the public entry point, shaped like vLLM's."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import nullcontext

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from speculative.acceptance import RejectionSampler, TypicalAcceptanceSampler
from speculative.config import GenerationConfig, ParallelConfig, SpeculativeConfig
from speculative.distributed.draft_length import RankZeroDraftLength
from speculative.distributed.group import TensorParallelGroup, connect
from speculative.distributed.mirror import LeaderEngine
from speculative.engine.engine import Engine
from speculative.engine.inputs import InputProcessor, PromptType
from speculative.engine.outputs import CompletionOutput, RequestOutput
from speculative.engine.sequence import Sequence
from speculative.engine.state import SampleState, unpack_generator
from speculative.models.base import LanguageModel
from speculative.models.compiled import CompiledCausalLM, prepare_model, warm_up_pair
from speculative.models.draft_vocabulary import apply_draft_vocabulary
from speculative.models.dtypes import check_dtype
from speculative.models.eagle_checkpoint import load_eagle_head
from speculative.models.llama import NativeCausalLM
from speculative.models.loading import ModelImpl, load_model, quantize_model
from speculative.models.quantization import check_quantization
from speculative.models.tensor_parallel import check_model
from speculative.precompile import PreCompileConfig
from speculative.proposers import (
    CrossTokenizerProposer,
    DraftModelProposer,
    DraftTreeProposer,
    EagleProposer,
    EagleTreeProposer,
    NgramProposer,
    SuffixProposer,
)
from speculative.sampling_params import SamplingParams


class LLM:
    """A target model, optionally with a drafter, that generates text speculatively and exactly.

    model / draft_model: a hub id or local path, a transformers PreTrainedModel, or a LanguageModel.
        A draft whose vocabulary differs from the target's drafts across tokenizers
        (CrossTokenizerProposer: a chain, greedy drafting; both tokenizers needed, fast ones; no
        tree, compile, precompile or tensor parallelism).
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
    precompile: a PreCompileConfig: prompts are padded to its prefill buckets (a prompt longer than
        every bucket is a ValueError naming the largest), and each of its standalone (batch_size,
        prefill_length) shapes is run once here, compiled when `compile`.
    quantization: None, "int8" or "int4" (vLLM's name): weight-only quantization of the target's and
        the draft's projections after loading (models/quantization.py; CPU and the native forward
        only, int4 for bfloat16 models only, a ValueError otherwise). Output is exactly the quantized
        target's own, as always: the draft's quantization changes only how often drafts are accepted.
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
    """

    def __init__(
        self,
        model: str | PreTrainedModel | LanguageModel,
        draft_model: str | PreTrainedModel | LanguageModel | None = None,
        speculative_config: SpeculativeConfig | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        draft_dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
        model_impl: ModelImpl = "auto",
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | str | None = None,
        compile: bool = False,
        precompile: PreCompileConfig | None = None,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        draft_tensor_parallel_size: int = 1,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name != "self"}  # for other ranks
        if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            raise TypeError("speculative_config must be a SpeculativeConfig or None")
        if speculative_config is None and draft_model is not None:
            speculative_config = SpeculativeConfig(method="draft_model")
        method = speculative_config.method if speculative_config else None
        if method in ("draft_model", "eagle", "eagle3") and draft_model is None:
            raise ValueError(f'SpeculativeConfig(method="{method}") needs LLM(draft_model=...)')
        if method in ("eagle", "eagle3") and (not isinstance(draft_model, str) or precompile or quantization):
            raise ValueError(
                f'SpeculativeConfig(method="{method}") needs LLM(draft_model=<the EAGLE head\'s directory>) '
                "and a target that is neither precompiled nor quantized"
            )
        if method in ("ngram", "suffix") and draft_model is not None:
            raise ValueError(f'SpeculativeConfig(method="{method}") uses no draft model; drop draft_model')
        if draft_dtype is not None:
            check_dtype(draft_dtype, "draft_dtype")
            if method != "draft_model":
                raise ValueError("draft_dtype is the draft model's dtype: give it with a draft_model")
        if draft_tokenizer is not None and method != "draft_model":
            raise ValueError("draft_tokenizer is the draft model's tokenizer: give it with a draft_model")
        check_quantization(quantization)
        parallel = ParallelConfig(tensor_parallel_size, draft_tensor_parallel_size)
        if method in ("eagle", "eagle3") and parallel.tensor_parallel_size > 1:
            raise ValueError(
                f'SpeculativeConfig(method="{method}") does not run with tensor_parallel_size > 1 yet'
            )
        self.quantization = quantization
        self.speculative_config = speculative_config
        self.precompile = precompile
        self.device = torch.device(device)
        self.tensor_parallel: TensorParallelGroup | None = None
        if parallel.tensor_parallel_size > 1:
            if compile:
                raise ValueError("compile=True does not run with tensor_parallel_size > 1 yet")
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
            self._build(
                model,
                draft_model,
                dtype,
                draft_dtype,
                seed,
                model_impl,
                (tokenizer, draft_tokenizer),
                compile,
                parallel,
                engine,
            )
        if ranks is not None:
            weakref.finalize(self, ranks.drop, handle)

    def _build(
        self,
        model: str | PreTrainedModel | LanguageModel,
        draft_model: str | PreTrainedModel | LanguageModel | None,
        dtype: str | torch.dtype,
        draft_dtype: str | torch.dtype | None,
        seed: int,
        model_impl: ModelImpl,
        tokenizers: tuple[PreTrainedTokenizerBase | str | None, PreTrainedTokenizerBase | str | None],
        compile: bool,
        parallel: ParallelConfig,
        engine: Callable[..., Engine],
    ) -> None:
        """Load the models (this rank's share of them), make the proposer, the engine (with `engine`:
        Engine, or rank 0's LeaderEngine) and the inputs' checker, and warm up the precompile shapes
        (__init__'s arguments, checked; `tokenizers`: tokenizer and draft_tokenizer)."""
        speculative_config = self.speculative_config
        quantization, precompile = self.quantization, self.precompile
        method = speculative_config.method if speculative_config else None
        group = self.tensor_parallel
        tokenizer, draft_tokenizer = tokenizers
        self.target = load_model(model, dtype, self.device, model_impl, tokenizer, tensor_parallel=group)
        quantize_model(self.target.model, quantization, "target")
        self.target.model = prepare_model(self.target.model, compile, precompile)
        self.tokenizer = self.target.tokenizer
        self.draft = None
        proposer = None
        if method == "draft_model":
            self.draft = load_model(
                draft_model,
                dtype if draft_dtype is None else draft_dtype,
                self.device,
                model_impl,
                draft_tokenizer,
                dtype_name="dtype" if draft_dtype is None else "draft_dtype",
                tensor_parallel=group if parallel.draft_tensor_parallel_size > 1 else None,
                tensor_parallel_name="draft_tensor_parallel_size",
            )
            apply_draft_vocabulary(self.draft.model, draft_model)
            quantize_model(
                self.draft.model,
                quantization,
                "draft model",
                "dtype" if draft_dtype is None else "draft_dtype",
            )
            self.draft.model = prepare_model(self.draft.model, compile, precompile)
            if _same_vocabulary(self.target, self.draft):
                proposer = _draft_proposer(self.draft.model, speculative_config)
            else:
                proposer = _cross_tokenizer_proposer(self.target, self.draft, speculative_config)
                _check_cross_tokenizer(compile, precompile, group)
        elif method in ("eagle", "eagle3"):
            native = self.target.model
            native = native.model if isinstance(native, CompiledCausalLM) else native  # the head shares it
            if not isinstance(native, NativeCausalLM):
                raise ValueError(
                    f'SpeculativeConfig(method="{method}") needs the native forward for the target '
                    f"(model types llama, mistral, qwen2, qwen3); got {type(native).__name__}"
                )
            head = load_eagle_head(draft_model, method, native)
            compiled = CompiledCausalLM(head) if compile else None  # a greedy chain's, a tree's drafting
            proposer = EagleProposer(head, compiled)
            if speculative_config.tree:
                c = speculative_config
                proposer = EagleTreeProposer(head, c.tree, c.tree_width, c.tree_nodes, compiled)
        elif method == "ngram":
            proposer = NgramProposer(
                speculative_config.prompt_lookup_min,
                speculative_config.prompt_lookup_max,
                speculative_config.tree_nodes if speculative_config.tree else None,
            )
        elif method == "suffix":
            proposer = SuffixProposer(
                speculative_config.suffix_decoding_max_tree_depth,
                speculative_config.suffix_decoding_max_cached_requests,
                speculative_config.suffix_decoding_max_spec_factor,
                speculative_config.suffix_decoding_min_token_prob,
                speculative_config.tree_nodes if speculative_config.tree else None,
            )
        if speculative_config is not None and speculative_config.tree:
            _check_tree_forward(self.target.model)
        rule = RejectionSampler()
        if speculative_config is not None and speculative_config.acceptance == "typical":
            rule = TypicalAcceptanceSampler(
                speculative_config.posterior_threshold, speculative_config.posterior_alpha
            )
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        k = speculative_config.num_speculative_tokens if speculative_config else 0
        adaptive = bool(speculative_config and speculative_config.adaptive)
        self.engine = engine(
            self.target.model,
            proposer,
            k,
            self.target.eos_token_ids,
            self.generator,
            rule,
            self.detokenize if self.tokenizer is not None else None,
            adaptive=adaptive,
            room=_room(speculative_config),
        )
        if group is not None and adaptive:  # every rank drafts rank 0's choice
            self.engine.draft_length = RankZeroDraftLength(k, self.device)
        same_tokens = self.draft is not None and not isinstance(proposer, CrossTokenizerProposer)
        context = min(m.model.max_length for m in (self.target, self.draft if same_tokens else None) if m)
        self.inputs = InputProcessor(
            self.tokenizer, self.target.model.vocab_size, context, self.device, precompile
        )
        if precompile is not None:
            draft = self.draft.model if same_tokens else None
            warm_up_pair(self.target.model, draft, precompile, k, every_width=method in ("ngram", "suffix"))

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
        return RequestOutput(
            str(index), prompt, prompt_ids, completions, sequences[0].prompt_logprobs, True, metrics
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


def _draft_proposer(model: LanguageModel, config: SpeculativeConfig) -> DraftModelProposer:
    """The draft model's proposer: a chain of k tokens, or the config's tree."""
    if config.tree is None:
        return DraftModelProposer(model)
    _check_tree_forward(model, "draft model")
    return DraftTreeProposer(model, config.tree, config.tree_width, config.tree_nodes)


def _room(config: SpeculativeConfig | None) -> int | None:
    """The cache room a step needs beyond the context: a tree's nodes, or the most a draft feeds
    while growing one (its root and `tree_width` nodes at each depth but the last); None: k."""
    if config is None or config.tree is None:
        return None
    return max(config.tree_nodes, config.tree_width * config.num_speculative_tokens)


def _check_tree_forward(model: LanguageModel, which: str = "model") -> None:
    """Trees need a forward that takes them (the native one); a ValueError naming `tree` otherwise."""
    if getattr(model, "forward_tree", None) is None:
        raise ValueError(
            f"SpeculativeConfig.tree needs the native forward for the {which} (model types llama, mistral, "
            f"qwen2, qwen3; model_impl 'native' or 'auto'); {type(model).__name__} verifies chains only"
        )


def _same_vocabulary(target, draft) -> bool:
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


def _cross_tokenizer_proposer(target, draft, config: SpeculativeConfig) -> CrossTokenizerProposer:
    """The proposer of a draft with its own tokenizer: a chain only (a ValueError naming `tree`)."""
    if config.tree is not None:
        raise ValueError(
            "SpeculativeConfig.tree is not supported with a draft model that has its own tokenizer "
            "(drafting across tokenizers proposes chains); use tree=None"
        )
    return CrossTokenizerProposer(draft.model, draft.tokenizer, target.tokenizer)


def _check_cross_tokenizer(compile: bool, precompile, group) -> None:
    """compile, precompile and tensor parallelism do not run with a draft of its own tokenizer (a
    ValueError naming the argument)."""
    for name, given in (
        ("compile", compile),
        ("precompile", precompile is not None),
        ("tensor_parallel_size", group is not None),
    ):
        if given:
            raise ValueError(
                f"{name} is not supported with a draft model that has its own tokenizer (drafting across "
                "tokenizers)"
            )
