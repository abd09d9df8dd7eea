"""Greedy exactness of a method's output against the target's own greedy output.

An output is identical when it equals the reference token for token, or when, at the first difference,
the target's two best logits are within NEAR_TIE of each other and the output picked one of them (a
float near-tie that another kernel may break the other way). The tests hold outputs to the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEAR_TIE = 1e-4


@torch.no_grad()
def compare(hf_model, prompt: Sequence[int], got: Sequence[int], expected: Sequence[int]) -> str:
    """ "identical", "near_tie" (proven) or "different": `got` against the reference `expected`.

    hf_model: the target as a transformers model, whose logits decide near-ties.
    """
    got, expected = list(got), list(expected)
    if got == expected:
        return "identical"
    i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if i is None:  # one is a prefix of the other: lengths differ, no token to explain it
        return "different"
    ids = torch.tensor([list(prompt) + expected[:i]], device=hf_model.device)
    logits = hf_model(input_ids=ids).logits[0, -1].double()
    top2 = logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    return "near_tie" if gap < NEAR_TIE and got[i] in top2.indices.tolist() else "different"


def summarize(verdicts: Sequence[str]) -> dict:
    """identical_fraction counts proven near-ties as identical; near_ties says how many there were."""
    total = len(verdicts)
    same = sum(v in ("identical", "near_tie") for v in verdicts)
    return {
        "identical_fraction": same / total if total else None,
        "near_ties": verdicts.count("near_tie"),
        "different": verdicts.count("different"),
        "num_outputs": total,
    }
