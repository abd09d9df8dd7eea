"""A seeded request gives the same text alone and inside a batch of other requests."""

from __future__ import annotations

import pytest
from conftest import noisy_copy, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig


@pytest.mark.parametrize("method", ["draft_model", "ngram", "self_draft", None])
def test_seeded_request_alone_and_in_a_batch(method) -> None:
    target = tiny_model("llama")
    kwargs = {}
    if method == "draft_model":
        kwargs = dict(
            draft_model=noisy_copy(target, 0.05),
            speculative_config=SpeculativeConfig(num_speculative_tokens=3),
        )
    elif method in ("ngram", "self_draft"):
        kwargs = dict(speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=3))
    llm = LLM(target, **kwargs)
    prompt = [5, 6, 7, 5, 6]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=30)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [
        ([9, 9, 3], SamplingParams(temperature=1.0, max_tokens=12)),
        ([4] * 11, SamplingParams(temperature=0.0, max_tokens=40)),
        ([7, 8], SamplingParams(temperature=0.5, seed=99, top_k=5, max_tokens=5)),
    ]
    for position in range(len(others) + 1):
        batch = others[:position] + [(prompt, seeded)] + others[position:]
        outputs = llm.generate([p for p, _ in batch], [s for _, s in batch])
        assert outputs[position].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=30))
    assert other_seed[0].outputs[0].token_ids != alone


def test_engine_seed_makes_unseeded_runs_repeatable() -> None:
    target = tiny_model("llama")
    params = SamplingParams(temperature=1.0, max_tokens=20)
    first = LLM(target, seed=5).generate([[3, 4, 5]] * 3, params)
    second = LLM(target, seed=5).generate([[3, 4, 5]] * 3, params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
