"""The demo recipe's EAGLE head training (`python -m speculative.demo.train_eagle`), smoke sized: the
training-time test computes what the engine drafts, the head learns, saves in the published layout,
loads, and drafts exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from exactness import hf_greedy
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import corpus, train_eagle
from speculative.demo.train import SMOKE, heldout_loss, train_loop
from speculative.demo.train_eagle import LAYOUT_NAMES, eagle_head, ttt_loss, ttt_losses
from speculative.models.eagle_checkpoint import load_eagle_head, save_eagle_head
from speculative.models.llama import NativeCausalLM
from speculative.models.norms import rms_norm

SIZES = {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_the_training_time_test_computes_what_the_engine_drafts(layout) -> None:
    """Pass d of ttt_losses at index p is the head's d-th draft after the context x_0 .. x_{p+1}, as
    EagleHead.forward drafts it: its KL to the target, recomputed from the engine's drafts, agrees."""
    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=6, seed=3).requires_grad_(False)
    head = eagle_head(target, SIZES, layout)
    with torch.no_grad():  # trainable weights moved off their initialisation
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    head.pack_weights()
    depth, length = 3, 5
    windows = torch.randint(1, 96, (2, length + depth + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        kls, _ = ttt_losses(head, target, windows, depth)
        out = target(input_ids=windows[:, :-1], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in head.target_layers], dim=-1)
        teacher = F.log_softmax(out.logits, dim=-1)
        drafted = torch.zeros(depth)
        for p in range(length):
            cache = head.new_cache(2, p + depth + 1)
            logits, hidden = head.forward(windows[:, 1 : p + 2], features[:, : p + 1], cache)
            logits, hidden = logits[:, -1:], hidden[:, -1:]
            for d in range(1, depth + 1):
                if d > 1:  # the d-th draft: the token x_{p+d} fed with the head's own hidden state
                    logits, hidden = head.forward(windows[:, p + d, None], hidden, cache)
                expected = teacher[:, p + d]
                drafted[d - 1] += F.kl_div(
                    F.log_softmax(logits[:, 0], -1), expected, log_target=True, reduction="sum"
                )
    drafted /= 2 * length
    torch.testing.assert_close(torch.stack(kls), drafted, atol=1e-4, rtol=1e-4)
    assert drafted[1] != drafted[0]  # the passes differ: the head's own features are not the target's


def test_an_eagle3_head_starts_reading_its_own_token() -> None:
    """train_eagle.attend_to_own_token: fed no feature (zeros), an "eagle3" head fresh from the recipe
    holds at each position the own-token term o(v(input_layernorm(embedding))) of that position, not
    a mixture of the window's: its attention starts on the position itself. (From the usual start,
    o_proj 0, the state is 0; with q and k random, a mixture.)"""
    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=6, seed=3).requires_grad_(False)
    torch.manual_seed(0)
    head = eagle_head(target, SIZES, "eagle3")
    length, heads, kv_heads = 24, SIZES["num_attention_heads"], SIZES["num_key_value_heads"]
    ids = (torch.randperm(95, generator=torch.Generator().manual_seed(1))[:length] + 1)[None]
    attention, width = head.model.layers[0].self_attn, target.config.hidden_size
    with torch.no_grad():
        _, hidden = head.score(ids, torch.zeros(1, length, head.fc.in_features))
        normed = rms_norm(head.embed(ids[0]), head.model.layers[0].input_layernorm.weight, head._eps)
        values = (normed @ attention.v_proj.weight[:, :width].T).view(length, kv_heads, -1)
        own = values.repeat_interleave(heads // kv_heads, 1).reshape(length, -1) @ attention.o_proj.weight.T
    agreement = F.cosine_similarity(hidden[0], own, dim=-1)  # q random: 0.35 on average, down to -0.37
    assert agreement.min() > 0.9 and agreement.mean() > 0.98


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_an_eagle3_head_saved_without_its_lm_head_reads_the_targets(tmp_path, draft_vocab) -> None:
    """save_eagle_head(share_lm_head=True) leaves out the recipe's EAGLE-3 lm_head (the target's rows at
    its draft vocabulary, frozen); loaded, the head takes those rows of the target's and drafts the same
    logits."""
    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=6, seed=3).requires_grad_(False)
    vocabulary = None if draft_vocab is None else torch.randperm(96)[:draft_vocab].sort().values
    head = eagle_head(target, SIZES, "eagle3", vocabulary)
    save_eagle_head(head, tmp_path / "head", share_lm_head=True)
    assert "lm_head.weight" not in load_file(tmp_path / "head" / "model.safetensors")
    native = NativeCausalLM.from_hf(target)
    loaded = load_eagle_head(tmp_path / "head", "eagle3", native)
    rows = target.lm_head.weight if vocabulary is None else target.lm_head.weight[vocabulary]
    torch.testing.assert_close(loaded.lm_head.weight, rows)
    ids, features = torch.tensor([[4, 6, 8]]), torch.randn(1, 3, head.fc.in_features)
    with torch.no_grad():
        want, _ = head.forward(ids, features, head.new_cache(1, 8))
    got, _ = loaded.forward(ids, features, loaded.new_cache(1, 8))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_a_trained_head_learns_saves_loads_and_stays_exact(tmp_path, layout) -> None:
    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=6, seed=3).requires_grad_(False)
    head = eagle_head(target, SIZES, layout)
    prompts = torch.randint(2, 96, (16, 2), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the target's own text (sampled, temperature 0.5): what its head should learn
        torch.manual_seed(0)
        text = target.generate(
            prompts, do_sample=True, temperature=0.5, top_k=0, max_new_tokens=98, pad_token_id=0
        )
    stream, heldout = text[:12].flatten(), text[12:, :99].reshape(-1, 33)  # heldout: [12, 33] windows
    cfg = {"batch": 8, "seq_len": 32, "warmup": 2, "eval_every": 1000}

    def ce(model, windows):
        return ttt_losses(model, target, windows, 1)[1]

    before = heldout_loss(head, heldout, 4, ce)
    record = train_loop(
        layout, head, lambda m, w: ttt_loss(m, target, w, 2), stream, heldout, cfg, 150, 1e-2, 0, None, ce=ce
    )
    assert record["steps"] == 150 and record["final_heldout_ce"] < before - 0.2
    save_eagle_head(head, tmp_path / layout)
    assert not (tmp_path / layout / "pytorch_model.bin").exists()
    llm = LLM(
        target,
        draft_model=str(tmp_path / layout),
        speculative_config=SpeculativeConfig(method=layout, num_speculative_tokens=3),
    )
    loaded = llm.engine.proposer.head.state_dict()
    for name in ("fc.weight", "lm_head.weight"):
        torch.testing.assert_close(loaded[name], head.state_dict()[name])
    prompt = [5, 9, 13, 17]
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert output[0].outputs[0].token_ids == hf_greedy(target, prompt, 20, None)


def test_generated_text_is_the_targets_own_and_half_of_every_batch(model_dirs, tmp_path) -> None:
    """`--generated`'s text is each prompt followed by the target's greedy continuation (what HF
    generate gives), and a mixture of streams gives each an equal share of a batch's windows."""
    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    (tmp_path / "target").symlink_to(model_dirs["target"])
    prompts = [[5, 9, 13, 17], [40, 2]]
    texts = train_eagle.target_continuations(tmp_path, prompts, 6)
    assert texts == [p + hf_greedy(target, p, 6, None) for p in prompts]
    streams = (torch.zeros(50, dtype=torch.long), torch.ones(50, dtype=torch.long))
    windows = corpus.random_windows(streams, 5, 8, torch.Generator().manual_seed(0))
    assert windows.shape == (5, 9) and windows[:, 0].tolist() == [0, 0, 0, 1, 1]


def test_train_eagle_resumes_the_saved_head_and_adds_up_its_record(model_dirs, tmp_path, monkeypatch) -> None:
    """`train_eagle --resume` trains the saved head further (starting from its weights) and appends
    to its training.json: steps, tokens and seconds summed over the pieces; each piece's card line
    names its data (the resumed one's half the target's own continuations, `--generated`). The
    acceptance is measured on the `--prompts` held-out prompts, not on `--generated`'s training ones."""
    measured, measure_acceptance = [], train_eagle.measure_acceptance

    def measure(pair, layout, prompts, cfg, count):
        measured.append(len(prompts))
        return measure_acceptance(pair, layout, prompts, cfg, count)

    monkeypatch.setattr(train_eagle, "measure_acceptance", measure)
    pair = tmp_path / "pair"
    pair.mkdir()
    for name in ("target", "draft"):
        (pair / name).symlink_to(model_dirs[name])
    argv = ["--pair", str(pair), "--layout", "eagle3", "--smoke", "--prompts", "2"]
    first = train_eagle.main([*argv, "--steps", "2"])
    saved = load_file(pair / "eagle3" / "model.safetensors")
    record = train_eagle.main([*argv, "--steps", "3", "--resume", "--generated", "3"])
    resumed = load_file(pair / "eagle3" / "model.safetensors")
    assert set(resumed) == set(saved)
    changes = [(resumed[name] - saved[name]).abs().max().item() for name in saved]
    # moved by 2 steps at a learning rate of at most 3e-3 from the saved weights, not from a fresh head
    assert 0 < max(changes) < 0.02, changes
    assert json.loads((pair / "eagle3" / "training.json").read_text()) == record
    assert measured == [2, 2]
    assert [p["steps"] for p in record["pieces"]] == [2, 3] and record["pieces"][0] == first["pieces"][0]
    window = SMOKE["batch"] * SMOKE["seq_len"] // 2
    assert (record["steps"], record["planned_steps"], record["tokens"]) == (5, 5, 5 * window)
    assert record["seconds"] == pytest.approx(sum(p["seconds"] for p in record["pieces"]), abs=0.1)
    assert record["final_heldout_ce"] == record["pieces"][1]["final_heldout_ce"]
    card = (pair / "eagle3" / "README.md").read_text()
    assert "\n- 2 steps of 4 windows" in card and "\n- 3 steps of 4 windows" in card
    assert "on corpus windows\n" in card and "half windows of 3 training prompts of 32 tokens" in card


def test_draft_vocab_cuts_the_saved_head_to_the_most_frequent_tokens(model_dirs, tmp_path) -> None:
    """`train_eagle --draft-vocab N` trains nothing: the saved EAGLE-1 head's weights stay, it gains a
    d2t of the N tokens most frequent in the training files, and its record the cut, measured again."""
    pair = tmp_path / "pair"
    pair.mkdir()
    for name in ("target", "draft"):
        (pair / name).symlink_to(model_dirs[name])
    argv = ["--pair", str(pair), "--layout", "eagle", "--smoke", "--prompts", "2"]
    train_eagle.main([*argv, "--steps", "2"])
    saved = load_file(pair / "eagle" / "model.safetensors")
    record = train_eagle.main([*argv, "--draft-vocab", "20"])
    cut = load_file(pair / "eagle" / "model.safetensors")
    assert set(cut) == set(saved) | {"d2t"}
    assert all(torch.equal(cut[name], saved[name]) for name in saved)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    train_files = corpus.split_files(corpus.list_files())[0][: SMOKE["files"][0]]
    encoded = corpus.encode_files(tokenizer, corpus.read_texts(train_files))
    counts = torch.bincount(corpus.token_stream(encoded, tokenizer.eos_token_id))
    tokens = torch.arange(20) + cut["d2t"]
    assert counts[tokens].min() >= counts.sort(descending=True).values[19]  # the 20 most frequent
    assert record["draft_vocabulary"]["size"] == 20 and record["pieces"][0]["steps"] == 2
    assert json.loads((pair / "eagle" / "config.json").read_text())["draft_vocab_size"] == 20
    assert "Its draft vocabulary is the 20 tokens most frequent" in (pair / "eagle" / "README.md").read_text()
    with pytest.raises(SystemExit):
        train_eagle.main(["--pair", str(pair), "--layout", "eagle3", "--draft-vocab", "20"])


# ---- --target: a target's own answers (speculative/demo/eagle_answers.py) ----------------------------


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_answer_losses_count_each_pass_against_the_token_it_drafts(layout) -> None:
    """Pass d's loss, cross-entropy and agreement at index p are the head's draft of token p + d + 1
    (the label at p + d), over the draft vocabulary: recomputed from ttt_hidden's full-vocabulary
    logits (-inf outside it) and the target's logits at p + d renormalised over the vocabulary (the
    KL), labels outside the vocabulary a miss, unlabelled positions out of all of them."""
    from speculative.demo.eagle_answers import answer_losses
    from speculative.demo.train_eagle import ttt_hidden

    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=6, seed=3).requires_grad_(False)
    vocabulary = torch.arange(0, 96, 2)  # the even tokens
    head = eagle_head(target, SIZES, layout, vocabulary)
    with torch.no_grad():  # off the identity start
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    head.pack_weights()
    depth, length = 3, 7
    tokens = torch.randint(1, 96, (2, length + depth), generator=torch.Generator().manual_seed(1))
    labels = torch.full_like(tokens, -100)
    labels[:, 2:-1] = tokens[:, 3:]  # the answer starts at token 3
    labels[1, 6] = -100  # and a gap
    with torch.no_grad():
        out = target(input_ids=tokens, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in head.target_layers], dim=-1)
        index = torch.full((96,), -1, dtype=torch.long)
        index[vocabulary] = torch.arange(len(vocabulary))
        out_losses = answer_losses(head, tokens, labels, features, depth, index)
        sums = out_losses["sums"]
        hiddens = ttt_hidden(head, features[:, :length], tokens, depth)
    kls = []
    for d, hidden in enumerate(hiddens, start=1):
        logits = head.head_logits(hidden)  # [2, length, 96], -inf at odd tokens
        wanted = labels[:, d : d + length]
        valid = wanted >= 0
        inside = valid & (wanted % 2 == 0)
        nll = F.cross_entropy(logits[inside], wanted[inside], reduction="sum")
        assert sums["positions"][d - 1] == valid.sum()
        assert torch.isclose(sums["nll"][d - 1], nll, rtol=1e-4)
        assert sums["agree"][d - 1] == (logits.argmax(-1) == wanted)[valid].sum()
        teacher = F.log_softmax(out.logits[:, d : d + length][valid][:, vocabulary], dim=-1)
        student = F.log_softmax(logits[valid][:, vocabulary], dim=-1)
        kls.append((teacher.exp() * (teacher - student)).sum(-1).mean())
    weights = [0.8**d for d in range(depth)]
    expected = sum(w * kl for w, kl in zip(weights, kls)) / sum(weights)
    assert torch.isclose(out_losses["loss"], expected, rtol=1e-4), (out_losses["loss"], expected)


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_the_recipe_on_a_targets_own_answers(chat_target, tmp_path, layout) -> None:
    """--target / --data, both layouts: a few steps on the target's answers lower the loss and the held-out
    cross-entropy; the head, its card and training.json are written; the features file serves a second
    (resumed) piece without the target, which starts where the first ended; through the engine greedy
    output is the target's alone."""

    root, out, features = chat_target, tmp_path / layout, tmp_path / "features.pt"
    argv = [
        "--target", str(root / "target"), "--data", str(root / "data"), "--out", str(out),
        "--layout", layout, "--steps", "30", "--intermediate", "64", "--batch-tokens", "1024",
        "--seq-len", "200", "--warmup", "1", "--lr", "3e-3", "--prompts", "2", "--new-tokens", "8",
        "--draft-vocab", "64", "--features", str(features),
    ]  # fmt: skip
    info = train_eagle.main(argv)
    assert info["steps"] == 30 and info["draft_vocabulary"] == 64 and features.is_file()
    trace = [loss for _, loss in info["loss_trace"]]
    assert sum(trace[-3:]) / 3 < 0.9 * sum(trace[:5]) / 5, trace  # batches differ: means
    before, after = info["heldout_before"], info["heldout_after"]
    assert before["positions"] == after["positions"] > 0
    assert sum(after["ce_per_depth"]) < sum(before["ce_per_depth"])  # (agreement: ~50 positions, noisy)
    card = (out / "README.md").read_text()
    assert f"{LAYOUT_NAMES[layout]} head for target" in card and "64 tokens most frequent" in card
    assert json.loads((out / "training.json").read_text())["steps"] == 30

    resumed = train_eagle.main([*argv[:8], "--steps", "5", *argv[10:], "--resume"])
    assert [p["steps"] for p in resumed["pieces"]] == [30, 5] and resumed["total"]["steps"] == 35
    # saved for the target's own features and trained on scaled ones (input_scale): the same head
    for name in ("agreement_per_depth", "ce_per_depth"):
        assert resumed["heldout_before"][name] == pytest.approx(after[name], abs=2e-4), name
    assert "in 2 pieces" in (out / "README.md").read_text()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[60, 61, 62, 63], [10, 20, 30, 40, 50, 60, 70]]
    alone = LLM(str(root / "target"), dtype="float32").generate(prompts, params)
    drafted = LLM(
        str(root / "target"),
        draft_model=str(out),
        speculative_config=SpeculativeConfig(method=layout),
        dtype="float32",
    ).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in alone]
    assert sum(o.metrics.num_drafted for o in drafted) > 0


def test_a_head_resumed_on_other_answers_keeps_its_draft_vocabulary(
    chat_target, tmp_path, monkeypatch
) -> None:
    """`--resume` on other answers (here the same ones with every byte shifted, so that their most
    frequent tokens differ) trains the saved head over its own draft vocabulary: while it trains, its
    lm_head rows are the target's at the tokens its d2t names, the first piece's; the card names each
    piece's data."""
    from speculative.demo import eagle_answers
    from speculative.demo.self_distill import read_answers
    from speculative.demo.train_draft import ANSWER_FILES
    from speculative.models.eagle_checkpoint import saved_draft_vocabulary

    root, out = chat_target, tmp_path / "head"
    other = tmp_path / "other"
    other.mkdir()
    for name in ANSWER_FILES:
        shifted = [
            {**a, "response": [(t + 50) % 256 for t in a["response"]]}
            for a in read_answers(root / "data" / name)
        ]
        (other / name).write_text("".join(json.dumps(a) + "\n" for a in shifted))
    argv = [
        "--target", str(root / "target"), "--out", str(out), "--layout", "eagle3", "--steps", "2",
        "--intermediate", "64", "--batch-tokens", "1024", "--seq-len", "200", "--warmup", "1",
        "--prompts", "1", "--new-tokens", "4", "--draft-vocab", "64",
    ]  # fmt: skip
    train_eagle.main([*argv, "--data", str(root / "data")])
    first = saved_draft_vocabulary(out)
    trained = []
    train_on_answers = eagle_answers.train_on_answers

    def seen(head, *args):
        trained.append((head.draft_vocabulary.clone(), head.lm_head.weight.detach().clone()))
        return train_on_answers(head, *args)

    monkeypatch.setattr(eagle_answers, "train_on_answers", seen)
    info = train_eagle.main([*argv, "--data", str(other), "--resume"])
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    [(vocabulary, rows)] = trained
    assert len(first) == info["draft_vocabulary"] == 64
    assert torch.equal(vocabulary, first) and torch.equal(rows, target.lm_head.weight[first])
    assert torch.equal(saved_draft_vocabulary(out), first)
    card = (out / "README.md").read_text()
    assert card.count("- Piece ") == 2 and f"in {other} (" in card and f"in {root / 'data'} (" in card


def test_target_features_are_kept_in_their_file(tmp_path) -> None:
    """A features file serves the same rows for the layers it holds (a subset sliced out) without the
    target; other rows or layers are computed again."""
    from speculative.demo.eagle_answers import target_features

    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=4, seed=3).requires_grad_(False)
    rows = [(torch.arange(1, n + 1), torch.full((n,), -100)) for n in (5, 9, 7)]
    path = tmp_path / "features.pt"
    written = target_features(target, rows, (1, 4), path)
    assert [f.shape for f in written] == [(5, 128), (9, 128), (7, 128)] and written[0].dtype == torch.bfloat16
    with torch.no_grad():
        alone = target(input_ids=rows[1][0][None], output_hidden_states=True).hidden_states
    expected = torch.cat([alone[1], alone[4]], -1)[0]
    assert (written[1].float() - expected).abs().max() < 0.02 * expected.abs().max()  # bfloat16's rounding

    class Broken(torch.nn.Module):
        config, model = target.config, None  # model(...) fails: the file must serve

    assert all(torch.equal(a, b) for a, b in zip(target_features(Broken(), rows, (1, 4), path), written))
    high = target_features(Broken(), rows, (4,), path)
    assert all(torch.equal(h, w[:, 64:]) for h, w in zip(high, written))
    with pytest.raises(TypeError):  # other rows: computed, by the broken target
        target_features(Broken(), rows[:2], (1, 4), path)


def test_the_target_recipe_needs_its_data_and_out(chat_target, tmp_path, capsys) -> None:
    target = str(chat_target / "target")
    for argv, message in (
        (["--target", target, "--out", str(tmp_path)], "--target needs --data"),
        (["--target", target, "--data", str(chat_target / "data")], "--target needs --out"),
        (["--pair", target, "--data", str(chat_target / "data")], "--data and --out are --target's"),
        (["--target", target, "--data", str(tmp_path), "--out", str(tmp_path / "o")], "holds 0 answers"),
        (["--target", target, "--data", "d", "--out", "o", "--generated", "3"], "are --pair's"),
    ):
        with pytest.raises(SystemExit) as stopped:
            train_eagle.main(argv)
        assert message in capsys.readouterr().err + str(stopped.value)
