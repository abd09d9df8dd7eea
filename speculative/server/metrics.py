"""The server's Prometheus metrics, in a registry of its own (several servers fit in one process).

Speculation counters have vLLM v1's meanings: a "draft" is one sequence's proposal in one step that
drafted at least one token; draft tokens and accepted tokens are counted over all of them, and
accepted tokens also per draft position (0-based, as vLLM's `position` label).
"""

from __future__ import annotations

from speculative.extras import needs_extra
from speculative.server.memory import heap_in_use

with needs_extra("server", "speculative.server"):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
    """Counters, gauges and histograms of one server; `registry` is what /metrics exposes."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()

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
            _PREFIX + "num_sequences_running", "Sequences in the running batch.", registry=registry
        )
        self.waiting = Gauge(
            _PREFIX + "num_sequences_waiting", "Sequences queued for the running batch.", registry=registry
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From arrival to a request's first generated token."
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time per generated token (a step's time / tokens it gave a sequence).",
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "From arrival to a request's last token.")
        heap = Gauge(
            _PREFIX + "heap_in_use_bytes",
            "Bytes the C heap has handed out and not had back (glibc; -1 elsewhere).",
            registry=registry,
        )
        heap.set_function(lambda: -1 if (used := heap_in_use()) is None else used)
        self.num_drafts = counter("spec_decode_num_drafts", "Proposals that drafted at least one token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_position = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            ("position",),
        )

    def request_finished(self, status: int, endpoint: str) -> None:
        """Count one HTTP request to a /v1 route by its response status."""
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()
