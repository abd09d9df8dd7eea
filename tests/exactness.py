"""Greedy exactness checks shared by tests: token-identical, or a proven near-tie (bench/exactness.py)."""

from __future__ import annotations

import torch

from speculative.bench.exactness import compare


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The target decoding alone: Hugging Face's own greedy `generate`."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def assert_greedy_equal(model, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """got must equal expected, except after a first difference where the target's two best logits
    are within NEAR_TIE of each other and got picked one of them (bench/exactness.py's rule)."""
    verdict = compare(model, prompt, got, expected)
    assert verdict != "different", (
        f"greedy output differs, and not at a near-tie:\n got      {got}\n expected {expected}"
    )
