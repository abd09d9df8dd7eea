"""Sampled speculative output follows the target's distribution exactly (chi-square tests).

Three-token continuations are sampled many times and compared with probabilities enumerated exactly
from the target: q(a) q(b | a) q(c | a, b), each after the request's temperature and top-k.
The same test fails for a rule that accepts every draft, so it can tell a broken sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from scipy.stats import chi2

import speculative.acceptance.rejection as rejection_module
import speculative.acceptance.tree as tree_module
from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.methods import NgramConfig

VOCAB = 8
LENGTH = 3
SAMPLES = 20_000


def exact_probs(model, prompt: list[int], temperature: float, top_k: int) -> np.ndarray:
    """P(x_1..x_3 | prompt) for all VOCAB**3 continuations, enumerated with the target alone."""

    def dist(contexts: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(contexts)).logits[:, -1].double()
        if top_k > 0:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return (logits / temperature).softmax(dim=-1)

    q1 = dist([prompt])[0]
    q2 = dist([prompt + [a] for a in range(VOCAB)])
    q3 = dist([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    return (q1[:, None, None] * q2[:, :, None] * q3).numpy().ravel()


def chi_square(samples: list[list[int]], probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, cells with expected count < 5 pooled."""
    index = [a * VOCAB * VOCAB + b * VOCAB + c for a, b, c in samples]
    observed = np.bincount(index, minlength=VOCAB**LENGTH).astype(float)
    expected = probs * len(samples)
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def sample(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(prompts, params)
    samples = [o.outputs[0].token_ids for o in outputs]
    assert all(len(s) == LENGTH for s in samples)
    return samples


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, seed=0)
    draft = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=5)
    return target, draft


def accept_every_draft(target_probs, bonus_token_ids, draft_probs, draft_token_ids, uniform, noise):
    """A deliberately broken rule: keeps every draft, so the output follows the draft."""
    return torch.cat([draft_token_ids, bonus_token_ids], dim=1)


CASES = [  # (temperature, top_k, k)
    (1.0, -1, 2),
    (0.7, 4, 1),
]


@pytest.mark.parametrize("temperature,top_k,k", CASES)
def test_speculative_sampling_matches_target(pair, temperature, top_k, k) -> None:
    target, draft = pair
    prompt = [2, 3, 4, 5]
    llm = LLM(
        target, draft_model=draft, speculative_config=SpeculativeConfig(num_speculative_tokens=k), seed=11
    )
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=LENGTH, ignore_eos=True)
    stat, dof = chi_square(
        sample(llm, [prompt] * SAMPLES, [params] * SAMPLES), exact_probs(target, prompt, temperature, top_k)
    )
    assert chi2.sf(stat, dof) > 1e-3, f"chi-square {stat:.1f} on {dof} dof"


@pytest.mark.parametrize("temperature,top_k,k", CASES)
def test_broken_sampler_fails(pair, monkeypatch, temperature, top_k, k) -> None:
    target, draft = pair
    monkeypatch.setattr(rejection_module, "rejection_sample", accept_every_draft)
    prompt = [2, 3, 4, 5]
    llm = LLM(
        target, draft_model=draft, speculative_config=SpeculativeConfig(num_speculative_tokens=k), seed=11
    )
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=LENGTH, ignore_eos=True)
    stat, dof = chi_square(
        sample(llm, [prompt] * SAMPLES, [params] * SAMPLES), exact_probs(target, prompt, temperature, top_k)
    )
    assert chi2.sf(stat, dof) < 1e-6


def test_seeded_batch_of_four_matches_target(pair) -> None:
    """Four rows of different prompts, every row with its own seed, in one batch."""
    target, draft = pair
    prompts = [[2, 3, 4, 5], [6], [1, 7, 1, 7, 1, 7, 2], [3, 3]]
    per_prompt = SAMPLES // len(prompts)
    llm = LLM(target, draft_model=draft, speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    batch = [p for p in prompts for _ in range(per_prompt)]
    params = [
        SamplingParams(temperature=0.9, max_tokens=LENGTH, ignore_eos=True, seed=i) for i in range(len(batch))
    ]
    samples = sample(llm, batch, params)
    total, dofs = 0.0, 0
    for j, prompt in enumerate(prompts):
        stat, dof = chi_square(
            samples[j * per_prompt : (j + 1) * per_prompt], exact_probs(target, prompt, 0.9, -1)
        )
        total, dofs = total + stat, dofs + dof
    assert chi2.sf(total, dofs) > 1e-3, f"chi-square {total:.1f} on {dofs} dof"


def test_ngram_sampling_matches_target(pair) -> None:
    """A deterministic drafter (one-hot p): accept x with probability q(x), residual = q without x."""
    target, _ = pair
    prompt = [2, 3, 2, 3, 2, 3, 2]
    llm = LLM(
        target,
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, options=NgramConfig(prompt_lookup_max=2)
        ),
        seed=3,
    )
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    outputs = llm.generate([prompt] * SAMPLES, params)
    assert sum(o.metrics.num_drafted for o in outputs) > 0
    stat, dof = chi_square([o.outputs[0].token_ids for o in outputs], exact_probs(target, prompt, 1.0, -1))
    assert chi2.sf(stat, dof) > 1e-3, f"chi-square {stat:.1f} on {dof} dof"


def test_acceptance_is_exercised(pair) -> None:
    """The pair disagrees enough that drafts are both accepted and rejected (the tests above bite)."""
    target, draft = pair
    llm = LLM(target, draft_model=draft, speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    outputs = llm.generate(
        [[2, 3, 4, 5]] * 2000, SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    )
    rate = sum(o.metrics.num_accepted for o in outputs) / sum(o.metrics.num_drafted for o in outputs)
    assert 0.2 < rate < 0.9, rate


def tree_llm(pair) -> LLM:
    """The draft's dynamic trees, 2 deep, 2 candidates per node, 4 drafts: siblings everywhere."""
    target, draft = pair
    config = SpeculativeConfig(num_speculative_tokens=2, tree="dynamic", tree_width=2, tree_nodes=4)
    return LLM(target, draft_model=draft, speculative_config=config, seed=11)


@pytest.mark.parametrize("broken", [False, True])
def test_tree_speculation_matches_target(pair, monkeypatch, broken) -> None:
    """Sibling by sibling rejection over trees: exact; without the residual update between siblings
    (a rejected sibling's probability left in q), the same test fails."""
    if broken:
        monkeypatch.setattr(tree_module, "_residual", lambda q, p: q)
    target, _ = pair
    prompt = [2, 3, 4, 5]
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    samples = sample(tree_llm(pair), [prompt] * SAMPLES, [params] * SAMPLES)
    p_value = chi2.sf(*chi_square(samples, exact_probs(target, prompt, 1.0, -1)))
    assert p_value < 1e-6 if broken else p_value > 1e-3
