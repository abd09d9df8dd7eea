"""EAGLE heads in vLLM's speculators format (models/speculators.py): checkpoints written here by hand,
under the speculators config keys and weight names, load with their weights where they belong and
keep greedy output exact; saved heads load back and draft the same; wrong ones are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from exactness import hf_greedy
from safetensors.torch import load_file, save_file

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models.eagle_checkpoint import (
    load_eagle_head,
    load_head_weights,
    save_eagle_head,
    save_speculators,
)
from speculative.models.llama import NativeCausalLM

HIDDEN, HEADS, KV_HEADS, VOCAB, EPS = 64, 4, 2, 96, 1e-5
HEAD_DIM, INNER = HIDDEN // HEADS, 2 * HIDDEN
DRAFT_TOKENS = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 60, 61, 62, 63, 64, 70, 80, 90, 95])


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4, seed=3)


def speculators_weights(layout: str, draft: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the speculators library's names and shapes, written out here: EAGLE-3's
    `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t` / `t2d` (over DRAFT_TOKENS with `draft`); EAGLE-1's
    `fusion_fc` (with a bias) and `transformer.*`."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.15

    attn_in = 2 * HIDDEN if layout == "eagle3" else HIDDEN
    layer = {
        "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, attn_in),
        "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, attn_in),
        "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, attn_in),
        "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj.weight": rand(INNER, HIDDEN),
        "mlp.up_proj.weight": rand(INNER, HIDDEN),
        "mlp.down_proj.weight": rand(HIDDEN, INNER),
        "post_attention_layernorm.weight": 1 + rand(HIDDEN),
    }
    if layout == "eagle":
        weights = {f"transformer.{name}": w for name, w in layer.items()}
        weights.update({"fusion_fc.weight": rand(HIDDEN, 2 * HIDDEN), "fusion_fc.bias": rand(HIDDEN)})
        return weights
    layer.update({"input_layernorm.weight": 1 + rand(HIDDEN), "hidden_norm.weight": 1 + rand(HIDDEN)})
    weights = {f"layers.0.{name}": w for name, w in layer.items()}
    rows = len(DRAFT_TOKENS) if draft else VOCAB
    weights.update(
        {
            "fc.weight": rand(HIDDEN, 3 * HIDDEN),
            "norm.weight": 1 + rand(HIDDEN),
            "lm_head.weight": rand(rows, HIDDEN),
        }
    )
    if draft:
        weights["d2t"] = DRAFT_TOKENS - torch.arange(len(DRAFT_TOKENS))
        weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
        weights["t2d"][DRAFT_TOKENS] = True
    return weights


def speculators_config(layout: str, draft: bool = True, **fields) -> dict:
    """config.json as the speculators library writes it (a diff of the layer config: hidden_act and
    max_position_embeddings left to LlamaConfig's defaults); `fields` override top-level keys."""
    config = {
        "architectures": ["Eagle3Speculator" if layout == "eagle3" else "EagleSpeculator"],
        "speculators_model_type": layout,
        "speculators_version": "0.3.0",
        "transformer_layer_config": {
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": INNER,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": 1,
            "rms_norm_eps": EPS,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        "speculators_config": {
            "algorithm": layout,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/llama-verifier", "architectures": ["LlamaForCausalLM"]},
        },
    }
    if layout == "eagle3":
        config.update(
            draft_vocab_size=len(DRAFT_TOKENS) if draft else VOCAB,
            norm_before_residual=False,
            target_hidden_size=HIDDEN,
            eagle_aux_hidden_state_layer_ids=[0, 1, 3],
        )
    else:
        config.update(layernorms=False, fusion_bias=True, transformer_layer_architecture="LlamaDecoderLayer")
    return {**config, **fields}


def write(path: Path, config: dict, weights: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"))
    return str(path)


def our_name(name: str) -> str:
    """A speculators weight name as EagleHead's parameter name (written out independently of the loader)."""
    for theirs, ours in (
        ("layers.0.", "model.layers.0."),
        ("transformer.", "model.layers.0."),
        ("fusion_fc.", "fc."),
        ("norm.", "model.norm."),
        ("embed_tokens.", "model.embed_tokens."),
    ):
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


def reference(
    layout: str, w: dict, options: dict, embed, feature, lm_head
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits over the target vocabulary and its hidden state at one position from an
    empty cache, from the speculators weights `w` directly (attention over one key is its value):
    EAGLE-3 per the library's first layer (residual: the feature, or hidden_norm of it with
    norm_before_residual; the hidden state normed with norm_output), EAGLE-1 per its fusion_fc and
    decoder layer without input norm, then the target's lm_head."""

    def rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g

    p = "layers.0." if layout == "eagle3" else "transformer."
    if layout == "eagle3":
        x = feature @ w["fc.weight"].T
        normed = rms(x, w[p + "hidden_norm.weight"])
        attn_in = torch.cat([rms(embed, w[p + "input_layernorm.weight"]), normed])
        residual = normed if options.get("norm_before_residual") else x
    else:
        x = torch.cat([embed, feature]) @ w["fusion_fc.weight"].T + w["fusion_fc.bias"]
        attn_in = residual = x
    v = (attn_in @ w[p + "self_attn.v_proj.weight"].T).view(KV_HEADS, HEAD_DIM)
    h = (
        residual
        + v.repeat_interleave(HEADS // KV_HEADS, dim=0).reshape(-1) @ w[p + "self_attn.o_proj.weight"].T
    )
    m = rms(h, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    if layout == "eagle":
        return h @ lm_head.T, h
    logits = torch.full((VOCAB,), float("-inf"))
    rows = torch.arange(len(w["lm_head.weight"])) + w["d2t"] if "d2t" in w else torch.arange(VOCAB)
    logits[rows] = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
    return logits, rms(h, w["norm.weight"]) if options.get("norm_output") else h


def one_position(head, target, layout: str) -> tuple[torch.Tensor, ...]:
    """The head's logits and hidden state at one position (token 7, a fixed random feature), and
    that input."""
    feature = torch.randn(
        3 * HIDDEN if layout == "eagle3" else HIDDEN, generator=torch.Generator().manual_seed(5)
    )
    logits, hidden = head.forward(torch.tensor([[7]]), feature.view(1, 1, -1), head.new_cache(1, 4))
    embed, lm_head = target.model.embed_tokens.weight[7].detach(), target.lm_head.weight.detach()
    return logits[0, 0], hidden[0, 0], embed, feature, lm_head


@pytest.mark.parametrize(
    ("layout", "draft", "options"),
    [
        ("eagle3", True, {}),
        ("eagle3", True, {"norm_before_residual": True}),
        ("eagle3", True, {"norm_output": True}),
        ("eagle3", False, {}),
        ("eagle", False, {}),
    ],
    ids=[
        "eagle3-draft-vocab",
        "eagle3-norm-before-residual",
        "eagle3-norm-output",
        "eagle3-whole-vocab",
        "eagle",
    ],
)
def test_a_handwritten_speculators_checkpoint_loads_and_keeps_greedy_exact(
    tmp_path, target, layout, draft, options
) -> None:
    """The weights land where their names say (compared by an independent name map, and the head's
    logits against a forward written here from the speculators weights), and greedy output through
    LLM(method=...) is the target's alone, in chains and trees."""
    weights = speculators_weights(layout, draft)
    if layout == "eagle3":  # the library saves a copy of the verifier's embedding
        weights["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    path = write(tmp_path, speculators_config(layout, draft, **options), weights)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 2], [20, 21]]
    for tree in (None, "dynamic"):
        config = SpeculativeConfig(
            method=layout, num_speculative_tokens=3, tree=tree, tree_width=2, tree_nodes=6
        )
        llm = LLM(target, draft_model=path, speculative_config=config)
        head = llm.engine.proposer.head
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == hf_greedy(target, prompt, 16, None)
        assert sum(o.metrics.num_drafted for o in outputs) > 0
    state = head.state_dict()
    for name, tensor in weights.items():
        if name != "t2d":
            assert torch.equal(state[our_name(name)].cpu(), tensor), name
    assert head.norm_before_residual is options.get("norm_before_residual", False)
    assert head.norm_output is options.get("norm_output", False)
    assert head.config.hidden_act == "silu" and head.config.rms_norm_eps == EPS
    assert head.target_layers == ((0, 1, 3) if layout == "eagle3" else (4,))
    got, hidden, embed, feature, lm_head = one_position(head, target, layout)
    want, want_hidden = reference(layout, weights, options, embed, feature, lm_head)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[torch.isfinite(want)], want[torch.isfinite(want)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-4)


# the parameters vLLM's Eagle3LlamaForCausalLM loads, after its renaming (vllm/model_executor/models/
# llama_eagle3.py: "model." + name except lm_head, d2t -> draft_id_to_target_id, t2d skipped, q/k/v and
# gate/up stacked)
VLLM_EAGLE3_PARAMETERS = {
    "model.fc.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.hidden_norm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
    "draft_id_to_target_id",
}


def vllm_names(names: set[str]) -> set[str]:
    renamed = set()
    for name in names - {"t2d"}:
        name = "draft_id_to_target_id" if name == "d2t" else name if "lm_head" in name else "model." + name
        for shard, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj")):
            name = name.replace(shard, stacked)
        renamed.add(name.replace(".gate_proj", ".gate_up_proj").replace(".up_proj", ".gate_up_proj"))
    return renamed


@pytest.mark.parametrize("layout", ["eagle3", "eagle"])
def test_saved_heads_load_back_and_draft_the_same(tmp_path, target, layout) -> None:
    """save_speculators writes the keys vLLM's adapter reads and the names its loader maps; the head
    loads back with the same weights and logits, and a head of the published layout converts."""
    native = NativeCausalLM.from_hf(target)
    options = {"norm_before_residual": True, "norm_output": True} if layout == "eagle3" else {}
    source = write(tmp_path / "a", speculators_config(layout, **options), speculators_weights(layout))
    head = load_eagle_head(source, layout, native)
    save_speculators(head, tmp_path / "b", "tiny/llama-verifier", verifier_architectures=["LlamaForCausalLM"])
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    saved = load_file(tmp_path / "b" / "model.safetensors")
    assert config["speculators_model_type"] == layout
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "tiny/llama-verifier",
        "architectures": ["LlamaForCausalLM"],
    }
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    if layout == "eagle3":
        assert set(saved) == set(speculators_weights(layout))
        assert vllm_names(set(saved)) == VLLM_EAGLE3_PARAMETERS
        assert config["draft_vocab_size"] == len(DRAFT_TOKENS) and config["norm_before_residual"] is True
        assert config["norm_output"] is True and not config["norm_before_fc"] and not config["fc_norm"]
        assert (
            config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3] and config["target_hidden_size"] == HIDDEN
        )
        assert torch.equal(saved["t2d"], speculators_weights(layout)["t2d"])
    else:
        assert set(saved) == set(speculators_weights(layout))
        assert config["fusion_bias"] is True and config["layernorms"] is False
    again = load_eagle_head(tmp_path / "b", layout, native)
    for name, tensor in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    ids, features = (
        torch.tensor([[4, 6, 8, 9]]),
        torch.randn(1, 4, head.fc.in_features - HIDDEN * (layout == "eagle")),
    )
    want, _ = head.forward(ids, features, head.new_cache(1, 8))
    got, _ = again.forward(ids, features, again.new_cache(1, 8))
    assert torch.equal(got, want)
    # the published layout (save_eagle_head) converts: its head saved for vLLM drafts the same
    save_eagle_head(head, tmp_path / "published")
    published = load_eagle_head(tmp_path / "published", layout, native)
    save_speculators(published, tmp_path / "c", "tiny/llama-verifier")
    converted = load_eagle_head(tmp_path / "c", layout, native)
    got, _ = converted.forward(ids, features, converted.new_cache(1, 8))
    assert torch.equal(got, want)


def test_an_eagle1_draft_vocabulary_saves_and_loads(tmp_path, target) -> None:
    """An EAGLE-1 head with a draft vocabulary (this engine's extension: draft_vocab_size, d2t and
    t2d as EAGLE-3's) reads the target's lm_head rows of those tokens and keeps them through a save;
    load_head_weights reads a speculators directory into a head of the same shapes."""
    native = NativeCausalLM.from_hf(target)
    weights = speculators_weights("eagle")
    weights["d2t"] = DRAFT_TOKENS - torch.arange(len(DRAFT_TOKENS))
    weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, DRAFT_TOKENS, True)
    config = speculators_config("eagle", draft_vocab_size=len(DRAFT_TOKENS))
    head = load_eagle_head(write(tmp_path / "a", config, weights), "eagle", native)
    assert torch.equal(head.draft_vocabulary, DRAFT_TOKENS)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[DRAFT_TOKENS])
    save_speculators(head, tmp_path / "b", "tiny/llama-verifier")
    assert set(load_file(tmp_path / "b" / "model.safetensors")) == set(weights)
    again = load_eagle_head(tmp_path / "b", "eagle", native)
    ids, features = torch.tensor([[4, 6, 8]]), torch.randn(1, 3, HIDDEN)
    want, _ = head.forward(ids, features, head.new_cache(1, 8))
    got, _ = again.forward(ids, features, again.new_cache(1, 8))
    assert torch.equal(got, want)
    other = load_eagle_head(
        write(tmp_path / "c", config, {**weights, **speculators_weights("eagle", seed=1)}), "eagle", native
    )
    load_head_weights(other, tmp_path / "b")
    got, _ = other.forward(ids, features, other.new_cache(1, 8))
    assert torch.equal(got, want)


def test_a_head_reading_the_final_norm_is_refused_for_vllm(tmp_path, target) -> None:
    config = speculators_config("eagle3", eagle_aux_hidden_state_layer_ids=[0, 2, 4])
    head = load_eagle_head(
        write(tmp_path / "a", config, speculators_weights("eagle3")), "eagle3", NativeCausalLM.from_hf(target)
    )
    with pytest.raises(ValueError, match=r"entering layers 0 \.\. 3"):
        save_speculators(head, tmp_path / "b", "tiny/llama-verifier", num_target_layers=4)


def _layer(**fields):
    return lambda c, w: c["transformer_layer_config"].update(fields)


@pytest.mark.parametrize(
    ("layout", "method", "change", "message"),
    [
        ("eagle3", "eagle", None, r'\'eagle3\' is an EAGLE-3 head: use method="eagle3"'),
        ("eagle", "eagle3", None, r'\'eagle\' is an EAGLE-1 head: use method="eagle"'),
        (
            "eagle3",
            "eagle3",
            lambda c, w: c.update(speculators_model_type="dflash"),
            r"'dflash' is a DFlash block drafter: use method=\"dflash\"",
        ),
        (
            "eagle3",
            "eagle3",
            lambda c, w: c.update(speculators_model_type="peagle"),
            "'peagle' is not supported",
        ),
        (
            "eagle3",
            "eagle3",
            lambda c, w: c.update(target_hidden_size=32),
            r"verifier 'tiny/llama-verifier', of hidden size 32 \(target_hidden_size\); the target's is 64",
        ),
        (
            "eagle",
            "eagle",
            _layer(hidden_size=32),
            r"verifier 'tiny/llama-verifier', of hidden size 32 \(hidden_size\); the target's is 64",
        ),
        ("eagle3", "eagle3", _layer(vocab_size=128), "of vocabulary 128 .*the target's is 96"),
        (
            "eagle3",
            "eagle3",
            lambda c, w: w.pop("layers.0.mlp.up_proj.weight"),
            r"lacks weights \['layers.0.mlp.up",
        ),
        ("eagle", "eagle", lambda c, w: w.pop("fusion_fc.bias"), r"lacks weights \['fusion_fc.bias'\]"),
        (
            "eagle",
            "eagle",
            lambda c, w: w.pop("transformer.mlp.down_proj.weight"),
            r"\['transformer.mlp.down",
        ),
        (
            "eagle3",
            "eagle3",
            lambda c, w: w.update({"midlayer.mlp.up_proj.weight": w["fc.weight"].clone()}),
            "unexpected",
        ),
        ("eagle3", "eagle3", lambda c, w: c.update(draft_vocab_size=20), r"weight '[\w.]+' has shape \(19"),
        ("eagle3", "eagle3", lambda c, w: w["t2d"].__setitem__(4, True), "'t2d' does not mark"),
        ("eagle3", "eagle3", _layer(num_hidden_layers=2), "num_hidden_layers is 2"),
        ("eagle3", "eagle3", _layer(model_type="qwen3"), "model_type 'qwen3'"),
        ("eagle3", "eagle3", lambda c, w: c.update(norm_before_fc=True), "norm_before_fc"),
        ("eagle", "eagle", lambda c, w: c.update(layernorms=True), "layernorms"),
        ("eagle3", "eagle3", lambda c, w: c.pop("transformer_layer_config"), "no transformer_layer_config"),
    ],
)
def test_wrong_speculators_checkpoints_name_what_is_wrong(
    tmp_path, target, layout, method, change, message
) -> None:
    config, weights = speculators_config(layout), speculators_weights(layout)
    if change is not None:
        change(config, weights)
    with pytest.raises(ValueError, match=message):
        load_eagle_head(write(tmp_path, config, weights), method, NativeCausalLM.from_hf(target))


def test_another_verifier_of_the_same_sizes_is_warned_about(tmp_path) -> None:
    target = tiny_model("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4, seed=3)
    target.config.architectures = ["MistralForCausalLM"]
    path = write(tmp_path, speculators_config("eagle3"), speculators_weights("eagle3"))
    with pytest.warns(UserWarning, match="made for verifier 'tiny/llama-verifier' .*MistralForCausalLM"):
        load_eagle_head(path, "eagle3", NativeCausalLM.from_hf(target))


def test_a_sliding_window_draft_layer_is_warned_about(tmp_path, target) -> None:
    """The library's training defaults to a sliding window in the draft layer; the head attends to the
    whole context, which differs from the trained head only past the window (the output stays exact)."""
    config = speculators_config("eagle3")
    config["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=2048)
    path = write(tmp_path, config, speculators_weights("eagle3"))
    with pytest.warns(UserWarning, match="sliding-window attention of 2048 tokens"):
        load_eagle_head(path, "eagle3", NativeCausalLM.from_hf(target))
