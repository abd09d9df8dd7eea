"""Bad input: each malformed request gets the right status and OpenAI's error JSON naming the problem,
and the server goes on serving; a property-based fuzz of the request schema never gets a 500."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speculative import cli
from speculative.server.app import create_app, serve_app

from .conftest import MAX_MODEL_LEN, MAX_PROMPT_TOKENS, MODEL, ascii_tokenizer, running

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

CASES = [  # (name, path, body (a dict, or raw bytes), status, words the message must hold)
    ("invalid JSON", COMPLETIONS, b'{"prompt": "x",', 400, "not valid JSON"),
    ("body not an object", COMPLETIONS, b"[1, 2]", 400, "JSON object"),
    ("empty body", COMPLETIONS, b"", 400, "body is missing"),
    ("missing prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt is required"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages is required"),
    ("prompt of a wrong type", COMPLETIONS, {**OK, "prompt": 5}, 400, "prompt: must be a string"),
    ("temperature as text", COMPLETIONS, {**OK, "temperature": "hot"}, 400, "temperature"),
    ("max_tokens as a float", COMPLETIONS, {**OK, "max_tokens": 2.5}, 400, "max_tokens"),
    ("stream as text", COMPLETIONS, {**OK, "stream": "yes"}, 400, "stream"),
    ("stop of numbers", COMPLETIONS, {**OK, "stop": [1]}, 400, "stop: must be a string or a list of strings"),
    ("top_p out of range", COMPLETIONS, {**OK, "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("temperature below 0", COMPLETIONS, {**OK, "temperature": -1}, 400, "temperature must be"),
    (
        "presence_penalty out of range",
        CHAT,
        {**CHAT_OK, "presence_penalty": 3},
        400,
        "presence_penalty must be in [-2, 2]",
    ),
    ("max_tokens 0", COMPLETIONS, {**OK, "max_tokens": 0}, 400, "max_tokens must be"),
    ("n 0", COMPLETIONS, {**OK, "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ("n > 1 with greedy", COMPLETIONS, {**OK, "n": 2, "temperature": 0}, 400, "n must be 1 with greedy"),
    ("top_k 0", COMPLETIONS, {**OK, "top_k": 0}, 400, "top_k must be -1"),
    ("min_tokens over max_tokens", COMPLETIONS, {**OK, "min_tokens": 9}, 400, "min_tokens must be"),
    (
        "logprobs over 20",
        COMPLETIONS,
        {**OK, "logprobs": 21},
        400,
        "logprobs: Input should be less than or equal to 20",
    ),
    (
        "top_logprobs without logprobs",
        CHAT,
        {**CHAT_OK, "top_logprobs": 2},
        400,
        "top_logprobs needs logprobs",
    ),
    ("logit_bias key not a token id", COMPLETIONS, {**OK, "logit_bias": {"a": 1}}, 400, "logit_bias keys"),
    (
        "logit_bias token outside the vocabulary",
        COMPLETIONS,
        {**OK, "logit_bias": {"5000": 1}},
        400,
        "logit_bias",
    ),
    (
        "stop_token_ids outside the vocabulary",
        COMPLETIONS,
        {**OK, "stop_token_ids": [5000]},
        400,
        "stop_token_ids",
    ),
    (
        "prompt token ids outside the vocabulary",
        COMPLETIONS,
        {**OK, "prompt": [1, 5000]},
        400,
        "outside [0, 97)",
    ),
    ("empty prompt", COMPLETIONS, {**OK, "prompt": ""}, 400, "prompt is empty"),
    (
        "prompt over --max-prompt-tokens",
        COMPLETIONS,
        {**OK, "prompt": "x" * (MAX_PROMPT_TOKENS + 1)},
        400,
        f"limit of {MAX_PROMPT_TOKENS} (--max-prompt-tokens)",
    ),
    (
        "prompt + max_tokens over the context",
        COMPLETIONS,
        {**OK, "max_tokens": MAX_MODEL_LEN},
        400,
        f"more than the model's context of {MAX_MODEL_LEN}",
    ),
    (
        "best_of with stream",
        COMPLETIONS,
        {**OK, "temperature": 1, "best_of": 3, "stream": True},
        400,
        "best_of",
    ),
    ("echo", COMPLETIONS, {**OK, "echo": True}, 400, "echo is not supported"),
    ("empty messages", CHAT, {**CHAT_OK, "messages": []}, 400, "messages: List should have at least 1 item"),
    (
        "unknown role",
        CHAT,
        {**CHAT_OK, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "image content",
        CHAT,
        {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    (
        "unknown response_format",
        CHAT,
        {**CHAT_OK, "response_format": {"type": "xml"}},
        400,
        "response_format.type",
    ),
    (
        "json_schema without a schema object",
        CHAT,
        {**CHAT_OK, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema is required",
    ),
    (
        "invalid JSON schema",
        CHAT,
        {
            **CHAT_OK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            },
        },
        400,
        "invalid json constraint",
    ),
    ("seed out of range", COMPLETIONS, {**OK, "seed": 2**70}, 400, "seed"),
    ("unknown model", COMPLETIONS, {**OK, "model": "gpt-9"}, 404, "gpt-9` does not exist"),
    ("unknown route", "/v1/embeddings", OK, 404, "no route POST /v1/embeddings"),
]


@pytest.mark.parametrize("name, path, body, status, words", CASES, ids=[c[0] for c in CASES])
def test_bad_request(served, name, path, body, status, words) -> None:
    if isinstance(body, bytes):
        response = served.post(path, content=body)
    else:
        response = served.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


LIMITS = [  # (name, path, body, the param named, words the message must hold)
    ("n over --max-num-seqs", COMPLETIONS, {**OK, "n": 33, "temperature": 1}, "n", "n must be in [1, 32]"),
    (
        "best_of over --max-num-seqs",
        COMPLETIONS,
        {**OK, "best_of": 40, "temperature": 1},
        "best_of",
        "best_of must be in [1, 32]",
    ),
    ("n over 128", CHAT, {**CHAT_OK, "n": 129}, "n", "n: Input should be less than or equal to 128"),
    (
        "top_logprobs over 20",
        CHAT,
        {**CHAT_OK, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "less than or equal to 20",
    ),
    ("17 stop strings", COMPLETIONS, {**OK, "stop": list("abcdefghijklmnopq")}, "stop", "at most 16 strings"),
    (
        "a stop string of 257 characters",
        CHAT,
        {**CHAT_OK, "stop": ["x" * 257]},
        "stop",
        "each of stop must be at most 256 characters long; got one of 257",
    ),
    (
        "1025 logit biases",
        COMPLETIONS,
        {**OK, "logit_bias": {str(i): 1.0 for i in range(1025)}},
        "logit_bias",
        "logit_bias must hold at most 1024 entries; got 1025",
    ),
    (
        "1025 stop token ids",
        CHAT,
        {**CHAT_OK, "stop_token_ids": list(range(1025))},
        "stop_token_ids",
        "at most 1024 entries; got 1025",
    ),
    ("129 bad words", COMPLETIONS, {**OK, "bad_words": ["a"] * 129}, "bad_words", "at most 128 entries"),
    (
        "a bad word of 257 characters",
        COMPLETIONS,
        {**OK, "bad_words": ["x" * 257]},
        "bad_words",
        "each of bad_words must be at most 256 characters long; got one of 257",
    ),
]


@pytest.mark.parametrize("name, path, body, param, words", LIMITS, ids=[c[0] for c in LIMITS])
def test_limits_name_the_parameter_and_its_range(served, name, path, body, param, words) -> None:
    response = served.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_lists_at_the_limits_are_taken(served) -> None:
    body = {**OK, "stop": [chr(ord("a") + i) * 256 for i in range(16)]}
    assert served.post(COMPLETIONS, body).status_code == 200
    body = {
        **OK,
        "stop_token_ids": [i % 90 + 5 for i in range(1024)],
        "bad_words": [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(127)] + ["x" * 256],
    }
    assert served.post(COMPLETIONS, body).status_code == 200
    many = {**OK, "logit_bias": {str(i): 0.5 for i in range(1024)}}  # more than the test model's vocabulary
    error = served.post(COMPLETIONS, many).json()["error"]
    assert "at most" not in error["message"] and error["param"] == "logit_bias", error


def test_a_body_over_the_size_limit_is_413(served) -> None:
    """1 MiB + 1 byte, declared by Content-Length or sent chunked with none: 413, OpenAI's error JSON."""
    big = json.dumps({**OK, "user": "x" * (1 << 20)}).encode()

    def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    for content in (big, chunks()):
        response = served.post(COMPLETIONS, content=content)
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert "limit of 1048576 bytes (--max-request-bytes)" in error["message"], error
        assert error["code"] == "request_too_large"
    assert served.post(COMPLETIONS, {**OK, "user": "x" * 1000}).status_code == 200


def test_max_request_bytes_flag(capsys) -> None:
    assert cli.main(["serve", "--max-request-bytes", "0"]) == 2
    assert "--max-request-bytes must be >= 1; got 0" in capsys.readouterr().err
    app = serve_app(*cli.serve_args(["--max-request-bytes", "200"]))
    body = {"prompt": "x", "max_tokens": 1}
    with running(app) as url:
        assert httpx.post(url + COMPLETIONS, json=body, timeout=60).status_code == 200
        assert httpx.post(url + COMPLETIONS, json={**body, "user": "x" * 200}, timeout=60).status_code == 413


def test_constraints_at_a_dead_end_are_a_400_for_that_request_alone(served) -> None:
    """allowed_token_ids {"{", "a"} under response_format json_object: "{", then no token is allowed.
    Not detectable up front (the first position has one): the request ends with a 400 naming
    allowed_token_ids, streamed as an error event before [DONE], while a request beside it succeeds."""
    allowed = served.tokenizer.convert_tokens_to_ids(["{", "a"])
    body = {**OK, "max_tokens": 8, "allowed_token_ids": allowed, "response_format": {"type": "json_object"}}
    message = "allowed_token_ids and guided_decoding leave no token allowed after 1 generated tokens"
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(served.post, COMPLETIONS, {**OK, "max_tokens": 32, "ignore_eos": True})
        response = served.post(COMPLETIONS, body)
        assert beside.result().status_code == 200
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": "allowed_token_ids",
        "code": None,
    }
    streamed = served.post(COMPLETIONS, {**body, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == message
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "{"
    assert served.post(COMPLETIONS, OK).status_code == 200


def test_wrong_method_and_still_serving(served) -> None:
    response = served.get(COMPLETIONS)
    assert response.status_code == 405 and "GET is not allowed" in response.json()["error"]["message"]
    for path, body in ((COMPLETIONS, OK), (CHAT, CHAT_OK)):
        response = served.post(path, body)
        assert response.status_code == 200, response.text


FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
    "stream",
    "stream_options",
    "user",
    "echo",
    "best_of",
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
    "unknown_field",
]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.integers(-3, 120), max_size=4),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-200, 200), max_size=2),
)
TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=12)
PLAUSIBLE = {
    "model": st.just(MODEL),
    "prompt": st.one_of(TEXT, st.lists(st.integers(0, 96), min_size=1, max_size=6)),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
        min_size=1,
        max_size=3,
    ),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "seed": st.integers(0, 2**32),
    "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
    "top_logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 96).map(str), st.floats(-100, 100), max_size=2),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
        ]
    ),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "best_of": st.integers(1, 3),
    "top_k": st.integers(-1, 200),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 96)),
    "allowed_token_ids": st.lists(st.integers(0, 96), min_size=1, max_size=4),
    "bad_words": st.lists(st.text(min_size=1, max_size=3), max_size=2),
}


MOSTLY = st.sampled_from([True, True, True, True, False])


@st.composite
def bodies(draw, path: str) -> dict:
    """A request body for path: its required field mostly plausible, other fields plausible four times in
    five and junk otherwise; max_tokens always small (or junk) so that generation stays short."""
    required = "prompt" if path == COMPLETIONS else "messages"
    body = {}
    for name in [required, *draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True))]:
        plausible = PLAUSIBLE.get(name)
        body[name] = draw(plausible if plausible is not None and draw(MOSTLY) else JUNK)
    for name in ("max_tokens", "max_completion_tokens")[: draw(st.integers(1, 2))]:
        body[name] = draw(st.integers(1, 6) if draw(MOSTLY) else JUNK.filter(lambda v: v is not None))
    return body


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_requests_never_500(served, data) -> None:
    path = data.draw(st.sampled_from([COMPLETIONS, CHAT]))
    body = data.draw(bodies(path))
    response = served.post(path, content=json.dumps(body).encode(), timeout=30)  # NaN and Infinity too
    assert response.status_code < 500, (body, response.text)
    if response.status_code != 200 or body.get("stream") is not True:
        response.json()  # an error (or answer) in JSON
        return
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        assert "error" not in json.loads(event), event


def test_nulls_mean_defaults(served) -> None:
    """Clients that send null for fields they leave unset (as some SDKs do) get the defaults."""
    nulls = dict.fromkeys(
        [
            "n",
            "temperature",
            "top_p",
            "stop",
            "seed",
            "logprobs",
            "presence_penalty",
            "echo",
            "stream",
            "stream_options",
            "logit_bias",
            "best_of",
            "suffix",
            "user",
            "ignore_eos",
            "min_tokens",
            "skip_special_tokens",
            "response_format",
        ]
    )
    response = served.post(COMPLETIONS, {**OK, **nulls})
    assert response.status_code == 200, response.text
    response = served.post(CHAT, {**CHAT_OK, **nulls, "top_logprobs": None, "max_completion_tokens": None})
    assert response.status_code == 200, response.text


def test_chat_without_a_chat_template(served) -> None:
    """A tokenizer without a chat template: chat completions answer 400 saying so (checked before the
    scheduler, which this app never starts)."""
    tokenizer = ascii_tokenizer()
    tokenizer.chat_template = None
    app = create_app(
        served.scheduler,
        model_name=MODEL,
        tokenizer=tokenizer,
        api_key=None,
        max_prompt_tokens=None,
        max_model_len=MAX_MODEL_LEN,
    )
    response = TestClient(app).post(CHAT, json=CHAT_OK)
    assert response.status_code == 400
    assert "no chat template" in response.json()["error"]["message"]


def test_response_format_without_the_guided_extra(served, hide_module) -> None:
    hide_module("llguidance", "speculative.sampling.guided")
    response = served.post(CHAT, {**CHAT_OK, "response_format": {"type": "json_object"}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert "needs the guided extra: pip install 'speculative[guided]'" in error["message"], error
