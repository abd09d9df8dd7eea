"""EAGLE heads: the published checkpoint layouts load, and drafting with them stays exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from exactness import hf_greedy
from safetensors.torch import save_file

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models.eagle_checkpoint import load_eagle_head
from speculative.models.llama import NativeCausalLM

HIDDEN, HEADS, KV_HEADS, VOCAB = 64, 4, 2, 96


def head_weights(layout: str, draft_vocab: int = VOCAB, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published names and shapes (written out here, independently of the
    loader): SafeAILab/EAGLE's EAGLE-1 `layers.0.*` and EAGLE-3's `midlayer.*`."""
    generator = torch.Generator().manual_seed(seed)
    head_dim, inner = HIDDEN // HEADS, 2 * HIDDEN
    attn_in = HIDDEN if layout == "eagle" else 2 * HIDDEN
    prefix = "layers.0." if layout == "eagle" else "midlayer."
    shapes = {
        "self_attn.q_proj.weight": (HEADS * head_dim, attn_in),
        "self_attn.k_proj.weight": (KV_HEADS * head_dim, attn_in),
        "self_attn.v_proj.weight": (KV_HEADS * head_dim, attn_in),
        "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
        "mlp.gate_proj.weight": (inner, HIDDEN),
        "mlp.up_proj.weight": (inner, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, inner),
    }
    weights = {
        prefix + name: torch.randn(shape, generator=generator) * 0.15 for name, shape in shapes.items()
    }
    norms = ["post_attention_layernorm"] + ([] if layout == "eagle" else ["input_layernorm", "hidden_norm"])
    weights.update({f"{prefix}{n}.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=generator) for n in norms})
    if layout == "eagle":
        weights["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=generator) * 0.15
        weights["fc.bias"] = torch.randn(HIDDEN, generator=generator) * 0.1
    else:
        weights["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=generator) * 0.15
        weights["norm.weight"] = torch.ones(HIDDEN)
        weights["lm_head.weight"] = torch.randn(draft_vocab, HIDDEN, generator=generator) * 0.15
        if draft_vocab < VOCAB:  # the draft vocabulary: every other target token
            targets = torch.arange(0, 2 * draft_vocab, 2)
            weights["d2t"] = targets - torch.arange(draft_vocab)
            weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, targets, True)
    return weights


def head_config(layout: str, draft_vocab: int = VOCAB, **fields) -> dict:
    config = dict(
        architectures=["LlamaForCausalLM"] if layout == "eagle" else ["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        max_position_embeddings=256,
    )
    if layout == "eagle3":
        config.update(draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=[0, 1, 3])
    return {**config, **fields}


def write_head(
    path: Path, layout: str, weights: dict | None = None, config: dict | None = None, bin: bool = False
) -> str:
    """A checkpoint directory in the published layout: config.json and the weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head_config(layout) if config is None else config))
    weights = head_weights(layout) if weights is None else weights
    if bin:
        torch.save(weights, path / "pytorch_model.bin")
    else:
        save_file(weights, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4, seed=3)


def test_forward_returns_the_requested_hidden_states(target) -> None:
    native = NativeCausalLM.from_hf(target)
    ids = torch.tensor([[5, 7, 9, 11]])
    with torch.no_grad():
        reference = target(ids, output_hidden_states=True).hidden_states  # embeddings, ..., final norm
    logits, hidden = native.forward(ids, native.new_cache(1, 8), hidden_layers=(0, 2, 4))
    torch.testing.assert_close(logits, native.forward(ids, native.new_cache(1, 8)))
    expected = torch.cat([reference[0], reference[2], reference[4]], dim=-1)
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="hidden_layers"):
        native.forward(ids, native.new_cache(1, 8), hidden_layers=(5,))


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
@pytest.mark.parametrize("bin", [False, True], ids=["safetensors", "bin"])
def test_published_layouts_load(tmp_path, target, layout, bin) -> None:
    weights = head_weights(layout)
    head = load_eagle_head(
        write_head(tmp_path, layout, weights, bin=bin), layout, NativeCausalLM.from_hf(target)
    )
    prefix = "model.layers.0."
    ours = {"layers.0.": prefix, "midlayer.": prefix, "norm.": "model.norm."}
    for name, tensor in weights.items():
        mapped = next((new + name[len(old) :] for old, new in ours.items() if name.startswith(old)), name)
        torch.testing.assert_close(head.state_dict()[mapped], tensor)
    assert head.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr() or bool(
        torch.equal(head.model.embed_tokens.weight, target.model.embed_tokens.weight)
    )
    assert head.target_layers == ((4,) if layout == "eagle" else (0, 1, 3))


def test_draft_vocabulary_maps_into_the_target_vocabulary(tmp_path, target) -> None:
    config = head_config("eagle3", draft_vocab=40)
    path = write_head(tmp_path, "eagle3", head_weights("eagle3", draft_vocab=40), config)
    native = NativeCausalLM.from_hf(target)
    head = load_eagle_head(path, "eagle3", native)
    features = torch.randn(1, 3, 3 * HIDDEN)
    logits, hidden = head.forward(torch.tensor([[4, 6, 8]]), features, head.new_cache(1, 8))
    assert logits.shape == (1, 3, VOCAB) and hidden.shape == (1, 3, HIDDEN)
    drafted = torch.zeros(VOCAB, dtype=torch.bool)
    drafted[0:80:2] = True  # the draft vocabulary: target tokens 0, 2, ..., 78
    assert torch.isfinite(logits[..., drafted]).all() and torch.isinf(logits[..., ~drafted]).all()


@pytest.mark.parametrize(
    ("layout", "change", "message"),
    [
        ("eagle", lambda c, w: c.pop("intermediate_size"), "no 'intermediate_size'"),
        ("eagle", lambda c, w: c.update(hidden_size=32), "hidden_size 32 is not the target's"),
        (
            "eagle",
            lambda c, w: w.pop("layers.0.mlp.up_proj.weight"),
            r"lacks weights \['layers.0.mlp.up_proj",
        ),
        ("eagle", lambda c, w: w.update({"fc.weight": torch.zeros(HIDDEN, HIDDEN)}), "'fc.weight' has shape"),
        (
            "eagle3",
            lambda c, w: w.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)}),
            "q_proj",
        ),
        ("eagle3", lambda c, w: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 9]), "aux_hidden_state"),
        ("eagle3", lambda c, w: c.update(draft_vocab_size=40), "'lm_head.weight' has shape"),
    ],
)
def test_wrong_checkpoints_name_what_is_wrong(tmp_path, target, layout, change, message) -> None:
    config, weights = head_config(layout), head_weights(layout)
    change(config, weights)
    with pytest.raises(ValueError, match=message):
        load_eagle_head(write_head(tmp_path, layout, weights, config), layout, NativeCausalLM.from_hf(target))


def test_a_head_in_the_other_layout_is_named(tmp_path, target) -> None:
    with pytest.raises(ValueError, match='method="eagle3"'):
        load_eagle_head(write_head(tmp_path, "eagle3"), "eagle", NativeCausalLM.from_hf(target))


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_greedy_output_equals_the_target_alone(tmp_path, target, layout) -> None:
    """Any head keeps greedy output exact: a random one, over prompts of different lengths, rows
    finishing at different times."""
    path = write_head(tmp_path, layout)
    llm = LLM(
        target,
        draft_model=path,
        speculative_config=SpeculativeConfig(method=layout, num_speculative_tokens=3),
    )
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 2], [20, 21]]
    outputs = llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 9, 17)]
    )
    for prompt, output, n in zip(prompts, outputs, (24, 9, 17)):
        assert output.outputs[0].token_ids == hf_greedy(target, prompt, n, None)
