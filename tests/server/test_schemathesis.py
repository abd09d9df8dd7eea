"""Schemathesis fuzzes the app's own OpenAPI schema in-process (ASGI, no network): no request it makes
gets a 5xx, and the server answers a normal completion correctly afterwards."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speculative import SamplingParams
from speculative.server.app import create_app
from speculative.server.scheduler import Scheduler

from .conftest import speculative_llm, tiny_pair

MAX_MODEL_LEN = 24  # small enough that any max_tokens the fuzzer picks is cheap on 2 cores
MAX_NUM_SEQS = 4  # so are n and best_of
EXAMPLES = 300  # requests in all, following the schema or breaking it (seconds on 2 cores)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def app(pair):
    scheduler = Scheduler(speculative_llm(*pair), max_num_seqs=MAX_NUM_SEQS, max_waiting=8)
    return create_app(
        scheduler,
        model_name="tiny",
        tokenizer=pair[2],
        api_key=None,
        max_prompt_tokens=None,
        max_model_len=MAX_MODEL_LEN,
    )


def test_no_request_gets_a_5xx_and_the_server_goes_on(app, pair) -> None:
    """Requests that follow the schema and requests that break it, on every operation; then a normal
    completion, in the same application (its lifespan ends with the test), answered as offline."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)

    @given(case=st.one_of(*(schema.as_strategy(mode) for mode in modes)), served_model=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def check(case, served_model: bool) -> None:
        if served_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # past the 404 of an unknown model, to the rest of the handler
        response = case.call()
        assert response.status_code < 500, (case.as_curl_command(), response.text)

    check()
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    response = schema["/v1/completions"]["POST"].Case(body=body, media_type="application/json").call()
    assert response.status_code == 200, response.text
    expected = speculative_llm(*pair).generate("def f(x):", SamplingParams(temperature=0, max_tokens=8))
    assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text
