"""Stop strings with log-probabilities and min_tokens, offline and streamed: the tokens a stop string
cuts count nowhere, stop strings wait for min_tokens, and a stream's log-probabilities go with its text."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from speculative import SamplingParams

from .conftest import API_KEY, MODEL

PROMPTS = ["def f(x):", "class A:", "import os"]


def greedy_text(served, prompt: str, **params) -> str:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **params)
    return served.reference.generate(prompt, params)[0].outputs[0].text


def stop_cases(served) -> list[tuple[str, str]]:
    """(prompt, stop string) pairs whose stop string occurs in the greedy text at several depths, so
    that some fall inside a speculative step's block of several tokens."""
    cases = []
    for prompt in PROMPTS:
        text = greedy_text(served, prompt)
        cases += [(prompt, text[i : i + length]) for i in (3, 9, 17, 26) for length in (1, 2)]
    return cases


def test_cumulative_logprob_sums_only_the_tokens_a_stop_string_keeps(served) -> None:
    for prompt, stop in stop_cases(served):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], logprobs=0)
        out = served.reference.generate(prompt, params)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert len(out.logprobs) == len(out.token_ids)
        kept = sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs))
        assert math.isclose(out.cumulative_logprob, kept, abs_tol=1e-4), (prompt, stop)


def test_stop_strings_wait_for_min_tokens(served) -> None:
    """As vLLM: a stop string that ends within the first min_tokens tokens' text does not stop the
    sequence; the first one that ends past it does."""
    min_tokens = 20
    for prompt in PROMPTS:
        params = {"max_tokens": 40, "ignore_eos": True, "min_tokens": min_tokens}
        whole = served.reference.generate(prompt, SamplingParams(temperature=0, **params))[0].outputs[0]
        floor = len(served.reference.detokenize(whole.token_ids[:min_tokens], None))
        stop = whole.text[2]  # occurs early, inside the first min_tokens tokens
        end = whole.text.find(stop, floor)
        expected = whole.text[:end] if end >= 0 else whole.text
        out = served.reference.generate(prompt, SamplingParams(temperature=0, stop=[stop], **params))[0]
        assert out.outputs[0].text == expected, (prompt, stop)
        response = served.post(
            "/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0, "stop": [stop], **params}
        )
        assert response.json()["choices"][0]["text"] == expected


def sse_chunks(served, body: dict) -> list[dict]:
    with httpx.stream(
        "POST",
        served.url + "/v1/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_streamed_logprobs_are_held_back_with_the_text(served, include_stop_str_in_output) -> None:
    """While a stream holds back text that could still begin a stop string, it holds back those
    tokens' log-probabilities too: every chunk's tokens spell its text (one character per token
    here) until the last, and the stream's tokens, log-probabilities and text offsets are the
    non-streamed answer's."""
    for prompt, stop in stop_cases(served)[::3]:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop, "never seen"],  # a long stop string: ten characters held back
            "logprobs": 1,
            "include_stop_str_in_output": include_stop_str_in_output,
        }
        whole = served.post("/v1/completions", body).json()["choices"][0]
        chunks = [c["choices"][0] for c in sse_chunks(served, body) if c["choices"]]
        for chunk in chunks[:-1]:
            assert "".join(chunk["logprobs"]["tokens"]) == chunk["text"], (prompt, stop, chunk)
        assert "".join(c["text"] for c in chunks) == whole["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key], key
