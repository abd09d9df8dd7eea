"""DFlash drafters in vLLM's speculators layout: a drafter saved for vLLM loads back and drafts the same,
a checkpoint written under the library's names loads where its names say (its draft vocabulary, its
mask vector, the verifier's layer numbering), the output stays the target's, and what cannot load or
cannot be served is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from exactness import hf_greedy
from safetensors.torch import load_file, save_file
from test_dflash import HIDDEN, LAYERS, LENGTHS, PROMPTS, VOCAB, random_drafter
from transformers import Qwen3Config

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo.train_dflash import with_own_head
from speculative.models.dflash import DFlashDrafter
from speculative.models.dflash_checkpoint import load_dflash, save_speculators_dflash
from speculative.models.llama import NativeCausalLM

DRAFT_VOCABULARY = torch.tensor(sorted({0, 1, 2, 3, 5, 8, 13, 21, 34, 89} | set(range(40, 60))))


@pytest.fixture(scope="module")
def native(target):
    return NativeCausalLM.from_hf(target)


@pytest.fixture(scope="module")
def target():
    from conftest import tiny_model

    return tiny_model("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=3)


def with_draft_vocabulary(drafter: DFlashDrafter, native: NativeCausalLM) -> DFlashDrafter:
    """A copy of `drafter` with an lm_head of its own: the target's rows of DRAFT_VOCABULARY, as the
    speculators library fills it."""
    return with_own_head(drafter, native.lm_head.weight.detach()[DRAFT_VOCABULARY], DRAFT_VOCABULARY)


def context_logits(drafter: DFlashDrafter, native: NativeCausalLM) -> torch.Tensor:
    """The drafter's block logits [1, block - 1, V] over a fixed context, through its cache."""
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    _, features = native.forward(tokens[:, :-1], native.new_cache(1, 8), hidden_layers=drafter.hidden_layers)
    cache = drafter.new_cache(1, 16)
    drafter.extend_context(features, cache)
    return drafter.draft(tokens[:, -1], cache)


@pytest.mark.parametrize("kind", ["mask-token", "learned-mask", "draft-vocabulary"])
def test_a_drafter_saved_for_vllm_loads_back_and_drafts_the_same(tmp_path, native, target, kind) -> None:
    drafter = random_drafter(target, mask_token=None if kind == "learned-mask" else 7)
    if kind == "draft-vocabulary":
        drafter = with_draft_vocabulary(drafter, native)
    drafter.share_native(native)
    save_speculators_dflash(
        drafter,
        tmp_path / "d",
        "tiny/llama-verifier",
        verifier_architectures=["LlamaForCausalLM"],
        mask_token_id=0 if kind == "learned-mask" else None,
    )
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["sample_from_anchor"] is False
    assert config["aux_hidden_state_layer_ids"] == [j + 1 for j in drafter.target_layer_ids]
    assert config["block_size"] == 5 and config["mask_token_id"] == (0 if kind == "learned-mask" else 7)
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["draft_vocab_size"] == (DRAFT_VOCABULARY.numel() if kind == "draft-vocabulary" else VOCAB)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny/llama-verifier"
    weights = load_file(tmp_path / "d" / "model.safetensors")
    assert ("d2t" in weights and "t2d" in weights) == (kind == "draft-vocabulary")
    assert "mask_embedding" not in weights and "embed_tokens.weight" not in weights
    assert (tmp_path / "d" / "mask_embedding.pt").is_file() == (kind == "learned-mask")

    again = load_dflash(tmp_path / "d", native)
    assert again.hidden_layers == drafter.hidden_layers and again.block_size == 5
    state, loaded = drafter.state_dict(), again.state_dict()
    assert set(state) == set(loaded) and all(torch.equal(state[n], loaded[n]) for n in state)
    expected, got = context_logits(drafter, native), context_logits(again, native)
    torch.testing.assert_close(got, expected)
    if kind == "draft-vocabulary":
        outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, DRAFT_VOCABULARY, False)
        assert torch.isinf(got[..., outside]).all() and torch.isfinite(got[..., ~outside]).all()


def library_checkpoint(path, native: NativeCausalLM, **changes) -> DFlashDrafter:
    """Write a DFlash checkpoint under the speculators library's names, as it saves one (its config a
    diff against Qwen3Config's defaults; a draft vocabulary whose lm_head is the verifier's rows; the
    verifier's embedding and training-only weights beside them), reading the streams entering target
    layers 1 and 3. Returns the same drafter built here by hand, for reference. `changes` update the
    config.json."""
    layer = {
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HIDDEN // 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
    }
    reference = DFlashDrafter(Qwen3Config(**layer), (0, 2), 5, mask_token_id=9)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in reference.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(noise * 0.15 if p.dim() == 2 else 1 + 0.1 * noise)
    weights = dict(reference.state_dict())
    lm_head = native.lm_head.weight.detach()
    weights["lm_head.weight"] = lm_head[DRAFT_VOCABULARY].clone()
    weights["d2t"] = DRAFT_VOCABULARY - torch.arange(DRAFT_VOCABULARY.numel())
    weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, DRAFT_VOCABULARY, True)
    weights["embed_tokens.weight"] = native.model.embed_tokens.weight.detach().clone()
    weights["verifier_lm_head.weight"] = lm_head[DRAFT_VOCABULARY].clone()
    weights["verifier_norm.weight"] = torch.ones(HIDDEN)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": DRAFT_VOCABULARY.numel(),
        "block_size": 5,
        "aux_hidden_state_layer_ids": [1, 3],
        "mask_token_id": 9,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/llama-verifier", "architectures": ["LlamaForCausalLM"]},
        },
        **changes,
    }
    (path / "config.json").write_text(json.dumps(config))
    return reference


def test_a_checkpoint_as_the_library_writes_it_drafts_as_its_names_say(tmp_path, native) -> None:
    """Each weight lands where its speculators name says, aux id i is the stream entering target layer
    i (DFlash's layer i - 1), and the draft vocabulary's logits are the verifier's rows there and -inf
    elsewhere."""
    reference = library_checkpoint(tmp_path / "d", native)
    drafter = load_dflash(tmp_path / "d", native)
    assert drafter.target_layer_ids == (0, 2) and drafter.hidden_layers == (1, 3)
    assert drafter.mask_token_id == 9 and not hasattr(drafter, "mask_embedding")
    assert drafter.lm_head.weight.shape == (DRAFT_VOCABULARY.numel(), HIDDEN)
    reference.share_native(native)
    expected = context_logits(reference, native)
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, DRAFT_VOCABULARY, False)
    expected[..., outside] = -torch.inf
    torch.testing.assert_close(context_logits(drafter, native), expected, atol=1e-5, rtol=1e-5)


def test_greedy_output_through_a_library_checkpoint_equals_the_target_alone(tmp_path, target, native) -> None:
    library_checkpoint(tmp_path / "d", native)
    llm = LLM(
        target,
        draft_model=str(tmp_path / "d"),
        speculative_config=SpeculativeConfig(method="dflash", num_speculative_tokens=4),
    )
    proposer, drafted = llm.engine.proposer, []
    original = proposer.propose

    def recording(*arguments):
        proposal = original(*arguments)
        drafted.extend(proposal.token_ids.flatten().tolist())
        return proposal

    proposer.propose = recording
    outputs = llm.generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    )
    for prompt, output, n in zip(PROMPTS, outputs, LENGTHS):
        assert output.outputs[0].token_ids == hf_greedy(target, prompt, n, None)
    assert drafted and set(drafted) <= set(DRAFT_VOCABULARY.tolist())


def test_the_targets_own_lm_head_is_shared_not_copied(tmp_path, native) -> None:
    library_checkpoint(tmp_path / "d", native, draft_vocab_size=VOCAB)
    weights = load_file(tmp_path / "d" / "model.safetensors")
    weights["lm_head.weight"] = native.lm_head.weight.detach().clone()
    for name in ("d2t", "t2d"):
        del weights[name]
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    assert load_dflash(tmp_path / "d", native).lm_head is None


def test_a_mask_vector_beside_the_weights_is_read(tmp_path, native) -> None:
    """vLLM's mask_embedding.pt: the masked positions take its vector, not the mask token's embedding."""
    library_checkpoint(tmp_path / "d", native)
    vector = torch.randn(HIDDEN)
    torch.save({"mask_token_id": 9, "embedding": vector}, tmp_path / "d" / "mask_embedding.pt")
    drafter = load_dflash(tmp_path / "d", native)
    assert drafter.mask_token_id == 9 and torch.equal(drafter.mask_embedding, vector)
    block = drafter.block_embeddings(torch.tensor([4]), 5)
    assert torch.equal(block[0, 1:], vector.expand(4, -1)) and not torch.equal(
        block[0, 1], native.embed(torch.tensor([9]))[0]
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sample_from_anchor": True}, "sample_from_anchor true"),
        ({"mask_token_id": None}, "mask_token_id None must be a token id"),
        ({"aux_hidden_state_layer_ids": [0, 3]}, r"aux_hidden_state_layer_ids \[0, 3\] must be"),
        ({"aux_hidden_state_layer_ids": [1, 5]}, r"in \[1, 4\]"),
        ({"target_hidden_size": 32}, r"of hidden size 32 \(target_hidden_size\); the target's is 64"),
        ({"speculators_model_type": "eagle3"}, r'\'eagle3\' is an EAGLE-3 head: use method="eagle3"'),
        ({"speculators_model_type": "mtp"}, "'mtp' is not supported"),
        ({"transformer_layer_config": {"model_type": "gemma"}}, "model_type 'gemma': only llama and qwen3"),
        ({"draft_vocab_size": VOCAB}, "'d2t' reorders a draft vocabulary that is the whole vocabulary"),
        ({"draft_vocab_size": 12}, "draft vocabulary of 12 tokens needs weights 'lm_head.weight' and 'd2t'"),
    ],
)
def test_wrong_speculators_dflash_checkpoints_name_what_is_wrong(tmp_path, native, change, message) -> None:
    library_checkpoint(tmp_path / "d", native, **change)
    with pytest.raises(ValueError, match=message):
        load_dflash(tmp_path / "d", native)


def test_a_wrong_vocabulary_map_or_mask_file_is_named(tmp_path, native) -> None:
    library_checkpoint(tmp_path / "d", native)
    weights = load_file(tmp_path / "d" / "model.safetensors")
    weights["t2d"] = weights["t2d"].roll(1)
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="'t2d' does not mark the target tokens 'd2t' maps to"):
        load_dflash(tmp_path / "d", native)
    library_checkpoint(tmp_path / "e", native)
    torch.save({"mask_token_id": 4, "embedding": torch.zeros(HIDDEN)}, tmp_path / "e" / "mask_embedding.pt")
    with pytest.raises(ValueError, match="mask_token_id 4 is not the config's 9"):
        load_dflash(tmp_path / "e", native)


def test_saving_for_vllm_refuses_what_vllm_cannot_serve(tmp_path, target) -> None:
    with pytest.raises(ValueError, match="vLLM serves DFlash drafters of qwen3 layers"):
        save_speculators_dflash(random_drafter(target, family="llama", mask_token=7), tmp_path / "a", None)
    with pytest.raises(ValueError, match="mask_token_id: the speculators layout names the mask token"):
        save_speculators_dflash(random_drafter(target), tmp_path / "b", None)
    with pytest.raises(ValueError, match="mask_token_id: the speculators layout names the mask token"):
        save_speculators_dflash(random_drafter(target, mask_token=7), tmp_path / "c", None, mask_token_id=8)
    last = DFlashDrafter(random_drafter(target).config, (1, LAYERS - 1), 5, mask_token_id=7)
    with pytest.raises(ValueError, match="not the last layer's output"):
        save_speculators_dflash(last, tmp_path / "d", None, num_target_layers=LAYERS)
