"""`speculative bench-serve`'s driver and figures: exact figures from known request times, the driver
against the live test server (every level's requests counted, errors reported), the server variants'
command lines, and the CLI end to end on the demo pair."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from speculative.bench.load import (
    Driver,
    LoadConfig,
    RequestRecord,
    counters_since,
    drive_servers,
    pooled,
    pooled_counters,
    run_load,
    serve_command,
    summarize,
)
from speculative.bench.load_report import engine_rows, markdown, soak_lines, speedup_lines
from speculative.cli import main
from speculative.prompts import PromptRecord

from .conftest import API_KEY


def test_figures_of_known_requests() -> None:
    records = [
        # TPOT (0.4 - 0.1) / 4; tokens 1 + 1 + 3 by chunk
        RequestRecord(sent=0.0, chunks=[0.1, 0.2, 0.4], chunk_tokens=[1, 1, 3], end=0.4, tokens=5),
        RequestRecord(sent=1.0, chunks=[1.3, 1.4], chunk_tokens=[1, 2], end=1.5, tokens=3),  # TPOT 0.2 / 2
        RequestRecord(sent=2.0, end=2.1, error="status 400: b'too long'"),
    ]
    figures = summarize(records, seconds=4.0)
    assert figures["requests"] == 3 and figures["errors"] == 1
    assert figures["error_examples"] == ["status 400: b'too long'"]
    assert figures["requests_per_s"] == pytest.approx(0.5)
    assert figures["output_tokens_per_s"] == pytest.approx(2.0)
    assert figures["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert figures["tpot_ms"]["p50"] == pytest.approx((75.0 + 100.0) / 2)
    assert figures["itl_ms"]["p50"] == pytest.approx(100.0)  # gaps 100, 200, 100 ms
    # a token each: 100 ms (1 token), 66.7 ms x 3 (200 ms, 3 tokens), 50 ms x 2 (100 ms, 2 tokens)
    assert figures["itl_token_ms"]["p50"] == pytest.approx(200.0 / 3)
    assert figures["itl_token_ms"]["p99"] == pytest.approx(200.0 / 3 + 0.95 * (100.0 - 200.0 / 3))
    assert figures["e2e_ms"]["p99"] == pytest.approx(400.0 + 0.99 * 100.0)  # of 400 and 500 ms


def test_server_variants_and_bad_configs() -> None:
    config = LoadConfig(k=3, dtype="bfloat16")
    plain = serve_command(config, "plain", "t", "d", 9000)
    assert plain[1:4] == ["-m", "speculative", "serve"] and "--draft-model" not in plain
    want = ["--method", "draft_model", "-k", "3", "--draft-model", "d"]
    assert serve_command(config, "draft", "t", "d", 9000)[-6:] == want
    own = serve_command(LoadConfig(k=3, method="self_draft"), "draft", "t", None, 9000)
    assert own[-4:] == ["--method", "self_draft", "-k", "3"] and "--draft-model" not in own
    assert serve_command(config, "adaptive", "t", "d", 9000)[-1] == "--adaptive"
    drafting = LoadConfig(
        k=3, serve_flags=["--max-num-seqs", "4"], draft_flags=["--num-assistant-tokens", "1"]
    )
    assert "--num-assistant-tokens" not in serve_command(drafting, "plain", "t", "d", 9000)
    for server in ("draft", "adaptive"):
        command = serve_command(drafting, server, "t", "d", 9000)
        assert command.count("--max-num-seqs") == 1 and command.count("--num-assistant-tokens") == 1
    with pytest.raises(ValueError, match="needs a draft model"):
        serve_command(config, "draft", "t", None, 9000)
    for field, value, message in [
        ("servers", ["eagle"], "servers must be among plain, draft, adaptive"),
        ("concurrency", [0], "concurrency must be"),
        ("rates", [0.0], "rates must be > 0"),
        ("max_tokens", 0, "max_tokens must be >= 1"),
        ("max_tokens_range", 1.0, r"max_tokens_range must be in \[0, 1\)"),
        ("soak_requests", -1, "soak_requests must be >= 0"),
        ("rounds", 0, "rounds must be >= 1"),
        ("method", "medusa", "method must be one of .*self_draft"),
    ]:
        with pytest.raises(ValueError, match=message):
            LoadConfig(**{field: value})


def test_the_driver_counts_every_request_of_every_level(served) -> None:
    config = LoadConfig(
        concurrency=[1, 3],
        rates=[40.0],
        requests=4,
        max_tokens=5,
        max_tokens_range=0.0,
        soak_requests=8,
        soak_max_tokens=2,
    )
    servers = {"draft": (served.url, os.getpid())}
    prompts = [PromptRecord("0", "def f("), PromptRecord("1", "x = 1\n")]
    result = asyncio.run(drive_servers(servers, prompts, config, API_KEY))["draft"]
    assert [level["requests"] for level in result["closed"]] == [4, 6]  # at least 2 per client
    for level in result["closed"] + result["open"]:
        assert level["errors"] == 0, level["error_examples"]
        tokens = level["output_tokens_per_s"] * level["seconds"]
        assert tokens == pytest.approx(5 * level["requests"])  # ignore_eos: exactly max_tokens each
        assert level["ttft_ms"]["p50"] > 0 and level["tpot_ms"]["p50"] > 0
        engine = level["engine"]  # the server's engine counters over the level
        assert engine["prefill_s"] > 0 and engine["step_s"] > 0 and any(k > 0 for k in engine["steps"])
    soak = result["soak"]
    assert soak["errors"] == 0 and soak["requests"] >= 8
    if sys.platform == "linux":  # glibc's heap figures, through the server's /metrics
        assert soak["heap_baseline"] > 0 and soak["heap_growth"] == soak["heap_end"] - soak["heap_baseline"]
    assert soak["bound"] == 1024 * (soak["requests"] - 6)  # after the warm-up: 4 of 8, at least 2 per client
    assert result["rss"] and all(rss > 0 for _, rss in result["rss"])
    results = {"servers": {"draft": result}, "config": {**config.__dict__}, "prompts": "p.jsonl"}
    results["machine"] = {"nproc": 2, "cpu": "cpu", "cpu_features": "AVX2", "torch": "t", "python": "p"}
    report = markdown(results, "load.png")
    assert "| draft | 3 clients |" in report and "| draft | 40 req/s |" in report
    assert "## Engine" in report
    labels = [row[:2] for row in engine_rows(results)]
    assert labels == [["draft", "1 client"], ["draft", "3 clients"], ["draft", "40 req/s"]]
    assert soak_lines(results)[0].startswith(f"draft: {soak['requests']} requests")


def test_rounds_take_turns_and_give_each_servers_ratio_to_plain(served) -> None:
    """Two names for the one test server: each level runs once per round on each, one after the
    other, the order rotated each round; the level pools its rounds, and the report gives each
    server's ratio to plain in the same round (median and range)."""
    config = LoadConfig(concurrency=[2], rates=[30.0], requests=4, max_tokens=3, rounds=2)
    servers = {name: (served.url, os.getpid()) for name in ("plain", "adaptive")}
    result = asyncio.run(drive_servers(servers, [PromptRecord("0", "def f(")], config, API_KEY))
    for kind in ("closed", "open"):
        plain, adaptive = (result[name][kind][0] for name in ("plain", "adaptive"))
        assert plain["requests"] == adaptive["requests"] == 8 and plain["errors"] == 0
        assert len(plain["rounds_output_tokens_per_s"]) == len(plain["spans"]) == 2
        (p0, n0), (p1, _) = plain["spans"]
        (a0, _), (a1, m1) = adaptive["spans"]
        assert p0 + n0 <= a0 < a1 and a1 + m1 <= p1  # plain first in round 0, adaptive in round 1
    ratios = [
        a / p
        for a, p in zip(
            result["adaptive"]["closed"][0]["rounds_output_tokens_per_s"],
            result["plain"]["closed"][0]["rounds_output_tokens_per_s"],
        )
    ]
    lines = speedup_lines({"servers": result})
    low, high = min(ratios), max(ratios)
    assert (
        lines[0] == f"adaptive, 2 clients: {sum(ratios) / 2:.2f}x plain (2 rounds, {low:.2f}x to {high:.2f}x)"
    )
    assert lines[1].startswith("adaptive, 30 req/s: ") and len(lines) == 2


def test_a_level_pools_its_rounds() -> None:
    first = [RequestRecord(sent=0.0, chunks=[0.1], end=1.0, tokens=10)]
    second = [
        RequestRecord(sent=5.0, chunks=[5.1], end=5.5, tokens=20),
        RequestRecord(sent=5.0, end=5.2, error="x"),
    ]
    level = pooled([(0.0, 1.0, first), (5.0, 0.5, second)])
    assert level["requests"] == 3 and level["errors"] == 1
    assert level["output_tokens_per_s"] == pytest.approx(30 / 1.5)
    assert level["rounds_output_tokens_per_s"] == pytest.approx([10.0, 40.0])
    assert level["spans"] == [[0.0, 1.0], [5.0, 0.5]]
    assert speedup_lines({"servers": {"draft": {"closed": [level], "open": []}}}) == []  # no plain


def test_engine_counters_of_a_level_add_up_over_its_rounds() -> None:
    before = {"steps": {0: 10.0, 2: 5.0}, "prefill_s": 1.0, "step_s": 2.0}
    after = {"steps": {0: 16.0, 2: 5.0, 4: 2.0}, "prefill_s": 1.5, "step_s": 3.0}
    run = counters_since(before, after)
    assert run == {"steps": {0: 6, 4: 2}, "prefill_s": 0.5, "step_s": 1.0}
    assert counters_since(None, after) is None and pooled_counters([run, None]) is None
    level = {"concurrency": 8, "engine": pooled_counters([run, run])}
    assert level["engine"] == {"steps": {0: 12, 4: 4}, "prefill_s": 1.0, "step_s": 2.0}
    rows = engine_rows({"servers": {"adaptive": {"closed": [level], "open": []}}})
    assert rows == [["adaptive", "8 clients", "16", "25.0%", "4.00", "33.3%"]]


def test_request_lengths_vary_over_their_range_the_same_for_every_server(served) -> None:
    """Lengths drawn from max_tokens * (1 -+ range), seeded by the request's number: every server of a
    run gets the same requests."""

    async def lengths() -> list[int]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=60) as client:
            driver = Driver(client, [PromptRecord("0", "def f(")], LoadConfig(seed=3))
            records = await driver.closed_loop(1, 12, max_tokens=8, spread=0.5)
        assert all(r.error is None for r in records)
        return [r.tokens for r in records]

    first = asyncio.run(lengths())
    assert all(4 <= n <= 12 for n in first) and len(set(first)) > 2
    assert asyncio.run(lengths()) == first


def test_chat_records_are_sent_as_chats_and_their_tokens_counted(served) -> None:
    """A chat record goes to /v1/chat/completions (its streamed deltas are the chunks), text to
    /v1/completions; both stream their usage, on every chunk: the tokens each chunk brought."""
    chat = PromptRecord("0", "Sort a list.", True, [{"role": "user", "content": "Sort a list."}])

    async def send() -> list:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=60) as client:
            driver = Driver(client, [chat, PromptRecord("1", "def f(")], LoadConfig())
            assert driver._request(8, 0.0)[0] == "/v1/chat/completions"
            assert driver._request(8, 0.0)[0] == "/v1/completions"
            return await driver.closed_loop(1, 2, max_tokens=6)

    records = asyncio.run(send())
    assert [(r.error, r.tokens) for r in records] == [(None, 6), (None, 6)]
    assert all(len(r.chunks) == len(r.chunk_tokens) >= 1 and sum(r.chunk_tokens) == 6 for r in records)


def test_conversations_send_each_turn_with_the_answers_so_far(served) -> None:
    """With conversations, a closed-loop client sends a record's user turns one after another, each
    with the system message and the server's answers so far, then the next record's."""
    system = {"role": "system", "content": "Be brief."}
    records = [
        PromptRecord(f"c{i}", "", True, [system, *({"role": "user", "content": f"q{i}{t}"} for t in "ab")])
        for i in range(2)
    ]
    sent = []

    async def talk() -> list[RequestRecord]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=60) as client:
            driver = Driver(client, records, LoadConfig(conversations=True))
            send = driver._request
            driver._request = lambda *args: (sent.append(args[2]), send(*args))[1]
            return await driver.closed_loop(1, 4, max_tokens=5)

    answers = asyncio.run(talk())
    assert all(r.error is None and r.tokens == 5 and r.text for r in answers)
    user = [[m["content"] for m in messages if m["role"] == "user"] for messages in sent]
    assert user == [["q0a"], ["q0a", "q0b"], ["q1a"], ["q1a", "q1b"]]
    assert sent[1] == [
        system,
        {"role": "user", "content": "q0a"},
        {"role": "assistant", "content": answers[0].text},
        {"role": "user", "content": "q0b"},
    ]
    with pytest.raises(ValueError, match="conversations takes chat records"):
        run_load(LoadConfig(conversations=True, prompts="code"), "unused", None, Path("unused"))


def test_requests_the_server_refuses_are_errors(served) -> None:
    config = LoadConfig(concurrency=[2], rates=[], requests=2, max_tokens=10_000)  # past the context
    servers = {"plain": (served.url, os.getpid())}
    prompts = [PromptRecord("0", "def f(")]
    level = asyncio.run(drive_servers(servers, prompts, config, API_KEY))["plain"]["closed"][0]
    assert level["errors"] == level["requests"] == 4
    assert level["error_examples"][0].startswith("status 400")


@pytest.mark.skipif(sys.platform != "linux", reason="RSS sampling and the server's death with the bench")
def test_bench_serve_on_the_demo_pair(tmp_path: Path, capsys) -> None:
    out = tmp_path / "load"
    argv = ["bench-serve", "--servers", "draft", "--concurrency", "2", "--requests", "2"]
    argv += ["--max-tokens", "4", "--rate", "20", "--soak", "6", "--out", str(out)]
    argv += ["--serve-args=--max-num-seqs 4"]  # (a value starting with -- needs the = form)
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["servers"]) == ["draft"] and results["config"]["serve_flags"] == [
        "--max-num-seqs",
        "4",
    ]
    for server in results["servers"].values():
        assert all(level["errors"] == 0 for level in server["closed"] + server["open"])
    report = (out / "report.md").read_text()
    assert "## Soak" in report and "![load](load.png)" in report and (out / "load.png").stat().st_size
    assert f"wrote {out / 'report.md'}" in capsys.readouterr().out


COMPILING_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

asked = []


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        asked.append(self.path)
        body = {"status": "ok", **({"compiling": True} if len(asked) <= int(sys.argv[3]) else {})}
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        with open(sys.argv[2], "w") as log:
            log.write(str(len(asked)))

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_that_compiles_in_the_background_is_timed_once_it_has_compiled(tmp_path) -> None:
    """`/health` answers `compiling` while a server's graphs compile beside its first requests:
    bench-serve starts timing it after that, not at its first answer."""
    from speculative.bench.server_process import ServerProcess, free_port

    script, asked, port = tmp_path / "server.py", tmp_path / "asked", free_port()
    script.write_text(COMPILING_SERVER)
    with ServerProcess([sys.executable, str(script), str(port), str(asked), "3"], port, "compiling"):
        assert asked.read_text() == "4"


def test_a_server_that_never_finishes_compiling_is_given_up(tmp_path, monkeypatch) -> None:
    from speculative.bench import server_process

    monkeypatch.setattr(server_process, "COMPILE_TIMEOUT", 2.0)
    script, asked, port = tmp_path / "server.py", tmp_path / "asked", server_process.free_port()
    script.write_text(COMPILING_SERVER)
    server = server_process.ServerProcess(
        [sys.executable, str(script), str(port), str(asked), "100000"], port
    )
    with pytest.raises(RuntimeError, match="did not compile its graphs within 2 s"):
        server.start()
    assert server.process.poll() is not None  # stopped
