"""Host-side record of one generated sequence: its tokens, text, log-probabilities and figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from speculative.engine.outputs import Logprob, SpeculationMetrics
from speculative.sampling_params import SamplingParams


@dataclass
class Sequence:
    """One sequence being generated: a prompt with n > 1 (or best_of) has several, sharing its prefill.

    prompt_index / sample_index: which prompt, and which of its sampled sequences.
    max_tokens: resolved (never None). generator: this sequence's own generator, or None.
    bad_words_token_ids / guide: the tokenizer's and the grammar's share of the sampling work.
    finish_reason: "stop", "length", "abort" (dropped before the end) or "error" (its own work
    raised; `error` says what: an error that begins "SamplingParams." is the request's own, its
    constraints having left no token allowed, NoTokenAllowed). start_time: when the engine admitted
    it (time.perf_counter()). num_cached_tokens: its prompt's tokens whose K/V came from the prefix
    cache rather than its prefill.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    prompt_index: int = 0
    sample_index: int = 0
    generator: torch.Generator | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    guide: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: SpeculationMetrics = field(default_factory=SpeculationMetrics)
    error: str | None = None
    start_time: float = 0.0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @cached_property
    def allowed_token_set(self) -> frozenset[int] | None:
        """SamplingParams.allowed_token_ids as a set for host-side checks; None: every token."""
        ids = self.params.allowed_token_ids
        return frozenset(ids) if ids else None


class NoTokenAllowed(ValueError):
    """A sequence's constraints (allowed_token_ids, its grammar, bad_words, min_tokens, ...) left no
    token allowed at its next position: a dead end of its own parameters. The message names the
    constraints it uses, first the one a user would change (allowed_token_ids, else the grammar)."""

    def __init__(self, sequence: Sequence) -> None:
        p = sequence.params
        used = [
            name
            for name, value in (
                ("allowed_token_ids", p.allowed_token_ids),
                ("guided_decoding", p.guided_decoding),
                ("bad_words", p.bad_words),
                ("min_tokens", p.min_tokens),
                ("logit_bias", p.logit_bias),
                ("logits_processors", p.logits_processors),
            )
            if value
        ]
        super().__init__(
            f"SamplingParams.{' and '.join(used)} leave no token allowed after "
            f"{len(sequence.output_token_ids)} generated tokens"
        )


class StopStrings:
    """Finds a sequence's stop strings in its text as it grows, across step boundaries.

    As vLLM, a stop string counts only where it ends past the text of the first min_tokens tokens:
    before that, stop strings are not checked (as EOS and stop_token_ids are banned)."""

    def __init__(self, sequence: Sequence, decode) -> None:
        self.sequence = sequence
        self.decode = decode  # list[int] -> str
        self.stops = sequence.params.stop
        self.longest = max(len(s) for s in self.stops)
        self.text = decode(sequence.output_token_ids) if sequence.output_token_ids else ""
        self.floor: int | None = None  # characters of the first min_tokens tokens, once there are so many

    def extend(self, num_new: int) -> bool:
        """Check the text after `num_new` more tokens; on a match cut the tokens after the one that
        completes it (and the text), return True. The caller keeps only the tokens left."""
        ids = self.sequence.output_token_ids
        old_length = len(self.text)
        text = self.text = self.decode(ids)
        floor = self._floor(ids)
        if floor is None:
            return False
        start = max(0, old_length - self.longest + 1)
        hits = [(i, s) for s in self.stops if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop)
        keep = len(ids) - num_new + 1
        while keep < len(ids) and len(self.decode(ids[:keep])) < end:
            keep += 1
        del ids[keep:]
        self.text = text[: end if self.sequence.params.include_stop_str_in_output else index]
        self.sequence.stop_reason = stop
        return True

    def _floor(self, ids: list[int]) -> int | None:
        """Where a stop string may end at the earliest (after the first min_tokens tokens' text);
        None while fewer tokens exist."""
        min_tokens = self.sequence.params.min_tokens
        if self.floor is None and len(ids) >= min_tokens:
            self.floor = len(self.decode(ids[:min_tokens])) if min_tokens else 0
        return self.floor
