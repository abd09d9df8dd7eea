"""`speculative serve` as a user runs it: a subprocess on 127.0.0.1, the official openai client, and a
graceful shutdown on SIGTERM that lets a running stream finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from speculative import LLM, SamplingParams, SpeculativeConfig

from .conftest import free_port, tiny_pair

KEY = "cli-key"
CONTEXT = 2048  # long enough for a stream that outlasts the SIGTERM
LONG_SHUTDOWN_S = 120.0
"""The shutdown timeout of a server whose streams must finish; also how long a test waits on one."""


def save_tiny_pair(root) -> tuple[str, str]:
    """The tiny pair (context CONTEXT) saved under `root`; returns (target path, draft path)."""
    target, draft, tokenizer = tiny_pair(max_position_embeddings=CONTEXT)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> tuple[str, str]:
    return save_tiny_pair(tmp_path_factory.mktemp("served"))


@contextmanager
def speculative_serve(
    model_paths, shutdown_timeout: float, *flags: str
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`speculative serve` with the key from SPECULATIVE_API_KEY and these extra flags; yields (base
    URL, process)."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speculative.cli",
            "serve",
            "--model",
            model_paths[0],
            "--draft-model",
            model_paths[1],
            "-k",
            "3",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--shutdown-timeout",
            str(shutdown_timeout),
            *flags,
        ],
        env={**os.environ, "SPECULATIVE_API_KEY": KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:  # a server that misses its start deadline is stopped too, never left running
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "speculative serve did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def cli_server(model_paths):
    """A server whose running requests have all the time they need after SIGTERM."""
    with speculative_serve(model_paths, shutdown_timeout=LONG_SHUTDOWN_S) as served:
        yield served


def test_openai_client_against_speculative_serve(cli_server, model_paths) -> None:
    url, _ = cli_server
    offline = LLM(
        model_paths[0],
        draft_model=model_paths[1],
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    text = (
        client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    assert (
        text
        == offline.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    )
    messages = [{"role": "user", "content": "hello"}]
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True
        )
    )
    ids = offline.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    expected = offline.generate(ids, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert httpx.get(url + "/v1/models").status_code == 401  # the key came from SPECULATIVE_API_KEY


def test_a_non_streaming_client_that_leaves_frees_its_rows(cli_server) -> None:
    url, _ = cli_server
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "x", "max_tokens": CONTEXT - 64, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        families = text_string_to_metric_families(httpx.get(url + "/metrics", headers=headers).text)
        samples = {(s.name, tuple(s.labels.values())): s.value for f in families for s in f.samples}
        if samples.get(("speculative:request_finished_total", ("abort",))) == 1:
            break
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)
    assert samples[("speculative:num_sequences_running", ())] == 0
    assert samples[("speculative:http_requests_total", ("/v1/completions", "499"))] == 1


class Stream(threading.Thread):
    """A streamed completion read in a thread: its SSE data lines as they come, and how it ended."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__()
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "x",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {KEY}"}
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=body, headers=headers, timeout=LONG_SHUTDOWN_S
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except Exception as error:  # the test asserts there is none
            self.error = error
        self.started.set()

    def assert_finished(self) -> None:
        """The stream ran to max_tokens: its last choice, its usage, then [DONE]."""
        assert self.error is None, f"the stream was cut: {self.error!r}"
        assert self.events[-1] == "[DONE]", "the stream was cut"
        assert json.loads(self.events[-2])["usage"]["completion_tokens"] == self.max_tokens
        assert json.loads(self.events[-3])["choices"][0]["finish_reason"] == "length"


def assert_refused(url: str) -> None:
    """A request sent after SIGTERM is refused at once: 503, or no connection; never a hang."""
    try:
        response = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 4},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=10,
        )
    except httpx.TimeoutException:
        pytest.fail("a request sent after SIGTERM hung")
    except httpx.TransportError:
        return  # the listener is closed
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"


def tokens_per_second(url: str) -> float:
    """The running server's decoding speed, from a timed greedy request of 64 tokens."""
    start = time.perf_counter()
    response = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 64, "temperature": 0, "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=LONG_SHUTDOWN_S,
    )
    assert response.status_code == 200, response.text
    return 64 / (time.perf_counter() - start)


def test_sigterm_lets_the_running_stream_finish(cli_server) -> None:
    """A stream of about two seconds at the server's measured speed is running at SIGTERM (it has sent
    its first events, not its end), and the shutdown timeout is far longer: it must end whole."""
    url, process = cli_server
    stream = Stream(url, max_tokens=min(CONTEXT - 64, max(32, int(2 * tokens_per_second(url)))))
    stream.start()
    assert stream.started.wait(timeout=LONG_SHUTDOWN_S) and stream.error is None, stream.error
    process.send_signal(signal.SIGTERM)
    assert "[DONE]" not in stream.events, "the stream had ended before the SIGTERM"
    assert_refused(url)
    stream.join(timeout=LONG_SHUTDOWN_S)
    assert process.wait(timeout=LONG_SHUTDOWN_S) in (0, -signal.SIGTERM), process.stdout.read()
    stream.assert_finished()


def test_sigterm_ends_the_streams_that_outlast_the_timeout_with_an_error(model_paths) -> None:
    """With --shutdown-timeout 0, streams far from their end at SIGTERM are cut at once: each gets an
    error event and [DONE] before its connection closes, never a dropped connection."""
    with speculative_serve(model_paths, shutdown_timeout=0) as (url, process):
        streams = [Stream(url, max_tokens=CONTEXT - 64) for _ in range(3)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.started.wait(timeout=LONG_SHUTDOWN_S) and stream.error is None, stream.error
        process.send_signal(signal.SIGTERM)
        assert_refused(url)
        for stream in streams:
            stream.join(timeout=LONG_SHUTDOWN_S)
        assert process.wait(timeout=LONG_SHUTDOWN_S) in (0, -signal.SIGTERM), process.stdout.read()
    for stream in streams:
        assert stream.error is None, f"the connection was dropped: {stream.error!r}"
        assert stream.events[-1] == "[DONE]"
        error = json.loads(stream.events[-2])["error"]
        assert error["type"] == "server_error" and "shut down" in error["message"], error
