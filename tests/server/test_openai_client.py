"""The official openai client against the running server: completions and chat, streaming and not,
greedy text equal to LLM.generate's for the same request."""

from __future__ import annotations

import json
import math

from speculative import SamplingParams

from .conftest import MODEL

PROMPT = "def add(a, b):"
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Add two numbers."},
]


def offline(served, prompt, **params):
    """LLM.generate's completion of one prompt (text or token ids)."""
    return served.reference.generate(prompt, SamplingParams(**params))[0]


def chat_prompt_ids(served, messages) -> list[int]:
    return served.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_completion_greedy_equals_generate(served) -> None:
    response = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    expected = offline(served, PROMPT, temperature=0, max_tokens=24)
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert (
        response.object == "text_completion" and response.model == MODEL and response.id.startswith("cmpl-")
    )
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_completion_stream_several_tokens_per_event(served) -> None:
    stream = served.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    expected = offline(served, PROMPT, temperature=0, max_tokens=40, ignore_eos=True, logprobs=1).outputs[0]
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    tokens_per_event = [len(c.choices[0].logprobs.tokens) for c in text_chunks]
    assert sum(tokens_per_event) == 40
    assert max(tokens_per_event) > 1, "a speculative step that accepts drafts sends several tokens at once"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    streamed = [lp for c in text_chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert all(
        math.isclose(a, expected.logprobs[i][t].logprob, abs_tol=1e-4)
        for i, (a, t) in enumerate(zip(streamed, expected.token_ids))
    )


def test_continuous_usage_counts_the_tokens_of_every_chunk(served) -> None:
    """stream_options.continuous_usage_stats (vLLM's): every chunk holds the usage so far, so its
    growth is each chunk's number of tokens (several after a step that accepted drafts)."""
    client = served.client()
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c for c in stream if c.choices]
    so_far = [c.usage.completion_tokens for c in chunks]
    assert so_far[-1] == 40 and all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)
    grown = [b - a for a, b in zip([0, *so_far], so_far)]
    assert grown == [len(c.choices[0].logprobs.tokens) for c in chunks] and max(grown) > 1
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    usage = [c.usage.completion_tokens for c in chat]
    assert usage[0] == 0 and usage == sorted(usage) and usage[-1] == 12
    without = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    assert all(c.usage is None for c in without if c.choices)  # the usage only at the end


def test_chat_greedy_equals_generate(served) -> None:
    client = served.client()
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0
    )
    expected = offline(served, chat_prompt_ids(served, MESSAGES), temperature=0, max_tokens=20).outputs[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_logprobs(served) -> None:
    response = served.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == values[0]  # greedy picks the most likely token
        assert bytes(entry.bytes).decode() == entry.token


def test_completion_logprobs_format(served) -> None:
    response = served.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = response.choices[0].logprobs
    assert "".join(lp.tokens) == response.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(2 <= len(top) <= 3 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))


def test_token_id_prompt_and_batch_of_prompts(served) -> None:
    ids = served.tokenizer(PROMPT)["input_ids"]
    prompts = ["class Stack:", "import os"]
    client = served.client()
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert single.choices[0].text == offline(served, ids, temperature=0, max_tokens=8).outputs[0].text
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [
        offline(served, p, temperature=0, max_tokens=8).outputs[0].text for p in prompts
    ]


def test_seeded_sampling_n_and_stop(served) -> None:
    client = served.client()
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        n=2,
        seed=7,
        extra_body={"top_k": 20},
    )
    expected = offline(served, PROMPT, temperature=0.9, top_p=0.95, top_k=20, n=2, seed=7, max_tokens=12)
    assert [c.text for c in response.choices] == [o.text for o in expected.outputs]
    stop = expected.outputs[0].text[3:5]
    stopped = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        stop=[stop],
        extra_body={"top_k": 20},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == expected.outputs[0].text[: expected.outputs[0].text.index(stop)]


def test_json_schema_response_format(served) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    response = served.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": schema}},
    )
    assert json.loads(response.choices[0].message.content)["color"] in ("red", "green")
    assert response.choices[0].finish_reason == "stop"


def test_models_route(served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
