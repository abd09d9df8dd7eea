"""PreCompileConfig at work: prompts padded to prefill buckets, the error past the largest, the warm-up."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model
from exactness import assert_greedy_equal, hf_greedy

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models.bucketed import BucketedModel
from speculative.models.llama import NativeCausalLM
from speculative.precompile import PreCompileConfig

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 9, 10, 11, 12, 9], [3, 4] * 10]  # 3, 9 and 20 tokens
BUCKETS = PreCompileConfig(batch_size=1, prefill_length=[8, 16, 32])


def _recording(model: NativeCausalLM) -> list[tuple[int, int, int]]:
    """Record (batch, q, cached tokens before) of every forward of `model`."""
    calls = []
    forward = model.forward

    def record(input_ids, cache, *args, **kwargs):
        calls.append((*input_ids.shape, cache.host_max_length))
        return forward(input_ids, cache, *args, **kwargs)

    model.forward = record
    return calls


def test_prompts_are_padded_to_their_bucket_and_decode_the_same() -> None:
    target = tiny_model("llama")
    target_native, draft_native = (NativeCausalLM.from_hf(m) for m in (target, noisy_copy(target, 0.02)))
    llm = LLM(target_native, draft_model=draft_native, precompile=BUCKETS)
    calls, draft_calls = _recording(target_native), _recording(draft_native)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for batch in ([PROMPTS[0]], [PROMPTS[1]], [PROMPTS[2]], PROMPTS[:2]):
        calls.clear()
        draft_calls.clear()
        outputs = llm.generate(batch, params)
        for prompt, out in zip(batch, outputs):
            assert_greedy_equal(target, prompt, out.outputs[0].token_ids, hf_greedy(target, prompt, 12, None))
        width = max(len(p) for p in batch)
        bucket = BUCKETS.bucket(width)
        assert [q for _, q, cached in calls if cached == 0] == [bucket]  # the target's prefill
        assert [q for _, q, cached in draft_calls if cached == 0] == [bucket]  # prompt + first token - 1
        assert all(q <= 5 for _, q, cached in calls if cached > 0)  # steps are not padded


def test_padded_prefill_keeps_prompt_logprobs() -> None:
    target = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, logprobs=1)
    plain = LLM(target).generate(PROMPTS, params)
    bucketed = LLM(target, precompile=BUCKETS).generate(PROMPTS, params)
    for a, b in zip(plain, bucketed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for token, lp in pa.items():
                assert abs(lp.logprob - pb[token].logprob) < 1e-5


def test_prompt_longer_than_every_bucket_names_the_largest() -> None:
    llm = LLM(tiny_model("llama"), precompile=PreCompileConfig(prefill_length=[8, 16]))
    with pytest.raises(
        ValueError, match="prompt 1: prompt of 20 tokens fits no prefill bucket; the largest is 16"
    ):
        llm.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(max_tokens=4))  # checked before any work
    assert llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids  # 9 fits 16


def test_warm_up_runs_every_standalone_shape() -> None:
    target = tiny_model("llama")
    target_native, draft_native = (NativeCausalLM.from_hf(m) for m in (target, noisy_copy(target, 0.02)))
    calls, draft_calls = _recording(target_native), _recording(draft_native)
    config = PreCompileConfig(batch_size=[1, 2], prefill_length=[8, 16, 32])  # (1, 8), (2, 16), (2, 32)
    spec = SpeculativeConfig(num_speculative_tokens=3)
    LLM(target_native, draft_model=draft_native, speculative_config=spec, precompile=config)
    prefills = [(b, q) for b, q, cached in calls if cached == 0]
    assert prefills == [(1, 8), (2, 16), (2, 32)]
    steps = {(b, q) for b, q, cached in calls if cached > 0}
    assert steps == {(1, 1), (1, 4), (2, 1), (2, 4)}  # plain step and verification of k + 1 = 4 tokens
    assert [(b, q) for b, q, cached in draft_calls if cached == 0] == prefills
    assert {(b, q) for b, q, cached in draft_calls if cached > 0} == {(1, 2), (1, 1), (2, 2), (2, 1)}


@pytest.mark.parametrize("adaptive", [False, True])
def test_adaptive_k_warms_up_every_verification_width_and_draft_length(monkeypatch, adaptive) -> None:
    """Adaptive k runs any k in 0..k: each needs its graphs (a compiled SmolLM2's first k = 2 step
    compiled for 90 s), so the warm-up makes them all; a fixed k only its own."""
    import speculative.models.compiled as compiled

    target = tiny_model("llama")
    target_native, draft_native = (NativeCausalLM.from_hf(m) for m in (target, noisy_copy(target, 0.02)))
    warmed, warm_up = [], compiled.warm_up
    monkeypatch.setattr(
        compiled,
        "warm_up",
        lambda model, config, steps, greedy=(): (
            warmed.append((steps, list(greedy))) or warm_up(model, config, steps, greedy)
        ),
    )
    spec = SpeculativeConfig(num_speculative_tokens=3, adaptive=adaptive)
    LLM(target_native, draft_model=draft_native, speculative_config=spec, precompile=PreCompileConfig())
    (target_steps, _), (_, draft_greedy) = warmed
    assert {q for q, _ in target_steps} == ({1, 2, 3, 4} if adaptive else {1, 4})
    lengths = [1, 2, 3] if adaptive else [3]
    assert sorted(draft_greedy) == sorted((q, j) for j in lengths for q in (1, 2))


def test_warm_up_without_buckets_and_cache_lengths() -> None:
    native = NativeCausalLM.from_hf(tiny_model("llama"))
    calls = _recording(native)
    LLM(native, precompile=PreCompileConfig(batch_size=[1, 4]))  # no buckets: a short prompt, no padding
    # a short prompt, then one of a few dozen tokens (a compiled model's other prefill graph)
    assert [(b, q) for b, q, cached in calls if cached == 0] == [(1, 8), (1, 48), (4, 8), (4, 48)]
    bucketed = BucketedModel(native, BUCKETS)
    assert bucketed.new_cache(2, 10).max_length == 16  # room for any prompt of <= 10 tokens padded
    assert bucketed.new_cache(2, 40).max_length == 40  # past the buckets: as asked
    with pytest.raises(TypeError, match="PreCompileConfig"):
        BucketedModel(native, {"prefill_length": 8})


def test_bucketed_forward_pads_only_a_fresh_cache() -> None:
    native = NativeCausalLM.from_hf(tiny_model("llama"))
    calls = _recording(native)
    model = BucketedModel(native, BUCKETS)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    cache = model.new_cache(1, 16)
    logits = model.forward(ids, cache)  # 5 tokens -> bucket 8, logits of the 5 real ones
    assert logits.shape == (1, 5, native.vocab_size) and cache.lengths.tolist() == [5]
    reference = native.forward(ids, native.new_cache(1, 16))
    assert (logits - reference).abs().max() < 1e-5
    model.forward(ids[:, :2], cache)  # not a prefill any more: 2 tokens as they are
    assert [q for _, q, _ in calls] == [8, 5, 2] and cache.lengths.tolist() == [7]
