"""Faults survived, nothing lost: every accepted request ends with its whole answer or an error (a
status, or an error event then [DONE] when streamed), never a hang, and the requests beside a fault
are unaffected. The engine is held at a gate where a test needs it still, so that nothing races."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from speculative import SamplingParams
from speculative.server.app import create_app, drain
from speculative.server.scheduler import Scheduler

from . import test_cli_serve as cli
from .conftest import API_KEY, MAX_MODEL_LEN, MODEL, running, speculative_llm, tiny_pair

COMPLETIONS = "/v1/completions"
LONG = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
"""A request far longer than any test lets it run."""
SHORT = {"model": MODEL, "prompt": "class Stack:", "max_tokens": 24, "temperature": 0}
ABORTED = ("speculative:request_finished_total", (("finished_reason", "abort"),))


class StepGate:
    """The engine's step behind a gate: while it is closed, the engine thread waits in its next step
    (the running requests gain nothing; the event loop goes on)."""

    def __init__(self, monkeypatch, engine) -> None:
        self.opened, self.waiting = threading.Event(), threading.Event()
        self.opened.set()
        step = engine.step

        def gated():
            if not self.opened.is_set():
                self.waiting.set()
                assert self.opened.wait(timeout=60), "the test never opened the gate"
            return step()

        monkeypatch.setattr(engine, "step", gated)

    def close(self) -> None:
        self.waiting.clear()
        self.opened.clear()

    def open(self) -> None:
        self.opened.set()

    def __enter__(self) -> StepGate:
        return self

    def __exit__(self, *exc) -> None:
        self.open()  # a failing test must not leave the engine held


@pytest.fixture
def gate(served, monkeypatch) -> StepGate:
    return StepGate(monkeypatch, served.scheduler.engine)


def reference_text(served, body: dict) -> str:
    params = SamplingParams(
        temperature=0, max_tokens=body["max_tokens"], ignore_eos=body.get("ignore_eos", False)
    )
    return served.reference.generate(body["prompt"], params)[0].outputs[0].text


def assert_whole(served, response: httpx.Response, body: dict) -> None:
    """A non-streamed greedy request's response holds its whole answer."""
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference_text(served, body)


def assert_idle(served) -> None:
    """No request is left in the scheduler, and the engine has no row."""
    served.wait_for(
        lambda: served.scheduler.num_running == 0 and served.scheduler.num_waiting == 0,
        what="an idle scheduler",
    )
    served.wait_for(lambda: served.scheduler.engine.batch is None, what="an empty engine batch")


def open_stream(served, body: dict):
    """A streamed request's response, open (headers read, body not)."""
    client = httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    request = client.build_request("POST", served.url + COMPLETIONS, json={**body, "stream": True})
    response = client.send(request, stream=True)
    assert response.status_code == 200
    return client, response


def test_a_stream_dropped_before_its_first_event_leaves_the_queue_at_once(served, gate) -> None:
    """The engine is held in a step of another request, so the stream waits in the queue without an
    event; its client leaves: the server notices and drops it while the engine is still held, and the
    other request then ends whole."""
    left, aborted = served.requests_counted(COMPLETIONS, 499), served.metrics().get(ABORTED, 0.0)
    gate.close()
    with ThreadPoolExecutor(1) as pool, gate:
        other = pool.submit(served.post, COMPLETIONS, SHORT)
        assert gate.waiting.wait(timeout=60)
        client, response = open_stream(served, LONG)
        served.wait_for(lambda: served.scheduler.num_waiting == 1, what="the stream in the queue")
        response.close()
        client.close()
        served.wait_for(lambda: served.scheduler.num_waiting == 0, what="the stream out of the queue")
        served.wait_for(lambda: served.requests_counted(COMPLETIONS, 499) == left + 1, what="a 499")
        assert served.metrics()[ABORTED] == aborted + 1
        assert not other.done()  # all this while the engine was held
        gate.open()
        assert_whole(served, other.result(timeout=60), SHORT)
    assert_idle(served)


def test_a_stream_dropped_mid_way_frees_its_row(served, gate) -> None:
    left, aborted = served.requests_counted(COMPLETIONS, 499), served.metrics().get(ABORTED, 0.0)
    with ThreadPoolExecutor(1) as pool, gate:
        client, response = open_stream(served, LONG)
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        other = pool.submit(served.post, COMPLETIONS, SHORT)
        gate.close()  # the stream is far from its 200 tokens, and gains nothing from here on
        response.close()
        client.close()
        served.wait_for(lambda: served.requests_counted(COMPLETIONS, 499) == left + 1, what="a 499")
        gate.open()
        served.wait_for(lambda: served.metrics()[ABORTED] == aborted + 1, what="the row aborted")
        assert_whole(served, other.result(timeout=60), SHORT)
    assert_idle(served)


def test_a_non_streamed_client_that_leaves_frees_its_row(served, gate) -> None:
    left, aborted = served.requests_counted(COMPLETIONS, 499), served.metrics().get(ABORTED, 0.0)
    with ThreadPoolExecutor(2) as pool, gate:
        gate.close()
        leaving = pool.submit(served.post, COMPLETIONS, LONG, timeout=1.0)
        other = pool.submit(served.post, COMPLETIONS, SHORT)
        with pytest.raises(httpx.TimeoutException):
            leaving.result(timeout=60)
        served.wait_for(lambda: served.requests_counted(COMPLETIONS, 499) == left + 1, what="a 499")
        gate.open()
        served.wait_for(lambda: served.metrics()[ABORTED] == aborted + 1, what="the row aborted")
        assert_whole(served, other.result(timeout=60), SHORT)
    assert_idle(served)


def test_an_engine_step_that_raises_fails_its_requests_and_the_server_goes_on(served, monkeypatch) -> None:
    """The step raises once, with a stream and a non-streamed request in the batch: the stream gets an
    error event then [DONE], the other a 500; the next request is served whole."""
    scheduler = served.scheduler
    step = scheduler.engine.step
    armed = threading.Event()
    armed.set()

    def failing_step():
        if armed.is_set() and scheduler.num_running >= 2:
            armed.clear()
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(scheduler.engine, "step", failing_step)
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream_events, served, LONG)
        plain = pool.submit(served.post, COMPLETIONS, {**LONG, "prompt": "import os"})
        events = streamed.result(timeout=60)
        response = plain.result(timeout=60)
    assert events[-1] == "[DONE]"
    assert "injected step failure" in json.loads(events[-2])["error"]["message"]
    assert response.status_code == 500 and "injected step failure" in response.json()["error"]["message"]
    assert not armed.is_set()
    assert_whole(served, served.post(COMPLETIONS, SHORT), SHORT)
    assert_idle(served)


def test_a_failure_outside_the_step_fails_the_requests_and_the_engine_thread_goes_on(
    served, monkeypatch
) -> None:
    """Publishing a step's tokens raises once: the running stream gets an error event then [DONE] (it
    waited for ever when the engine thread ended), and the next request is served whole."""
    scheduler = served.scheduler
    publish = scheduler._publish
    armed = threading.Event()
    armed.set()

    def failing_publish(requests, elapsed):
        if armed.is_set() and any(r.first_token_time is not None for r in requests):
            armed.clear()
            raise RuntimeError("injected publish failure")
        return publish(requests, elapsed)

    monkeypatch.setattr(scheduler, "_publish", failing_publish)
    events = stream_events(served, LONG)
    assert events[-1] == "[DONE]"
    assert "injected publish failure" in json.loads(events[-2])["error"]["message"]
    assert not armed.is_set()
    assert_whole(served, served.post(COMPLETIONS, SHORT), SHORT)
    assert_idle(served)


def stream_events(served, body: dict) -> list[str]:
    """A streamed request's data lines, to the end."""
    with httpx.stream(
        "POST",
        served.url + COMPLETIONS,
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_failing_prefill_fails_its_request_alone(served, monkeypatch) -> None:
    boom = served.tokenizer("BOOM")["input_ids"]
    add = served.scheduler.engine.add

    def failing_add(sequences, *args, **kwargs):
        if any(s.prompt_token_ids[: len(boom)] == boom for s in sequences):
            raise RuntimeError("injected prefill failure")
        return add(sequences, *args, **kwargs)

    monkeypatch.setattr(served.scheduler.engine, "add", failing_add)
    fine = {**SHORT, "max_tokens": 40, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(served.post, COMPLETIONS, fine) for _ in range(2)]
        failed = pool.submit(served.post, COMPLETIONS, {**SHORT, "prompt": "BOOM"})
        response = failed.result(timeout=60)
        assert response.status_code == 500
        assert "injected prefill failure" in response.json()["error"]["message"]
        for other in others:
            assert_whole(served, other.result(timeout=60), fine)
    assert_idle(served)


def test_a_prompt_longer_than_the_context_never_reaches_the_prefill(served, monkeypatch) -> None:
    """Refused with a 400 naming the context, before the scheduler: the engine's add is not called."""
    calls = []
    monkeypatch.setattr(served.scheduler.engine, "add", lambda *args, **kwargs: calls.append(args))
    app = create_app(
        served.scheduler,
        model_name=MODEL,
        tokenizer=served.tokenizer,
        api_key=None,
        max_prompt_tokens=None,
        max_model_len=MAX_MODEL_LEN,
    )
    client = TestClient(app)  # not started: the scheduler is the shared server's
    prompt = "x" * MAX_MODEL_LEN
    for body in ({"prompt": prompt}, {"prompt": prompt[:200], "max_tokens": 100}):
        response = client.post(COMPLETIONS, json={"model": MODEL, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]
    assert calls == [] and served.scheduler.num_waiting == 0


def test_a_request_during_shutdown_gets_503_while_running_ones_finish() -> None:
    """After drain (what SIGTERM calls), /v1 requests and /health answer 503 with OpenAI's error JSON
    at once, and the stream already running ends whole."""
    target, draft, tokenizer = tiny_pair()
    scheduler = Scheduler(speculative_llm(target, draft, tokenizer), max_num_seqs=4)
    app = create_app(
        scheduler,
        model_name=MODEL,
        tokenizer=tokenizer,
        api_key=None,
        max_prompt_tokens=None,
        max_model_len=MAX_MODEL_LEN,
        shutdown_timeout=60,
    )
    body = {**LONG, "max_tokens": 60}
    with running(app) as url:
        with httpx.stream("POST", url + COMPLETIONS, json={**body, "stream": True}, timeout=60) as response:
            lines = response.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            drain(app)
            refused = httpx.post(url + COMPLETIONS, json=SHORT, timeout=10)
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable"
            assert "shutting down" in refused.json()["error"]["message"]
            assert httpx.get(url + "/health", timeout=10).status_code == 503
            events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> tuple[str, str]:
    return cli.save_tiny_pair(tmp_path_factory.mktemp("served"))


def test_sigterm_with_32_running_streams_ends_each_with_its_answer_or_an_error_event(model_paths) -> None:
    """32 streams running at SIGTERM, a few short ones among long ones, and a shutdown timeout of 2 s:
    each stream ends with its whole answer or with an error event saying the server shut down, then
    [DONE]; none is cut without an event, and a request sent meanwhile is refused."""
    with cli.speculative_serve(model_paths, 2.0) as (url, process):
        streams = [cli.Stream(url, max_tokens=16 if i % 8 == 0 else cli.CONTEXT - 64) for i in range(32)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.started.wait(timeout=cli.LONG_SHUTDOWN_S) and stream.error is None, stream.error
        process.send_signal(signal.SIGTERM)
        cli.assert_refused(url)
        for stream in streams:
            stream.join(timeout=cli.LONG_SHUTDOWN_S)
        assert process.wait(timeout=cli.LONG_SHUTDOWN_S) in (0, -signal.SIGTERM), process.stdout.read()
    for stream in streams:
        assert stream.error is None, f"the connection was dropped: {stream.error!r}"
        assert stream.events[-1] == "[DONE]"
        last = json.loads(stream.events[-2])
        if "error" in last:
            assert "shut down" in last["error"]["message"], last
        else:
            stream.assert_finished()
