"""OpenAI's wire format at the HTTP edge: request bodies (pydantic), their SamplingParams, response dicts.

Requests follow OpenAI's `POST /v1/completions` and `POST /v1/chat/completions` bodies plus vLLM's
sampling extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens, include_stop_str_in_output, allowed_token_ids, bad_words). Types are strict (a
string is not a number); ranges are SamplingParams' own, so its ValueError, which names the field,
becomes a 400 here (`APIError`). Unknown fields are ignored, as OpenAI's own server does; fields that
would change the answer and that this server cannot honour (echo, suffix, tools) are refused.

`prompt` may be a string, a list of token ids, or a list of either: each prompt of a list gets n
choices, prompt i's choice j at index i * n + j, as OpenAI numbers them.

Responses are plain dicts in OpenAI's shapes: `text_completion` and `chat.completion` objects, their
streaming chunks (`text_completion` again and `chat.completion.chunk`), usage, and log-probabilities in
each endpoint's format.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from speculative.engine.outputs import Logprob
from speculative.sampling_params import SamplingParams

if TYPE_CHECKING:
    from speculative.sampling.guided import GuidedDecodingParams

MAX_CHOICES = 128
"""n and best_of at most: one request cannot fill the server with sequences."""
MAX_LOGPROBS = 20
"""logprobs / top_logprobs at most (OpenAI's and vLLM's default limit)."""
MAX_STOP = 16
"""Stop strings per request at most (OpenAI takes 4; vLLM's clients may send more)."""
MAX_STOP_CHARS = 256
"""Characters per stop string at most: the engine looks for each one after every step."""
MAX_ENTRIES = {"logit_bias": 1024, "stop_token_ids": 1024, "bad_words": 128}
"""Entries per request at most in these fields (the body's size alone would let one request carry
tens of thousands): each is applied to the request's rows at every step (bad_words: each word's tokens
matched against the row's latest tokens), so a long list slows every sequence of the batch."""
MIN_LOGPROB = -9999.0
"""OpenAI's stand-in for a log-probability of -inf (JSON has no infinity)."""
_INT64 = 2**63


class APIError(Exception):
    """A request answered with OpenAI's error JSON: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _one_of(description: str):
    """A validator that reports a failed union as one clear error instead of one per member."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", f"must be {description}") from None

    return WrapValidator(validate)


TokenIds = list[Annotated[int, Field(ge=0, lt=_INT64)]]
Prompt = Annotated[
    str | TokenIds | list[str] | list[TokenIds],
    _one_of("a string, a list of token ids (integers >= 0), or a non-empty list of either"),
]
Stop = Annotated[str | list[str] | None, _one_of("a string or a list of strings")]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    """Stream one more chunk, with no choices, holding the request's usage."""
    continuous_usage_stats: bool = False
    """With include_usage (vLLM's extension): every chunk holds the usage so far, so that a client
    knows how many tokens each chunk brought (a speculative step's chunk can hold several)."""


class JsonSchema(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema the output follows; None allows any JSON object."""
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None
    """Required with type "json_schema"."""


_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
)
"""Request fields that are SamplingParams fields of the same name and meaning."""


class SamplingRequest(_Body):
    """The fields both endpoints share: OpenAI's, then vLLM's extras. Null (or leaving a field out)
    means SamplingParams' default; see SamplingParams for each field's range."""

    model: str | None = None
    """The served model's name; None means the served model."""
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> bias added to its logit."""
    response_format: ResponseFormat | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    return_speculation_metrics: bool = False
    """Add the request's speculation figures (vLLM's names: SpeculationMetrics.vllm_fields) to the
    response as "speculation_metrics"; streamed, to the last chunk before [DONE]."""

    def check_limits(self, max_choices: int) -> None:
        """The server's limits that the schema does not hold, checked before any tokenization: n and
        best_of at most max_choices, at most MAX_STOP stop strings and MAX_ENTRIES bad words, logit
        biases and stop token ids, stop strings and bad words of MAX_STOP_CHARS characters at most.
        An APIError (400) naming the field and its allowed range."""
        for name in ("n", "best_of"):
            value = getattr(self, name, None)
            if value is not None and value > max_choices:
                raise APIError(
                    400,
                    f"{name} must be in [1, {max_choices}] on this server (its sequences all run at "
                    f"once, --max-num-seqs); got {value}",
                    param=name,
                )
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP:
            raise APIError(400, f"stop must hold at most {MAX_STOP} strings; got {len(stop)}", param="stop")
        for name, most in MAX_ENTRIES.items():
            count = len(getattr(self, name) or ())
            if count > most:
                raise APIError(400, f"{name} must hold at most {most} entries; got {count}", param=name)
        for name, strings in (("stop", stop), ("bad_words", self.bad_words or [])):
            longest = max(map(len, strings), default=0)
            if longest > MAX_STOP_CHARS:
                raise APIError(
                    400,
                    f"each of {name} must be at most {MAX_STOP_CHARS} characters long; got one of {longest}",
                    param=name,
                )

    def _sampling_params(self, max_tokens: int, logprobs: int | None, best_of: int | None) -> SamplingParams:
        """SamplingParams of this request, or an APIError (400) naming the offending field."""
        if self.stream and best_of is not None and best_of != (self.n or 1):
            raise APIError(
                400,
                "best_of must equal n (or be left out) when stream is true: only the "
                "n best sequences are returned, known at the end",
                param="best_of",
            )
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(
                **given,
                max_tokens=max_tokens,
                logprobs=logprobs,
                best_of=best_of,
                logit_bias=self._logit_bias(),
                guided_decoding=self._guided_decoding(),
            )
        except ValueError as error:
            raise invalid_request(error) from None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bad = [key for key in self.logit_bias if not re.fullmatch(r"\d{1,18}", key)]
        if bad:
            raise APIError(
                400,
                f"logit_bias keys must be token ids (decimal integers >= 0); got {bad[0]!r}",
                param="logit_bias",
            )
        return {int(key): bias for key, bias in self.logit_bias.items()}

    def _guided_decoding(self) -> GuidedDecodingParams | None:
        """response_format's constraint; None for text. Without the guided extra a constraint is a 400
        naming response_format."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        try:
            from speculative.sampling.guided import GuidedDecodingParams
        except ModuleNotFoundError as error:
            raise APIError(
                400,
                f"response_format {fmt.type!r} is not available on this server: {error}",
                param="response_format",
            ) from None
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(
                    400,
                    'response_format.json_schema is required when response_format.type is "json_schema"',
                    param="response_format.json_schema",
                )
            if fmt.json_schema.schema_ is not None:
                return GuidedDecodingParams(json=fmt.json_schema.schema_)
        return GuidedDecodingParams(json_object=True)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`. max_tokens defaults to 16, as OpenAI's; null fills the context."""

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """The chosen token's log-probability and this many top ones, per token."""
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    echo: bool | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per element of a batch."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:  # [] is an empty list of token ids
            raise APIError(400, "prompt is empty: it needs at least one token", param="prompt")
        return list(prompt)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams with max_tokens resolved by the server (the request's, or what the context
        allows)."""
        if self.echo:
            raise APIError(400, "echo is not supported by this server; leave it out or false", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server; leave it out", param="suffix")
        return self._sampling_params(max_tokens, self.logprobs, self.best_of)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[
        str | list[ContentPart] | None, _one_of('a string or a list of {"type": "text", "text": ...} parts')
    ] = None
    name: str | None = None

    def template_input(self) -> dict[str, str]:
        """The message as chat templates take it: role and content as one string."""
        content = (
            self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        )
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`. max_completion_tokens (or the older max_tokens) defaults to what the
    context leaves."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams with max_tokens resolved by the server (the request's, or what the context
        allows)."""
        if self.tools:
            raise APIError(400, "tools are not supported by this server", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, None)


def invalid_request(error: Exception) -> APIError:
    """SamplingParams' ValueError ("SamplingParams.top_p must be ...") as a 400 naming the field."""
    message = str(error)
    found = re.match(r"SamplingParams\.(\w+)", message)
    param = {"guided_decoding": "response_format"}.get(found[1], found[1]) if found else None
    return APIError(400, message.replace("SamplingParams.", "", 1) if found else message, param=param)


# ---- responses ----


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with num_cached_tokens (a server with prefix caching), its
    prompt_tokens_details.cached_tokens: the prompt tokens whose prefill the prefix cache saved."""
    body = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


def response_object(
    object: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict],
    usage: dict | None,
    with_usage: bool = True,
    speculation_metrics: dict | None = None,
) -> dict:
    """A response or streamed chunk: object is "text_completion", "chat.completion" or
    "chat.completion.chunk". Chunks carry "usage" (null but on the last) only when the request asked
    for it (stream_options.include_usage; on every chunk with continuous_usage_stats);
    "speculation_metrics" is there when given."""
    body = {"id": request_id, "object": object, "created": created, "model": model, "choices": choices}
    if with_usage:
        body["usage"] = usage
    if speculation_metrics is not None:
        body["speculation_metrics"] = speculation_metrics
    return body


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None
) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_choice(
    index: int,
    text: str | None,
    logprobs: dict | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    *,
    role: bool = False,
    chunk: bool = False,
) -> dict:
    """A chat choice: with chunk=True its `delta` holds the role (first chunk) and the new text."""
    message: dict[str, str] = {"role": "assistant"} if role or not chunk else {}
    if text is not None and (text or not chunk or role):
        message["content"] = text
    return {
        "index": index,
        "delta" if chunk else "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], decode, text_offset: int
) -> dict:
    """The completions endpoint's log-probabilities of some tokens.

    token_ids: the chosen tokens; logprobs: one {token id: Logprob} per token (the chosen and the top
    N, as the engine gives them); decode: token id -> its text; text_offset: the text's length before
    these tokens. Returns {tokens, token_logprobs, top_logprobs, text_offset}, top_logprobs holding
    every entry the engine gave (the chosen token and the top N), as vLLM does.
    """
    tokens, values, tops, offsets = [], [], [], []
    for token, entries in zip(token_ids, logprobs):
        text = _token_text(token, entries, decode)
        tokens.append(text)
        values.append(_finite(entries[token].logprob))
        tops.append({_token_text(t, entries, decode): _finite(e.logprob) for t, e in entries.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def end_offset(logprobs: dict, text_offset: int) -> int:
    """The text_offset after `completion_logprobs(..., text_offset)`'s tokens."""
    if not logprobs["tokens"]:
        return text_offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int, decode) -> dict:
    """The chat endpoint's log-probabilities: {"content": [{token, logprob, bytes, top_logprobs}]},
    top_logprobs being the num_top most likely tokens at each position, most likely first."""
    content = []
    for token, entries in zip(token_ids, logprobs):
        top = sorted(
            ((t, e) for t, e in entries.items() if e.rank is not None and e.rank <= num_top),
            key=lambda item: item[1].rank,
        )
        content.append(
            {
                **_chat_token(token, entries[token], entries, decode),
                "top_logprobs": [_chat_token(t, e, entries, decode) for t, e in top],
            }
        )
    return {"content": content}


def _chat_token(token: int, entry: Logprob, entries: dict[int, Logprob], decode) -> dict:
    text = _token_text(token, entries, decode)
    return {"token": text, "logprob": _finite(entry.logprob), "bytes": list(text.encode("utf-8"))}


def _token_text(token: int, entries: dict[int, Logprob], decode) -> str:
    decoded = entries[token].decoded_token
    return decoded if decoded is not None else decode(token)


def _finite(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)
