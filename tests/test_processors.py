"""Each logits processor against a reference computed by hand on small logits."""

from __future__ import annotations

import math

import torch

from speculative import SamplingParams
from speculative.sampling import processors as P
from speculative.sampling.context import TokenContext
from speculative.sampling.strategy import SampleStrategy

V = 6


def context(prompt: list[int], output: list[int], block: list[int]) -> TokenContext:
    tokens = torch.tensor([prompt + output + [0] * 8])
    return TokenContext(
        tokens,
        torch.tensor([len(prompt) + len(output)]),
        torch.tensor([len(prompt)]),
        torch.tensor([block], dtype=torch.long).reshape(1, len(block)),
        V,
    )


def test_penalties_use_each_positions_own_context() -> None:
    ctx = context(prompt=[0, 1], output=[2, 2], block=[3])  # position 1 also sees the draft 3
    logits = torch.tensor([[[1.0, -1.0, 2.0, 0.5, -0.5, 3.0]] * 2])
    out = P.apply_penalties(
        logits,
        ctx,
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        repetition=torch.tensor([2.0]),
    )
    # position 0: seen {0, 1, 2}; output counts {2: 2}
    assert torch.allclose(out[0, 0], torch.tensor([0.5, -2.0, 1.0 - 0.5 - 0.5, 0.5, -0.5, 3.0]))
    # position 1: seen {0, 1, 2, 3}; output counts {2: 2, 3: 1}
    assert torch.allclose(out[0, 1], torch.tensor([0.5, -2.0, 0.0, 0.25 - 0.25 - 0.5, -0.5, 3.0]))


def test_min_tokens_bans_stops_until_enough_tokens() -> None:
    ctx = context(prompt=[0], output=[4], block=[5, 5])  # generated: 1, 2, 3 at positions 0, 1, 2
    logits = torch.zeros(1, 3, V)
    out = P.apply_min_tokens(logits, ctx, min_tokens=torch.tensor([3]), stop_ids=torch.tensor([[1, 3, -1]]))
    assert out[0, 0, 1] == out[0, 0, 3] == out[0, 1, 1] == -math.inf
    assert out[0, 2].isfinite().all() and out[0, 0, 0] == 0


def test_bad_words_ban_the_last_token_after_the_prefix() -> None:
    ctx = context(prompt=[0, 4], output=[2], block=[4])  # contexts end ...2 then ...2, 4
    logits = torch.zeros(1, 2, V)
    out = P.apply_bad_words(logits, ctx, [(torch.tensor([0]), [4, 5]), (torch.tensor([0]), [3])])
    assert out[0, 0, 5] == 0 and out[0, 1, 5] == -math.inf  # "4 5" banned only after a 4
    assert (out[0, :, 3] == -math.inf).all()  # a one-token word is banned everywhere


def test_allowed_bias_min_p_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.15, 0.1, 0.05, 0.0001]]]))
    allowed = P.apply_allowed(logits, torch.tensor([[True, True, False, True, True, True]]))
    assert allowed[0, 0, 2] == -math.inf and allowed[0, 0, 0] == logits[0, 0, 0]
    min_p = P.apply_min_p(logits, torch.tensor([0.3]))  # threshold 0.3 * 0.4 = 0.12
    assert min_p[0, 0, :3].isfinite().all() and (min_p[0, 0, 3:] == -math.inf).all()
    top_k = P.apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert top_k[0, 0, :2].isfinite().all() and (top_k[0, 0, 2:] == -math.inf).all()
    top_p = P.apply_top_k_top_p(logits, torch.tensor([V]), torch.tensor([0.69]))  # 0.4 + 0.3 reach 0.69
    assert top_p[0, 0, :2].isfinite().all() and (top_p[0, 0, 2:] == -math.inf).all()
    both = P.apply_top_k_top_p(
        logits, torch.tensor([3]), torch.tensor([0.8])
    )  # top-3 renormalised: .47 .35 .18
    assert both[0, 0, :2].isfinite().all() and (both[0, 0, 2:] == -math.inf).all()


def test_strategy_order_and_greedy_after_processing() -> None:
    """allowed -> bias -> penalties -> temperature, and greedy takes the argmax after them."""
    params = SamplingParams(
        temperature=0.5, allowed_token_ids=[0, 1, 2], logit_bias={1: 1.0}, repetition_penalty=2.0
    )
    strategy = SampleStrategy([params], V, "cpu")
    ctx = context(prompt=[0], output=[], block=[])
    logits = torch.tensor([[[2.0, 0.5, 0.2, 9.0, 0.0, 0.0]]])
    expected = torch.tensor([1.0, 1.5, 0.2, -math.inf, -math.inf, -math.inf]) / 0.5
    assert torch.allclose(strategy.probs(logits, ctx)[0, 0], expected.softmax(-1))
    greedy = SampleStrategy(
        [
            SamplingParams(
                temperature=0, allowed_token_ids=[0, 1, 2], logit_bias={1: 1.0}, repetition_penalty=2.0
            )
        ],
        V,
        "cpu",
    )
    assert greedy.argmax(logits, ctx).item() == 1  # 3 is not allowed, 0 is penalised below 1


def test_user_logits_processors_see_each_positions_output() -> None:
    seen = []

    def two_args(output, logits):
        seen.append(list(output))
        return logits + torch.arange(V, dtype=logits.dtype)

    def three_args(prompt, output, logits):
        assert prompt == [0, 1]
        return logits

    strategy = SampleStrategy(
        [SamplingParams(temperature=1.0, logits_processors=[two_args, three_args])], V, "cpu"
    )
    out = strategy.process(torch.zeros(1, 3, V), context(prompt=[0, 1], output=[2], block=[4, 5]))
    assert seen == [[2], [2, 4], [2, 4, 5]]
    assert torch.equal(out[0, 1], torch.arange(V, dtype=torch.float32))
