"""EAGLE heads: the published checkpoint layouts load, and drafting with them stays exact."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import test_distribution as dist
import torch
from conftest import tiny_model
from exactness import hf_greedy
from safetensors.torch import save_file
from scipy.stats import chi2

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.config import GenerationConfig
from speculative.demo import DEMO_DIR
from speculative.engine.state import SampleState
from speculative.models.eagle_checkpoint import load_eagle_head, save_eagle_head, write_draft_vocabulary
from speculative.models.llama import NativeCausalLM
from speculative.models.packed import hold
from speculative.precompile import PreCompileConfig

HIDDEN, HEADS, KV_HEADS, VOCAB = 64, 4, 2, 96


def head_weights(
    layout: str, draft_vocab: int = VOCAB, seed: int = 0, hidden: int = HIDDEN, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """Random weights under the published names and shapes (written out here, independently of the
    loader): SafeAILab/EAGLE's EAGLE-1 `layers.0.*` and EAGLE-3's `midlayer.*`. An EAGLE-3 draft
    vocabulary smaller than the target's is every other target token."""
    generator = torch.Generator().manual_seed(seed)
    head_dim, inner = hidden // HEADS, 2 * hidden
    attn_in = hidden if layout == "eagle" else 2 * hidden
    prefix = "layers.0." if layout == "eagle" else "midlayer."
    shapes = {
        "self_attn.q_proj.weight": (HEADS * head_dim, attn_in),
        "self_attn.k_proj.weight": (KV_HEADS * head_dim, attn_in),
        "self_attn.v_proj.weight": (KV_HEADS * head_dim, attn_in),
        "self_attn.o_proj.weight": (hidden, HEADS * head_dim),
        "mlp.gate_proj.weight": (inner, hidden),
        "mlp.up_proj.weight": (inner, hidden),
        "mlp.down_proj.weight": (hidden, inner),
    }
    weights = {
        prefix + name: torch.randn(shape, generator=generator) * 0.15 for name, shape in shapes.items()
    }
    norms = ["post_attention_layernorm"] + ([] if layout == "eagle" else ["input_layernorm", "hidden_norm"])
    weights.update({f"{prefix}{n}.weight": 1 + 0.1 * torch.randn(hidden, generator=generator) for n in norms})
    if layout == "eagle":
        weights["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.15
        weights["fc.bias"] = torch.randn(hidden, generator=generator) * 0.1
    else:
        weights["fc.weight"] = torch.randn(hidden, 3 * hidden, generator=generator) * 0.15
        weights["norm.weight"] = torch.ones(hidden)
        weights["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=generator) * 0.15
        if draft_vocab < vocab:
            targets = torch.arange(0, 2 * draft_vocab, 2)
            weights["d2t"] = targets - torch.arange(draft_vocab)
            weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True)
    return weights


def head_config(layout: str, draft_vocab: int = VOCAB, **fields) -> dict:
    """config.json of a head for the tiny target (fields override)."""
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


def check_drafts(llm: LLM, monkeypatch) -> list[int]:
    """Patch the EAGLE proposer of `llm` to check that each proposal's chain (or a width-1 tree's) is
    the one the head drafts over the whole context from a fresh cache with the target's features;
    returns the list to which each checked proposal appends its batch size."""
    proposer, native, checked = llm.engine.proposer, llm.target.model, []
    original = proposer.propose

    def checked_propose(tokens, lengths, num_tokens, strategy):
        proposal, expected = original(tokens, lengths, num_tokens, strategy), []
        for row, n in enumerate(lengths.tolist()):
            context, drafts = tokens[row : row + 1, :n], proposal.token_ids[row : row + 1]
            _, features = native.forward(
                context[:, :-1], native.new_cache(1, n), hidden_layers=proposer.hidden_layers
            )
            cache = proposer.head.new_cache(1, n + num_tokens)
            logits, hidden = proposer.head.forward(context[:, 1:], features, cache)
            steps = [logits[:, -1]]
            for i in range(num_tokens - 1):
                logits, hidden = proposer.head.forward(drafts[:, i : i + 1], hidden[:, -1:], cache)
                steps.append(logits[:, -1])
            expected.append(torch.stack(steps, dim=1))  # [1, k, V]
        expected = torch.cat(expected)  # [B, k, V]
        if proposal.probs is None:
            assert proposal.token_ids.tolist() == expected.argmax(-1).tolist()
        else:
            torch.testing.assert_close(proposal.probs, strategy.probs(expected), atol=1e-5, rtol=1e-4)
        checked.append(len(lengths))
        return proposal

    monkeypatch.setattr(proposer, "propose", checked_propose)
    return checked


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


@pytest.mark.parametrize(
    ("fields", "layers"),
    [
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, (1, 2, 3)),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}, (0, 2, 4)),
        ({}, (2, 2, 1)),
    ],
    ids=["in-eagle_config", "final-norm", "default"],
)
def test_eagle3_target_layers(tmp_path, target, fields, layers) -> None:
    """The aux layer ids nested in `eagle_config` (L, the target's layer count: its final norm's
    output), or vLLM's default (2, L // 2, L - 3)."""
    config = head_config("eagle3", **fields)
    del config["eagle_aux_hidden_state_layer_ids"]
    head = load_eagle_head(
        write_head(tmp_path, "eagle3", config=config), "eagle3", NativeCausalLM.from_hf(target)
    )
    assert head.target_layers == layers


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


def test_an_eagle1_draft_vocabulary_is_rows_of_the_target_lm_head(tmp_path, target) -> None:
    """write_draft_vocabulary cuts an EAGLE-1 head to some target tokens (FR-Spec): its lm_head is
    their rows of the target's, its logits there are the whole head's and -inf elsewhere; it saves
    and loads back, and greedy output stays the target's alone, in chains and trees."""
    native = NativeCausalLM.from_hf(target)
    path = write_head(tmp_path / "head", "eagle")
    whole = load_eagle_head(path, "eagle", native)
    tokens = torch.tensor([90, 3, 12, 4, 60, 5, 7, 20, 21, 33, 8, 9, 10, 11, 2])  # any order
    write_draft_vocabulary(path, tokens)
    assert json.loads(Path(path, "config.json").read_text())["draft_vocab_size"] == len(tokens)
    head = load_eagle_head(path, "eagle", native)
    inside = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, tokens, True)
    assert torch.equal(head.draft_vocabulary, tokens.sort().values)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[tokens.sort().values])
    ids, features = torch.tensor([[4, 6, 8]]), torch.randn(1, 3, HIDDEN)
    want, _ = whole.forward(ids, features, whole.new_cache(1, 8))
    got, _ = head.forward(ids, features, head.new_cache(1, 8))
    torch.testing.assert_close(got[..., inside], want[..., inside])
    assert torch.isinf(got[..., ~inside]).all()
    save_eagle_head(head, tmp_path / "saved")
    again = load_eagle_head(tmp_path / "saved", "eagle", native)
    assert torch.equal(again.draft_vocabulary, head.draft_vocabulary)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 2]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for tree in (None, "dynamic"):
        config = SpeculativeConfig(method="eagle", num_speculative_tokens=3, tree=tree, tree_nodes=6)
        llm = LLM(target, draft_model=path, speculative_config=config)
        for prompt, output in zip(prompts, llm.generate(prompts, params)):
            assert output.outputs[0].token_ids == hf_greedy(target, prompt, 16, None)
            assert output.metrics.num_drafted > 0


def test_a_draft_vocabulary_is_written_into_an_eagle1_head_only(tmp_path) -> None:
    with pytest.raises(ValueError, match="into an EAGLE-1 head only"):
        write_draft_vocabulary(write_head(tmp_path / "three", "eagle3"), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"target token ids in \[0, 96\)"):
        write_draft_vocabulary(write_head(tmp_path / "one", "eagle"), torch.tensor([1, 96]))


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
        ("eagle3", lambda c, w: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 5]), r"in \[0, 4\]"),
        ("eagle3", lambda c, w: c.update(draft_vocab_size=40), "'lm_head.weight' has shape"),
        ("eagle", lambda c, w: c.update(draft_vocab_size=40), "needs the weight 'd2t'"),
        (
            "eagle",
            lambda c, w: c.update(draft_vocab_size=2) or w.update(d2t=torch.tensor([5, 4])),
            "does not map the draft vocabulary one to one",
        ),
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
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_greedy_output_equals_the_target_alone(tmp_path, target, layout, tree) -> None:
    """Any head keeps greedy output exact: a random one, over prompts of different lengths, rows
    finishing at different times; chains and EAGLE-2's dynamic trees."""
    path = write_head(tmp_path, layout)
    config = SpeculativeConfig(method=layout, num_speculative_tokens=3, tree=tree, tree_width=2, tree_nodes=6)
    llm = LLM(target, draft_model=path, speculative_config=config)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 2], [20, 21]]
    outputs = llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 9, 17)]
    )
    for prompt, output, n in zip(prompts, outputs, (24, 9, 17)):
        assert output.outputs[0].token_ids == hf_greedy(target, prompt, n, None)


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
@pytest.mark.parametrize("accept_all", [False, True], ids=["greedy", "sampled-accept-all"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree-of-width-1"])
def test_drafts_equal_the_head_run_from_scratch(
    tmp_path, target, layout, accept_all, tree, monkeypatch
) -> None:
    """Each proposal's chain is the one the head drafts over the whole context from a fresh cache with
    the target's features: the head's cache and features stay in step through rejections, whole
    chains kept (typical acceptance at threshold 0 keeps every draft), plain steps and rows leaving.
    A static tree of width 1 is the chain of the head's top tokens, grown by its tree forward."""
    settings = dict(method=layout, num_speculative_tokens=3)
    if tree:
        settings.update(tree="static", tree_width=1, tree_nodes=3)
    if accept_all:
        settings.update(acceptance="typical", posterior_threshold=0.0)
    llm = LLM(
        target, draft_model=write_head(tmp_path, layout), speculative_config=SpeculativeConfig(**settings)
    )
    checked = check_drafts(llm, monkeypatch)
    if not (accept_all or tree):
        ks = itertools.cycle([3, 0, 2, 3, 0, 0, 1])  # plain steps (k = 0) between proposals too
        llm.engine.draft_length.choose = lambda rows, backlog=None: next(ks)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 2], [20, 21]]
    temperature = 1.0 if accept_all else 0.0
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]
    outputs = llm.generate(prompts, params)
    assert len(checked) > 4
    if accept_all:  # every step kept its whole chain and the bonus token
        assert all(len(o.outputs[0].token_ids) == n for o, n in zip(outputs, (20, 7, 13)))
        assert len(checked) <= 1 + 19 // 4 + 1


def test_sampled_output_follows_the_target(tmp_path) -> None:
    """Sampled speculative output follows the target's distribution (chi-square over every 3-token
    continuation, test_distribution.py's helpers): an EAGLE-3 head over a draft vocabulary of half
    the target's tokens (the others it can never propose), at temperature 0.8 and top-k 6."""
    small = dict(vocab_size=dist.VOCAB, hidden_size=32)
    target = tiny_model("llama", num_layers=2, seed=0, **small)
    config = head_config(
        "eagle3", 4, **small, intermediate_size=64, eagle_aux_hidden_state_layer_ids=[0, 1, 1]
    )
    weights = head_weights("eagle3", 4, seed=5, hidden=32, vocab=dist.VOCAB)
    llm = LLM(
        target,
        draft_model=write_head(tmp_path, "eagle3", weights, config),
        speculative_config=SpeculativeConfig(method="eagle3", num_speculative_tokens=2),
        seed=11,
    )
    prompt, params = (
        [2, 3, 2, 5],
        SamplingParams(temperature=0.8, top_k=6, max_tokens=dist.LENGTH, ignore_eos=True),
    )
    samples = dist.sample(llm, [prompt] * dist.SAMPLES, [params] * dist.SAMPLES)
    stat, dof = dist.chi_square(samples, dist.exact_probs(target, prompt, 0.8, 6))
    assert chi2.sf(stat, dof) > 1e-3


def test_eagle_settings_that_cannot_work_are_refused(tmp_path, target) -> None:
    with pytest.raises(ValueError, match="needs LLM\\(draft_model"):
        LLM(target, speculative_config=SpeculativeConfig(method="eagle"))
    with pytest.raises(ValueError, match="neither precompiled nor quantized"):
        LLM(
            target,
            draft_model=write_head(tmp_path, "eagle"),
            speculative_config=SpeculativeConfig(method="eagle"),
            precompile=PreCompileConfig([1]),
        )


def test_prefill_features_follow_the_rows(tmp_path, target, monkeypatch) -> None:
    """The prefill's hidden states reach the head for the rows that stay: a prompt's n sequences
    (copied cache rows), a row finished by its first token, and sequences resumed from a state."""
    path = write_head(tmp_path, "eagle3")
    config = SpeculativeConfig(method="eagle3", num_speculative_tokens=3)
    llm = LLM(target, draft_model=path, speculative_config=config)
    checked = check_drafts(llm, monkeypatch)
    prompts = [[3, 4, 5], [9, 8], [7, 8, 9, 10, 11]]
    params = [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=1.0, top_k=1, n=2, max_tokens=12, ignore_eos=True),  # greedy, n > 1
        SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
    ]
    outputs = llm.generate(prompts, params)
    for prompt, output, p in zip(prompts, outputs, params):
        for sequence in output.outputs:
            assert sequence.token_ids == hf_greedy(target, prompt, p.max_tokens, None)
    assert checked and checked[0] == 3  # the first proposal: the n = 2 rows and the third prompt's
    chunks = GenerationConfig(streaming_chunks=2)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    full = list(llm.stream(prompts[1:], seeded, config=chunks))
    state = SampleState.from_json(full[1].to_json())
    resumed = list(LLM(target, draft_model=path, speculative_config=config, seed=9).resume(state, chunks))
    assert resumed[-1].sequences == full[-1].sequences


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_saved_heads_load_back(tmp_path, target, layout) -> None:
    """save_eagle_head writes the published layout: a head loads back with the same weights."""
    native = NativeCausalLM.from_hf(target)
    config = head_config(layout, draft_vocab=40) if layout == "eagle3" else None
    weights = head_weights(layout, draft_vocab=40) if layout == "eagle3" else None
    head = load_eagle_head(write_head(tmp_path / "a", layout, weights, config), layout, native)
    save_eagle_head(head, tmp_path / "b")
    again = load_eagle_head(tmp_path / "b", layout, native)
    assert again.target_layers == head.target_layers
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor)


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_fc_runs_packed_and_follows_its_weight(tmp_path, target, layout) -> None:
    """`fc` runs as a PackedLinear (a oneDNN prepacked copy on CPU): the head's output is fc's through
    F.linear, also after an in-place change of fc's weight (the copy is laid out again)."""
    head = load_eagle_head(write_head(tmp_path, layout), layout, NativeCausalLM.from_hf(target))
    assert head.packed_linears()[-1] is head._fc and head._fc.linears == [head.fc]
    ids, features = (
        torch.tensor([[5, 7, 9]]),
        torch.randn(1, 3, head.fc.in_features - HIDDEN * (layout == "eagle")),
    )

    def with_f_linear() -> tuple[torch.Tensor, torch.Tensor]:
        fc = head.fc
        packed = head._fc
        hold(head, "_fc", lambda x: torch.nn.functional.linear(x, fc.weight, fc.bias))
        try:
            return head.forward(ids, features, head.new_cache(1, 8))
        finally:
            hold(head, "_fc", packed)

    for _ in range(2):
        logits, hidden = head.forward(ids, features, head.new_cache(1, 8))
        expected_logits, expected_hidden = with_f_linear()
        torch.testing.assert_close(hidden, expected_hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            head.fc.weight.mul_(-2.0)


def test_the_demo_head_drafts_for_the_demo_target() -> None:
    """The committed head (models/demo/eagle, `python -m speculative.demo.train_eagle --layout eagle`)
    loads for the demo target, drafts tokens the target accepts, and the greedy output is the
    target's alone."""
    target, head = (str(DEMO_DIR / name) for name in ("target", "eagle"))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
    plain = LLM(target, dtype="float32").generate(prompts, params)
    config = SpeculativeConfig(method="eagle", num_speculative_tokens=4)
    llm = LLM(target, draft_model=head, speculative_config=config, dtype="float32")
    eagle = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in eagle] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_accepted for o in eagle) > 0.3 * sum(o.metrics.num_drafted for o in eagle)
