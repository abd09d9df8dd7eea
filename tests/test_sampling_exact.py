"""Speculative decoding stays exact under every SamplingParams processor."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import byte_tokenizer, noisy_copy, tiny_model
from scipy.stats import chi2
from test_distribution import LENGTH, SAMPLES, VOCAB, chi_square

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.engine.batch import Batch
from speculative.sampling.guided import GuidedDecodingParams


def reference_logits(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    """The processing order of the sampler's docstring, written out by hand for one position."""
    logits = logits.double().clone()
    if p.allowed_token_ids:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        logits[~keep] = float("-inf")
    for token, bias in (p.logit_bias or {}).items():
        logits[token] += bias
    for token in set(prompt + output):
        logits[token] = (
            logits[token] / p.repetition_penalty
            if logits[token] > 0
            else logits[token] * p.repetition_penalty
        )
    for token, count in Counter(output).items():
        logits[token] -= p.frequency_penalty * count + p.presence_penalty
    logits = logits / p.temperature
    probs = logits.softmax(-1)
    logits[probs < p.min_p * probs.max()] = float("-inf")
    if p.top_k > 0:
        logits[logits < logits.topk(p.top_k).values[-1]] = float("-inf")
    if p.top_p < 1:
        probs = logits.softmax(-1)
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        logits[order[before >= p.top_p]] = float("-inf")
    return logits


def exact_probs(model, prompt: list[int], p: SamplingParams) -> np.ndarray:
    """P(x_1..x_3 | prompt) under the processed target, enumerated."""
    probs = np.zeros((VOCAB,) * LENGTH)
    with torch.no_grad():

        def dist(output):
            raw = model(torch.tensor([prompt + output])).logits[0, -1]
            return reference_logits(raw, prompt, output, p).softmax(-1)

        q1 = dist([])
        for a in range(VOCAB):
            if q1[a] == 0:
                continue
            q2 = dist([a])
            for b in range(VOCAB):
                if q2[b] > 0:
                    probs[a, b] = (q1[a] * q2[b] * dist([a, b])).numpy()
    return probs.ravel()


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, seed=0)
    draft = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=5)
    return target, draft


PENALTIES = SamplingParams(
    temperature=1.0,
    repetition_penalty=1.6,
    frequency_penalty=1.2,
    presence_penalty=0.6,
    min_p=0.02,
    max_tokens=LENGTH,
    ignore_eos=True,
)
FILTERS = SamplingParams(
    temperature=0.8,
    top_k=6,
    top_p=0.9,
    logit_bias={3: 1.5, 5: -0.5},
    allowed_token_ids=[0, 2, 3, 4, 5, 6, 7],
    max_tokens=LENGTH,
    ignore_eos=True,
)


def run(pair, params: SamplingParams, seed: int, tree: bool = False) -> float:
    """The chi-square p-value of SAMPLES continuations (over the draft's dynamic trees with `tree`)."""
    target, draft = pair
    prompt = [2, 3, 2, 5]
    config = SpeculativeConfig(num_speculative_tokens=2)
    if tree:
        config = SpeculativeConfig(num_speculative_tokens=2, tree="dynamic", tree_width=2, tree_nodes=4)
    llm = LLM(target, draft_model=draft, speculative_config=config, seed=seed)
    outputs = llm.generate([prompt] * SAMPLES, params)
    stat, dof = chi_square([o.outputs[0].token_ids for o in outputs], exact_probs(target, prompt, params))
    return chi2.sf(stat, dof)


@pytest.mark.parametrize("params", [PENALTIES, FILTERS], ids=["penalties+min_p", "top_k+top_p+bias+allowed"])
def test_processors_keep_sampling_exact(pair, params) -> None:
    assert run(pair, params, seed=21) > 1e-3


def test_processors_over_trees_keep_sampling_exact(pair) -> None:
    """Each node's penalties and min_p see its own path (TokenContext over a tree)."""
    assert run(pair, PENALTIES, seed=21, tree=True) > 1e-3


def test_processors_over_trees_reading_the_nodes_as_a_chain_fail(pair, monkeypatch) -> None:
    """Processing a tree's nodes as if they were one chain (each node after every earlier one) is
    caught."""
    original = Batch.context
    monkeypatch.setattr(Batch, "context", lambda self, block=None, parents=None: original(self, block, None))
    assert run(pair, PENALTIES, seed=21, tree=True) < 1e-6


def test_processors_without_the_draft_prefix_fail(pair, monkeypatch) -> None:
    """Processing each draft position with the context before the block (a classic bug) is caught."""
    original = Batch.context

    def without_prefix(self, block=None):
        return original(self, None if block is None else torch.full_like(block, -1))

    monkeypatch.setattr(Batch, "context", without_prefix)
    assert run(pair, PENALTIES, seed=21) < 1e-6


def test_greedy_with_penalties_equals_plain_decoding() -> None:
    target = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.4, frequency_penalty=0.7)
    prompts = [[5, 6, 7, 5, 6], [9], [3, 4, 3, 4, 3]]
    plain = LLM(target).generate(prompts, params)
    for kwargs in (
        dict(draft_model=noisy_copy(target, 0.02)),
        dict(speculative_config=SpeculativeConfig(method="ngram")),
    ):
        spec = LLM(target, **kwargs).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    unpenalized = LLM(target).generate(prompts, SamplingParams(temperature=0.0, max_tokens=40))
    assert [o.outputs[0].token_ids for o in unpenalized] != [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("tree", [None, "static"])
def test_logprobs_equal_plain_decoding(tree) -> None:
    target = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, prompt_logprobs=2)
    plain = LLM(target).generate([[5, 6, 7, 8]], params)[0]
    config = SpeculativeConfig(num_speculative_tokens=4, tree=tree, tree_width=2, tree_nodes=8)
    spec = LLM(target, draft_model=target, speculative_config=config).generate([[5, 6, 7, 8]], params)[0]
    assert spec.metrics.num_accepted > 0
    a, b = spec.outputs[0], plain.outputs[0]
    assert a.token_ids == b.token_ids and len(a.logprobs) == 24
    for x, y, token in zip(a.logprobs, b.logprobs, a.token_ids):
        assert x.keys() == y.keys() and token in x and 3 <= len(x) <= 4
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) < 1e-5 and x[t].rank == y[t].rank
    assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-4
    with torch.no_grad():  # against the target's own log-softmax
        logp = target(torch.tensor([[5, 6, 7, 8] + b.token_ids])).logits[0].log_softmax(-1)
    for i, (entry, token) in enumerate(zip(b.logprobs, b.token_ids)):
        assert abs(entry[token].logprob - logp[3 + i, token].item()) < 1e-5
    assert (
        spec.prompt_logprobs[0] is None and abs(spec.prompt_logprobs[1][6].logprob - logp[0, 6].item()) < 1e-5
    )


LETTERS = [byte_tokenizer().convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_blocks(include) -> None:
    """draft = target accepts blocks of 5 after the first token: text[4:8] spans tokens 4-7,
    across the boundary between the first block (tokens 1-5) and the second (6-10)."""
    tokenizer = byte_tokenizer()
    target = tiny_model("llama", vocab_size=257, eos_token_id=256, bos_token_id=256)
    llm = LLM(
        target,
        draft_model=target,
        tokenizer=tokenizer,
        speculative_config=SpeculativeConfig(num_speculative_tokens=4),
    )
    base = SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=LETTERS)
    free = llm.generate(["abc"], base)[0].outputs[0]
    stop = free.text[4:8]
    assert free.text.find(stop) == 4
    params = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        allowed_token_ids=LETTERS,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    out = llm.generate(["abc"], params)[0].outputs[0]
    assert out.text == (free.text[:8] if include else free.text[:4])
    assert out.token_ids == free.token_ids[:8]
    assert out.finish_reason == "stop" and out.stop_reason == stop


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("speculate", [True, False])
def test_guided_json_always_parses(speculate) -> None:
    tokenizer = byte_tokenizer()
    target = tiny_model("llama", vocab_size=257, eos_token_id=256, bos_token_id=256)
    kwargs = dict(
        draft_model=noisy_copy(target, 0.02), speculative_config=SpeculativeConfig(num_speculative_tokens=4)
    )
    llm = LLM(target, tokenizer=tokenizer, **(kwargs if speculate else {}))
    params = SamplingParams(
        temperature=1.0, max_tokens=100, guided_decoding=GuidedDecodingParams(json=SCHEMA)
    )
    outputs = llm.generate(["{"] * 50, params)
    for out in outputs:
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"color", "ok"} and value["color"] in SCHEMA["properties"]["color"]["enum"]
        assert isinstance(value["ok"], bool) and out.outputs[0].finish_reason == "stop"
    if speculate:
        assert sum(o.metrics.num_accepted for o in outputs) > 0


def test_seeded_request_with_processors_alone_and_in_a_mixed_batch() -> None:
    tokenizer = byte_tokenizer()
    target = tiny_model("llama", vocab_size=257, eos_token_id=256, bos_token_id=256)
    llm = LLM(
        target,
        draft_model=noisy_copy(target, 0.05),
        tokenizer=tokenizer,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    seeded = SamplingParams(
        temperature=0.9,
        seed=77,
        max_tokens=30,
        repetition_penalty=1.2,
        min_p=0.01,
        presence_penalty=0.3,
        logprobs=1,
    )
    alone = llm.generate(["def f"], seeded)[0].outputs[0]
    others = [
        SamplingParams(temperature=0.0, max_tokens=10, stop=["e"]),
        SamplingParams(temperature=1.0, n=2, max_tokens=12),
        SamplingParams(temperature=0.7, top_k=5, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
    ]
    outputs = llm.generate(["x = 1", "def f", "import os", "ok?"], [others[0], seeded, others[1], others[2]])
    assert outputs[1].outputs[0].token_ids == alone.token_ids and outputs[1].outputs[0].text == alone.text
    assert len(outputs[2].outputs) == 2 and outputs[3].outputs[0].text in ("yes", "no")


def test_n_and_best_of_share_the_prefill() -> None:
    target = tiny_model("llama")
    llm = LLM(
        target,
        draft_model=noisy_copy(target, 0.05),
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, n=3, best_of=6, seed=4, max_tokens=16))[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, n=3, best_of=6, seed=4, max_tokens=16))[
        0
    ]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
