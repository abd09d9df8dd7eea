"""Tests for speculative.acceptance.tree: greedy, lossless and typical acceptance over token trees.

The lossless tests compare sampled blocks with probabilities enumerated exactly from the target: the
target's distribution after a path is a fixed function of the path's tokens (a table), each emitted
block is completed to a fixed length by sampling the target itself after it, and the completed
sequences must follow q(a) q(b | a) q(c | a, b). Broken variants of the rule fail the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from acceptance_rules import GreedyAcceptance
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

import speculative.acceptance.tree as tree_module
from speculative.acceptance import (
    AcceptanceRule,
    RejectionSampler,
    TypicalAcceptanceSampler,
    greedy_accept,
    rejection_sample,
    tree_greedy_accept,
    tree_rejection_sample,
    tree_typical_accept,
    typical_accept,
)
from speculative.tree import check_tree

I64 = torch.int64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=I64)


def _chain(b: int, k: int) -> torch.Tensor:
    return torch.arange(-1, k).expand(b, k + 1).clone()


def _random_trees(b: int, m: int, v: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """b random trees of up to m nodes (padding at the end of a row): (tokens, parents), [b, m] each."""
    real = torch.randint(1, m + 1, (b, 1), generator=g)  # nodes per row, root included
    index = torch.arange(m)
    parents = (torch.rand(b, m, generator=g) * index).floor().to(I64)  # uniform in [0, i)
    parents = torch.where((index < real) & (index > 0), parents, -1)
    tokens = torch.where(index < real, torch.randint(0, v, (b, m), generator=g), -1)
    return tokens, parents


def _python_walk(choose, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Reference walk of one row: `choose(node, children)` returns (accepted child or None, token)."""
    node, path, emitted = 0, [0], []
    while True:
        children = [j for j in range(len(parents)) if parents[j] == node and tokens[j] >= 0]
        child, token = choose(node, children)
        if child is None:
            emitted.append(token)
            break
        node = child
        path.append(child)
        emitted.append(tokens[child])
    pad = [-1] * (len(tokens) - len(path))
    return emitted + pad, path + pad


def _greedy_reference(target_ids, tokens, parents):
    def choose(node, children):
        match = [j for j in children if tokens[j] == target_ids[node]]
        return (match[0], None) if match else (None, target_ids[node])

    return _python_walk(choose, tokens, parents)


# ----------------------------------------------------------------------------- greedy


def test_tree_greedy_hand_written_trees():
    # row 0: branching, the argmax path 0 -> 2 -> 5 ends at a leaf: the bonus target_ids[5] follows
    # row 1: the same tree, no child of the root matches
    # row 2: duplicate sibling tokens (nodes 1 and 2 both 3): the lowest index is taken
    # row 3: duplicates again, the walk stops inside (node 1's child has 5, the target wants 6)
    # row 4: only the root (all padding)
    tokens = _t(
        [
            [9, 3, 4, 5, 6, 7, -1, -1],
            [9, 3, 4, 5, 6, 7, -1, -1],
            [9, 3, 3, 5, 6, -1, -1, -1],
            [9, 3, 3, 5, 6, -1, -1, -1],
            [9, -1, -1, -1, -1, -1, -1, -1],
        ]
    )
    parents = _t(
        [
            [-1, 0, 0, 1, 1, 2, -1, -1],
            [-1, 0, 0, 1, 1, 2, -1, -1],
            [-1, 0, 0, 1, 2, -1, -1, -1],
            [-1, 0, 0, 1, 2, -1, -1, -1],
            [-1, -1, -1, -1, -1, -1, -1, -1],
        ]
    )
    target = _t(
        [
            [4, 0, 7, 0, 0, 2, 0, 0],
            [8, 3, 7, 0, 0, 2, 0, 0],
            [3, 5, 6, 1, 0, 0, 0, 0],
            [3, 6, 6, 1, 0, 0, 0, 0],
            [2, 0, 0, 0, 0, 0, 0, 0],
        ]
    )
    check_tree(parents)
    emitted, path = tree_greedy_accept(target, tokens, parents)
    assert emitted.dtype == I64 and path.dtype == I64
    assert emitted.tolist() == [
        [4, 7, 2, -1, -1, -1, -1, -1],
        [8, -1, -1, -1, -1, -1, -1, -1],
        [3, 5, 1, -1, -1, -1, -1, -1],
        [3, 6, -1, -1, -1, -1, -1, -1],
        [2, -1, -1, -1, -1, -1, -1, -1],
    ]
    assert path.tolist() == [
        [0, 2, 5, -1, -1, -1, -1, -1],
        [0, -1, -1, -1, -1, -1, -1, -1],
        [0, 1, 3, -1, -1, -1, -1, -1],
        [0, 1, -1, -1, -1, -1, -1, -1],
        [0, -1, -1, -1, -1, -1, -1, -1],
    ]


def test_tree_greedy_on_a_chain_is_greedy_accept():
    g = _gen(0)
    b, k, v = 64, 4, 3  # a small vocabulary: many drafts match
    target = torch.randint(0, v, (b, k + 1), generator=g)
    drafts = torch.where(
        torch.rand(b, k, generator=g) < 0.7, target[:, :k], torch.randint(0, v, (b, k), generator=g)
    )
    drafts[::7, 1] = -1  # "no draft" inside a chain: never matched
    tokens = torch.cat([torch.randint(0, v, (b, 1), generator=g), drafts], dim=1)
    emitted, path = tree_greedy_accept(target, tokens, _chain(b, k))
    assert torch.equal(emitted, greedy_accept(target, drafts))
    n = (emitted >= 0).sum(1, keepdim=True)  # the path is the chain's first n nodes
    assert torch.equal(path, torch.where(torch.arange(k + 1) < n, torch.arange(k + 1), -1))


@st.composite
def _trees(draw):
    m = draw(st.integers(1, 10))
    real = draw(st.integers(1, m))
    v = draw(st.integers(1, 4))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, real)] + [-1] * (m - real)
    tokens = [draw(st.integers(0, v - 1)) for _ in range(real)] + [-1] * (m - real)
    target = [draw(st.integers(0, v - 1)) for _ in range(m)]
    return target, tokens, parents


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(_trees(), min_size=1, max_size=3))
def test_tree_greedy_equals_a_python_walk(rows):
    m = max(len(r[1]) for r in rows)  # pad rows to one width (padding nodes at the end)
    target = _t([t + [0] * (m - len(t)) for t, _, _ in rows])
    tokens = _t([x + [-1] * (m - len(x)) for _, x, _ in rows])
    parents = _t([p + [-1] * (m - len(p)) for _, _, p in rows])
    emitted, path = tree_greedy_accept(target, tokens, parents)
    for row in range(len(rows)):
        want = _greedy_reference(target[row].tolist(), tokens[row].tolist(), parents[row].tolist())
        assert (emitted[row].tolist(), path[row].tolist()) == want


# ----------------------------------------------------------------------------- rejection: the walk


def _rejection_reference(target_probs, draft_probs, tokens, parents, uniforms, noise):
    """One row's multi-candidate walk, written plainly (float64)."""
    q = target_probs[0].double()

    def choose(node, children):
        nonlocal q
        for j in children:
            x = tokens[j]
            p = torch.zeros_like(q) if draft_probs is None else draft_probs[j].double()
            if draft_probs is None:
                p[x] = 1.0
            if uniforms[j] * p[x] <= q[x]:
                q = target_probs[j].double()
                return j, None
            residual = (q - p).clamp_min(0)
            if residual.sum() > 0:
                q = residual / residual.sum()
        return None, int((q / noise.double()).argmax())

    return _python_walk(choose, tokens, parents)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_tree_rejection_equals_a_python_walk(with_draft_probs):
    g = _gen(1)
    b, m, v = 300, 9, 4
    tokens, parents = _random_trees(b, m, v, g)
    target_probs = torch.softmax(2 * torch.randn(b, m, v, generator=g, dtype=torch.float64), -1)
    draft_probs = torch.softmax(2 * torch.randn(b, m, v, generator=g, dtype=torch.float64), -1)
    draft_probs = draft_probs if with_draft_probs else None
    uniforms = 1 - torch.rand(b, m, generator=g, dtype=torch.float64)
    noise = torch.empty(b, v, dtype=torch.float64).exponential_(generator=g)
    emitted, path = tree_rejection_sample(target_probs, draft_probs, tokens, parents, uniforms, noise)
    for row in range(b):
        want = _rejection_reference(
            target_probs[row],
            None if draft_probs is None else draft_probs[row],
            tokens[row].tolist(),
            parents[row].tolist(),
            uniforms[row].tolist(),
            noise[row],
        )
        assert (emitted[row].tolist(), path[row].tolist()) == want, row


def test_tree_rejection_on_a_chain_is_rejection_sample_given_the_same_randomness():
    """Same uniforms (node i's = draft i's), same noise, and the bonus drawn as argmax(q_k / noise):
    the same tokens, row by row."""
    g = _gen(2)
    b, k, v = 500, 3, 6
    target_probs = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    p = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    drafts = torch.multinomial(p.reshape(-1, v), 1, generator=g).view(b, k)
    tokens = torch.cat([torch.zeros(b, 1, dtype=I64), drafts], dim=1)
    uniforms = 1 - torch.rand(b, k + 1, generator=g)
    noise = torch.empty(b, v).exponential_(generator=g)
    bonus = (target_probs[:, k] / noise).argmax(-1, keepdim=True)
    for draft_probs in (p, None):
        want = rejection_sample(target_probs[:, :k], bonus, draft_probs, drafts, uniforms[:, 1:], noise)
        tree_draft_probs = None if draft_probs is None else torch.cat([torch.zeros(b, 1, v), p], dim=1)
        emitted, _ = tree_rejection_sample(
            target_probs, tree_draft_probs, tokens, _chain(b, k), uniforms, noise
        )
        assert torch.equal(emitted, want)


def test_tree_rejection_certain_target_keeps_its_path():
    """q one-hot along the path 0 -> 3 -> 4: deterministic drafts there are always accepted."""
    v = 5
    tokens = _t([[0, 1, 2, 3, 4, -1]])
    parents = _t([[-1, 0, 0, 0, 3, -1]])
    target_probs = torch.zeros(1, 6, v)
    target_probs[0, 0, 3] = target_probs[0, 3, 4] = target_probs[0, 4, 2] = 1.0
    target_probs[0, [1, 2, 5], 0] = 1.0
    for seed in range(5):
        g = _gen(seed)
        uniforms = 1 - torch.rand(1, 6, generator=g)
        noise = torch.empty(1, v).exponential_(generator=g)
        emitted, path = tree_rejection_sample(target_probs, None, tokens, parents, uniforms, noise)
        assert emitted.tolist() == [[3, 4, 2, -1, -1, -1]] and path.tolist() == [[0, 3, 4, -1, -1, -1]]


# ----------------------------------------------------------------------------- rejection: exactness

N = 20_000
V = 5
LENGTH = 3  # the tree's depth is 2: a block has at most 3 tokens
PARENTS = [-1, 0, 0, 0, 2, 2, -1]  # the root with three children, the second of which has two; padding
M = len(PARENTS)


def _dirichlet(shape, g):
    e = -torch.log(1 - torch.rand(*shape, generator=g, dtype=torch.float64))
    return e / e.sum(-1, keepdim=True)


def _tables(seed: int):
    """The target's distribution after each path of up to two tokens, and the draft's after the
    empty path and after one token: (q0 [V], q1 [V, V], q2 [V, V, V], p0 [V], p1 [V, V]), float64."""
    g = _gen(seed)
    return (
        _dirichlet((V,), g),
        _dirichlet((V, V), g),
        _dirichlet((V, V, V), g),
        _dirichlet((V,), g),
        _dirichlet((V, V), g),
    )


def _exact(q0, q1, q2) -> np.ndarray:
    return (q0[:, None, None] * q1[:, :, None] * q2).numpy().ravel()  # [V ** 3]


def _without(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """p [N, V] with each row's token x [N] removed, renormalised."""
    p = p.scatter(1, x[:, None], 0.0)
    return p / p.sum(-1, keepdim=True)


def _draw_siblings(p: torch.Tensor, count: int, kind: str, g) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` sibling tokens [N, count] drawn from p [N, V], i.i.d. or without replacement, and the
    distribution each was drawn from [N, count, V]."""
    tokens, dists = [], []
    for _ in range(count):
        tokens.append(torch.multinomial(p, 1, generator=g)[:, 0])
        dists.append(p)
        if kind == "without":
            p = _without(p, tokens[-1])
    return torch.stack(tokens, 1), torch.stack(dists, 1)


def _tree_step(kind: str, seed: int, chain: bool = False):
    """N rows of one verification of the fixed tree (or a chain of two drafts): the drafts drawn as
    `kind` says ("none": the draft's top-k, one-hot p; "iid"; "without": without replacement), the
    target's distributions from the tables. Returns the inputs of tree_rejection_sample and the tables."""
    tables = _tables(seed)
    q0, q1, q2, p0, p1 = tables
    g = _gen(seed + 1000)
    parents = _chain(N, 2) if chain else _t([PARENTS] * N)
    m = parents.shape[1]
    root_children = 1 if chain else 3
    if kind == "none":  # deterministic candidates, the draft's top-k: one-hot p
        first = p0.topk(root_children).indices.expand(N, root_children)
        first_p = None
    else:
        first, first_p = _draw_siblings(p0.expand(N, V), root_children, kind, g)
    middle = first[:, -1] if chain else first[:, 1]  # the node with children: node 1 (chain) or 2
    if kind == "none":
        second = p1[middle].topk(1 if chain else 2, dim=-1).indices
        second_p = None
    else:
        second, second_p = _draw_siblings(p1[middle], 1 if chain else 2, kind, g)
    tokens = torch.cat(
        [
            torch.zeros(N, 1, dtype=I64),
            first,
            second,
            torch.full((N, m - 1 - first.shape[1] - second.shape[1]), -1),
        ],
        1,
    )
    draft_probs = None
    if kind != "none":
        draft_probs = torch.cat(
            [
                torch.zeros(N, 1, V, dtype=torch.float64),
                first_p,
                second_p,
                torch.zeros(N, m - 1 - first.shape[1] - second.shape[1], V, dtype=torch.float64),
            ],
            1,
        ).float()
    depth_one = list(range(1, 1 + first.shape[1]))
    depth_two = list(range(1 + first.shape[1], 1 + first.shape[1] + second.shape[1]))
    target_probs = torch.full((N, m, V), 1.0 / V, dtype=torch.float64)
    target_probs[:, 0] = q0
    target_probs[:, depth_one] = q1[first]
    target_probs[:, depth_two] = q2[middle[:, None], second]
    uniforms = 1 - torch.rand(N, m, generator=g)
    noise = torch.empty(N, V).exponential_(generator=g)
    return (target_probs.float(), draft_probs, tokens, parents, uniforms, noise), tables, g


def _complete(emitted: torch.Tensor, q0, q1, q2, g) -> torch.Tensor:
    """Each block [N, M] completed to LENGTH tokens by sampling the target after it: [N, LENGTH]."""
    seq = emitted[:, :LENGTH].clone()
    for t in range(LENGTH):
        dist = (
            q0.expand(N, V) if t == 0 else q1[seq[:, 0].clamp(min=0)] if t == 1 else q2[seq[:, 0], seq[:, 1]]
        )
        fresh = torch.multinomial(dist, 1, generator=g)[:, 0]
        seq[:, t] = torch.where(seq[:, t] >= 0, seq[:, t], fresh)
    return seq


def _pvalue(seq: torch.Tensor, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of [N, 3] sequences against probs [V ** 3], cells expecting fewer
    than 5 pooled."""
    index = (seq[:, 0] * V * V + seq[:, 1] * V + seq[:, 2]).numpy()
    observed = np.bincount(index, minlength=V**LENGTH).astype(float)
    expected = probs * len(index)
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def _run(kind: str, seed: int, chain: bool = False) -> tuple[float, torch.Tensor]:
    inputs, (q0, q1, q2, _, _), g = _tree_step(kind, seed, chain)
    emitted, path = tree_rejection_sample(*inputs)
    tokens, parents = inputs[2], inputs[3]
    # the path is a root path and the emitted drafts are its tokens
    n = (path >= 0).sum(1)
    for t in range(1, int(n.max())):
        on = n > t
        assert torch.equal(parents[on].gather(1, path[on, t : t + 1]), path[on, t - 1 : t])
        assert torch.equal(emitted[on, t - 1], tokens[on].gather(1, path[on, t : t + 1])[:, 0])
    return _pvalue(_complete(emitted, q0, q1, q2, g), _exact(q0, q1, q2)), emitted


KINDS = ["none", "iid", "without"]


@pytest.mark.parametrize("kind", KINDS)
def test_tree_rejection_matches_the_target(kind):
    pvalue, emitted = _run(kind, seed=10)
    assert pvalue > 1e-3, pvalue
    lengths = (emitted >= 0).sum(1)
    assert (lengths == 1).any() and (lengths == 2).any() and (lengths == 3).any()  # the tree is used


def _skip_residual(q, p):
    return q  # a rejected sibling leaves q as it was


def _unnormalised_residual(q, p):
    return (q - p).clamp_min(0)  # the next sibling is judged against a residual that sums below 1


@pytest.mark.parametrize("broken", [_skip_residual, _unnormalised_residual])
@pytest.mark.parametrize("kind", KINDS)
def test_broken_tree_rejection_fails(kind, broken, monkeypatch):
    monkeypatch.setattr(tree_module, "_residual", broken)
    pvalue, _ = _run(kind, seed=10)
    assert pvalue < 1e-6, pvalue


def test_tree_rejection_on_a_chain_matches_the_target_as_rejection_sample_does():
    inputs, (q0, q1, q2, _, _), g = _tree_step("iid", seed=20, chain=True)
    target_probs, draft_probs, tokens, _, uniforms, noise = inputs
    emitted, _ = tree_rejection_sample(*inputs)
    assert _pvalue(_complete(emitted, q0, q1, q2, g), _exact(q0, q1, q2)) > 1e-3
    bonus = torch.multinomial(target_probs[:, 2], 1, generator=g)
    chain = rejection_sample(
        target_probs[:, :2], bonus, draft_probs[:, 1:], tokens[:, 1:], uniforms[:, 1:], noise
    )
    assert _pvalue(_complete(chain, q0, q1, q2, g), _exact(q0, q1, q2)) > 1e-3


# ----------------------------------------------------------------------------- typical


TYPICAL_TOKENS = _t([[0, 1, 2, 3, 0, 1, -1]])
TYPICAL_PARENTS = _t([[-1, 0, 0, 1, 2, 2, -1]])
TYPICAL_BONUS = _t([[10, 11, 12, 13, 14, 15, 16]])  # not real tokens: tells which node's bonus came out


def _typical_probs(node1=(0.1, 0.1, 0.1, 0.7), node2=(0.35, 0.05, 0.5, 0.1), root=(0.1, 0.4, 0.4, 0.1)):
    probs = torch.full((1, 7, 4), 0.25)
    probs[0, 0], probs[0, 1], probs[0, 2] = torch.tensor(root), torch.tensor(node1), torch.tensor(node2)
    return probs


@pytest.mark.parametrize(
    "probs,emitted,path",
    [
        # 1, 2, 3, 4 pass (5 does not): 3 and 4 are the deepest, 3 the lower index; a leaf: its bonus
        (_typical_probs(), [1, 3, 13], [0, 1, 3]),
        # node 3 fails: the deepest is 4, a leaf
        (_typical_probs(node1=(0.7, 0.1, 0.1, 0.1)), [2, 0, 14], [0, 2, 4]),
        # nodes 3 and 4 fail: 1 and 2 at depth 1, node 1 has a (rejected) child: its argmax
        (_typical_probs(node1=(0.7, 0.1, 0.1, 0.1), node2=(0.05, 0.05, 0.5, 0.4)), [1, 0], [0, 1]),
        # nothing passes at the root: its argmax
        (_typical_probs(root=(0.2, 0.2, 0.1, 0.5)), [3], [0]),
    ],
)
def test_tree_typical_hand_checked(probs, emitted, path):
    # alpha large: the threshold is posterior_threshold = 0.3 (alpha * exp(-H) >= 10 / 4)
    out, out_path = tree_typical_accept(probs, TYPICAL_TOKENS, TYPICAL_PARENTS, TYPICAL_BONUS, 0.3, 10.0)
    pad = [-1] * (7 - len(emitted))
    assert out.tolist() == [emitted + pad] and out_path.tolist() == [path + [-1] * (7 - len(path))]


def test_tree_typical_root_alone_gives_its_bonus():
    out, path = tree_typical_accept(
        torch.full((1, 3, 4), 0.25), _t([[2, -1, -1]]), _t([[-1, -1, -1]]), _t([[3, 0, 0]]), 0.3, 10.0
    )
    assert out.tolist() == [[3, -1, -1]] and path.tolist() == [[0, -1, -1]]


def test_tree_typical_on_a_chain_is_typical_accept():
    g = _gen(3)
    b, k, v = 200, 3, 6
    probs = torch.softmax(3 * torch.randn(b, k + 1, v, generator=g), -1)
    drafts = torch.multinomial(probs[:, :k].reshape(-1, v), 1, generator=g).view(b, k)
    bonus = torch.randint(0, v, (b, k + 1), generator=g)
    tokens = torch.cat([torch.zeros(b, 1, dtype=I64), drafts], 1)
    emitted, _ = tree_typical_accept(probs, tokens, _chain(b, k), bonus, 0.3, 0.2)
    assert torch.equal(emitted, typical_accept(probs, bonus[:, k:], drafts, 0.3, 0.2))


# ----------------------------------------------------------------------------- the rules' verify_tree


def _strategy(temperatures: list[float], vocab: int, seed: int = 0):
    from speculative.sampling import SampleStrategy
    from speculative.sampling_params import SamplingParams

    params = [SamplingParams(temperature=t, seed=seed + row) for row, t in enumerate(temperatures)]
    generators = [torch.Generator().manual_seed(seed + row) for row in range(len(params))]
    return SampleStrategy(params, vocab, torch.device("cpu"), torch.Generator(), generators=generators)


RULES = [GreedyAcceptance(), RejectionSampler(), TypicalAcceptanceSampler(0.09, 0.3)]


def _tree_batch(b: int, m: int, v: int, seed: int):
    g = _gen(seed)
    tokens, parents = _random_trees(b, m, v, g)
    logits = 3 * torch.randn(b, m, v, generator=g)
    # let the argmax path into the trees: make some nodes the target's argmax after their parent
    wanted = logits.argmax(-1).gather(1, parents.clamp(min=0))
    tokens = torch.where((parents >= 0) & (torch.rand(b, m, generator=g) < 0.5), wanted, tokens)
    return logits, tokens, parents


@pytest.mark.parametrize("rule", RULES)
def test_verify_tree_on_a_greedy_batch(rule):
    b, m, v = 6, 8, 7
    logits, tokens, parents = _tree_batch(b, m, v, seed=4)
    assert isinstance(rule, AcceptanceRule)
    emitted, path = rule.verify_tree(logits, tokens, parents, None, _strategy([0.0] * b, v), None)
    assert emitted.shape == path.shape == (b, m) and emitted.dtype == path.dtype == I64
    n = (path >= 0).sum(1)
    assert torch.equal((emitted >= 0).sum(1), n)
    if rule.lossless:
        want_emitted, want_path = tree_greedy_accept(logits.argmax(-1), tokens, parents)
        assert torch.equal(emitted, want_emitted) and torch.equal(path, want_path)
        assert (n > 1).any()  # some drafts were kept


def test_greedy_verify_tree_refuses_a_sampled_row():
    logits, tokens, parents = _tree_batch(1, 4, 5, seed=5)
    with pytest.raises(ValueError, match="temperature 0"):
        GreedyAcceptance().verify_tree(logits, tokens, parents, None, _strategy([0.8], 5), None)


def test_rejection_verify_tree_draws_uniforms_then_noise_from_each_rows_generator():
    b, m, v = 3, 8, 7
    logits, tokens, parents = _tree_batch(b, m, v, seed=6)
    draft_probs = torch.softmax(torch.randn(b, m, v, generator=_gen(7)), -1)
    temperatures = [1.0, 0.7, 1.3]
    out = RejectionSampler().verify_tree(
        logits, tokens, parents, draft_probs, _strategy(temperatures, v, 9), None
    )
    again = RejectionSampler().verify_tree(
        logits, tokens, parents, draft_probs, _strategy(temperatures, v, 9), None
    )
    assert all(torch.equal(a, b) for a, b in zip(out, again))  # reproducible with the same seeds
    strategy = _strategy(temperatures, v, 9)
    probs = strategy.probs(logits, None)
    uniforms, noise = strategy.random.uniform(m), strategy.random.exponential(v)
    want = tree_rejection_sample(probs, draft_probs, tokens, parents, uniforms, noise)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    alone = RejectionSampler().verify_tree(
        logits[2:], tokens[2:], parents[2:], draft_probs[2:], _strategy(temperatures[2:], v, 11), None
    )
    assert all(torch.equal(a[2:], b) for a, b in zip(out, alone))  # a row's draws are its own


def test_typical_verify_tree_draws_a_bonus_at_every_node():
    b, m, v = 3, 8, 7
    logits, tokens, parents = _tree_batch(b, m, v, seed=8)
    rule = TypicalAcceptanceSampler(0.3, 0.2)
    out = rule.verify_tree(logits, tokens, parents, None, _strategy([1.0, 0.5, 0.9], v, 3), None)
    strategy = _strategy([1.0, 0.5, 0.9], v, 3)
    probs = strategy.probs(logits, None)
    bonus = (probs / strategy.random.exponential(m, v)).argmax(-1)
    want = tree_typical_accept(probs, tokens, parents, bonus, 0.3, 0.2)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
