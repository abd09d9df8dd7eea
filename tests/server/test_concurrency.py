"""Many clients at once: 32 concurrent streams with mixed parameters, and clients that leave mid-stream."""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from speculative import SamplingParams

from .conftest import API_KEY, MODEL

PROMPTS = [
    "def add(a, b):",
    "class Stack:",
    "import os\n",
    "for i in range(10):",
    "# TODO",
    "x = [1, 2, 3]",
    "while True:",
    "return None",
]
NUM_CLIENTS = 32


def client_request(i: int) -> tuple[str, dict, SamplingParams | None]:
    """Client i's endpoint, body, and the SamplingParams whose offline text it must equal (greedy and
    seeded ones; None where the text is only checked for its length)."""
    prompt, max_tokens = PROMPTS[i % len(PROMPTS)], 8 + i % 5 * 4
    kind = i % 4
    if kind == 0:
        body = {"prompt": prompt, "temperature": 0}
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
    elif kind == 1:
        body = {
            "prompt": prompt,
            "temperature": 0.8,
            "top_p": 0.9,
            "top_k": 30,
            "seed": i,
            "ignore_eos": True,
        }
        params = SamplingParams(
            temperature=0.8, top_p=0.9, top_k=30, seed=i, ignore_eos=True, max_tokens=max_tokens
        )
    elif kind == 2:
        body = {
            "prompt": prompt,
            "temperature": 1.0,
            "presence_penalty": 0.5,
            "min_p": 0.05,
            "n": 2,
            "ignore_eos": True,
        }
        params = None
    else:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "repetition_penalty": 1.2,
        }
        params = SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=max_tokens)
    return (
        "/v1/chat/completions" if kind == 3 else "/v1/completions",
        {
            **body,
            "model": MODEL,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        params,
    )


def stream(url: str, path: str, body: dict) -> tuple[dict[int, str], dict[int, str], dict]:
    """POST a streaming request; returns each choice's text and finish reason, and the usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    with httpx.stream(
        "POST", url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for chunk in map(json.loads, events[:-1]):
        for choice in chunk["choices"]:
            delta = choice["delta"].get("content") if "delta" in choice else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (delta or "")
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
        usage = chunk.get("usage") or usage
    return texts, finish, usage


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def burst(served) -> None:
    """32 clients at once, each checked against what it asked for."""
    requests = [client_request(i) for i in range(NUM_CLIENTS)]
    expected = {}
    for i, (_path, body, params) in enumerate(requests):
        if params is not None:
            prompt = body.get("prompt") or served.tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            expected[i] = served.reference.generate(prompt, params)[0].outputs[0]
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        results = list(pool.map(lambda r: stream(served.url, r[0], r[1]), requests, timeout=120))
    for i, ((_path, body, _params), (texts, finish, usage)) in enumerate(zip(requests, results)):
        n = body.get("n", 1)
        assert sorted(texts) == sorted(finish) == list(range(n)), (i, texts, finish)
        if i in expected:
            assert texts[0] == expected[i].text, (i, body)
            assert finish[0] == expected[i].finish_reason
        if body.get("ignore_eos"):
            assert usage["completion_tokens"] == n * body["max_tokens"], (i, usage)
            assert set(finish.values()) == {"length"}


def test_32_concurrent_streams(served) -> None:
    for _ in range(2):  # the allocator's arenas and caches settle over the first bursts
        burst(served)
        served.wait_for(
            lambda: served.scheduler.num_running == 0 and served.scheduler.num_waiting == 0,
            what="an idle scheduler",
        )
    assert served.scheduler.engine.batch is None and served.scheduler.engine.cache is None
    before = resident_bytes()
    burst(served)  # the same again: nothing a request held may stay behind
    served.wait_for(lambda: served.scheduler.num_running == 0, what="an idle scheduler")
    grown = resident_bytes() - before
    assert grown < 64 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over a third burst"


def test_clients_that_leave_mid_stream(served) -> None:
    running = ("speculative:num_sequences_running", ())
    aborted = ("speculative:request_finished_total", (("finished_reason", "abort"),))
    left_before = served.requests_counted("/v1/completions", 499)
    aborted_before = served.metrics().get(aborted, 0.0)
    body = {
        "model": MODEL,
        "prompt": "def f(x):",
        "max_tokens": 200,
        "temperature": 0.7,
        "ignore_eos": True,
        "stream": True,
    }

    def leave_early(i: int) -> int:
        with httpx.stream(
            "POST",
            served.url + "/v1/completions",
            json={**body, "seed": i},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        ) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    return events  # closing the response drops the connection mid-stream
        return events

    with ThreadPoolExecutor(10) as pool:
        assert list(pool.map(leave_early, range(10), timeout=60)) == [2] * 10
    served.wait_for(lambda: served.metrics()[running] == 0, timeout=10, what="the running gauge at 0")
    served.wait_for(
        lambda: served.requests_counted("/v1/completions", 499) == left_before + 10,
        what="10 requests counted as 499 (client closed)",
    )
    assert served.metrics()[aborted] == aborted_before + 10  # their rows left the batch before the end
    response = served.post(
        "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 4, "temperature": 0}
    )
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in (
        "length",
        "stop",
    )


def test_a_request_that_fails_in_the_engine_fails_alone(served, monkeypatch) -> None:
    """A request whose own work raises inside the engine gets a 500 (or an error event when streamed)
    while a request beside it finishes, and the server goes on."""
    boom = served.tokenizer("BOOM")["input_ids"]
    make_sequences = served.scheduler.llm.make_sequences

    def explode(output_ids, logits):
        raise RuntimeError("boom")

    def sequences_that_explode(ids, params, index=0):
        if ids[: len(boom)] == boom:
            params = dataclasses.replace(params, logits_processors=[explode])
        return make_sequences(ids, params, index)

    monkeypatch.setattr(served.scheduler.llm, "make_sequences", sequences_that_explode)
    body = {"model": MODEL, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        fine = pool.submit(stream, served.url, "/v1/completions", {**body, "prompt": "fine", "stream": True})
        failed = pool.submit(served.post, "/v1/completions", {**body, "prompt": "BOOM"})
        with pytest.raises(openai.APIError, match=r"the engine failed this request: .*boom"):
            list(
                served.client().completions.create(model=MODEL, prompt="BOOM now", max_tokens=30, stream=True)
            )
        response = failed.result(timeout=60)
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert "boom" in response.json()["error"]["message"]
        texts, finish, _ = fine.result(timeout=60)
    assert finish == {0: "length"} and len(texts[0]) == 30
    assert served.post("/v1/completions", {**body, "prompt": "after"}).status_code == 200
