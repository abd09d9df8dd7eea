"""`speculative serve --replicas 2`: two engines behind Ray Serve's proxy answer the official openai
client as one server does, requests spread over both, the key and the shared /metrics hold behind the
proxy, a killed replica is replaced while the other answers every request, and SIGTERM stops it all.
Also the flags that replicas refuse, and the metrics that processes share."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import psutil
import pytest
from prometheus_client import generate_latest, values
from prometheus_client.parser import text_string_to_metric_families

from speculative import LLM, SamplingParams, SpeculativeConfig, cli
from speculative.server.app import REPLICA_HEADER
from speculative.server.metrics import MULTIPROCESS_DIR, ServerMetrics, forget_dead_processes

from .test_cli_serve import KEY, save_tiny_pair, speculative_serve

RESTART_S = 240.0
"""How long Ray may take to replace a killed replica (about 30 s measured on 2 loaded cores)."""
PROMPT = "def add(a, b):"


def completed(client: openai.OpenAI) -> tuple[str, str]:
    """A greedy completion of PROMPT: (its text, the replica that answered)."""
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0
    )
    return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]


def completions_ok(url: str) -> float:
    """/metrics' count of /v1/completions answered 200, over every replica."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "speculative:http_requests_total" and s.labels == {
                "endpoint": "/v1/completions",
                "status": "200",
            }:
                return s.value
    return 0.0


def replica_processes(process) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(process.pid).children(recursive=True)
        if "ServeReplica" in " ".join(p.cmdline())
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--replicas", "0"], "--replicas must be >= 1; got 0"),
        (["--tensor-parallel-size", "2"], "--replicas runs each engine in one process"),
        (["--device", "cuda"], "--replicas runs on the CPU only (--device cpu); got --device cuda"),
        (["--chat-template", "{% if %}"], "--chat-template is not a valid Jinja template"),  # before Ray
    ],
)
def test_refused_flags(capsys, flags, message) -> None:
    assert cli.main(["serve", "--replicas", "2", *flags]) == 2
    assert message in capsys.readouterr().err


def samples(metrics: ServerMetrics) -> dict[str, float]:
    """/metrics' unlabelled samples, by name."""
    exposed = text_string_to_metric_families(generate_latest(metrics.exposed()).decode())
    return {s.name: s.value for family in exposed for s in family.samples if not s.labels}


def test_processes_share_one_view_of_the_metrics(tmp_path, monkeypatch) -> None:
    """Two replicas' processes, one gone (prometheus-client's multiprocess values, each process's
    pid given): their counters add up and stay; the gone one's gauges leave with forget_dead_processes."""
    monkeypatch.setenv(MULTIPROCESS_DIR, str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid, running in ((gone.pid, 3), (os.getpid(), 2)):
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda pid=pid: pid))
        metrics = ServerMetrics()
        metrics.running.set(running)
        metrics.generation_tokens.inc(5)
    shared = samples(metrics)
    assert shared["speculative:generation_tokens_total"] == 10
    assert shared["speculative:num_sequences_running"] == 5
    assert not any(name.startswith("speculative:heap") for name in shared)  # a process's own
    forget_dead_processes(str(tmp_path))
    shared = samples(metrics)
    assert shared["speculative:generation_tokens_total"] == 10
    assert shared["speculative:num_sequences_running"] == 2


@pytest.mark.slow  # Ray starts, two replicas load, one is replaced: about a minute or two
def test_two_replicas_behind_ray_serve(tmp_path) -> None:
    pytest.importorskip("ray.serve", reason="needs the replicas extra")
    paths = save_tiny_pair(tmp_path)
    offline = LLM(
        paths[0], draft_model=paths[1], speculative_config=SpeculativeConfig(num_speculative_tokens=3)
    )
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    flags = ("--replicas", "2", "--max-num-seqs", "4", "--max-waiting", "8")
    with speculative_serve(paths, 30.0, *flags) as (url, process):
        output: list[str] = []  # read as it comes: the replicas' access logs would fill the pipe
        threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        messages = [{"role": "user", "content": "hello"}]
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream)

        # Requests spread: the replica that answers is random while both are idle.
        before, sent, replicas = completions_ok(url), 0, set()
        deadline = time.monotonic() + RESTART_S
        while len(replicas) < 2:
            assert time.monotonic() < deadline, f"only replica {replicas} answered {sent} requests"
            text, replica = completed(client)
            assert text == expected
            sent, replicas = sent + 1, replicas | {replica}
        assert completions_ok(url) == before + sent  # /metrics adds both replicas up

        # Kill one replica's process: the other answers every request until Ray has replaced it.
        victims = replica_processes(process)
        assert len(victims) == 2, victims
        victims[0].kill()
        before, sent, answered = completions_ok(url), 0, set()
        deadline = time.monotonic() + RESTART_S
        while not answered - replicas:
            assert time.monotonic() < deadline, "Ray did not replace the killed replica"
            text, replica = completed(client)
            assert text == expected
            sent, answered = sent + 1, answered | {replica}
        assert len(answered & replicas) == 1  # the survivor, then the new one
        assert completions_ok(url) == before + sent  # the dead replica's counts stay in the sum

        ray_processes = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, "".join(output)
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not alive, f"Ray's processes outlived the server: {alive}"
