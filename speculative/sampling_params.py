"""SamplingParams: how one request is sampled, with vLLM's names, meanings and ranges.

Follows the OpenAI completions API and vLLM's SamplingParams. Every field is validated at construction,
and a bad value raises a ValueError that names the field and its allowed range. Checks that need the
model (token ids inside the vocabulary, prompt length against the context) happen in `LLM.generate`,
before any work starts.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from speculative.extras import needs_extra
from speculative.fields import DictRoundTrip, check, is_int, is_number

_check = functools.partial(check, owner="SamplingParams")

LogitsProcessor = Callable[..., Any]
"""vLLM's signatures: fn(output_token_ids, logits) or fn(prompt_token_ids, output_token_ids, logits),
with logits [vocab] for one position; returns the new logits [vocab]."""

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class GuidedDecodingParams:
    """vLLM's guided decoding parameters: exactly one of json, regex, choice, grammar, json_object.

    json: a JSON schema (a dict or its JSON text); the output is a JSON value valid under it. Object
        properties come out in the schema's order; compact (no free whitespace) unless the schema's
        "x-guidance" options say otherwise. regex: the whole output matches it (Rust `regex` syntax, as
        llguidance reads it).
    choice: the output is exactly one of these strings. grammar: a Lark grammar in llguidance's syntax
        (or GBNF, which is converted). json_object: the output is any JSON object.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        chosen = self._set_fields()
        if len(chosen) != 1:
            raise ValueError(
                f"exactly one of {', '.join(_KINDS)} must be set; got "
                f"{', '.join(chosen) if chosen else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a dict or a JSON string, not {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, not {type(value).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("choice must be a list of strings")
            if len(self.choice) == 0:
                raise ValueError("choice must list at least one string")

    def _set_fields(self) -> list[str]:
        chosen = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            chosen.append("json_object")
        return chosen

    def kind(self) -> str:
        """The field that is set: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        return self._set_fields()[0]

    def key(self) -> tuple[str, str]:
        """A hashable, canonical description of the constraint (for caches)."""
        kind = self.kind()
        if kind == "json":
            return kind, _schema_text(self.json)
        if kind == "choice":
            return kind, json.dumps(list(self.choice), ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _schema_text(schema: dict | str) -> str:
    """The schema as compact JSON text, keys in their given order (it sets the order of properties)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema must be an object, not {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"json schema is not JSON-serializable: {e}") from None


def _needs_guided() -> None:
    """Guided decoding runs on llguidance (speculative/sampling/guided.py, where GuidedDecodingParams is
    also found): a request for it without the guided extra is refused at once, naming the extra."""
    with needs_extra("guided", "guided decoding"):
        import llguidance  # noqa: F401


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
            _needs_guided()
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
            _needs_guided()
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
