"""Tests for speculative.acceptance: greedy, lossless rejection sampling, typical acceptance."""

from __future__ import annotations

import math

import pytest
import torch
from acceptance_rules import GreedyAcceptance
from scipy.stats import chisquare

from speculative.acceptance import (
    AcceptanceRule,
    RejectionSampler,
    TypicalAcceptanceSampler,
    greedy_accept,
    rejection_sample,
)

I64 = torch.int64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _one_hot_probs(ids: torch.Tensor, v: int) -> torch.Tensor:  # ids [B, n] -> [B, n, V]
    return torch.zeros(*ids.shape, v).scatter_(-1, ids.unsqueeze(-1), 1.0)


def _ids_excluding(exclude: torch.Tensor, v: int, g: torch.Generator) -> torch.Tensor:
    """Random ids in [0, V) that differ from ``exclude`` elementwise."""
    offset = torch.randint(1, v, exclude.shape, generator=g)
    return (exclude + offset) % v


# ----------------------------------------------------------------------------- greedy


def test_greedy_all_match_gives_bonus():
    target = torch.tensor([[5, 6, 7, 8]])
    out = greedy_accept(target, torch.tensor([[5, 6, 7]]))
    assert out.dtype == I64
    assert out.tolist() == [[5, 6, 7, 8]]


@pytest.mark.parametrize("m", [0, 1, 2])
def test_greedy_first_mismatch(m):
    target = torch.tensor([[5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7]])
    draft[0, m] = 1
    if m + 1 < 3:
        draft[0, m + 1] = 9  # anything after the mismatch is irrelevant
    expected = [5, 6, 7][:m] + [[5, 6, 7][m]] + [-1] * (3 - m)
    assert greedy_accept(target, draft).tolist() == [expected]


def test_greedy_batch_rows_differ_and_minus_one_draft():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[1, 2, 3], [0, 2, 3], [1, 2, 0], [1, -1, 3]])
    assert greedy_accept(target, draft).tolist() == [
        [1, 2, 3, 4],
        [1, -1, -1, -1],
        [1, 2, 3, -1],
        [1, 2, -1, -1],
    ]


# ----------------------------------------------------------------------------- rejection, exact


def test_rejection_q_equals_p_accepts_all():
    g = _gen(0)
    b, k, v = 16, 3, 10
    probs = torch.rand(b, k + 1, v, generator=g)
    probs /= probs.sum(-1, keepdim=True)
    draft = torch.multinomial(probs[:, :k].reshape(-1, v), 1, generator=g).view(b, k)
    bonus = torch.randint(0, v, (b, 1), generator=g)
    out = RejectionSampler(strict_mode=True)(probs, bonus, probs[:, :k].clone(), draft, generator=g)
    assert out.dtype == I64 and out.shape == (b, k + 1)
    assert torch.equal(out, torch.cat([draft, bonus], 1))


def test_rejection_zero_target_mass_recovers_from_residual():
    b, v = 64, 5
    q = torch.tensor([0.0, 0.4, 0.6, 0.0, 0.0]).expand(b, 1, v)
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]).expand(b, 1, v)
    draft = torch.zeros(b, 1, dtype=I64)
    bonus = torch.full((b, 1), 4, dtype=I64)
    u = torch.ones(b, 1) - torch.rand(b, 1, generator=_gen(1))
    noise = torch.empty(b, v).exponential_(generator=_gen(2))
    out = rejection_sample(q, bonus, p, draft, u, noise)
    # residual max(0, q - p) = [0, 0, 0.6, 0, 0]: token 1 (in q's support) must never appear
    assert (out[:, 0] == 2).all() and (out[:, 1] == -1).all()


def test_rejection_zero_target_mass_at_every_draft():
    b, k, v = 8, 3, 6
    g = _gen(3)
    q = torch.zeros(b, k, v)
    q[..., 4:] = 0.5  # q lives on {4, 5}
    draft = torch.randint(0, 4, (b, k), generator=g)
    p = _one_hot_probs(draft, v)
    noise = torch.empty(b, v).exponential_(generator=g)
    u = torch.ones(b, k)  # u = 1 is the most lenient uniform
    out = rejection_sample(q, torch.zeros(b, 1, dtype=I64), p, draft, u, noise)
    assert ((out[:, 0] == 4) | (out[:, 0] == 5)).all()
    assert (out[:, 1:] == -1).all()
    assert torch.equal(out, rejection_sample(q, torch.zeros(b, 1, dtype=I64), None, draft, u, noise))


def test_rejection_deterministic_drafter_certain_target_accepts():
    b, v = 4, 7
    draft = torch.tensor([[1, 2], [3, 4], [5, 6], [0, 0]])
    target = _one_hot_probs(torch.cat([draft, torch.zeros(b, 1, dtype=I64)], 1), v)
    bonus = torch.tensor([[6], [5], [4], [3]])
    out = RejectionSampler()(target, bonus, None, draft, generator=_gen(4))
    assert torch.equal(out, torch.cat([draft, bonus], 1))


def test_rejection_minus_one_draft_recovers_from_q():
    q = torch.tensor([[[0.6, 0.4, 0.0, 0.0]]])
    p = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    bonus = torch.tensor([[3]])
    draft = torch.tensor([[-1]])
    noise = torch.ones(1, 4)
    # With p taken as 0 the residual is q itself (argmax 0); had p been used it would be token 1.
    assert rejection_sample(q, bonus, p, draft, torch.ones(1, 1), noise).tolist() == [[0, -1]]
    assert rejection_sample(q, bonus, None, draft, torch.ones(1, 1), noise).tolist() == [[0, -1]]


def test_rejection_all_zero_residual_falls_back_to_q():
    q = torch.tensor([[[0.3, 0.2, 0.0]]])  # not normalised: q <= p everywhere
    p = torch.tensor([[[0.5, 0.5, 0.0]]])
    out = rejection_sample(
        q, torch.tensor([[2]]), p, torch.tensor([[0]]), torch.ones(1, 1), torch.tensor([[1.0, 0.1, 1.0]])
    )
    assert out.tolist() == [[1, -1]]


def test_rejection_deterministic_given_randomness():
    g = _gen(5)
    b, k, v = 32, 4, 12
    target = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    p = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    draft = torch.multinomial(p.reshape(-1, v), 1, generator=g).view(b, k)
    bonus = torch.randint(0, v, (b, 1), generator=g)
    u = 1 - torch.rand(b, k, generator=g)
    noise = torch.empty(b, v).exponential_(generator=g)
    sampler = RejectionSampler(strict_mode=True)
    a = sampler(target, bonus, p, draft, uniform_samples=u, recovery_noise=noise)
    assert torch.equal(a, sampler(target, bonus, p, draft, uniform_samples=u, recovery_noise=noise))
    assert torch.equal(a, rejection_sample(target[:, :k], bonus, p, draft, u, noise))
    s1 = sampler(target, bonus, p, draft, generator=_gen(9))
    assert torch.equal(s1, sampler(target, bonus, p, draft, generator=_gen(9)))
    # output layout: accepted drafts, one token, then -1
    n_acc = (a[:, :k] == draft).to(I64).cumprod(1).sum(1)
    for row in range(b):
        assert (a[row, n_acc[row] + 1 :] == -1).all() and a[row, n_acc[row]] >= 0


# ----------------------------------------------------------------------------- rejection, statistical

N = 20_000
V = 8


def _dirichlet(shape, g):
    """Dirichlet(1, ..., 1) rows: normalised Exp(1) draws (seeded by ``g``)."""
    e = -torch.log(1 - torch.rand(*shape, generator=g, dtype=torch.float64))
    return (e / e.sum(-1, keepdim=True)).float()


def _speculate(k, seed, draft_probs_kind="random"):
    """N independent rows of one verification step with context-independent q and p."""
    g = _gen(seed)
    q = _dirichlet((k + 1, V), g)  # [k+1, V]
    p = _dirichlet((k, V), g)  # [k, V]
    draft = torch.multinomial(p.repeat(N, 1), 1, replacement=True, generator=g).view(N, k)
    draft_probs = p.expand(N, k, V)
    if draft_probs_kind == "none":
        draft = torch.randint(0, V, (N, k), generator=g)  # deterministic drafter: any fixed token
        draft_probs = None
    elif draft_probs_kind == "minus_one":
        draft = torch.full((N, k), -1, dtype=I64)
    bonus = torch.multinomial(q[k].expand(N, V), 1, replacement=True, generator=g)
    out = RejectionSampler(strict_mode=True)(q.expand(N, k + 1, V), bonus, draft_probs, draft, generator=g)
    return q, p, draft, out, g


def _pvalue(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("k", [1, 3])
def test_first_token_distribution_is_target(k):
    q, _, draft, out, g = _speculate(k, seed=10 + k)
    assert _pvalue(out[:, 0], q[0]) > 1e-3

    # Broken rule 1: accept every draft -> first token ~ p_1.
    assert _pvalue(draft[:, 0], q[0]) < 1e-6
    # Broken rule 2: same acceptance, but recovered token drawn from q_1 instead of the residual.
    accepted0 = out[:, 0] == draft[:, 0]
    from_q = torch.multinomial(q[0].expand(N, V), 1, replacement=True, generator=g).squeeze(1)
    broken = torch.where(accepted0, draft[:, 0], from_q)
    assert _pvalue(broken, q[0]) < 1e-6


@pytest.mark.parametrize("kind", ["none", "minus_one"])
def test_first_token_distribution_without_draft_probs(kind):
    q, _, _, out, _ = _speculate(2, seed=20, draft_probs_kind=kind)
    assert _pvalue(out[:, 0], q[0]) > 1e-3
    if kind == "minus_one":
        assert (out[:, 1:] == -1).all()


def test_pair_distribution_k2():
    k = 2
    q, p, draft, out, g = _speculate(k, seed=30)
    t1, t2 = out[:, 0], out[:, 1]
    has_second = t2 >= 0
    # Where this step stopped after one token, the next step (context-independent q) would
    # emit the second from q_2: the completed pair must be distributed as q_1(x) * q_2(y).
    next_step = torch.multinomial(q[1].expand(N, V), 1, replacement=True, generator=g).squeeze(1)
    t2_full = torch.where(has_second, t2, next_step)
    joint = torch.outer(q[0], q[1]).flatten()  # all V*V cells enumerated
    assert _pvalue(t1 * V + t2_full, joint) > 1e-3
    # Given that this step produced a second token (position 1 accepted: P = min(p_1, q_1)(x)),
    # that token is still exactly q_2, independent of the first.
    cond = torch.outer(torch.minimum(p[0], q[0]), q[1]).flatten()
    assert _pvalue(t1[has_second] * V + t2[has_second], cond) > 1e-3
    # Third slot: only the bonus (after two accepts), which is drawn from q_3 here.
    has_third = out[:, 2] >= 0
    assert torch.equal(has_third, (out[:, :k] == draft).all(1))
    assert _pvalue(out[has_third, 2], q[2]) > 1e-3


# ----------------------------------------------------------------------------- typical acceptance

B, K, VT = 5, 3, 1000


def _typical(threshold=0.03, alpha=0.9, strict=True):
    return TypicalAcceptanceSampler(threshold, alpha, strict_mode=strict)


@pytest.mark.parametrize("seed", range(3))
def test_typical_one_hot_target_rejects_all(seed):
    g = _gen(seed)
    argmax = torch.randint(0, VT, (B, K + 1), generator=g)
    target = _one_hot_probs(argmax, VT)
    draft = _ids_excluding(argmax[:, :K], VT, g)
    bonus = torch.randint(0, VT, (B, 1), generator=g)
    out = _typical()(target, bonus, None, draft)
    assert out.shape == (B, K + 1) and out.dtype == I64
    assert torch.equal(out[:, 0], argmax[:, 0])
    assert (out[:, 1:] == -1).all()


@pytest.mark.parametrize("normalised", [True, False])
def test_typical_high_entropy_accepts_all(normalised):
    g = _gen(1)
    if normalised:
        target = torch.full((B, K + 1, VT), 1.0 / VT)
    else:  # vLLM's test: unnormalised torch.rand, whose "entropy" is huge
        target = torch.rand(B, K + 1, VT, generator=g)
    draft = torch.randint(0, VT, (B, K), generator=g)
    bonus = torch.randint(0, VT, (B, 1), generator=g)
    out = _typical()(target, bonus, None, draft)
    assert torch.equal(out, torch.cat([draft, bonus], 1))


def test_typical_mixed_rows():
    g = _gen(2)
    argmax = torch.randint(0, VT, (4, K + 1), generator=g)
    target = _one_hot_probs(argmax, VT)
    target[[1, 3]] = 1.0 / VT
    draft = _ids_excluding(argmax[:, :K], VT, g)
    bonus = torch.randint(0, VT, (4, 1), generator=g)
    out = _typical()(target, bonus, None, draft)
    assert torch.equal(out[[0, 2], 0], argmax[[0, 2], 0]) and (out[[0, 2], 1:] == -1).all()
    assert torch.equal(out[[1, 3]], torch.cat([draft, bonus], 1)[[1, 3]])


def test_typical_zero_threshold_and_alpha_accepts_all():
    g = _gen(3)
    argmax = torch.randint(0, VT, (B, K + 1), generator=g)
    target = _one_hot_probs(argmax, VT)
    target[target == 0] = 1e-5
    draft = _ids_excluding(argmax[:, :K], VT, g)
    bonus = torch.randint(0, VT, (B, 1), generator=g)
    assert (_typical()(target, bonus, None, draft)[:, 1:] == -1).all()
    out = _typical(0.0, 0.0)(target, bonus, None, draft)
    assert torch.equal(out, torch.cat([draft, bonus], 1))


@pytest.mark.parametrize("m", range(K + 1))
def test_typical_partial_acceptance(m):
    g = _gen(40 + m)
    k = K
    draft = torch.randint(0, VT, (B, k), generator=g)
    best = _ids_excluding(draft, VT, g)  # a different argmax at rejected positions
    target = torch.full((B, k + 1, VT), 0.01 / (VT - 2))
    rows = torch.arange(B)
    for i in range(k):
        if i < m:  # draft is the clear favourite: accepted
            target[rows, i, draft[:, i]] = 0.99
        else:  # draft has tiny mass, `best` is the favourite: rejected
            target[rows, i, best[:, i]] = 0.99
    bonus = torch.randint(0, VT, (B, 1), generator=g)
    out = _typical()(target, bonus, None, draft)
    assert torch.equal(out[:, :m], draft[:, :m])
    replacement = bonus[:, 0] if m == k else best[:, m]
    assert torch.equal(out[:, m], replacement)
    if m < k:
        assert torch.equal(replacement, target[:, m].argmax(-1))
    assert (out[:, m + 1 :] == -1).all()


def test_typical_non_default_thresholds():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    h = -sum(float(x) * math.log(float(x) + 1e-5) for x in q)
    target = q.expand(1, 2, 4).clone()
    draft, bonus = torch.tensor([[1]]), torch.tensor([[3]])

    def run(threshold, alpha):
        return TypicalAcceptanceSampler(threshold, alpha, strict_mode=True)(target, bonus, None, draft)

    assert run(0.25, 10.0).tolist() == [[1, 3]]  # threshold = 0.25 < 0.3
    assert run(0.35, 10.0).tolist() == [[0, -1]]  # threshold = 0.35 > 0.3: argmax emitted
    assert run(1.0, 0.29 * math.exp(h)).tolist() == [[1, 3]]  # alpha * exp(-H) = 0.29
    assert run(1.0, 0.31 * math.exp(h)).tolist() == [[0, -1]]  # alpha * exp(-H) = 0.31
    assert run(0.3, 10.0).tolist() == [[0, -1]]  # strict inequality: q(x) == threshold rejects


def test_typical_minus_one_draft_rejected():
    target = torch.tensor([0.2, 0.2, 0.4, 0.2]).expand(2, 3, 4)
    draft = torch.tensor([[-1, 1], [1, -1]])
    bonus = torch.tensor([[0], [0]])
    out = _typical(0.0, 0.0)(target, bonus, None, draft)
    assert out.tolist() == [[2, -1, -1], [1, 2, -1]]


def test_typical_is_deterministic():
    g = _gen(7)
    target = torch.softmax(torch.randn(B, K + 1, 50, generator=g) * 3, -1)
    draft = torch.randint(0, 50, (B, K), generator=g)
    bonus = torch.randint(0, 50, (B, 1), generator=g)
    s = _typical()
    assert torch.equal(s(target, bonus, None, draft), s(target, bonus, None, draft))


# ----------------------------------------------------------------------------- strict mode / ctor


def _valid_inputs(b=3, k=2, v=6):
    g = _gen(11)
    target = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    draft_probs = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    draft = torch.randint(0, v, (b, k), generator=g)
    bonus = torch.randint(0, v, (b, 1), generator=g)
    return dict(target=target, bonus=bonus, draft_probs=draft_probs, draft=draft)


SAMPLERS = {
    "rejection": lambda: RejectionSampler(strict_mode=True),
    "typical": lambda: TypicalAcceptanceSampler(0.03, 0.9, strict_mode=True),
}


def _replace(key, fn):
    return lambda d: d.update({key: fn(d[key])})


def _poke(key, index, value):
    return lambda d: d[key].__setitem__(index, value)


BAD_CASES = [  # (id, mutation of valid inputs, exception type, message pattern)
    (
        "draft_shape",
        _replace("draft", lambda t: t[:, :1]),
        ValueError,
        r"draft_token_ids must have shape \[3, 2\]",
    ),
    (
        "bonus_shape",
        _replace("bonus", lambda t: t[:, 0]),
        ValueError,
        r"bonus_token_ids must have shape \[3, 1\]",
    ),
    (
        "batch_mismatch",
        _replace("bonus", lambda t: t[:2]),
        ValueError,
        r"bonus_token_ids must have shape \[3, 1\].*got \[2, 1\]",
    ),
    (
        "draft_probs_vocab",
        _replace("draft_probs", lambda t: t[..., :5]),
        ValueError,
        r"draft_probs must have shape \[3, 2, 6\]",
    ),
    ("target_ndim", _replace("target", lambda t: t[0]), ValueError, r"target_with_bonus_probs must be 3-D"),
    (
        "draft_dtype",
        _replace("draft", lambda t: t.int()),
        TypeError,
        r"draft_token_ids must have dtype torch.int64",
    ),
    (
        "bonus_dtype",
        _replace("bonus", lambda t: t.float()),
        TypeError,
        r"bonus_token_ids must have dtype torch.int64",
    ),
    (
        "target_dtype",
        _replace("target", lambda t: t.long()),
        TypeError,
        r"target_with_bonus_probs must have a floating-point dtype",
    ),
    (
        "draft_probs_dtype",
        _replace("draft_probs", lambda t: t.long()),
        TypeError,
        r"draft_probs must have a floating-point dtype",
    ),
    ("draft_above", _poke("draft", (0, 0), 6), ValueError, r"draft_token_ids must lie in \[-1, 6\)"),
    ("draft_below", _poke("draft", (0, 0), -2), ValueError, r"draft_token_ids must lie in \[-1, 6\)"),
    ("bonus_above", _poke("bonus", (0, 0), 7), ValueError, r"bonus_token_ids must lie in \[0, 6\)"),
    ("bonus_below", _poke("bonus", (0, 0), -1), ValueError, r"bonus_token_ids must lie in \[0, 6\)"),
    (
        "target_nan",
        _poke("target", (0, 0, 0), float("nan")),
        ValueError,
        r"target_with_bonus_probs contains non-finite",
    ),
    (
        "target_negative",
        _poke("target", (0, 0, 0), -0.1),
        ValueError,
        r"target_with_bonus_probs contains negative",
    ),
]


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_strict_mode_errors(sampler, case):
    _, mutate, exc, pattern = case
    d = _valid_inputs()
    SAMPLERS[sampler]()(d["target"], d["bonus"], d["draft_probs"], d["draft"])  # valid: fine
    mutate(d)
    with pytest.raises(exc, match=pattern):
        SAMPLERS[sampler]()(d["target"], d["bonus"], d["draft_probs"], d["draft"])


def test_strict_mode_rejection_randomness_checks():
    d = _valid_inputs()
    s = RejectionSampler(strict_mode=True)
    with pytest.raises(ValueError, match=r"uniform_samples must have shape \[3, 2\]"):
        s(d["target"], d["bonus"], None, d["draft"], uniform_samples=torch.rand(3, 3))
    with pytest.raises(ValueError, match=r"uniform_samples must lie in \(0, 1\]"):
        s(d["target"], d["bonus"], None, d["draft"], uniform_samples=torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"recovery_noise must have shape \[3, 6\]"):
        s(d["target"], d["bonus"], None, d["draft"], recovery_noise=torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"draft_probs contains negative"):
        s(d["target"], d["bonus"], -d["draft_probs"], d["draft"])


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_strict_mode_device_mismatch(sampler):
    d = _valid_inputs()
    with pytest.raises(ValueError, match=r"bonus_token_ids is on meta but target_with_bonus_probs is on cpu"):
        SAMPLERS[sampler]()(d["target"], d["bonus"].to("meta"), d["draft_probs"], d["draft"])


def test_strict_mode_off_skips_checks():
    d = _valid_inputs()
    d["bonus"][0, 0] = 99  # out of range, but not checked: it is passed through as the bonus
    d["draft"][0] = d["target"][0, :2].argmax(-1)
    out = TypicalAcceptanceSampler(0.0, 0.0)(d["target"], d["bonus"], None, d["draft"])
    assert out[0, -1] == 99


@pytest.mark.parametrize(
    "threshold, alpha, pattern",
    [
        (-0.1, 0.9, r"posterior_threshold must be in \[0, 1\]"),
        (1.5, 0.9, r"posterior_threshold must be in \[0, 1\]"),
        (float("nan"), 0.9, r"posterior_threshold must be in \[0, 1\]"),
        (0.03, -1.0, r"posterior_alpha must be >= 0"),
        (0.03, float("nan"), r"posterior_alpha must be >= 0"),
    ],
)
def test_typical_constructor_range_errors(threshold, alpha, pattern):
    with pytest.raises(ValueError, match=pattern):
        TypicalAcceptanceSampler(threshold, alpha)


def test_typical_constructor_accepts_bounds():
    TypicalAcceptanceSampler(0.0, 0.0)
    TypicalAcceptanceSampler(1.0, 5.0, strict_mode=True)


# ---- the AcceptanceRule protocol: what the engine is given -------------------------------------------


def _strategy(temperatures: list[float], vocab: int, seed: int = 0):
    from speculative.sampling import SampleStrategy
    from speculative.sampling_params import SamplingParams

    params = [SamplingParams(temperature=t, seed=seed + row) for row, t in enumerate(temperatures)]
    generators = [torch.Generator().manual_seed(seed + row) for row in range(len(params))]
    return SampleStrategy(params, vocab, torch.device("cpu"), torch.Generator(), generators=generators)


@pytest.mark.parametrize(
    "rule", [GreedyAcceptance(), RejectionSampler(), TypicalAcceptanceSampler(0.09, 0.3)]
)
def test_every_rule_is_an_acceptance_rule_with_the_output_layout(rule):
    assert isinstance(rule, AcceptanceRule)
    assert rule.lossless == (not isinstance(rule, TypicalAcceptanceSampler))
    logits = torch.randn(3, 4, 11, generator=_gen(0))  # [B, k + 1, V]
    drafts = torch.tensor([[1, 2, 3], [-1, -1, -1], [logits[2, 0].argmax().item(), 5, -1]])
    out = rule.verify(logits, drafts, None, _strategy([0.0] * 3, 11), None)
    assert out.shape == (3, 4) and out.dtype == I64
    for row in out.tolist():  # accepted drafts, one more token, then -1
        n = sum(t >= 0 for t in row)
        assert n >= 1 and all(t >= 0 for t in row[:n]) and all(t == -1 for t in row[n:])


def test_lossless_rules_on_a_greedy_batch_keep_the_drafts_equal_to_the_processed_argmax():
    logits = torch.randn(2, 4, 9, generator=_gen(1))
    argmax = logits.argmax(-1)  # [B, k + 1]
    drafts = torch.stack([argmax[0, :3], torch.tensor([argmax[1, 0], (argmax[1, 1] + 1) % 9, argmax[1, 2]])])
    want = greedy_accept(argmax, drafts)
    assert want[1].tolist() == [argmax[1, 0].item(), argmax[1, 1].item(), -1, -1]
    for rule in (GreedyAcceptance(), RejectionSampler()):
        assert torch.equal(rule.verify(logits, drafts, None, _strategy([0.0, 0.0], 9), None), want)


def test_greedy_acceptance_refuses_a_sampled_row():
    with pytest.raises(ValueError, match="temperature 0"):
        GreedyAcceptance().verify(torch.randn(1, 2, 5), torch.tensor([[1]]), None, _strategy([0.8], 5), None)


def test_rejection_rule_draws_from_each_rows_own_generator():
    """A row's draws come from its own generator (bonus, uniforms, noise in that order): the same
    row alone or beside another gives the same tokens."""
    logits = torch.randn(2, 4, 13, generator=_gen(2))
    drafts = torch.randint(0, 13, (2, 3), generator=_gen(3))
    draft_probs = torch.softmax(torch.randn(2, 3, 13, generator=_gen(4)), -1)
    both = RejectionSampler().verify(logits, drafts, draft_probs, _strategy([1.0, 1.0], 13, seed=7), None)
    alone = RejectionSampler().verify(
        logits[1:], drafts[1:], draft_probs[1:], _strategy([1.0], 13, seed=8), None
    )
    assert torch.equal(both[1:], alone)


def test_engine_takes_its_rule():
    """The engine verifies through the rule it is given: greedy acceptance gives the default's tokens,
    a rule that rejects every draft gives them too, one target token a step."""
    from conftest import noisy_copy, tiny_model

    from speculative import LLM, SamplingParams, SpeculativeConfig

    class RejectAll:
        lossless = True

        def verify(self, logits, draft_token_ids, draft_probs, strategy, context):
            first = strategy.argmax(logits[:, :1], context)  # [B, 1]: the target's own first token
            return torch.cat([first, torch.full_like(draft_token_ids, -1)], dim=1)

    target = tiny_model("llama")
    llm = LLM(
        target,
        draft_model=noisy_copy(target, 0.02),
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = llm.generate([[3, 4, 5]], params)[0].outputs[0].token_ids
    for rule in (GreedyAcceptance(), RejectAll()):
        llm.engine.rule = rule
        out = llm.generate([[3, 4, 5]], params)[0]
        assert out.outputs[0].token_ids == want
    assert out.metrics.num_accepted == 0 and out.metrics.num_steps == 11
