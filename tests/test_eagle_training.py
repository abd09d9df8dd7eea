"""The demo recipe's EAGLE-1 head training (`python -m speculative.demo.train --eagle-steps N`), smoke
sized: the head learns, saves in the published layout, loads, and drafts exactly."""

from __future__ import annotations

import torch
from conftest import tiny_model
from exactness import hf_greedy

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo.train import eagle_head, eagle_loss, eagle_losses, heldout_loss, train_loop
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
