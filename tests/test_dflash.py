"""DFlash block drafters: drafting stays exact, the cached context follows the committed text, saved
drafters load back, and the training recipe learns."""

from __future__ import annotations

import itertools
import json

import pytest
import test_distribution as dist
import torch
from conftest import tiny_model
from exactness import hf_greedy
from safetensors.torch import load_file
from scipy.stats import chi2
from transformers import AutoModelForCausalLM, Qwen3Config

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import train_dflash
from speculative.demo.train_dflash import (
    Answers,
    answer_anchors,
    chunked_kl,
    dflash_drafter,
    dflash_losses,
    sample_anchors,
)
from speculative.models.dflash import DFlashDrafter, default_target_layers
from speculative.models.dflash_checkpoint import load_dflash, save_dflash
from speculative.models.llama import NativeCausalLM
from speculative.proposers.dflash import DFlashProposer
from speculative.tree import tree_depths

HIDDEN, VOCAB, LAYERS = 64, 96, 4


def random_drafter(
    target,
    block: int = 5,
    layers: int = 2,
    family: str = "qwen3",
    seed: int = 0,
    mask_token: int | None = None,
) -> DFlashDrafter:
    """A randomly initialised drafter for `target` (weights N(0, 0.15), norms near 1): it drafts badly, so
    most drafts are rejected."""
    t = target.config
    fields = dict(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=2 * t.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if family == "qwen3":
        config = Qwen3Config(head_dim=t.hidden_size // 4, **fields)
    else:
        from transformers import LlamaConfig

        config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config, default_target_layers(t.num_hidden_layers, layers), block, mask_token)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
    return drafter


def saved(tmp_path, target, name: str = "dflash", **settings) -> str:
    path = tmp_path / name
    save_dflash(random_drafter(target, **settings), path)
    return str(path)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=3)


def check_drafts(llm: LLM, monkeypatch) -> list[int]:
    """Patch the DFlash proposer of `llm` to check each proposal against the drafter run over the whole
    context from scratch (block_logits over the target's features of the context but its last token, the
    block at the last token): the cached context stays the committed text's through rejections, plain
    steps, rows joining and leaving. Returns the list of the checked proposals' batch sizes."""
    proposer, native, checked = llm.engine.proposer, llm.target.model, []
    original = proposer.propose

    def checked_propose(tokens, lengths, num_tokens, strategy):
        proposal, expected = original(tokens, lengths, num_tokens, strategy), []
        assert proposer.cache.lengths.tolist() == (lengths - 1).tolist()
        for row, n in enumerate(lengths.tolist()):
            context = tokens[row : row + 1, :n]
            _, features = native.forward(
                context[:, :-1], native.new_cache(1, n), hidden_layers=proposer.hidden_layers
            )
            logits = proposer.drafter.block_logits(features, context[:, -1:], torch.tensor([[n - 1]]))
            expected.append(logits[:, 0, :num_tokens])  # [1, k, V]
        expected = torch.cat(expected)
        if proposal.parents is not None:  # a tree: depth d's nodes among position d's top candidates
            depths = tree_depths(proposal.parents)[:, 1:] - 1  # [B, n], -1 at padding
            top = expected.topk(proposer.width, dim=-1).indices  # [B, k, w]
            for row, (ids, ds) in enumerate(zip(proposal.token_ids.tolist(), depths.tolist())):
                assert all(t in top[row, d].tolist() for t, d in zip(ids, ds) if d >= 0)
        elif proposal.probs is None:
            assert proposal.token_ids.tolist() == expected.argmax(-1).tolist()
        else:
            torch.testing.assert_close(proposal.probs, strategy.probs(expected), atol=1e-5, rtol=1e-4)
        checked.append(len(lengths))
        return proposal

    monkeypatch.setattr(proposer, "propose", checked_propose)
    return checked


PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 2], [20, 21]]
LENGTHS = (24, 9, 17)


@pytest.mark.parametrize("family,k", [("qwen3", 1), ("qwen3", 4), ("llama", 3)])
def test_greedy_output_equals_the_target_alone(tmp_path, target, k, family) -> None:
    """A random drafter keeps greedy output token-identical to the target's alone: chains of several k
    (block 5: up to 4), a batch of rows of different lengths finishing at different times."""
    path = saved(tmp_path, target, family=family)
    llm = LLM(
        target,
        draft_model=path,
        speculative_config=SpeculativeConfig(method="dflash", num_speculative_tokens=k),
    )
    outputs = llm.generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    )
    for prompt, output, n in zip(PROMPTS, outputs, LENGTHS):
        assert output.outputs[0].token_ids == hf_greedy(target, prompt, n, None)


@pytest.mark.parametrize("shape", ["dynamic", "static"])
def test_trees_keep_greedy_output_and_draft_from_the_block(tmp_path, target, shape, monkeypatch) -> None:
    """A tree grown from one block (width 2, 6 nodes, 3 deep) keeps greedy output token-identical to the
    target's alone, each depth's nodes are that block position's top candidates over the committed
    context (the features along each accepted path keep the cache right), and a batch's trees shrink
    to chains (verified as such) as the batch grows."""
    config = SpeculativeConfig(
        method="dflash", num_speculative_tokens=3, tree=shape, tree_width=2, tree_nodes=6
    )
    llm = LLM(target, draft_model=saved(tmp_path, target), speculative_config=config)
    checked, trees = check_drafts(llm, monkeypatch), []
    propose = llm.engine.proposer.propose

    def recording(*arguments):
        proposal = propose(*arguments)
        trees.append(proposal.parents is not None and proposal.token_ids.shape[1] > 3)
        return proposal

    llm.engine.proposer.propose = recording
    for prompts, lengths in ((PROMPTS[:1], LENGTHS[:1]), (PROMPTS, LENGTHS)):
        outputs = llm.generate(
            prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        )
        for prompt, output, n in zip(prompts, outputs, lengths):
            assert output.outputs[0].token_ids == hf_greedy(target, prompt, n, None)
    assert any(trees) and not all(trees) and 3 in checked


@pytest.mark.parametrize("accept_all", [False, True], ids=["greedy", "sampled-accept-all"])
def test_drafts_equal_the_drafter_run_from_scratch(tmp_path, target, accept_all, monkeypatch) -> None:
    """Each proposal is the block the drafter drafts over the whole context from scratch: its cached
    context K/V follow the committed text through rejections, whole chains kept (typical acceptance at
    threshold 0 keeps every draft), plain steps (k = 0) and rows leaving."""
    settings = dict(method="dflash", num_speculative_tokens=3)
    if accept_all:
        settings.update(acceptance="typical", posterior_threshold=0.0)
    llm = LLM(target, draft_model=saved(tmp_path, target), speculative_config=SpeculativeConfig(**settings))
    checked = check_drafts(llm, monkeypatch)
    if not accept_all:
        ks = itertools.cycle([3, 0, 2, 3, 0, 0, 1])
        llm.engine.draft_length.choose = lambda rows, backlog=None: next(ks)
    temperature = 1.0 if accept_all else 0.0
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]
    outputs = llm.generate(PROMPTS, params)
    assert len(checked) > 4
    if accept_all:  # every step kept its whole chain and the bonus token
        assert all(len(o.outputs[0].token_ids) == n for o, n in zip(outputs, (20, 7, 13)))
        assert len(checked) <= 1 + 19 // 4 + 1


def test_rows_joining_a_running_batch_get_their_context(tmp_path, target, monkeypatch) -> None:
    """Continuous batching: rows prefilled while others run join the drafter's cache with their prompts'
    features (and n > 1 sequences of one prompt share them)."""
    config = SpeculativeConfig(method="dflash", num_speculative_tokens=2)
    llm = LLM(target, draft_model=saved(tmp_path, target), speculative_config=config)
    checked = check_drafts(llm, monkeypatch)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    *_, sequences = llm.inputs.prepare([PROMPTS[0]], params)
    engine.add(sequences)
    engine.step()
    _, _, _, more = llm.inputs.prepare(
        [PROMPTS[1], PROMPTS[2]], [params, SamplingParams(temperature=1.0, top_k=1, n=2, max_tokens=6)]
    )
    engine.add(more)
    while engine.batch is not None:
        engine.step()
    for s in sequences + more:
        prompt = s.prompt_token_ids
        assert s.output_token_ids == hf_greedy(target, prompt, len(s.output_token_ids), None)
    assert 4 in checked  # the running row, the new one and the n = 2 pair


@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_sampled_output_follows_the_target(tmp_path, tree) -> None:
    """Sampled output follows the target's distribution (chi-square over every 3-token continuation,
    test_distribution.py's helpers) at temperature 0.8 and top-k 6, k = 2: chains, and trees of 4
    drafts whose siblings the rule rejects one by one."""
    assert chi2.sf(*_chi_square(tmp_path, tree)) > 1e-3


def test_a_proposer_that_lies_about_its_probs_fails_the_test(tmp_path, monkeypatch) -> None:
    """The same test fails when the proposal's probs are not the distributions its drafts were drawn
    from (here: each claimed with its token ids shifted by one), so it can tell."""
    original = DFlashProposer.propose

    def lying(self, tokens, lengths, num_tokens, strategy):
        proposal = original(self, tokens, lengths, num_tokens, strategy)
        if proposal.probs is None:
            return proposal
        return proposal._replace(probs=proposal.probs.roll(1, dims=-1))  # token x claims x - 1's probability

    monkeypatch.setattr(DFlashProposer, "propose", lying)
    assert chi2.sf(*_chi_square(tmp_path)) < 1e-6


def _chi_square(tmp_path, tree: str | None = None) -> tuple[float, int]:
    small = tiny_model("llama", vocab_size=dist.VOCAB, hidden_size=32, num_layers=2, seed=0)
    drafter = random_drafter(small, block=4, layers=1, seed=5)
    save_dflash(drafter, tmp_path / "small")
    config = SpeculativeConfig(
        method="dflash", num_speculative_tokens=2, tree=tree, tree_width=2, tree_nodes=4
    )
    llm = LLM(small, draft_model=str(tmp_path / "small"), speculative_config=config, seed=11)
    prompt = [2, 3, 2, 5]
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=dist.LENGTH, ignore_eos=True)
    samples = dist.sample(llm, [prompt] * dist.SAMPLES, [params] * dist.SAMPLES)
    return dist.chi_square(samples, dist.exact_probs(small, prompt, 0.8, 6))


@pytest.mark.parametrize("mask_token", [None, 7], ids=["learned-mask", "mask-token"])
def test_saved_drafters_load_back_and_draft_the_same(tmp_path, target, mask_token) -> None:
    """save_dflash / load_dflash: the same weights and config, the shared embedding and lm_head not
    saved, and the same drafts from the same context."""
    native = NativeCausalLM.from_hf(target)
    drafter = random_drafter(target, mask_token=mask_token)
    save_dflash(drafter, tmp_path / "d")
    names = set(json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"])
    assert names == {"target_layer_ids", "block_size", "mask_token_id"}
    again = load_dflash(tmp_path / "d", native)
    assert again.target_layer_ids == drafter.target_layer_ids and again.block_size == 5
    assert again.mask_token_id == mask_token
    state, loaded = drafter.state_dict(), again.state_dict()
    assert set(state) == set(loaded) and not any("embed_tokens" in n or "lm_head" in n for n in state)
    assert all(torch.equal(state[n], loaded[n]) for n in state)
    drafter.share_native(native)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    _, features = native.forward(tokens[:, :-1], native.new_cache(1, 8), hidden_layers=drafter.hidden_layers)
    logits = []
    for model in (drafter, again):
        cache = model.new_cache(1, 16)
        model.extend_context(features[:, :3], cache)  # in two pieces: the cache appends
        model.extend_context(features[:, 3:], cache)
        logits.append(model.draft(tokens[:, -1], cache))
    torch.testing.assert_close(logits[0], logits[1])
    reference = drafter.block_logits(features, tokens[:, -1:], torch.tensor([[7]]))[:, 0]
    torch.testing.assert_close(logits[0], reference, atol=1e-5, rtol=1e-5)


def test_wrong_checkpoints_and_settings_name_what_is_wrong(tmp_path, target) -> None:
    native = NativeCausalLM.from_hf(target)
    path = tmp_path / "d"
    save_dflash(random_drafter(target), path)
    config = json.loads((path / "config.json").read_text())
    for change, message in (
        ({"hidden_size": 32}, "hidden_size 32 is not the target's 64"),
        ({"dflash_config": {"block_size": 5}}, "dflash_config.target_layer_ids is missing"),
        ({"dflash_config": {**config["dflash_config"], "target_layer_ids": [9]}}, "target_layer_ids"),
        ({"model_type": "gemma"}, "model_type must be one of"),
    ):
        bad = tmp_path / f"bad{len(message)}"
        save_dflash(random_drafter(target), bad)
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_dflash(bad, native)
    with pytest.raises(ValueError, match="num_speculative_tokens must be at most"):
        LLM(
            target,
            draft_model=str(path),
            speculative_config=SpeculativeConfig(method="dflash", num_speculative_tokens=5),
        )
    with pytest.raises(ValueError, match="needs LLM\\(draft_model"):
        LLM(target, speculative_config=SpeculativeConfig(method="dflash"))


def test_a_drafter_to_train_reads_layers_of_its_target(target) -> None:
    """--target-layers: the drafter reads the layers named (DFlash's ids); one the target lacks is an
    error naming the range."""
    sizes = {"intermediate_size": 64}
    drafter = dflash_drafter(target, sizes, block=4, layers=1, target_layers=(0, LAYERS - 1))
    assert drafter.target_layer_ids == (0, LAYERS - 1) and drafter.hidden_layers == (1, LAYERS)
    with pytest.raises(ValueError, match=rf"target layers must be in \[0, {LAYERS}\); got \[{LAYERS}\]"):
        dflash_drafter(target, sizes, block=4, layers=1, target_layers=(LAYERS,))


def test_sample_anchors_leave_room_for_the_block() -> None:
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(3, 20, 5, 8, gen)
    assert anchors.shape == (3, 8) and anchors.min() >= 1 and anchors.max() <= 15
    assert all(len(set(row)) == 8 for row in anchors.tolist())
    assert sample_anchors(1, 8, 5, 8, gen).shape == (1, 3)  # only 3 anchors fit


def test_the_training_recipe_lowers_the_loss(target) -> None:
    """A few steps of the recipe's loss (position-decayed KL to the target over anchored blocks, the
    drafter's own parameters only: the shared embedding and lm_head stay frozen) lower it."""
    torch.manual_seed(0)
    drafter = dflash_drafter(target, {"intermediate_size": 128}, block=4, layers=1)
    embedding = target.get_input_embeddings().weight.clone()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    windows = torch.randint(2, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(12):
        figures = dflash_losses(drafter, target, windows, 6, 2.0, torch.Generator().manual_seed(2))
        optimizer.zero_grad()
        figures["loss"].backward()
        optimizer.step()
        losses.append(figures["loss"].item())
    assert losses[-1] < 0.6 * losses[0], losses
    assert figures["kl"].shape == (3,) and figures["agree"].shape == (3,)
    assert torch.equal(target.get_input_embeddings().weight, embedding)


def test_chunked_kl_is_the_whole_computation_a_chunk_at_a_time() -> None:
    """chunked_kl (two rows a chunk) gives the KL, the cross-entropy, the top-token agreement and the
    gradient of the computation over whole [rows, V] logits."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 8, generator=gen, requires_grad=True)
    teacher, head = torch.randn(9, 8, generator=gen), torch.randn(30, 8, generator=gen)
    tokens = torch.randint(0, 30, (9,), generator=gen)
    weights = torch.rand(9, generator=gen)
    kl, nll, same = chunked_kl(hidden, teacher, head, tokens, chunk_elements=60)
    (kl * weights).sum().backward()
    chunked_grad, hidden.grad = hidden.grad, None
    log_q, log_p = (torch.log_softmax(x @ head.T, dim=-1) for x in (hidden, teacher))
    whole = torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    (whole * weights).sum().backward()
    torch.testing.assert_close(kl, whole.detach())
    torch.testing.assert_close(chunked_grad, hidden.grad)
    torch.testing.assert_close(
        nll, torch.nn.functional.cross_entropy(log_q, tokens, reduction="none").detach()
    )
    assert torch.equal(same, log_q.argmax(-1) == log_p.argmax(-1))


def test_answer_anchors_draft_the_answer_only() -> None:
    """In rows of prompt + answer, anchors are positions whose next token is the answer's (and leave room
    for the block); a drafted position counts where its token is the answer's; a row with fewer such
    positions than the others fills its anchors with blocks that count for nothing."""
    block = 4
    rows = [
        (torch.arange(12), torch.tensor([-100] * 5 + [1] * 6 + [-100])),  # prompt of 6, answer of 6
        (torch.arange(6), torch.tensor([-100] * 3 + [1] * 2 + [-100])),  # prompt of 4, answer of 2
    ]
    features = [torch.randn(len(tokens), 3 * 8) for tokens, _ in rows]  # F = 2 x 8, then H = 8
    data = Answers(rows, features, head=torch.randn(30, 8), index=None)
    tokens, labels, drafter_features, final = data.batch([0, 1], block)
    assert tokens.shape == (2, 15) and (labels[:, 12:] == -100).all() and (tokens[1, 6:] == 0).all()
    assert drafter_features.shape == (2, 15, 16) and final.shape == (2, 15, 8)
    assert torch.equal(final[1, :6], features[1][:, 16:]) and not final[1, 6:].any()
    for seed in range(20):
        anchors, valid = answer_anchors(labels, block, 5, torch.Generator().manual_seed(seed))
        assert anchors.shape == (2, 5) and valid.shape == (2, 5, 3)
        assert anchors.min() >= 1 and anchors.max() <= 15 - block
        for b in range(2):
            for j, a in enumerate(anchors[b].tolist()):
                if labels[b, a] < 0:  # a filler
                    assert not valid[b, j].any()
                else:
                    assert valid[b, j].tolist() == [bool(labels[b, a + i - 1] >= 0) for i in range(1, block)]
        assert int((labels[1].gather(0, anchors[1]) >= 0).sum()) == 2  # row 1 has only 2 to draft
        assert valid[0].sum() > 0 and valid[0, :, 0].all()


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_the_recipe_on_a_targets_own_answers(chat_target, tmp_path, draft_vocab) -> None:
    """--target / --data: a few steps on the target's answers lower the loss and the held-out KL; the
    drafter, its card and training.json are written, and through the engine greedy output is the
    target's alone. With --draft-vocab the saved drafter's lm_head is the target's rows at the answers'
    most frequent tokens (d2t), and --features keeps the target's features."""
    root, out = chat_target, tmp_path / "dflash"
    argv = [
        "--target", str(root / "target"), "--data", str(root / "data"), "--out", str(out),
        "--steps", "12", "--block", "5", "--layers", "1", "--intermediate", "64", "--batch-tokens", "1024",
        "--seq-len", "200", "--warmup", "1", "--lr", "3e-3", "--prompts", "2", "--new-tokens", "8",
        "--features", str(tmp_path / "features.pt"),
    ]  # fmt: skip
    if draft_vocab:
        argv += ["--draft-vocab", str(draft_vocab)]
    info = train_dflash.main(argv)
    assert info["steps"] == 12 and info["answers"] == {
        "first.jsonl": 40,
        "second.jsonl": 6,
        "sampled.jsonl": 0,
        "written.jsonl": 0,
        "written-second.jsonl": 0,
    }
    trace = [loss for _, loss in info["loss_trace"]]
    assert sum(trace[-3:]) / 3 < 0.8 * trace[0], trace
    before, after = info["heldout_before"], info["heldout_after"]
    assert before["positions"] == after["positions"] > 0  # the 2 held-out answers' drafted tokens
    assert sum(after["kl_per_position"]) < sum(before["kl_per_position"])
    assert set(info["acceptance"]) >= {"k=4"} and (out / "README.md").is_file()
    assert json.loads((out / "training.json").read_text())["steps"] == 12
    assert "the loss is on the answer's tokens only" in (out / "README.md").read_text()
    assert info["draft_vocabulary"] == draft_vocab and (tmp_path / "features.pt").is_file()
    weights = load_file(str(out / "model.safetensors"))
    card = " ".join((out / "README.md").read_text().split())
    assert ("a draft vocabulary of the 64 tokens" in card) == bool(draft_vocab)
    if draft_vocab:
        lm_head = AutoModelForCausalLM.from_pretrained(root / "target").get_output_embeddings().weight
        tokens = weights["d2t"] + torch.arange(draft_vocab)
        assert weights["lm_head.weight"].shape == (draft_vocab, lm_head.shape[1])
        assert tokens.unique().numel() == draft_vocab
        assert torch.equal(weights["lm_head.weight"], lm_head[tokens])
    else:
        assert "lm_head.weight" not in weights
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[60, 61, 62, 63], [10, 20, 30, 40, 50, 60, 70]]
    alone = LLM(str(root / "target"), dtype="float32").generate(prompts, params)
    drafted = LLM(
        str(root / "target"),
        draft_model=str(tmp_path / "dflash"),
        speculative_config=SpeculativeConfig(method="dflash"),
        dtype="float32",
    ).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in alone]
    assert sum(o.metrics.num_drafted for o in drafted) > 0


def test_the_target_recipe_needs_its_data_and_out(chat_target, tmp_path, capsys) -> None:
    target = str(chat_target / "target")
    for argv, message in (
        (["--target", target, "--out", str(tmp_path)], "--target needs --data"),
        (["--target", target, "--data", str(chat_target / "data")], "--target needs --out"),
        (["--pair", target, "--data", str(chat_target / "data")], "--data and --features are --target's"),
        (["--target", target, "--data", str(tmp_path), "--out", str(tmp_path / "o")], "holds 0 answers"),
    ):
        with pytest.raises(SystemExit) as stopped:
            train_dflash.main(argv)
        assert message in capsys.readouterr().err + str(stopped.value)
