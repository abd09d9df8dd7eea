"""Requests in, engine sequences out: prompts encoded, SamplingParams checked against the models, and
each prompt's n (or best_of) sequences made with their generators, bad words and grammar states.

Everything is checked before any work starts, so that a bad request is a ValueError (or TypeError)
naming what does not fit, and nothing already running is touched.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from speculative.engine.sequence import Sequence
from speculative.engine.state import SampleState
from speculative.precompile import PreCompileConfig
from speculative.sampling_params import SamplingParams

PromptType = str | list[int] | dict
"""A prompt: text, a list of token ids, or {"prompt_token_ids": [...]}."""


class Prepared(NamedTuple):
    """A generation's inputs, per prompt: its text (None when given as ids), its token ids and its
    SamplingParams; and the engine sequences of all prompts (prompt_index: the prompt's place)."""

    texts: list[str | None]
    token_ids: list[list[int]]
    params: list[SamplingParams]
    sequences: list[Sequence]


class InputProcessor:
    """Turns (prompts, SamplingParams) into engine sequences for models of `vocab_size` tokens and a
    context of `max_length` (the shorter of target and draft); `tokenizer` may be None (token ids
    only); `precompile`: prompts must fit one of its prefill buckets."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        max_length: int,
        device: torch.device,
        precompile: PreCompileConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.device = device
        self.precompile = precompile

    def prepare(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
    ) -> Prepared:
        """Encode and check every prompt (truncated as its params say) and make its sequences."""
        texts, token_ids = self.encode(prompts)
        params = _params(sampling_params, len(token_ids))
        sequences = []
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            if p.truncate_prompt_tokens is not None:
                ids = token_ids[i] = ids[-p.truncate_prompt_tokens :]
            sequences.extend(self.sequences(ids, p, i))
        return Prepared(texts, token_ids, params, sequences)

    def encode(self, prompts: PromptType | Seq[PromptType]) -> tuple[list[str | None], list[list[int]]]:
        """Each prompt's text (None for token ids) and token ids; one prompt or a list of them."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        texts, token_ids = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is text but the model has no tokenizer; pass token ids")
                ids = self.tokenizer(prompt)["input_ids"]
                texts.append(prompt)
            else:
                ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise TypeError(
                        f"prompt {i} must be a string, a list of token ids or "
                        f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__}"
                    )
                texts.append(None)
            token_ids.append(list(ids))
        return texts, token_ids

    def sequences(self, ids: list[int], p: SamplingParams, index: int = 0) -> list[Sequence]:
        """The engine's sequences (n or best_of) for one prompt of token ids, checked against the
        models (vocabulary, context length, tokenizer needs): a ValueError names what does not fit.
        `index` is the prompt's place in its batch, used in messages and to group its sequences."""
        p.token_ids_in_vocabulary(self.vocab_size)
        if not ids:
            raise ValueError(f"prompt {index} is empty: it needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_length - len(ids)
        if len(ids) + max_tokens > self.max_length or max_tokens < 1:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens and max_tokens={p.max_tokens}: "
                f"together more than the model's context of {self.max_length} tokens"
            )
        if self.precompile is not None:
            try:
                self.precompile.bucket(len(ids))
            except ValueError as error:
                raise ValueError(f"prompt {index}: {error}") from None
        needs_tokenizer = [
            name
            for name, used in (
                ("stop", p.stop),
                ("bad_words", p.bad_words),
                ("guided_decoding", p.guided_decoding),
            )
            if used
        ]
        if needs_tokenizer and self.tokenizer is None:
            raise ValueError(f"SamplingParams.{needs_tokenizer[0]} needs a tokenizer, and the model has none")
        bad_words, guide = self._sampling_aids(p)
        if guide is not None and p.allowed_token_ids:
            first = guide.new_state().allowed_for_block([])[0]  # [vocab] bool: the grammar's first mask
            if not first[p.allowed_token_ids].any():
                raise ValueError(
                    "SamplingParams.allowed_token_ids and guided_decoding leave no token allowed "
                    "at the first position"
                )
        return [
            Sequence(
                ids,
                p,
                max_tokens,
                index,
                s,
                _generator(p.seed, s, self.device),
                bad_words,
                guide.new_state() if guide else None,
            )
            for s in range(p.sampled_sequences)
        ]

    def restore(self, state: SampleState) -> list[Sequence]:
        """A SampleState's sequences ready to resume: generators, bad words and grammar states (advanced
        over the output so far) restored."""
        sequences = state.to_sequences(self.device)
        for s in sequences:
            self.attach_aids(s)
        return sequences

    def attach_aids(self, s: Sequence) -> None:
        """Give a sequence made elsewhere (a SampleState, another rank) its bad words' token ids and its
        grammar state, advanced over its output so far."""
        s.bad_words_token_ids, guide = self._sampling_aids(s.params)
        if guide is not None:
            s.guide = guide.new_state()
            s.guide.accept(s.output_token_ids)

    def _sampling_aids(self, p: SamplingParams) -> tuple[list[list[int]], object]:
        """The tokenizer's share of a request: its bad words' token ids and its compiled grammar."""
        bad_words = _bad_words_token_ids(self.tokenizer, p.bad_words) if p.bad_words else []
        guide = None
        if p.guided_decoding is not None:
            from speculative.sampling.guided import Guide  # llguidance only where guided decoding is used

            guide = Guide.compile(p.guided_decoding, self.tokenizer, self.vocab_size)
        return bad_words, guide


def _params(sampling_params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: the same for all (default SamplingParams()) or one each."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    if not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be SamplingParams or a list of them")
    return params


def _generator(seed: int | None, sample_index: int, device: torch.device) -> torch.Generator | None:
    """Sequence s of a seeded prompt draws from its own generator; sequence 0 from the seed itself."""
    if seed is None:
        return None
    seed = seed if sample_index == 0 else (seed * 1_000_003 + sample_index) % 2**63
    return torch.Generator(device=device).manual_seed(seed)


def _bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's tokenization, alone and after a space (as it appears mid-text), as vLLM does."""
    found: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in found:
                found.append(ids)
    return found
