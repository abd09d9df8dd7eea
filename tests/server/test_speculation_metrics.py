"""Per-request speculation metrics in vLLM's names: consistent within a request (histograms against the
totals), on `RequestOutput.metrics` and in the server's answers when asked, and adding up over
requests to exactly what the Prometheus counters counted."""

from __future__ import annotations

import json

import httpx
import pytest

from speculative import SamplingParams

from .conftest import API_KEY

FIELDS = {
    "num_drafts": "speculative:spec_decode_num_drafts_total",
    "num_draft_tokens": "speculative:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "speculative:spec_decode_num_accepted_tokens_total",
}


def check_consistent(fields: dict, num_steps: int | None = None) -> None:
    """The histograms add up to the totals they break down."""
    histogram, by_length = fields["acceptance_histogram"], fields["acceptance_histogram_by_draft_length"]
    assert sum(histogram) == fields["num_drafts"]
    assert sum(j * count for j, count in enumerate(histogram)) == fields["num_accepted_tokens"]
    assert sum(fields["num_accepted_tokens_per_pos"]) == fields["num_accepted_tokens"]
    assert sum(int(d) * sum(counts) for d, counts in by_length.items()) == fields["num_draft_tokens"]
    for d, counts in by_length.items():
        assert len(counts) == int(d) + 1
    merged = [
        sum(counts[j] for counts in by_length.values() if j < len(counts)) for j in range(len(histogram))
    ]
    assert merged == histogram
    if fields["num_draft_tokens"]:
        assert fields["draft_acceptance_rate"] == fields["num_accepted_tokens"] / fields["num_draft_tokens"]
    if num_steps:
        assert fields["mean_acceptance_length"] == pytest.approx(
            1 + fields["num_accepted_tokens"] / num_steps
        )


def test_request_outputs_carry_them(served) -> None:
    outputs = served.reference.generate(
        ["def f(", "x = [1, 2"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    for output in outputs:
        m = output.metrics
        fields = m.vllm_fields()
        check_consistent(fields, m.num_steps)
        assert fields["num_drafts"] == m.drafted_per_position[0] > 0


def _post(served, body: dict) -> dict:
    """The request's "speculation_metrics", from the answer or from the last chunk of its stream."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return response.json()["speculation_metrics"]
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert "speculation_metrics" not in events[0]
    return events[-1]["speculation_metrics"]


def test_server_answers_add_up_to_the_prometheus_counters(served) -> None:
    before = served.metrics()
    bodies = [
        {"prompt": "def f(", "max_tokens": 20, "temperature": 0.0},
        {"prompt": "class A:", "max_tokens": 16, "temperature": 1.0, "seed": 3, "stream": True},
        {"prompt": ["x = 1", "y = [2"], "max_tokens": 12, "temperature": 0.7, "n": 2, "seed": 5},
        {"prompt": "import os", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}},
    ]
    answers = [
        _post(served, {**body, "ignore_eos": True, "return_speculation_metrics": True}) for body in bodies
    ]
    after = served.metrics()
    for answer in answers:
        check_consistent(answer)
    for field, counter in FIELDS.items():
        counted = after.get((counter, ()), 0) - before.get((counter, ()), 0)
        assert sum(answer[field] for answer in answers) == counted, field
    positions = max(len(answer["num_accepted_tokens_per_pos"]) for answer in answers)
    for position in range(positions):
        key = ("speculative:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(position)),))
        counted = after.get(key, 0) - before.get(key, 0)
        answered = sum(a["num_accepted_tokens_per_pos"][position] for a in answers)
        assert answered == counted, position


def test_left_out_unless_asked(served) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "def f(", "max_tokens": 4}
    response = httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert "speculation_metrics" not in response.json()
