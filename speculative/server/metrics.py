"""The server's Prometheus metrics, in a registry of its own (several servers fit in one process).

Speculation counters have vLLM v1's meanings: a "draft" is one sequence's proposal in one step that
drafted at least one token; draft tokens and accepted tokens are counted over all of them, and
accepted tokens also per draft position (0-based, as vLLM's `position` label).

Several processes (`speculative serve --replicas N`) share one view through prometheus-client's
multiprocess mode: with MULTIPROCESS_DIR set in their environment before prometheus_client is imported,
each process keeps its values in files there, and `ServerMetrics.exposed()` adds up every process's,
the ones that have died included (counters never go back; the gauges count live processes only).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from speculative.extras import needs_extra
from speculative.server.memory import heap_in_use

with needs_extra("server", "speculative.server"):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
"""The environment variable naming the folder of prometheus-client's multiprocess mode."""

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_PREFIX = "speculative:"


class ServerMetrics:
    """Counters, gauges and histograms of one server, in `registry`; `exposed()` is what /metrics
    shows. In multiprocess mode (MULTIPROCESS_DIR set) there is no heap gauge (the heap is a process's)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_DIR)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(_PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(_PREFIX + name, doc, buckets=_LATENCY_BUCKETS, registry=registry)

        self.http_requests = counter(
            "http_requests", "HTTP requests to /v1 routes by endpoint and status.", ("endpoint", "status")
        )
        self.requests_finished = counter(
            "request_finished", "Generation requests finished, by reason.", ("finished_reason",)
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.running = Gauge(
            _PREFIX + "num_sequences_running",
            "Sequences in the running batch.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.waiting = Gauge(
            _PREFIX + "num_sequences_waiting",
            "Sequences queued for the running batch.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From arrival to a request's first generated token."
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time per generated token (a step's time / tokens it gave a sequence).",
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "From arrival to a request's last token.")
        if self.multiprocess_dir is None:
            heap = Gauge(
                _PREFIX + "heap_in_use_bytes",
                "Bytes the C heap has handed out and not had back (glibc; -1 elsewhere).",
                registry=registry,
            )
            heap.set_function(lambda: -1 if (used := heap_in_use()) is None else used)
        self.engine_steps = counter(
            "engine_steps", "Engine steps, by draft tokens verified a row (0: a plain step).", ("drafted",)
        )
        self.engine_seconds = counter(
            "engine_busy_seconds",
            "The engine thread's busy seconds: prefilling admitted requests, and stepping the batch.",
            ("phase",),
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (--enable-prefix-caching)."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache, their prefill skipped."
        )
        self.num_drafts = counter("spec_decode_num_drafts", "Proposals that drafted at least one token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_position = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            ("position",),
        )

    def exposed(self) -> CollectorRegistry:
        """What /metrics shows: `registry`, or in multiprocess mode every process's values added up."""
        if self.multiprocess_dir is None:
            return self.registry
        exposed = CollectorRegistry()
        multiprocess.MultiProcessCollector(exposed, self.multiprocess_dir)
        return exposed

    def request_finished(self, status: int, endpoint: str) -> None:
        """Count one HTTP request to a /v1 route by its response status."""
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()


def forget_dead_processes(folder: str) -> None:
    """Drop the live gauges of the processes of `folder` (a MULTIPROCESS_DIR of this machine) that are no
    longer running, as a replica that starts does for the one it replaces; their counters stay."""
    for pid in {int(m[1]) for f in Path(folder).glob("*.db") if (m := re.search(r"_(\d+)\.db$", f.name))}:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, folder)
