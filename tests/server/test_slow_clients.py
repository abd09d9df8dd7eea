"""Slow clients hold nothing for long: a body sent slowly gets a 408 after --timeout-request-body, an
idle keep-alive connection closes after --timeout-keep-alive, a client that stops reading its stream
is dropped after --timeout-send, connections beyond --limit-concurrency get a 503, and the requests of
other clients are served meanwhile."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from speculative import cli
from speculative.server.app import create_app
from speculative.server.args import SHUTDOWN_GRACE_S, ServerArgs, uvicorn_options
from speculative.server.scheduler import Scheduler

from .conftest import MAX_MODEL_LEN, MODEL, running, speculative_llm, tiny_pair

BODY_TIMEOUT_S = 1.0
SEND_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1
LIMIT = 8
REQUEST = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    target, draft, tokenizer = tiny_pair()
    app = create_app(
        Scheduler(speculative_llm(target, draft, tokenizer), max_num_seqs=4),
        model_name=MODEL,
        tokenizer=tokenizer,
        api_key=None,
        max_prompt_tokens=None,
        max_model_len=MAX_MODEL_LEN,
        request_body_timeout=BODY_TIMEOUT_S,
        send_timeout=SEND_TIMEOUT_S,
    )
    with running(app, timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=LIMIT) as base:
        yield base


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One response (its head and Content-Length bytes of body), leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))[15:]
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def assert_served(url: str) -> None:
    response = httpx.post(url + "/v1/completions", json=REQUEST, timeout=30)
    assert response.status_code == 200, response.text


def test_a_body_sent_too_slowly_gets_408_and_holds_no_one_up(url) -> None:
    body = json.dumps(REQUEST).encode()
    with connect(url) as slow:
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body[:10]
        )
        start = time.monotonic()
        assert_served(url)  # while the slow body is pending
        answer = read_all(slow)  # the rest of the body never comes
        waited = time.monotonic() - start
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower()
    error = json.loads(content)["error"]
    assert "did not arrive within 1 s (--timeout-request-body)" in error["message"], error
    assert BODY_TIMEOUT_S * 0.9 <= waited < 30


def test_an_idle_keep_alive_connection_is_closed(url) -> None:
    with connect(url) as idle:
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        first = read_response(idle)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b'{"status":"ok"}'), first
        assert_served(url)  # while the connection idles
        assert read_all(idle) == b""  # closed by the server, with nothing more sent
        assert KEEP_ALIVE_S * 0.9 <= time.monotonic() - start < 30


LONG_CONTEXT = 8192  # tokens: a stream of 4 sequences with logprobs, megabytes, outlasting the timeout


def test_a_client_that_stops_reading_its_stream_is_dropped() -> None:
    """A client that reads only the head of a long stream (4 sequences with 20 logprobs a token: large
    events) and then nothing, so that the connection's buffers fill: after --timeout-send the server
    drops it as a client that left: the request is aborted (its rows freed while the stream had far
    to go), counted 499, the connection closed without the end of the stream, and other requests are
    served meanwhile. Without the timeout the stream's handler waits on that client forever and its
    rows run to the end."""
    target, draft, tokenizer = tiny_pair(max_position_embeddings=LONG_CONTEXT)
    scheduler = Scheduler(speculative_llm(target, draft, tokenizer), max_num_seqs=8)
    app = create_app(
        scheduler,
        model_name=MODEL,
        tokenizer=tokenizer,
        api_key=None,
        max_prompt_tokens=None,
        max_model_len=LONG_CONTEXT,
        send_timeout=SEND_TIMEOUT_S,
    )
    with running(app) as base:
        host, port = base.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect((host, int(port)))
        stream = {"max_tokens": LONG_CONTEXT - 16, "ignore_eos": True, "stream": True, "n": 4, "logprobs": 20}
        body = json.dumps({**REQUEST, **stream, "temperature": 1.0, "seed": 0}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first
        deadline = time.monotonic() + 60
        while "abort" not in (finished := _counts(base, "speculative:request_finished_total")):
            assert time.monotonic() < deadline, f"the stalled stream still runs: {finished}"
            time.sleep(0.2)
        assert finished["abort"] == 1.0 and set(finished) == {"abort"}, finished  # cut short, not run out
        assert_served(base)
        sock.settimeout(30)
        rest = read_all(sock)  # what the buffers held, then the server's close
        assert b"[DONE]" not in rest
        statuses = _counts(base, 'speculative:http_requests_total{endpoint="/v1/completions"')
        assert statuses == {"499": 1.0, "200": 1.0}, statuses


def _counts(url: str, metric: str) -> dict[str, float]:
    """The values of `metric`'s series in /metrics, by the last label's value."""
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return {
        line.split('"')[-2]: float(line.split()[-1])
        for line in lines
        if line.startswith(metric.rstrip("}")) and "{" in line and not line.startswith("#")
    }


def test_connections_beyond_the_limit_get_503(url) -> None:
    with ExitStack() as stack:
        for _ in range(LIMIT):  # connections that send nothing
            stack.enter_context(connect(url))
        time.sleep(0.2)  # the server has accepted them
        assert httpx.get(url + "/health", timeout=30).status_code == 503
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health", timeout=30).status_code != 200:  # their closing frees the room
        assert time.monotonic() < deadline, "the closed connections still count"
        time.sleep(0.05)
    assert_served(url)


def test_serve_passes_the_slow_client_flags_to_uvicorn(capsys) -> None:
    server, _ = cli.serve_args(
        ["--timeout-keep-alive", "2", "--limit-concurrency", "64", "--h11-max-incomplete-event-size", "4096"]
    )
    options = uvicorn_options(server)
    assert options["timeout_keep_alive"] == 2 and options["limit_concurrency"] == 64
    assert options["h11_max_incomplete_event_size"] == 4096
    defaults = uvicorn_options(ServerArgs())
    assert (defaults["timeout_keep_alive"], defaults["limit_concurrency"]) == (5, 1024)
    # uvicorn drops connections only after the shutdown timeout and a write's timeout have passed
    assert defaults["timeout_graceful_shutdown"] == 30 + 30 + SHUTDOWN_GRACE_S
    for flag, value, message in (
        ("--timeout-request-body", "0", "--timeout-request-body must be > 0; got 0.0"),
        ("--timeout-send", "0", "--timeout-send must be > 0; got 0.0"),
        ("--limit-concurrency", "0", "--limit-concurrency must be >= 1; got 0"),
        ("--timeout-keep-alive", "0", "--timeout-keep-alive must be >= 1; got 0"),
        ("--max-prefill-tokens", "0", "--max-prefill-tokens must be >= 1; got 0"),
    ):
        assert cli.main(["serve", flag, value]) == 2
        assert message in capsys.readouterr().err
