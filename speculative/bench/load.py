"""`speculative bench-serve`: `speculative serve` under load over HTTP, after vLLM's benchmark_serving.

Each server variant runs as its own `speculative serve` process (ServerProcess) on the same pair:
"plain" (the target alone: no speculation), "draft" (the draft model, k drafts per step) and
"adaptive" (the draft model, k chosen per step by the server), only one driven at a time (with
more than one round, all are up together). Every request streams /v1/completions with httpx, a
prompt of the set as text, greedy unless `temperature`, and exactly its max_tokens tokens
(ignore_eos): a level's request i asks for a length drawn (seeded by i) uniformly from max_tokens *
(1 -+ max_tokens_range), vLLM's --random-range-ratio. Lengths that vary are what real traffic has;
with one length for all (max_tokens_range 0) a closed loop's clients stay in step, their requests
ending in the same step and their prompts prefilled together, waves that plain decoding keeps and
speculation breaks up. The client records when it sent the request and when each chunk with text arrived.

After each server's warm-up, `rounds` rounds run; in each, every level below runs on one server
after another, the servers' order rotated from round to round. A machine's speed drifts by several
percent from minute to minute (on a shared 2-core VM, 10% between two runs of the same level), so a
ratio between servers is only worth what the rounds show of it: the report gives each server's
output tokens/s over plain's in the same round, the median and range over the rounds. Levels:

- closed loop, for each concurrency c: c clients, each sending its next request as soon as its last
  one ended, until `requests` requests (at least 2 per client) have been sent;
- open loop, for each rate r: requests sent at Poisson arrival times of r per second, whatever the
  server's answers (vLLM's `--request-rate`);
- soak (`soak_requests` > 0; after the rounds, one server after another): that many short requests
  (`soak_max_tokens`) at the largest concurrency, the server's resident set size (RSS) and C heap in
  use (its /metrics) read when it is idle after the first SOAK_WARM_UP of them and after the last:
  memory is flat if the heap in use grew by less than a leak of LEAK_PER_REQUEST bytes a request
  would have added.

Figures of a level (vLLM's), of its requests in every round: requests/s and output tokens/s over its
rounds' summed wall time (and each round's output tokens/s); time to first token (TTFT: first chunk
with text), time per output token (TPOT: (end - first chunk) / (tokens - 1), per request),
inter-chunk latency (ITL per chunk: gaps between chunks, vLLM's ITL) and inter-token latency (ITL per
token: a chunk's gap shared by the tokens it brought, each token a sample; the server's own
`inter_token_latency_seconds`): a speculative step's chunk can hold several tokens, so its gap is a
longer step's while its tokens come sooner, each as p50 / p99 in ms; errors (a status other than 200,
an error event, or no [DONE]). The server's RSS is sampled every RSS_PERIOD s throughout (psutil).
From the server's /metrics, read before and after each level (`engine_counters`): its engine's steps
by the draft tokens they verified a row (0: a plain step) and its busy seconds prefilling and stepping,
which say how often adaptive k drafted at a level and how much of the time went to prefills.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from speculative.bench.load_report import token_range, write_load_outputs
from speculative.bench.prompts import default_sets, resolve_set
from speculative.bench.server_process import ServerProcess, free_port
from speculative.extras import needs_extra
from speculative.machine import machine
from speculative.methods import METHODS
from speculative.models.dtypes import cpu_features
from speculative.models.loading import load_tokenizer
from speculative.prompts import PromptRecord, load_jsonl

with needs_extra("bench", "speculative bench-serve"):
    import httpx
    import psutil

SERVERS = ("plain", "draft", "adaptive")
RSS_PERIOD = 0.25  # seconds between RSS samples
LEAK_PER_REQUEST = 1024  # bytes: the soak's bound is what a leak of this much per request would add
SOAK_WARM_UP = 0.5  # the soak's first fraction of requests, before its RSS baseline: what is allocated
# once fills up first (oneDNN's cache of up to 1,024 matmul kernels, one per shape a batch meets, took
# about 2,500 requests at 32 streams on the demo pair to fill, ~200 MiB)
SETTLE = 1.0  # seconds from a soak phase's last answer to its RSS reading: the server is idle by then
REQUEST_TIMEOUT = 600.0  # seconds for one request


@dataclass
class LoadConfig:
    """What `speculative bench-serve` runs (fields as its flags). model / draft_model: None takes the demo
    pair; prompts: a JSONL set or a bundled set's name (None: the first bundled set for the target's
    tokenizer, chat for an instruction-tuned model, code otherwise), of which the first `num_prompts`
    are sent in turn (chat records to /v1/chat/completions); serve_flags: more `speculative serve`
    flags for every server; draft_flags: more for the servers that draft (draft, adaptive) alone, such
    as a draft model's own options, which plain decoding refuses."""

    model: str | None = field(
        default=None, metadata={"engine": "model", "help": "target model", "default_text": "the demo model"}
    )
    draft_model: str | None = field(
        default=None,
        metadata={"engine": "draft_model", "help": "draft model", "default_text": "the demo model's draft"},
    )
    prompts: str | None = field(
        default=None,
        metadata={
            "help": "a JSONL prompt set or a bundled set's name",
            "default_text": "chat, or code for the toy",
        },
    )
    num_prompts: int = field(default=32, metadata={"help": "prompts sent in turn, the first ones"})
    max_tokens: int = field(default=64, metadata={"help": "tokens per request, EOS ignored"})
    max_tokens_range: float = field(
        default=0.5,
        metadata={"help": "each request's tokens drawn from max-tokens * (1 -+ this); 0: all max-tokens"},
    )
    k: int = field(default=4, metadata={"engine": "num_speculative_tokens"})
    method: str = field(
        default="draft_model",
        metadata={
            "help": "the drafting servers' method (draft, adaptive): draft_model drafts with --draft-model, "
            "self_draft with the target's quantized copy (no draft model)",
            "choices": lambda: tuple(METHODS),
        },
    )
    servers: list[str] = field(
        default_factory=lambda: list(SERVERS),
        metadata={
            "help": "server variants: plain (no speculation), draft (k drafts), adaptive (k chosen per step)"
        },
    )
    concurrency: list[int] = field(
        default_factory=lambda: [1, 8, 32], metadata={"help": "closed-loop clients"}
    )
    rates: list[float] = field(
        default_factory=lambda: [4.0],
        metadata={"help": "open-loop req/s", "flags": ("--rate",), "nargs": "*"},
    )
    requests: int = field(default=64, metadata={"help": "requests per level, at least 2 per client"})
    rounds: int = field(
        default=1,
        metadata={
            "help": "rounds of every level, the servers taking turns in each (all up together): ratios to "
            "plain over the rounds (1: one server up at a time)"
        },
    )
    soak_requests: int = field(default=0, metadata={"help": "soak requests (0: none)", "flags": ("--soak",)})
    soak_max_tokens: int = field(default=8, metadata={"help": "tokens per soak request"})
    dtype: str = field(default="float32", metadata={"engine": "dtype", "help": "the servers' --dtype"})
    compile: bool = field(
        default=False, metadata={"engine": "compile", "help": "the servers run compiled (--compile)"}
    )
    temperature: float = field(default=0.0, metadata={"help": "0 is greedy"})
    conversations: bool = field(
        default=False,
        metadata={
            "help": "closed loop: each client holds a conversation, a chat record's user turns sent one "
            "request each with the server's answers so far as the history, then the next record's "
            "(a multi-turn prompt set: chat-multiturn)"
        },
    )
    seed: int = field(default=0, metadata={"engine": "seed", "help": "the servers' --seed"})
    serve_flags: list[str] = field(default_factory=list)
    draft_flags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_tokens", "k", "requests", "rounds", "soak_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.max_tokens_range < 1:
            raise ValueError(f"max_tokens_range must be in [0, 1); got {self.max_tokens_range}")
        if self.soak_requests < 0:
            raise ValueError(f"soak_requests must be >= 0; got {self.soak_requests}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if unknown := [s for s in self.servers if s not in SERVERS]:
            raise ValueError(f"servers must be among {', '.join(SERVERS)}; got {', '.join(unknown)}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be one or more integers >= 1; got {self.concurrency}")
        if any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be > 0 requests/s; got {self.rates}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")


@dataclass
class RequestRecord:
    """One request, times in seconds since the benchmark's clock started: sent, each chunk with text
    (`chunks`) and the tokens it brought (`chunk_tokens`, from the usage every chunk holds), and the
    end; `tokens` the completion tokens of its usage; `error` None if it completed; `text` the answer."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    error: str | None = None
    text: str = ""


def serve_command(config: LoadConfig, server: str, target: str, draft: str | None, port: int) -> list[str]:
    """The `speculative serve` command line of a server variant (ValueError where it needs a draft and
    there is none)."""
    command = [sys.executable, "-m", "speculative", "serve", "--model", target, "--port", str(port)]
    command += ["--dtype", config.dtype, "--seed", str(config.seed), *config.serve_flags]
    if config.compile:
        command.append("--compile")
    if server == "plain":
        return command
    command += [*config.draft_flags, "--method", config.method, "-k", str(config.k)]
    if METHODS[config.method].uses_draft_model:
        if draft is None:
            raise ValueError(f"server {server!r} needs a draft model: pass --draft-model or leave it out")
        command += ["--draft-model", draft]
    return command + (["--adaptive"] if server == "adaptive" else [])


class Driver:
    """Sends the requests of one server's levels and records them; `clock()` is seconds since `start`
    (a time.perf_counter(); default now)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        prompts: list[PromptRecord],
        config: LoadConfig,
        start: float | None = None,
    ) -> None:
        self.client, self.prompts, self.config = client, prompts, config
        self.start = time.perf_counter() if start is None else start
        self.sent = 0  # requests sent so far: the next prompt is prompts[sent % len]
        self.conversations = 0  # conversations begun: the next is prompts[conversations % len]

    def clock(self) -> float:
        return time.perf_counter() - self.start

    def _request(
        self, max_tokens: int, spread: float, messages: list[dict] | None = None
    ) -> tuple[str, dict]:
        """The next request's path and body: `messages` where given, else the next prompt's; a chat
        record (its messages, or its text as a user turn) goes to /v1/chat/completions, other prompts
        (text) to /v1/completions."""
        chat = PromptRecord("", "", chat=True, messages=messages) if messages else None
        record = chat or self.prompts[self.sent % len(self.prompts)]
        if spread:
            rng = random.Random(f"{self.config.seed}-{self.sent}")
            max_tokens = rng.randint(*token_range(max_tokens, spread))
        self.sent += 1
        body = {
            "max_tokens": max_tokens,
            "temperature": self.config.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if record.chat:
            messages = record.messages or [{"role": "user", "content": record.text}]
            return "/v1/chat/completions", {"messages": messages, **body}
        return "/v1/completions", {"prompt": record.text, **body}

    async def request(
        self, max_tokens: int, spread: float = 0.0, messages: list[dict] | None = None
    ) -> RequestRecord:
        """One streamed completion of max_tokens tokens (spread > 0: drawn from max_tokens * (1 -+
        spread), module docstring), of `messages` (None: the next prompt); never raises (a failure is
        the record's error)."""
        record = RequestRecord(sent=self.clock())
        done = False
        try:
            path, body = self._request(max_tokens, spread, messages)
            async with self.client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    record.error = f"status {response.status_code}: {(await response.aread())[:200]!r}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        record.error = f"error event: {event['error']}"
                        return record
                    choices = event.get("choices", [])
                    so_far = (event.get("usage") or {}).get("completion_tokens", record.tokens)
                    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
                    if text:
                        record.text += text
                        record.chunks.append(self.clock())
                        record.chunk_tokens.append(so_far - record.tokens)
                    record.tokens = so_far
            if not done:
                record.error = "the stream ended without [DONE]"
        except httpx.HTTPError as error:
            record.error = f"{type(error).__name__}: {error}"
        finally:
            record.end = self.clock()
        return record

    async def closed_loop(
        self, concurrency: int, requests: int, max_tokens: int, spread: float = 0.0
    ) -> list[RequestRecord]:
        """`concurrency` clients sending `requests` requests (at least 2 each) back to back; with
        config.conversations each client's requests are a conversation's turns (LoadConfig)."""
        remaining = iter(range(max(requests, 2 * concurrency)))
        records: list[RequestRecord] = []

        async def client() -> None:
            history: list[dict] = []
            turns: list[dict] = []
            for _ in remaining:  # shared: each request is claimed by one client
                if not self.config.conversations:
                    records.append(await self.request(max_tokens, spread))
                    continue
                if not turns:  # the next conversation: its system messages, then its user turns one by one
                    messages = self.prompts[self.conversations % len(self.prompts)].messages or []
                    self.conversations += 1
                    history = [m for m in messages if m["role"] == "system"]
                    turns = [m for m in messages if m["role"] == "user"]
                history.append(turns.pop(0))
                record = await self.request(max_tokens, spread, list(history))
                history.append({"role": "assistant", "content": record.text})
                records.append(record)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return records

    async def open_loop(
        self, rate: float, requests: int, max_tokens: int, rng: random.Random, spread: float = 0.0
    ) -> list[RequestRecord]:
        """`requests` requests at Poisson arrival times of `rate` per second."""
        tasks, due = [], self.clock()
        for _ in range(requests):
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - self.clock()))
            tasks.append(asyncio.create_task(self.request(max_tokens, spread)))
        return list(await asyncio.gather(*tasks))


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 of `values` in ms (None where there are none)."""
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values) * 1e3, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def summarize(records: list[RequestRecord], seconds: float) -> dict:
    """A level's figures (module docstring) from its requests and its wall time."""
    done = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in done)
    return {
        "requests": len(records),
        "errors": len(records) - len(done),
        "error_examples": sorted({r.error for r in records if r.error})[:3],
        "seconds": seconds,
        "requests_per_s": len(done) / seconds,
        "output_tokens_per_s": tokens / seconds,
        "ttft_ms": percentiles([r.chunks[0] - r.sent for r in done if r.chunks]),
        "tpot_ms": percentiles(
            [(r.end - r.chunks[0]) / (r.tokens - 1) for r in done if r.chunks and r.tokens > 1]
        ),
        "itl_ms": percentiles([b - a for r in done for a, b in zip(r.chunks, r.chunks[1:])]),
        "itl_token_ms": percentiles(
            [
                (b - a) / n
                for r in done
                for a, b, n in zip(r.chunks, r.chunks[1:], r.chunk_tokens[1:])
                for _ in range(n)
            ]
        ),
        "e2e_ms": percentiles([r.end - r.sent for r in done]),
    }


async def _sample_rss(process: psutil.Process, driver: Driver, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((driver.clock(), process.memory_info().rss))
        try:
            await asyncio.wait_for(stop.wait(), RSS_PERIOD)
        except TimeoutError:
            pass


def pooled(runs: list[tuple[float, float, list[RequestRecord]]]) -> dict:
    """A level's figures over its rounds, each run (start, seconds, records): `summarize` of all their
    requests over their summed time, each round's output tokens/s, and the spans [start, seconds]
    the level ran in."""
    level = summarize([r for _, _, records in runs for r in records], sum(seconds for _, seconds, _ in runs))
    level["rounds_output_tokens_per_s"] = [
        summarize(records, seconds)["output_tokens_per_s"] for _, seconds, records in runs
    ]
    level["spans"] = [[start, seconds] for start, seconds, _ in runs]
    return level


async def drive_servers(
    servers: dict[str, tuple[str, int]],
    prompts: list[PromptRecord],
    config: LoadConfig,
    api_key: str | None = None,
) -> dict[str, dict]:
    """Drive the servers, name -> (url, pid of its process), all up at once (module docstring): each
    one's warm-up; then `config.rounds` rounds, in which each level runs on one server after another
    (the order rotated each round), so that the machine's drift between rounds falls on every server
    alike; then each one's soak. Returns per server {"closed": [...], "open": [...], "soak": ... |
    None, "rss": [(seconds, bytes)]}, each level `pooled` over its rounds."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    start, stop = time.perf_counter(), asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        drivers, processes, samplers = {}, {}, []
        results: dict[str, dict] = {}
        for name, (url, pid) in servers.items():
            client = httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits, headers=headers)
            drivers[name] = Driver(await stack.enter_async_context(client), prompts, config, start)
            processes[name] = psutil.Process(pid)
            results[name] = {"closed": [], "open": [], "soak": None, "rss": []}
            sampler = _sample_rss(processes[name], drivers[name], results[name]["rss"], stop)
            samplers.append(asyncio.create_task(sampler))
        busiest = max(config.concurrency)
        for driver in drivers.values():  # warm-up: first calls of each batch size
            await driver.closed_loop(busiest, busiest, 8)
        levels = [("closed", c) for c in config.concurrency] + [("open", r) for r in config.rates]
        runs: dict[tuple[str, str, float], list] = {}
        engine: dict[tuple[str, str, float], list] = {}  # each run's engine_counters over its level
        names = list(drivers)
        for round_ in range(config.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for kind, value in levels:
                for name in order:
                    driver = drivers[name]
                    counters = await engine_counters(driver.client)
                    level_start = driver.clock()
                    if kind == "closed":
                        records = await driver.closed_loop(
                            int(value), config.requests, config.max_tokens, config.max_tokens_range
                        )
                    else:  # every server of a round gets the same arrival times
                        rng = random.Random(f"{config.seed}-{value}-{round_}")
                        records = await driver.open_loop(
                            value, config.requests, config.max_tokens, rng, config.max_tokens_range
                        )
                    span = (level_start, driver.clock() - level_start, records)
                    runs.setdefault((name, kind, value), []).append(span)
                    engine.setdefault((name, kind, value), []).append(
                        counters_since(counters, await engine_counters(driver.client))
                    )
        for name in names:
            for kind, value in levels:
                key = "concurrency" if kind == "closed" else "rate"
                level = {key: value, **pooled(runs[name, kind, value])}
                level["engine"] = pooled_counters(engine[name, kind, value])
                results[name][kind].append(level)
            if config.soak_requests:
                results[name]["soak"] = await _soak(drivers[name], processes[name], busiest, config)
        stop.set()
        await asyncio.gather(*samplers)
    return results


_ENGINE_STEPS = "speculative:engine_steps_total"
_ENGINE_SECONDS = "speculative:engine_busy_seconds_total"


async def _metrics_lines(client: httpx.AsyncClient) -> list[str]:
    """The lines of the server's /metrics (none where it has no such route)."""
    response = await client.get("/metrics")
    return response.text.splitlines() if response.status_code == 200 else []


async def engine_counters(client: httpx.AsyncClient) -> dict | None:
    """The server's engine counters from /metrics: {"steps": {drafted: steps}, "prefill_s": seconds,
    "step_s": seconds} (module docstring); None where it has none (another server)."""
    counters: dict = {"steps": {}, "prefill_s": 0.0, "step_s": 0.0}
    found = False
    for line in await _metrics_lines(client):
        name, _, rest = line.partition("{")
        if name not in (_ENGINE_STEPS, _ENGINE_SECONDS):
            continue
        label, value = rest.split('"')[1], float(line.split()[-1])
        found = True
        if name == _ENGINE_STEPS:
            counters["steps"][int(label)] = value
        else:
            counters[f"{label}_s"] = value
    return counters if found else None


def counters_since(before: dict | None, after: dict | None) -> dict | None:
    """What the engine counters gained from `before` to `after` (None where either is missing)."""
    if before is None or after is None:
        return None
    steps = {k: n - before["steps"].get(k, 0.0) for k, n in after["steps"].items()}
    return {
        "steps": {k: int(n) for k, n in sorted(steps.items()) if n},
        "prefill_s": after["prefill_s"] - before["prefill_s"],
        "step_s": after["step_s"] - before["step_s"],
    }


def pooled_counters(runs: list[dict | None]) -> dict | None:
    """A level's engine counters summed over its rounds (None where a round has none)."""
    if not runs or any(run is None for run in runs):
        return None
    steps: dict[int, int] = {}
    for run in runs:
        for k, n in run["steps"].items():
            steps[k] = steps.get(k, 0) + n
    return {
        "steps": dict(sorted(steps.items())),
        "prefill_s": sum(run["prefill_s"] for run in runs),
        "step_s": sum(run["step_s"] for run in runs),
    }


async def _heap_in_use(client: httpx.AsyncClient) -> int | None:
    """The server's speculative:heap_in_use_bytes from /metrics (None where it has none)."""
    for line in await _metrics_lines(client):
        if line.startswith("speculative:heap_in_use_bytes "):
            value = float(line.split()[1])
            return None if value < 0 else int(value)
    return None


async def _soak(driver: Driver, process: psutil.Process, concurrency: int, config: LoadConfig) -> dict:
    """`soak_requests` short requests; the idle server's RSS and C heap in use after the first
    SOAK_WARM_UP of them and at the end, and the bound a leak of LEAK_PER_REQUEST bytes a request would
    exceed over the rest. Flat: the heap in use grew by less (the RSS where the server reports no heap:
    it also moves with the heap's fragmentation, about +-13 MiB on the demo pair)."""
    warm = max(concurrency, int(config.soak_requests * SOAK_WARM_UP))
    start = driver.clock()
    records = await driver.closed_loop(concurrency, warm, config.soak_max_tokens)
    await asyncio.sleep(SETTLE)
    rss, heap = process.memory_info().rss, await _heap_in_use(driver.client)
    rest = await driver.closed_loop(concurrency, config.soak_requests - warm, config.soak_max_tokens)
    await asyncio.sleep(SETTLE)
    rss_end, heap_end = process.memory_info().rss, await _heap_in_use(driver.client)
    bound = LEAK_PER_REQUEST * len(rest)
    growth = heap_end - heap if heap is not None and heap_end is not None else None
    return {
        "start": start,
        "requests": len(records) + len(rest),
        "errors": sum(r.error is not None for r in records + rest),
        "rss_baseline": rss,
        "rss_end": rss_end,
        "growth": rss_end - rss,
        "heap_baseline": heap,
        "heap_end": heap_end,
        "heap_growth": growth,
        "bound": bound,
        "flat": (growth if growth is not None else rss_end - rss) < bound,
        "seconds": driver.clock() - start,
    }


def run_load(config: LoadConfig, target: str, draft: str | None, out: Path) -> dict:
    """Every server of `config` started and driven (drive_servers): with one round, one server up at
    a time; with more, all up together (each holding its models) so that they can take turns.
    results.json, report.md and load.png written to `out` (created). Returns the results."""
    prompt_file = resolve_set(config.prompts) if config.prompts else default_sets(load_tokenizer(target))[0]
    prompts = load_jsonl(prompt_file)[: config.num_prompts]
    if config.conversations and not all(any(m["role"] == "user" for m in p.messages or []) for p in prompts):
        raise ValueError(
            f"conversations takes chat records with user turns (chat-multiturn); {prompt_file} has others"
        )
    results: dict = {
        "config": asdict(config),
        "machine": {**machine(), "cpu_features": cpu_features()},
        "prompts": str(prompt_file),
        "servers": {},
    }

    def drive(names: list[str]) -> dict[str, dict]:
        with contextlib.ExitStack() as stack:
            servers = {}
            for server in names:
                port = free_port()
                command = serve_command(config, server, target, draft, port)
                process = ServerProcess(command, port, f"speculative serve ({server})", stop_timeout=60)
                stack.enter_context(process)
                servers[server] = (process.url, process.pid)
            return asyncio.run(drive_servers(servers, prompts, config))

    for names in [[server] for server in config.servers] if config.rounds == 1 else [config.servers]:
        results["servers"].update(drive(names))
    write_load_outputs(results, out)
    return results
