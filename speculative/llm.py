"""LLM: the public entry point, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from speculative.acceptance import TypicalAcceptanceSampler
from speculative.config import SpeculativeConfig
from speculative.engine.engine import Engine, Request
from speculative.engine.outputs import CompletionOutput, RequestOutput
from speculative.models.base import LanguageModel
from speculative.models.loading import ModelImpl, load_model
from speculative.proposers import DraftModelProposer, NgramProposer
from speculative.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """A target model, optionally with a drafter, that generates text speculatively and exactly.

    model / draft_model: a hub id or local path, a transformers PreTrainedModel, or a LanguageModel.
        The draft must share the target's vocabulary.
    speculative_config: how to speculate; None decodes plainly with the target (the baseline),
        except that giving a draft_model alone speculates with SpeculativeConfig()'s defaults.
    dtype: "auto", "float32", "bfloat16", "float16" or a torch.dtype; device: "cpu", "cuda", ...
    seed: seeds the generator of requests that have no seed of their own.
    model_impl: "auto" (native forward for Llama/Mistral/Qwen2/Qwen3), "native" or "transformers".
    tokenizer: overrides the tokenizer found beside the model (a path or a tokenizer object).
    """

    def __init__(self, model: str | PreTrainedModel | LanguageModel,
                 draft_model: str | PreTrainedModel | LanguageModel | None = None,
                 speculative_config: SpeculativeConfig | None = None, *, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "cpu", seed: int = 0, model_impl: ModelImpl = "auto",
                 tokenizer: PreTrainedTokenizerBase | str | None = None) -> None:
        if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            raise TypeError("speculative_config must be a SpeculativeConfig or None")
        if speculative_config is None and draft_model is not None:
            speculative_config = SpeculativeConfig(method="draft_model")
        method = speculative_config.method if speculative_config else None
        if method == "draft_model" and draft_model is None:
            raise ValueError('SpeculativeConfig(method="draft_model") needs LLM(draft_model=...)')
        if method == "ngram" and draft_model is not None:
            raise ValueError('SpeculativeConfig(method="ngram") uses no draft model; drop draft_model')
        self.device = torch.device(device)
        self.target = load_model(model, dtype, self.device, model_impl, tokenizer)
        self.tokenizer = self.target.tokenizer
        self.draft = None
        proposer = None
        if method == "draft_model":
            self.draft = load_model(draft_model, dtype, self.device, model_impl)
            _check_same_vocabulary(self.target, self.draft)
            proposer = DraftModelProposer(self.draft.model)
        elif method == "ngram":
            proposer = NgramProposer(speculative_config.prompt_lookup_min, speculative_config.prompt_lookup_max)
        typical = None
        if speculative_config is not None and speculative_config.acceptance == "typical":
            typical = TypicalAcceptanceSampler(speculative_config.posterior_threshold,
                                               speculative_config.posterior_alpha)
        self.speculative_config = speculative_config
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        k = speculative_config.num_speculative_tokens if speculative_config else 0
        self.engine = Engine(self.target.model, proposer, k, self.target.eos_token_ids, self.generator, typical)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate a completion for each prompt.

        prompts: a string, a list of token ids, {"prompt_token_ids": [...]}, or a list of these.
        sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
        Returns one RequestOutput per prompt, in order. All inputs are checked before any work.
        """
        texts, token_ids = self._encode(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(token_ids)
        else:
            params = list(sampling_params)
            if len(params) != len(token_ids):
                raise ValueError(f"got {len(params)} SamplingParams for {len(token_ids)} prompts")
            if not all(isinstance(p, SamplingParams) for p in params):
                raise TypeError("sampling_params must be SamplingParams or a list of them")
        self._check_lengths(token_ids, params)
        requests = [Request(ids, p) for ids, p in zip(token_ids, params)]
        if requests:
            self.engine.run(requests)
        return [self._output(i, text, r) for i, (text, r) in enumerate(zip(texts, requests))]

    def _encode(self, prompts: PromptType | Sequence[PromptType]) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        texts, token_ids = [], []
        vocab = self.target.model.vocab_size
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is text but the model has no tokenizer; pass token ids")
                ids = self.tokenizer(prompt)["input_ids"]
                texts.append(prompt)
            else:
                ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise TypeError(f"prompt {i} must be a string, a list of token ids or "
                                    f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")
                texts.append(None)
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty: it needs at least one token")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            token_ids.append(list(ids))
        return texts, token_ids

    def _check_lengths(self, token_ids: list[list[int]], params: list[SamplingParams]) -> None:
        limit = min(m.model.max_length for m in (self.target, self.draft) if m is not None)
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            if len(ids) + p.max_tokens > limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens and max_tokens={p.max_tokens}: "
                                 f"together more than the model's context of {limit} tokens")

    def _output(self, index: int, prompt: str | None, request: Request) -> RequestOutput:
        ids = request.output_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        completion = CompletionOutput(0, text, ids, request.finish_reason, request.stop_reason)
        return RequestOutput(str(index), prompt, request.prompt_token_ids, [completion], True, request.metrics)


def _check_same_vocabulary(target, draft) -> None:
    """The draft must share the target's vocabulary: same size and, where both have one, tokenizer."""
    vt, vd = target.model.vocab_size, draft.model.vocab_size
    if vt != vd:
        raise ValueError(f"the draft model's vocabulary ({vd} tokens) differs from the target's ({vt}); "
                         f"speculative decoding needs a draft that shares the target's vocabulary")
    if target.tokenizer is not None and draft.tokenizer is not None \
            and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer maps tokens to other ids than the target's; "
                         "speculative decoding needs a draft that shares the target's vocabulary")
