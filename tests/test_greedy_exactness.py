"""Greedy speculative output is token-identical to the target decoding alone, for every drafter."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model
from exactness import assert_greedy_equal, hf_greedy

from speculative import LLM, SamplingParams, SpeculativeConfig

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [9],
    [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 30, 31],
    [40, 41, 40, 41, 40],
]
MAX_TOKENS = 24
EOS = 1


def _drafter(kind: str, family: str, target):
    if kind == "random":
        return {"draft_model": tiny_model(family, num_layers=1, seed=7)}
    if kind == "self":
        return {"draft_model": target}
    if kind == "noisy":
        return {"draft_model": noisy_copy(target, 0.02)}
    return {}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("drafter", ["random", "self", "noisy", "ngram"])
def test_greedy_matches_target_alone(family: str, drafter: str) -> None:
    target = tiny_model(family)
    expected = [hf_greedy(target, p, MAX_TOKENS, EOS) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for k in (1, 3, 8):
        method = "ngram" if drafter == "ngram" else "draft_model"
        config = SpeculativeConfig(method=method, num_speculative_tokens=k)
        llm = LLM(target, speculative_config=config, **_drafter(drafter, family, target))
        for batch in (PROMPTS[:1], PROMPTS):
            outputs = llm.generate(batch, params)
            for prompt, out, want in zip(batch, outputs, expected):
                assert_greedy_equal(target, prompt, out.outputs[0].token_ids, want)
                m = out.metrics
                assert m.num_accepted <= m.num_drafted <= k * m.num_steps
                if drafter == "self":  # draft = target: every draft is accepted
                    assert m.num_accepted == m.num_drafted


def test_plain_decoding_is_the_baseline() -> None:
    target = tiny_model("llama")
    outputs = LLM(target).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(PROMPTS, outputs):
        assert_greedy_equal(
            target, prompt, out.outputs[0].token_ids, hf_greedy(target, prompt, MAX_TOKENS, EOS)
        )
        assert out.metrics.num_drafted == 0 and out.metrics.num_steps == len(out.outputs[0].token_ids) - 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformers_path_matches(family: str) -> None:
    """Any AutoModelForCausalLM through transformers' own forward (holes in its cache for batches)."""
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        target = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=96,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=256,
                eos_token_id=EOS,
                bos_token_id=0,
            )
        ).eval()
        draft = noisy_copy(target, 0.002)
    else:
        target = tiny_model("llama")
        draft = noisy_copy(target, 0.05)
    expected = [hf_greedy(target, p, MAX_TOKENS, EOS) for p in PROMPTS]
    llm = LLM(
        target,
        draft_model=draft,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
        model_impl="transformers",
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out, want in zip(PROMPTS, outputs, expected):
        assert_greedy_equal(target, prompt, out.outputs[0].token_ids, want)
    assert sum(o.metrics.num_accepted for o in outputs) > 0


def test_eos_and_max_tokens_truncate_an_accepted_block() -> None:
    """draft = target accepts whole blocks; EOS or max_tokens inside a block cuts the output there."""
    target = tiny_model("llama")
    llm = LLM(target, draft_model=target, speculative_config=SpeculativeConfig(num_speculative_tokens=8))
    free = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for prompt, out in zip(PROMPTS, free):
        ids = out.outputs[0].token_ids
        assert len(ids) == 40 and out.outputs[0].finish_reason == "length"
        stop = ids[5]  # a token the row emits inside its first accepted block
        cut = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
        )[0].outputs[0]
        assert cut.token_ids == ids[: ids.index(stop) + 1]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        short = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
        assert short.outputs[0].token_ids == ids[:6] and short.outputs[0].finish_reason == "length"
    with_eos = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40))
    for out, ref in zip(with_eos, free):
        ids = ref.outputs[0].token_ids
        want = ids[: ids.index(EOS) + 1] if EOS in ids else ids
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == ("stop" if EOS in ids else "length")


@pytest.mark.parametrize("draft_dtype", ["bfloat16", torch.float64])
def test_a_draft_in_another_dtype_changes_nothing_but_acceptance(draft_dtype) -> None:
    """LLM(draft_dtype=...): the draft runs in its own dtype (its cache too), the output stays the
    target's own greedy output."""
    target = tiny_model("llama")
    expected = [hf_greedy(target, p, MAX_TOKENS, EOS) for p in PROMPTS]
    llm = LLM(
        target,
        draft_model=noisy_copy(target, 0.02),
        draft_dtype=draft_dtype,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    want = torch.bfloat16 if draft_dtype == "bfloat16" else draft_dtype
    assert llm.draft.model.dtype == want and llm.target.model.dtype == torch.float32
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out, want_ids in zip(PROMPTS, outputs, expected):
        assert_greedy_equal(target, prompt, out.outputs[0].token_ids, want_ids)
    assert sum(o.metrics.num_accepted for o in outputs) > 0
