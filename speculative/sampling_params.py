"""SamplingParams: how one request is sampled, with vLLM's names, meanings and ranges.

Follows the OpenAI completions API and vLLM's SamplingParams. Every field is validated at construction,
and a bad value raises a ValueError that names the field and its allowed range. Checks that need the
model (token ids inside the vocabulary, prompt length against the context) happen in `LLM.generate`,
before any work starts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from speculative.fields import DictRoundTrip, check, is_int, is_number

if TYPE_CHECKING:
    from speculative.sampling.guided import GuidedDecodingParams

_check = functools.partial(check, owner="SamplingParams")

LogitsProcessor = Callable[..., Any]
"""vLLM's signatures: fn(output_token_ids, logits) or fn(prompt_token_ids, output_token_ids, logits),
with logits [vocab] for one position; returns the new logits [vocab]."""


@dataclass
class SamplingParams(DictRoundTrip):
    """Sampling parameters for one request (vLLM's fields; see each for its range).

    n: sequences returned for the prompt. >= 1.
    best_of: sequences generated, the n with the highest cumulative log-probability returned.
        >= n; None means n. Refused with greedy sampling when > 1.
    presence_penalty: subtracted from the logit of every token already generated. [-2, 2].
    frequency_penalty: subtracted once per occurrence of a token already generated. [-2, 2].
    repetition_penalty: divides positive (multiplies negative) logits of tokens in the prompt or the
        output. > 0; 1 disables.
    temperature: 0 means greedy. [0, inf).
    top_p: cumulative probability of the top tokens kept. (0, 1].
    top_k: top tokens kept; -1 keeps all. -1 or >= 1.
    min_p: tokens below min_p * (probability of the most likely token) are dropped. [0, 1].
    seed: the request's own random seed: the same seed gives the same text in any batch.
    stop: strings that end the generation; not in the output unless include_stop_str_in_output.
    stop_token_ids: token ids that end the generation; kept in the output token ids.
    bad_words: words never generated: the last token of each word's tokenization is banned where
        the context ends with the rest of it.
    include_stop_str_in_output: keep the stop string in the text.
    ignore_eos: keep generating after EOS.
    max_tokens: tokens generated at most; None fills the model's context. >= 1.
    min_tokens: EOS and stop_token_ids are banned before this many tokens. [0, max_tokens].
    logprobs: the chosen token's log-probability plus this many top ones, per output token. >= 0.
    prompt_logprobs: the same for every prompt token. >= 0.
    detokenize: produce text (stop strings need it).
    skip_special_tokens / spaces_between_special_tokens: passed to the tokenizer's decode.
    logits_processors: user callables applied to the logits at every verified position.
    truncate_prompt_tokens: keep only the last this many prompt tokens. >= 1.
    guided_decoding: constrain the output to a JSON schema, regex, choice list or grammar.
    logit_bias: token id -> bias added to its logit, clamped to [-100, 100].
    allowed_token_ids: only these tokens may be generated. Non-empty.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] | None = None
    truncate_prompt_tokens: int | None = None
    guided_decoding: GuidedDecodingParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self.logits_processors = list(self.logits_processors or [])
        _check(is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            self.best_of is None or (is_int(self.best_of) and self.best_of >= self.n),
            "best_of",
            self.best_of,
            f"None or an integer >= n ({self.n})",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(is_number(value) and -2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _check(
            is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0",
        )
        _check(
            is_number(self.temperature) and 0.0 <= self.temperature < math.inf,
            "temperature",
            self.temperature,
            "a finite number >= 0",
        )
        _check(is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(
            is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            self.top_k,
            "-1 (disabled) or an integer >= 1",
        )
        _check(is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or is_int(self.seed), "seed", self.seed, "an integer or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a list of integers >= 0",
        )
        _check(
            all(isinstance(w, str) and w for w in self.bad_words),
            "bad_words",
            self.bad_words,
            "a list of non-empty strings",
        )
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        _check(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "None or an integer >= 1",
        )
        limit = "max_tokens" if self.max_tokens is None else f"max_tokens ({self.max_tokens})"
        _check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or math.inf),
            "min_tokens",
            self.min_tokens,
            f"an integer in [0, {limit}]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and value >= 0), name, value, "None or an integer >= 0")
        _check(
            all(callable(f) for f in self.logits_processors),
            "logits_processors",
            self.logits_processors,
            "a list of callables",
        )
        _check(
            self.truncate_prompt_tokens is None
            or (is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens >= 1),
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens,
            "None or an integer >= 1",
        )
        if self.guided_decoding is not None:
            from speculative.sampling.guided import GuidedDecodingParams
        _check(
            self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecodingParams),
            "guided_decoding",
            self.guided_decoding,
            "a GuidedDecodingParams or None",
        )
        _check(
            self.logit_bias is None
            or (
                isinstance(self.logit_bias, dict)
                and all(
                    is_int(t) and t >= 0 and is_number(b) and math.isfinite(b)
                    for t, b in self.logit_bias.items()
                )
            ),
            "logit_bias",
            self.logit_bias,
            "a dict of token id (>= 0) -> finite bias",
        )
        if self.logit_bias:
            self.logit_bias = {t: min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
        _check(
            self.allowed_token_ids is None
            or (
                isinstance(self.allowed_token_ids, (list, tuple))
                and len(self.allowed_token_ids) > 0
                and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
            ),
            "allowed_token_ids",
            self.allowed_token_ids,
            "None or a non-empty list of integers >= 0",
        )
        _check(
            not (self.stop and not self.detokenize),
            "stop",
            self.stop,
            "empty when detokenize is False (stop strings are matched in the text)",
        )
        _check(
            not (self.greedy and self.sampled_sequences > 1),
            "best_of" if self.best_of else "n",
            self.best_of or self.n,
            "1 with greedy sampling (temperature 0): the samples would be identical",
        )

    @property
    def greedy(self) -> bool:
        """True when the request samples greedily (temperature 0)."""
        return self.temperature == 0.0

    @property
    def sampled_sequences(self) -> int:
        """Sequences generated for the prompt: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; refuses logits_processors, which are callables."""
        if self.logits_processors:
            raise ValueError(
                "SamplingParams with logits_processors cannot be serialized (they are callables)"
            )
        data = {
            name: getattr(self, name) for name in self.__dataclass_fields__ if name != "logits_processors"
        }
        if self.guided_decoding is not None:
            data["guided_decoding"] = asdict(self.guided_decoding)
        if self.logit_bias:
            data["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """The inverse of to_dict."""
        data = dict(data)
        if data.get("guided_decoding") is not None:
            from speculative.sampling.guided import GuidedDecodingParams

            data["guided_decoding"] = GuidedDecodingParams(**data["guided_decoding"])
        if data.get("logit_bias"):
            data["logit_bias"] = {int(t): b for t, b in data["logit_bias"].items()}
        return super().from_dict(data)

    def token_ids_in_vocabulary(self, vocab_size: int) -> None:
        """Raise if a token id field names an id outside [0, vocab_size)."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            bad = [t for t in ids or [] if t >= vocab_size]
            _check(not bad, name, bad[:5], f"token ids in [0, {vocab_size})")
