"""Greedy exactness checks shared by tests: token-identical, or a proven near-tie (DESIGN.md section 7)."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The target decoding alone: Hugging Face's own greedy `generate`."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long))
    return out[0, len(prompt):].tolist()


def assert_greedy_equal(model, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """got must equal expected, except after a first difference where the target's two best logits
    are within NEAR_TIE of each other and got picked one of them."""
    if got == expected:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    assert i < min(len(got), len(expected)), f"lengths differ without a token difference: {got} vs {expected}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + expected[:i]])).logits[0, -1].double()
    top2 = logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    assert gap < NEAR_TIE and got[i] in top2.indices.tolist(), (
        f"greedy output differs at token {i}: got {got[i]}, expected {expected[i]}; "
        f"top-2 logit gap {gap:.3g} is no near-tie\n got      {got}\n expected {expected}")
