"""Tree verification's model side: NativeCausalLM.forward_tree against plain forwards of each path,
StaticKVCache.keep_path against a cache fed the path as a chain, and the tree helpers."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import tiny_model

from speculative.models.compiled import CompiledCausalLM
from speculative.models.hf import HFCausalLM
from speculative.models.llama import NativeCausalLM
from speculative.tree import check_tree, tree_ancestors, tree_depths

TOL = 1e-5
# Two rows of different trees, M = 7. Row 0: the root's children 1, 2, 3; node 2's children 4, 5;
# node 6 padding. Row 1: 0 -> 1 -> {2, 3}, 0 -> 4 -> 5, 3 -> 6.
PARENTS = torch.tensor([[-1, 0, 0, 0, 2, 2, -1], [-1, 0, 1, 1, 0, 4, 3]])
CONTEXT = (9, 5)  # cached tokens per row before the tree (the root is fed by the tree)
PATHS = ([0, 2, 5, -1], [0, 1, 3, 6])  # what keep_path keeps: root-to-node paths, -1 padded
FAMILIES = {
    "llama": dict(),
    "qwen3": dict(),
    "mistral_window": dict(sliding_window=3),  # a window shorter than the longer paths' context
}


@functools.cache
def native(name: str) -> NativeCausalLM:
    family = name.split("_")[0]
    return NativeCausalLM.from_hf(tiny_model(family, vocab_size=96, **FAMILIES[name]))


def ids(*shape: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, 96, shape, generator=torch.Generator().manual_seed(seed))


def path_to(parents: list[int], node: int) -> list[int]:
    """The root-to-node path's node indices."""
    path = [node]
    while parents[path[0]] >= 0:
        path.insert(0, parents[path[0]])
    return path


def prefilled(model: NativeCausalLM, context: torch.Tensor, lengths: tuple[int, ...]):
    """A cache of 2 rows holding the first `lengths[b]` tokens of context[b] (one ragged prefill)."""
    cache = model.new_cache(len(lengths), 40)
    model(context, cache, num_tokens=torch.tensor(lengths))
    return cache


def plain_last_logits(model: NativeCausalLM, tokens: list[int]) -> torch.Tensor:
    """The logits after `tokens`, fed plainly to a fresh cache."""
    return model(torch.tensor([tokens]), model.new_cache(1, 40))[0, -1]


def test_tree_helpers() -> None:
    check_tree(PARENTS)
    ancestors = tree_ancestors(PARENTS)
    for b, row in enumerate(PARENTS.tolist()):
        for i in range(len(row)):
            expected = set(path_to(row, i)) if i == 0 or row[i] >= 0 else {i}
            assert set(ancestors[b, i].nonzero().flatten().tolist()) == expected
    assert tree_depths(PARENTS).tolist() == [[0, 1, 1, 1, 2, 2, 0], [0, 1, 2, 2, 1, 2, 3]]
    chain = torch.tensor([[-1, *range(63)]])  # the deepest tree of 64 nodes
    assert tree_depths(chain).tolist() == [list(range(64))]
    assert torch.equal(tree_ancestors(chain)[0], torch.ones(64, 64, dtype=torch.bool).tril())
    for bad in ([[0, 0]], [[-1, 1]], [[-1, 0, 3, 0]], [[-1, -1, 1]], [[-1, -2]]):
        with pytest.raises(ValueError):
            check_tree(torch.tensor(bad))


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window"])
def test_chain_tree_equals_plain_forward(name: str) -> None:
    model = native(name)
    context, chain = ids(2, 9), ids(2, 5, seed=4)
    cache = prefilled(model, context, CONTEXT)
    tree_cache = copy.deepcopy(cache)
    plain = model(chain, cache)
    parents = torch.tensor([-1, 0, 1, 2, 3]).expand(2, -1)
    tree = model.forward_tree(chain, tree_cache, parents)
    torch.testing.assert_close(tree, plain, rtol=TOL, atol=TOL)
    assert torch.equal(tree_cache.lengths, cache.lengths)
    for b, length in enumerate(cache.lengths.tolist()):
        for mine, theirs in zip(tree_cache.keys + tree_cache.values, cache.keys + cache.values):
            torch.testing.assert_close(mine[b, :, :length], theirs[b, :, :length], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window"])
def test_branching_tree_logits_are_those_of_each_path(name: str) -> None:
    model = native(name)
    context, nodes = ids(2, 9), ids(2, 7, seed=5)
    nodes[0, 6] = -1  # a padding node's token
    cache = prefilled(model, context, CONTEXT)
    logits = model.forward_tree(nodes, cache, PARENTS)
    assert logits.shape == (2, 7, 96) and logits.dtype == torch.float32
    assert cache.lengths.tolist() == [length + 7 for length in CONTEXT]
    for b, row in enumerate(PARENTS.tolist()):
        for i in range(7):
            if i > 0 and row[i] < 0:
                continue  # padding: garbage logits
            tokens = context[b, : CONTEXT[b]].tolist() + nodes[b, path_to(row, i)].tolist()
            torch.testing.assert_close(logits[b, i], plain_last_logits(model, tokens), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window"])
def test_keep_path_leaves_the_cache_of_a_chain(name: str) -> None:
    model = native(name)
    context, nodes, following = ids(2, 9), ids(2, 7, seed=5), ids(2, 1, seed=6)
    nodes[0, 6] = -1
    cache = prefilled(model, context, CONTEXT)
    start = cache.lengths.clone()
    model.forward_tree(nodes, cache, PARENTS)
    cache.keep_path(start, torch.tensor(PATHS))
    kept = [[node for node in path if node >= 0] for path in PATHS]
    assert cache.lengths.tolist() == [length + len(path) for length, path in zip(CONTEXT, kept)]
    logits = model(following, cache)[:, 0]
    for b in range(2):
        fed = context[b, : CONTEXT[b]].tolist() + nodes[b, kept[b]].tolist()
        reference = model.new_cache(1, 40)
        expected = model(torch.tensor([fed + following[b].tolist()]), reference)[0, -1]
        torch.testing.assert_close(logits[b], expected, rtol=TOL, atol=TOL)
        length = len(fed) + 1
        for mine, theirs in zip(cache.keys + cache.values, reference.keys + reference.values):
            torch.testing.assert_close(mine[b, :, :length], theirs[0, :, :length], rtol=TOL, atol=TOL)


@pytest.mark.slow  # compiles (inductor): seconds
def test_compiled_tree_is_the_eager_one_and_hf_has_none() -> None:
    """A compiled tree call (a graph of its own) gives the eager logits, to rounding."""
    model = native("llama")
    context, nodes = ids(2, 9), ids(2, 7, seed=5)
    expected = model.forward_tree(nodes, prefilled(model, context, CONTEXT), PARENTS)
    compiled = CompiledCausalLM(model)
    cache = compiled.new_cache(2, 40)
    compiled.model(context, cache, num_tokens=torch.tensor(CONTEXT))
    torch.testing.assert_close(compiled.forward_tree(nodes, cache, PARENTS), expected, atol=1e-4, rtol=1e-4)
    assert getattr(HFCausalLM(tiny_model("llama", vocab_size=96)), "forward_tree", None) is None


@pytest.mark.parametrize("name", ["llama", "mistral_window"])
def test_a_tree_grown_a_level_at_a_time_is_the_tree_fed_at_once(name: str) -> None:
    """A drafter's growth: the root, then each level's nodes given the nodes already cached."""
    model = native(name)
    context, nodes = ids(2, 9), ids(2, 7, seed=5)
    nodes[0, 6] = -1
    whole = model.forward_tree(nodes, prefilled(model, context, CONTEXT), PARENTS)
    cache = prefilled(model, context, CONTEXT)
    # levels by node index: {0}, then 1..3 / 1 and 4, then the rest
    parts = [model.forward_tree(nodes[:, :1], cache, PARENTS[:, :1])]
    for end in (4, 7):
        begin = sum(part.shape[1] for part in parts)
        parts.append(model.forward_tree(nodes[:, begin:end], cache, PARENTS[:, :end]))
    grown = torch.cat(parts, dim=1)
    real = (PARENTS >= 0) | (torch.arange(7) == 0)
    torch.testing.assert_close(grown[real], whole[real], rtol=TOL, atol=TOL)
    assert cache.lengths.tolist() == [length + 7 for length in CONTEXT]


def test_forward_tree_refuses_a_query_longer_than_its_tree() -> None:
    model = native("llama")
    cache = prefilled(model, ids(2, 9), CONTEXT)
    with pytest.raises(ValueError, match="q <= M"):
        model.forward_tree(ids(2, 3), cache, PARENTS[:, :2])
