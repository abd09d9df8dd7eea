"""The API key, /health, and /metrics in Prometheus' format with counters that move as requests are served."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/v1/no-such-route"),
    ],
)
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "test-key"])
def test_every_route_but_health_needs_the_key(served, method, path, header) -> None:
    headers = {"Authorization": header} if header else {}
    response = httpx.request(method, served.url + path, json={"model": MODEL, "prompt": "x"}, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]


def test_the_key_opens_and_health_is_open(served) -> None:
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    assert served.get("/v1/models").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()
    response = served.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert response.choices[0].text is not None


def test_metrics_parse_and_move(served) -> None:
    before = served.metrics()
    ok_before = served.requests_counted("/v1/completions", 200)
    bad_before = served.requests_counted("/v1/completions", 400)
    served.client().completions.create(
        model=MODEL, prompt="def f(x):", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert served.post("/v1/completions", {"prompt": "x", "top_p": 7}).status_code == 400
    served.wait_for(
        lambda: served.requests_counted("/v1/completions", 400) == bad_before + 1, what="the 400 counted"
    )
    assert served.requests_counted("/v1/completions", 200) == ok_before + 1
    after = served.metrics()

    def moved(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("speculative:generation_tokens_total") >= 10
    assert moved("speculative:prompt_tokens_total") >= len("def f(x):")
    assert moved("speculative:request_finished_total", (("finished_reason", "length"),)) >= 1
    assert moved("speculative:spec_decode_num_drafts_total") >= 1
    assert moved("speculative:spec_decode_num_draft_tokens_total") >= 3
    assert moved("speculative:time_to_first_token_seconds_count") >= 1
    # the engine's steps by the drafts they verified a row (k = 3: a 10-token answer drafts), its busy time
    steps = {
        labels: value for (name, labels), value in after.items() if name == "speculative:engine_steps_total"
    }
    assert {labels[0][1] for labels in steps} <= {"0", "1", "2", "3"}
    assert (
        sum(
            moved("speculative:engine_steps_total", labels)
            for labels in steps
            if labels != (("drafted", "0"),)
        )
        >= 1
    )
    assert moved("speculative:engine_busy_seconds_total", (("phase", "prefill"),)) > 0
    assert moved("speculative:engine_busy_seconds_total", (("phase", "step"),)) > 0
    assert after[("speculative:num_sequences_running", ())] == 0
    assert after[("speculative:num_sequences_waiting", ())] == 0
