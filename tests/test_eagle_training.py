"""The demo recipe's EAGLE-1 head training (`python -m speculative.demo.train --eagle-steps N`), smoke
sized: the head learns, saves in the published layout, loads, and drafts exactly."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from exactness import hf_greedy
from safetensors.torch import load_file

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import train_eagle
from speculative.demo.train import SMOKE, eagle_head, eagle_loss, eagle_losses, heldout_loss, train_loop
from speculative.models.eagle_checkpoint import save_eagle_head


def test_a_trained_head_learns_saves_loads_and_stays_exact(tmp_path) -> None:
    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=2, seed=3).requires_grad_(False)
    head = eagle_head(target, {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2})
    prompts = torch.randint(2, 96, (16, 2), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the target's own text (sampled, temperature 0.5): what its head should learn
        torch.manual_seed(0)
        text = target.generate(
            prompts, do_sample=True, temperature=0.5, top_k=0, max_new_tokens=98, pad_token_id=0
        )
    stream, heldout = text[:12].flatten(), text[12:, :99].reshape(-1, 33)  # heldout: [12, 33] windows
    cfg = {"batch": 8, "seq_len": 32, "warmup": 2, "eval_every": 1000}

    def ce(model, windows):
        return eagle_losses(model, target, windows)[1]

    before = heldout_loss(head, heldout, 4, ce)
    record = train_loop(
        "eagle", head, lambda m, w: eagle_loss(m, target, w), stream, heldout, cfg, 150, 1e-2, 0, None, ce=ce
    )
    assert record["steps"] == 150 and record["final_heldout_ce"] < before - 0.2
    save_eagle_head(head, tmp_path / "eagle")
    assert not (tmp_path / "eagle" / "pytorch_model.bin").exists()
    llm = LLM(
        target,
        draft_model=str(tmp_path / "eagle"),
        speculative_config=SpeculativeConfig(method="eagle", num_speculative_tokens=3),
    )
    torch.testing.assert_close(
        llm.engine.proposer.head.state_dict()["fc.weight"], head.state_dict()["fc.weight"]
    )
    prompt = [5, 9, 13, 17]
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert output[0].outputs[0].token_ids == hf_greedy(target, prompt, 20, None)


def test_train_eagle_resumes_the_saved_head_and_adds_up_its_record(model_dirs, tmp_path) -> None:
    """`train_eagle --resume` trains the saved head further (starting from its weights) and appends
    to its training.json: steps, tokens and seconds summed over the pieces."""
    pair = tmp_path / "pair"
    pair.mkdir()
    for name in ("target", "draft"):
        (pair / name).symlink_to(model_dirs[name])
    argv = ["--pair", str(pair), "--smoke", "--prompts", "2"]
    first = train_eagle.main([*argv, "--steps", "2"])
    saved = load_file(pair / "eagle" / "model.safetensors")
    record = train_eagle.main([*argv, "--steps", "3", "--resume"])
    resumed = load_file(pair / "eagle" / "model.safetensors")
    assert set(resumed) == set(saved)
    changes = [(resumed[name] - saved[name]).abs().max().item() for name in saved]
    # moved by 2 steps at a learning rate of at most 3e-3 from the saved weights, not from a fresh head
    assert 0 < max(changes) < 0.02, changes
    assert json.loads((pair / "eagle" / "training.json").read_text()) == record
    assert [p["steps"] for p in record["pieces"]] == [2, 3] and record["pieces"][0] == first["pieces"][0]
    window = SMOKE["batch"] * SMOKE["seq_len"]
    assert (record["steps"], record["planned_steps"], record["tokens"]) == (5, 5, 5 * window)
    assert record["seconds"] == pytest.approx(sum(p["seconds"] for p in record["pieces"]), abs=0.1)
    assert record["final_heldout_ce"] == record["pieces"][1]["final_heldout_ce"]
    assert "--steps 2`, then `--resume --steps 3`" in (pair / "eagle" / "README.md").read_text()
