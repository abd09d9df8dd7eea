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

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from speculative import LLM, SamplingParams, SpeculativeConfig

from .conftest import free_port, tiny_pair

KEY = "cli-key"
CONTEXT = 2048  # long enough for a stream that outlasts the SIGTERM


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("served")
    target, draft, tokenizer = tiny_pair(max_position_embeddings=CONTEXT)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="module")
def cli_server(model_paths):
    """`speculative serve` with the key from SPECULATIVE_API_KEY; yields (base URL, process)."""
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
            "20",
        ],
        env={**os.environ, "SPECULATIVE_API_KEY": KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "speculative serve did not come up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    try:
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


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


def test_sigterm_lets_the_running_stream_finish(cli_server) -> None:
    url, process = cli_server
    max_tokens = CONTEXT - 64
    events: list[str] = []
    first_event = threading.Event()

    def read_stream() -> None:
        body = {
            "model": "tiny",
            "prompt": "x",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_event.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first_event.wait(timeout=30)
    process.send_signal(signal.SIGTERM)
    events_at_signal = len(events)
    time.sleep(0.3)
    try:  # new requests are refused: the listener is closed (or, on a kept-alive connection, 503)
        assert httpx.get(url + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass
    reader.join(timeout=60)
    assert process.wait(timeout=30) in (0, -signal.SIGTERM), process.stdout.read()
    assert events[-1] == "[DONE]", "the running stream was cut"
    assert len(events) > events_at_signal + 2, "the stream had ended before the SIGTERM"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == max_tokens
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
