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
from speculative.demo.train_eagle import eagle_head, ttt_loss, ttt_losses
from speculative.models.eagle_checkpoint import save_eagle_head

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


def test_train_eagle_resumes_the_saved_head_and_adds_up_its_record(model_dirs, tmp_path) -> None:
    """`train_eagle --resume` trains the saved head further (starting from its weights) and appends
    to its training.json: steps, tokens and seconds summed over the pieces; each piece's card line
    names its data (the resumed one's half the target's own continuations, `--generated`)."""
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
