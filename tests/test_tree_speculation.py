"""Tree speculation end to end: the draft model's trees (static and dynamic) and the n-gram trie,
verified in one forward; greedy output token-identical to the target alone, sampled output seeded."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model
from exactness import assert_greedy_equal, hf_greedy
from test_eagle import write_head

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.methods import SuffixConfig
from speculative.models.eagle_checkpoint import load_eagle_head
from speculative.models.llama import NativeCausalLM
from speculative.proposers import DraftTreeProposer
from speculative.proposers.base import Proposal
from speculative.proposers.eagle_tree import EagleTreeProposer
from speculative.proposers.ngram import NgramProposer, _merge
from speculative.sampling import SampleStrategy
from speculative.tree import batch_tree, check_tree, tree_depths

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [9],
    [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4],
    [30, 31, 32, 33, 34, 30, 31, 32, 35, 30, 31],
]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _llm(target, drafter: str, family: str, tree: str, k: int, **config) -> LLM:
    method = "ngram" if drafter == "ngram" else "draft_model"
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, tree=tree, **config)
    draft = {
        "ngram": None,
        "self": target,
        "noisy": noisy_copy(target, 0.02) if drafter == "noisy" else None,
        "random": tiny_model(family, num_layers=1, seed=7) if drafter == "random" else None,
    }[drafter]
    return LLM(target, draft_model=draft, speculative_config=spec)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize(
    ("drafter", "tree"),
    [
        ("random", "dynamic"),
        ("noisy", "dynamic"),
        ("self", "static"),
        ("noisy", "static"),
        ("ngram", "static"),
    ],
)
def test_greedy_tree_speculation_matches_target_alone(family: str, drafter: str, tree: str) -> None:
    overrides = {"sliding_window": 4} if family == "mistral" else {}
    target = tiny_model(family, **overrides)
    expected = [hf_greedy(target, p, MAX_TOKENS, 1) for p in PROMPTS]
    for k, width, nodes in ((1, 2, 2), (4, 3, 10)):
        llm = _llm(target, drafter, family, tree, k, tree_width=width, tree_nodes=nodes)
        for batch in (PROMPTS[:1], PROMPTS):
            outputs = llm.generate(batch, GREEDY)
            for prompt, out, want in zip(batch, outputs, expected):
                assert_greedy_equal(target, prompt, out.outputs[0].token_ids, want)
                m = out.metrics
                assert m.num_accepted <= m.num_drafted <= k * m.num_steps
                if drafter == "self":  # the static tree holds the draft's (= the target's) top path
                    assert m.num_accepted == m.num_drafted


def test_a_tree_accepts_more_per_step_than_the_chain_of_its_depth() -> None:
    target = tiny_model("llama")
    draft = noisy_copy(target, 0.08)
    accepted = {}
    for tree in (None, "dynamic"):
        spec = SpeculativeConfig(num_speculative_tokens=4, tree=tree, tree_width=4, tree_nodes=24)
        outputs = LLM(target, draft_model=draft, speculative_config=spec).generate(PROMPTS, GREEDY)
        accepted[tree] = sum(o.metrics.num_accepted for o in outputs) / sum(
            o.metrics.num_steps for o in outputs
        )
    assert accepted["dynamic"] > accepted[None]


@pytest.mark.parametrize(("drafter", "tree"), [("noisy", "dynamic"), ("ngram", "static")])
def test_sampled_tree_speculation_is_seeded(drafter: str, tree: str) -> None:
    target = tiny_model("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, seed=11)
    runs = []
    for batch in (PROMPTS[:1], PROMPTS):  # a seeded row's output does not depend on its neighbours
        llm = _llm(target, drafter, "llama", tree, 3, tree_width=2, tree_nodes=6)
        runs.append(llm.generate(batch, params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == MAX_TOKENS


@pytest.mark.parametrize("shape", ["static", "dynamic"])
def test_draft_trees_are_valid_and_as_large_as_asked(shape: str) -> None:
    model = NativeCausalLM.from_hf(tiny_model("llama"))
    proposer = DraftTreeProposer(model, shape, width=3, num_nodes=7)
    tokens = torch.randint(2, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([30, 12])
    proposer.add_rows(tokens, lengths)
    strategy = SampleStrategy([SamplingParams(temperature=0.8)] * 2, 96, "cpu")  # sampled: kept whole
    proposal = proposer.propose(tokens, lengths, 3, strategy)
    assert proposal.token_ids.shape == (2, 7) and proposal.probs is None
    check_tree(proposal.parents)
    assert int(tree_depths(proposal.parents).max()) <= 3
    assert bool((proposal.token_ids >= 0).all())
    if shape == "static":  # the topology is fixed: the same for every row and every context
        assert proposal.parents.tolist() == [proposal.parents[0].tolist()] * 2
        # rank sum 0: the top path (depths 1-3); rank sum 1, shallowest first: a runner-up at depth
        # 1, two at depth 2 (off the top path's first node, and the top child of depth 1's runner-up)
        # and one at depth 3
        assert sorted(tree_depths(proposal.parents)[0, 1:].tolist()) == [1, 1, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("drafter", ["draft model", "eagle head"])
def test_greedy_batches_shrink_their_trees_to_chains(tmp_path, drafter: str) -> None:
    """batch_tree: a greedy batch of B rows grows trees of width // B and nodes // B (at least a chain
    of min(nodes, k)), chains where the width comes to 1 or the nodes to no more than the chain's; the
    proposal is then a chain (no parents), the draft's top path: the tokens a batch-1 tree of width 1
    proposes."""
    assert batch_tree(2, 8, 1, 4) == (2, 8) and batch_tree(2, 8, 2, 4) == (1, 4)
    assert batch_tree(4, 24, 2, 6) == (2, 12) and batch_tree(4, 24, 8, 6) == (1, 6)
    assert batch_tree(4, 6, 2, 3) == (1, 3)  # width 2 left, but no more nodes than the chain's
    assert batch_tree(1, 2, 3, 4) == (1, 2)  # never more drafts than the batch-1 tree
    assert batch_tree(8, 8, 1, 4) == (8, 8) and batch_tree(8, 8, 2, 4) == (1, 4)  # n-gram, suffix
    assert batch_tree(16, 16, 2, 4) == (8, 8)
    target = NativeCausalLM.from_hf(tiny_model("llama", num_layers=2))
    draft = NativeCausalLM.from_hf(noisy_copy(tiny_model("llama", num_layers=2), 0.05))
    head = load_eagle_head(write_head(tmp_path, "eagle"), "eagle", target)
    tokens = torch.randint(2, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([30, 12])
    features = torch.randn(2, 29, 64, generator=torch.Generator().manual_seed(1))  # the prefill's

    def propose(width: int, nodes: int, rows: slice) -> Proposal:
        if drafter == "draft model":
            proposer = DraftTreeProposer(draft, "dynamic", width, nodes)
        else:
            proposer = EagleTreeProposer(head, "dynamic", width, nodes)
            proposer.observe(features[rows, : int(lengths[rows].max()) - 1])
        proposer.add_rows(tokens[rows], lengths[rows])
        strategy = SampleStrategy.greedy(tokens[rows].shape[0], 96)
        return proposer.propose(tokens[rows], lengths[rows], 3, strategy)

    chain = propose(2, 6, slice(0, 2))  # width 2 // 2 rows = 1
    assert chain.parents is None and chain.token_ids.shape == (2, 3)
    for row in range(2):
        alone = propose(1, 6, slice(row, row + 1))
        assert alone.parents is None and alone.token_ids.tolist() == chain.token_ids[row : row + 1].tolist()
    tree = propose(4, 8, slice(0, 2))  # width 4 // 2 = 2, 8 // 2 = 4 nodes
    assert tree.token_ids.shape == (2, 4) and tree.parents is not None
    check_tree(tree.parents)


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_ngram_and_suffix_tries_shrink_with_a_greedy_batch(proposer: str) -> None:
    """Tries of 8 nodes, k = 4: a greedy batch of 2 proposes chains, the chain proposer's; one row, or
    a sampled batch of 2, tries."""
    pattern = [5, 6, 7, 8, 9, 10, 11, 12]
    tokens = torch.tensor([pattern * 3 + [5, 6], pattern * 2 + [5, 6, 9, 10, 5, 6, 7, 8, 5, 6]])
    lengths = torch.full((2,), tokens.shape[1])
    sampled = SampleStrategy([SamplingParams(temperature=0.8)] * 2, 96, "cpu")

    def propose(nodes: int | None, strategy: SampleStrategy, rows: slice = slice(0, 2)) -> Proposal:
        if proposer == "ngram":
            made = NgramProposer(1, 3, tree_nodes=nodes)
        else:
            made = SuffixConfig(suffix_decoding_max_cached_requests=0).proposer(nodes)
        made.add_rows(tokens[rows], lengths[rows])
        return made.propose(tokens[rows], lengths[rows], 4, strategy)

    chains = propose(8, SampleStrategy.greedy(2, 96))
    assert chains.parents is None and chains.token_ids.shape[1] > 0
    assert chains.token_ids.tolist() == propose(None, SampleStrategy.greedy(2, 96)).token_ids.tolist()
    assert propose(8, sampled).parents is not None
    for row in range(2):
        assert propose(8, SampleStrategy.greedy(1, 96), slice(row, row + 1)).parents is not None


def test_ngram_trie_merges_shared_prefixes_up_to_its_size() -> None:
    tokens, parents = _merge([[4, 5, 6], [4, 5, 7], [8, -1, -1], [4, 9, 6]], 10)
    assert tokens == [4, 5, 6, 7, 8, 9, 6]
    assert parents == [0, 1, 2, 2, 0, 1, 6]
    assert _merge([[4, 5, 6], [7, 8, 9]], 4) == ([4, 5, 6, 7], [0, 1, 2, 0])


def test_tree_config_errors_name_the_field() -> None:
    for field, value in (("tree", "beam"), ("tree_width", 0), ("tree_nodes", 129)):
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig(**{field: value})
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig(tree="dynamic", adaptive=True)
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="tree needs the native forward"):
        LLM(
            target,
            draft_model=target,
            speculative_config=SpeculativeConfig(tree="static"),
            model_impl="transformers",
        )
