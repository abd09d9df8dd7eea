"""NativeCausalLM against the transformers implementations of llama, mistral, qwen2 and qwen3."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from speculative.models.base import LanguageModel
from speculative.models.llama import SUPPORTED_MODEL_TYPES, NativeCausalLM, supports

TOL = 1e-4
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    # biases everywhere, tied embeddings, llama3 RoPE scaling through ROPE_INIT_FUNCTIONS
    "llama_bias": lambda: LlamaConfig(
        **SMALL,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "mistral": lambda: MistralConfig(**SMALL),
    # q/k/v bias, no o bias; yarn RoPE (attention_scaling != 1)
    "qwen2": lambda: Qwen2Config(
        **SMALL,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=32
        ),
    ),
    # head_dim 24 != 64 / 4, q_norm/k_norm, three layers, tied embeddings
    "qwen3": lambda: Qwen3Config(**{**SMALL, "num_hidden_layers": 3}, head_dim=24, tie_word_embeddings=True),
    # sliding window of 4 on every layer
    "mistral_window": lambda: MistralConfig(**SMALL, sliding_window=4),
    # sliding window of 4 on layers >= max_window_layers only
    "qwen2_window": lambda: Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "qwen3_window": lambda: Qwen3Config(
        **SMALL, head_dim=16, use_sliding_window=True, sliding_window=3, max_window_layers=1
    ),
}
HF_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
FAMILIES = ["llama", "llama_bias", "mistral", "qwen2", "qwen3"]
WINDOWED = ["mistral_window", "qwen2_window", "qwen3_window"]


@functools.cache
def models(name: str) -> tuple[torch.nn.Module, NativeCausalLM]:
    """A HF model with every parameter randomized (biases and norms too) and its native twin."""
    config = CONFIGS[name]()
    torch.manual_seed(0)
    hf = HF_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in pname else 0.0, 0.1 if "norm" in pname else 0.15)
    native = NativeCausalLM(config).eval()
    native.load_state_dict(hf.state_dict())
    return hf, native


def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence HF logits [batch, seq, vocab]."""
    with torch.no_grad():
        return hf(input_ids=ids, use_cache=False).logits.float()


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() < TOL, (a - b).abs().max().item()


def test_protocol_and_supports():
    _, native = models("qwen3")
    assert isinstance(native, LanguageModel)
    assert native.vocab_size == 128 and native.max_length == 64
    assert native.device == torch.device("cpu") and native.dtype == torch.float32
    assert all(supports(CONFIGS[n]()) for n in CONFIGS)
    assert SUPPORTED_MODEL_TYPES == {"llama", "mistral", "qwen2", "qwen3"}
    cache = native.new_cache(3, 20)
    assert cache.keys[0].shape == (3, 2, 20, 24) and len(cache.keys) == 3


def test_from_hf_matches_load_state_dict():
    hf, native = models("llama_bias")
    built = NativeCausalLM.from_hf(hf)
    assert built.lm_head.weight is built.model.embed_tokens.weight
    ids = tokens(2, 7)
    assert_close(built(ids, built.new_cache(2, 16)), native(ids, native.new_cache(2, 16)))


@pytest.mark.parametrize("name", FAMILIES + WINDOWED)
def test_full_prompt(name):
    hf, native = models(name)
    ids = tokens(2, 12)
    cache = native.new_cache(2, 16)
    logits = native(ids, cache)
    assert logits.dtype == torch.float32
    assert_close(logits, hf_logits(hf, ids))
    assert cache.lengths.tolist() == [12, 12]


@pytest.mark.parametrize("name", FAMILIES + WINDOWED)
def test_prefill_then_decode(name):
    hf, native = models(name)
    ids = tokens(2, 12, seed=2)
    expected = hf_logits(hf, ids)
    cache = native.new_cache(2, 12)
    assert_close(native(ids[:, :5], cache), expected[:, :5])
    assert_close(native(ids[:, 5:8], cache), expected[:, 5:8])  # a multi-token verify step
    for t in range(8, 12):
        assert_close(native(ids[:, t : t + 1], cache), expected[:, t : t + 1])


@pytest.mark.parametrize("name", FAMILIES + WINDOWED)
def test_ragged_batch(name):
    hf, native = models(name)
    lengths = [9, 4, 7]
    ids = tokens(3, 9, seed=3)
    num_tokens = torch.tensor(lengths)
    padded = ids.clone()
    for b, n in enumerate(lengths):
        padded[b, n:] = 0

    cache = native.new_cache(3, 16)
    logits = native(padded, cache, num_tokens=num_tokens)
    assert cache.lengths.tolist() == lengths
    for b, n in enumerate(lengths):
        assert_close(logits[b, :n], hf_logits(hf, ids[b : b + 1, :n])[0])

    # logits at each row's last real token only, then one more token per row
    cache = native.new_cache(3, 16)
    last = native(padded, cache, num_tokens=num_tokens, logits_indices=(num_tokens - 1)[:, None])
    assert last.shape == (3, 1, 128)
    nxt = tokens(3, 1, seed=4)
    step = native(nxt, cache)
    for b, n in enumerate(lengths):
        row = torch.cat([ids[b, :n], nxt[b]])[None]
        expected = hf_logits(hf, row)[0]
        assert_close(last[b, 0], expected[n - 1])
        assert_close(step[b, 0], expected[n])


@pytest.mark.parametrize("name", FAMILIES + ["mistral_window"])
@pytest.mark.parametrize("host_bound", [False, True])
def test_rollback_per_row(name, host_bound):
    hf, native = models(name)
    prompt, draft, new = tokens(2, 6, seed=5), tokens(2, 4, seed=6), tokens(2, 3, seed=7)
    cache = native.new_cache(2, 24)
    native(prompt, cache)
    native(draft, cache)
    keep = [1, 3]  # draft tokens kept per row
    lengths = torch.tensor([6 + k for k in keep])
    cache.rollback(lengths, max_length=int(lengths.max()) if host_bound else None)
    logits = native(new, cache)
    assert cache.lengths.tolist() == [6 + k + 3 for k in keep]

    contexts = [torch.cat([prompt[b], draft[b, :k], new[b]]) for b, k in enumerate(keep)]
    for b, ctx in enumerate(contexts):
        fresh = native(ctx[None], native.new_cache(1, 24))[0, -3:]
        assert_close(logits[b], fresh)
        assert_close(logits[b], hf_logits(hf, ctx[None])[0, -3:])


def test_sliding_window_matters():
    """The windowed mistral must differ from full attention, so the window tests are not vacuous."""
    hf, native = models("mistral_window")
    ids = tokens(1, 12, seed=8)
    windowed = native(ids, native.new_cache(1, 12))
    for layer in native.model.layers:
        layer.self_attn.sliding_window = None
    try:
        full = native(ids, native.new_cache(1, 12))
    finally:
        for layer in native.model.layers:
            layer.self_attn.sliding_window = 4
    assert (windowed[:, 4:] - full[:, 4:]).abs().max() > 1e-2
    assert_close(windowed[:, :4], full[:, :4])
    assert_close(windowed, hf_logits(hf, ids))


@pytest.mark.parametrize(
    ("name", "causal_layers"), [("llama", [True, True]), ("qwen2_window", [True, False])]
)
def test_a_prefill_into_an_empty_cache_attends_by_the_causal_rule_without_a_mask(
    name, causal_layers, monkeypatch
):
    """Into an empty cache, a layer without a sliding window calls SDPA with is_causal and no mask (a
    windowed one keeps its mask); right-padded rows give the masked forward's logits, and the cache
    the same next step."""
    _, native = models(name)
    ids, num_tokens = tokens(3, 9, seed=9), torch.tensor([9, 4, 7])
    sdpa, calls = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("is_causal", False) and kwargs.get("attn_mask") is None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    caches = [native.new_cache(3, 16) for _ in range(2)]
    causal = native(ids, caches[0], num_tokens=num_tokens)
    assert calls == causal_layers
    calls.clear()
    masked = native.forward_with(functools.partial(native.run, causal_from=None), ids, caches[1], num_tokens)
    assert calls == [False] * len(causal_layers)
    for b, n in enumerate(num_tokens.tolist()):
        assert_close(causal[b, :n], masked[b, :n])
    nxt = tokens(3, 2, seed=10)
    calls.clear()
    assert_close(native(nxt, caches[0]), native(nxt, caches[1]))
    assert not any(calls)  # onto a cache that holds tokens: the mask


@pytest.mark.parametrize(("name", "split_layers"), [("qwen3", 3), ("qwen2_window", 1)])
def test_a_long_query_after_cached_tokens_attends_in_two_parts_without_a_mask(
    name, split_layers, monkeypatch
):
    """A forward of CAUSAL_SPLIT_MIN_QUERY+ tokens onto rows that all hold the same number of tokens
    (a prompt prefilled after a cached prefix, a chunk of a chunked prefill) attends in two parts,
    merged by their log-sum-exps, in each layer without a sliding window, and gives the logits of a
    prefill of the whole; rows holding different numbers of tokens keep the mask."""
    hf, native = models(name)
    ids = tokens(2, 56, seed=11)
    flash, calls = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, []

    class Spy:
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return flash(*args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", Spy())
    cache = native.new_cache(2, 64)
    native(ids[:, :20], cache)
    assert not calls
    split = native(ids[:, 20:], cache)
    assert len(calls) == 2 * split_layers  # the part before the queries, then the queries among themselves
    assert_close(split, hf_logits(hf, ids)[:, 20:])
    calls.clear()
    ragged = native.new_cache(2, 64)
    native(ids[:, :20], ragged, num_tokens=torch.tensor([20, 19]))
    native(ids[:, 20:], ragged)
    assert not calls


def test_cache_overflow_raises():
    _, native = models("llama")
    cache = native.new_cache(2, 8)
    native(tokens(2, 6), cache)
    with pytest.raises(ValueError, match="overflow"):
        native(tokens(2, 3), cache)
    assert cache.lengths.tolist() == [6, 6]
    native(tokens(2, 2), cache)  # exactly full is fine
    assert cache.lengths.tolist() == [8, 8]
