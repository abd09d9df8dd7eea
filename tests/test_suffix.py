"""Suffix decoding (speculative/proposers/suffix.py): the tries' counts, the proposals on hand-made
sequences, the global cache's bound, and outputs exact: greedy token-identical to the target alone
(chains and trees, batches, rows joining mid-run), sampled following the target's distribution."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model
from exactness import assert_greedy_equal, hf_greedy
from scipy.stats import chi2
from test_distribution import LENGTH, SAMPLES, VOCAB, chi_square, exact_probs

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.methods import SuffixConfig
from speculative.proposers import SuffixProposer
from speculative.proposers.suffix import SuffixCache, SuffixTrie
from speculative.sampling import SampleStrategy
from speculative.tree import check_tree

GREEDY_STRATEGY = SampleStrategy.greedy(1, 64)


def _counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every substring the trie holds with its count, leaves' occurrences read from the texts."""
    out: dict[tuple[int, ...], int] = {}

    def walk(node, prefix: tuple[int, ...]) -> None:
        if node.children is None:
            text = trie.texts[node.seq]
            end = min(len(text), node.start + trie.max_depth)
            for stop in range(node.start + node.depth, end + 1):
                out[tuple(text[node.start : stop])] = 1
            return
        if prefix:
            out[prefix] = node.count
        assert node.total == sum(c.count for c in node.children.values())
        for token, child in node.children.items():
            walk(child, (*prefix, token))

    walk(trie.root, ())
    return out


def _substrings(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for text in texts:
        for i in range(len(text)):
            for j in range(i + 1, min(len(text), i + depth) + 1):
                out[tuple(text[i:j])] = out.get(tuple(text[i:j]), 0) + 1
    return out


def test_trie_counts_every_substring_through_appends_and_removals() -> None:
    rng = random.Random(0)
    for _ in range(200):
        depth, vocab = rng.randint(2, 6), rng.randint(2, 4)
        trie, texts, alive = SuffixTrie(depth), {}, []
        for seq in range(rng.randint(1, 6)):
            if alive and rng.random() < 0.3:
                gone = alive.pop(0)
                trie.remove(gone)
                del texts[gone]
                continue
            text = [rng.randrange(vocab) for _ in range(rng.randint(1, 15))]
            texts[seq], i = text, 0
            while i < len(text):  # appended in pieces, as committed tokens are
                step = rng.randint(1, 4)
                trie.extend(seq, text[i : i + step])
                i += step
            alive.append(seq)
        assert _counts(trie) == _substrings(list(texts.values()), depth)


def _proposer(context: list[int], tree_nodes: int | None = None, **options) -> SuffixProposer:
    """A SuffixProposer over `context`, options by SuffixConfig's names without `suffix_decoding_`."""
    config = SuffixConfig(**{f"suffix_decoding_{name}": value for name, value in options.items()})
    proposer = config.proposer(tree_nodes)
    proposer.add_rows(torch.tensor([context]), torch.tensor([len(context)]))
    return proposer


def _propose(proposer: SuffixProposer, contexts: list[list[int]], k: int = 4):
    width = max(len(c) for c in contexts)
    tokens = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
    lengths = torch.tensor([len(c) for c in contexts])
    return proposer.propose(tokens, lengths, k, GREEDY_STRATEGY)


CONTEXT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # "1 2" was followed by 3 twice; "1 2 3" by 4 and by 5


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, [3, 4]),  # the match "1 2" is 2 long: max_spec_factor 1.0 allows 2 tokens; 4 ties 5, first seen
        ({"max_spec_factor": 2.0}, [3, 4, 1, 2]),  # 3 (1.0), 4 (0.5), 1 (0.5), 2 (0.5)
        ({"max_spec_factor": 2.0, "min_token_prob": 0.6}, [3]),  # 4's 0.5 is below the bound
        ({"max_spec_factor": 0.5}, [3]),
        # In a 3-deep trie the match "1 2" leaves room for 1 token, the shorter "2" for 2: 3, then 4 or 5.
        ({"max_tree_depth": 3, "max_spec_factor": 4.0}, [3, 4]),
    ],
)
def test_chain_follows_the_most_frequent_continuation_within_the_limits(options, expected) -> None:
    proposal = _propose(_proposer(CONTEXT, **options), [CONTEXT])
    assert proposal.token_ids.tolist() == [expected]
    assert proposal.probs is None and proposal.parents is None


def test_tree_takes_the_most_probable_nodes_best_first() -> None:
    proposer = _proposer(CONTEXT, max_spec_factor=2.0, tree_nodes=4)
    proposal = _propose(proposer, [CONTEXT])
    # 3 (1.0); its children 4 and 5 (0.5 each); then 4's child 1 (0.5), pushed before 5's.
    assert proposal.token_ids.tolist() == [[3, 4, 5, 1]]
    assert proposal.parents.tolist() == [[-1, 0, 1, 1, 2]]
    check_tree(proposal.parents)


def test_nothing_is_proposed_without_a_match_and_rows_follow_select_rows() -> None:
    proposer = SuffixConfig().proposer()
    contexts = [[7, 8, 9, 10], CONTEXT]
    proposer.add_rows(torch.tensor([c + [0] * 6 for c in contexts[:1]] + [CONTEXT]), torch.tensor([4, 10]))
    assert _propose(proposer, contexts).token_ids.tolist() == [[-1, -1], [3, 4]]
    proposer.select_rows(torch.tensor([1]))
    assert _propose(proposer, contexts[1:]).token_ids.tolist() == [[3, 4]]
    proposer.select_rows(torch.tensor([], dtype=torch.long))
    assert proposer.rows == []
    lone = _proposer([7, 8, 9, 10])
    assert _propose(lone, [[7, 8, 9, 10]]).token_ids.shape == (1, 0)  # on CPU: no column at all


def test_committed_tokens_extend_the_rows_trie() -> None:
    proposer = _proposer([1, 2, 3, 4, 5, 6])
    assert _propose(proposer, [[1, 2, 3, 4, 5, 6]]).token_ids.shape == (1, 0)
    assert _propose(proposer, [[1, 2, 3, 4, 5, 6, 1, 2, 3]], k=8).token_ids.tolist() == [[4, 5, 6]]


def test_finished_responses_feed_the_global_cache_which_keeps_the_newest() -> None:
    proposer = SuffixConfig(suffix_decoding_max_cached_requests=2).proposer()
    responses = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    for response in responses:  # each a prompt [1] and its response, finishing
        context = [1, *response]
        proposer.add_rows(torch.tensor([[1, response[0]]]), torch.tensor([2]))
        proposer.on_finish(torch.tensor([context]), torch.tensor([len(context)]), torch.tensor([0]))
        proposer.select_rows(torch.tensor([], dtype=torch.long))
    assert len(proposer.cache) == 2 and sorted(proposer.cache.trie.texts.values()) == responses[1:]
    asked = [[5, 20, 21], [5, 30, 31], [5, 10, 11]]
    proposer.add_rows(torch.tensor(asked), torch.tensor([3, 3, 3]))
    assert _propose(proposer, asked).token_ids.tolist() == [[22, 23], [32, 33], [-1, -1]]  # 10.. evicted


def test_no_cached_requests_disables_the_global_cache() -> None:
    cache = SuffixCache(max_depth=24, max_requests=0)
    cache.add([1, 2, 3])
    assert len(cache) == 0 and cache.trie.texts == {}


def test_a_long_context_that_repeats_itself_proposes_its_latest_match() -> None:
    # What a proposal costs is the benchmark's to say (docs/internals.md#measured-choices), not a test's.
    rng = random.Random(1)
    words = [rng.randrange(1000) for _ in range(1000)]
    context = words + words[200:800] + words[100:500]  # 2,000 tokens that repeat themselves
    proposer = _proposer(context[:-1])
    for _ in range(3):  # proposing again, with nothing committed in between, proposes the same
        proposal = _propose(proposer, [context], k=8)
        assert proposal.token_ids.tolist() == [words[500:508]]


def test_config_rejects_suffix_options_out_of_range() -> None:
    for field, value in [
        ("suffix_decoding_max_tree_depth", 1),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_spec_factor", 0.0),
        ("suffix_decoding_min_token_prob", 1.5),
    ]:
        with pytest.raises(ValueError, match=f"SuffixConfig.{field} must be"):
            SpeculativeConfig.from_dict({"method": "suffix", field: value})
    with pytest.raises(ValueError, match="uses no draft model"):
        LLM(
            tiny_model("llama"),
            draft_model=tiny_model("llama"),
            speculative_config=SpeculativeConfig("suffix"),
        )


PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [9],
    [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4],
    [30, 31, 32, 33, 34, 30, 31, 32, 35, 30, 31],
]
MAX_TOKENS = 24


@pytest.mark.parametrize("tree", [None, "static"])
def test_greedy_output_matches_the_target_alone(tree: str | None) -> None:
    target = tiny_model("llama")
    expected = [hf_greedy(target, p, MAX_TOKENS, 1) for p in PROMPTS]
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=6, tree=tree, tree_nodes=6)
    llm = LLM(target, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    accepted, responses = 0, []
    for batch in (PROMPTS[:1], PROMPTS, PROMPTS[::-1]):  # later rounds draw on earlier responses
        outputs = llm.generate(batch, params)
        for prompt, out in zip(batch, outputs):
            assert_greedy_equal(target, prompt, out.outputs[0].token_ids, expected[PROMPTS.index(prompt)])
            assert out.metrics.num_accepted <= out.metrics.num_drafted <= 6 * out.metrics.num_steps
            accepted += out.metrics.num_accepted
            responses += [out.outputs[0].token_ids] if len(out.outputs[0].token_ids) > 1 else []
    assert accepted > 0
    assert sorted(llm.engine.proposer.cache.trie.texts.values()) == sorted(responses)  # on_finish's


@pytest.mark.parametrize("tree", [None, "static"])
def test_rows_joining_mid_run_give_their_tokens_alone(tree: str | None) -> None:
    target = tiny_model("llama", num_layers=2)
    # No global cache: with one, the seeded sampled row's drafts (so its text, not its distribution)
    # would depend on the responses that finished before it.
    spec = SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=3,
        tree=tree,
        tree_nodes=5,
        options=SuffixConfig(suffix_decoding_max_cached_requests=0),
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    alone = [
        LLM(target, speculative_config=spec).generate([p], s)[0].outputs[0].token_ids
        for p, s in zip(PROMPTS, params)
    ]
    llm = LLM(target, speculative_config=spec)
    engine = llm.engine
    sequences = [llm.make_sequences(PROMPTS[i], p, i) for i, p in enumerate(params)]
    engine.add(sequences[0])
    engine.step()
    engine.add(sequences[1])
    engine.step()
    engine.step()
    engine.add(sequences[2])
    while engine.sequences:
        engine.step()
    assert [s[0].output_token_ids for s in sequences] == alone


def test_sampled_output_follows_the_target_distribution() -> None:
    target = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, seed=0)
    prompt = [2, 3, 2, 3, 2, 3, 2]
    spec = SpeculativeConfig(
        method="suffix", num_speculative_tokens=2, options=SuffixConfig(suffix_decoding_max_spec_factor=4.0)
    )
    llm = LLM(target, speculative_config=spec, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    outputs = llm.generate([prompt] * (SAMPLES // 2), params)  # enough to catch a broken rule
    assert sum(o.metrics.num_drafted for o in outputs) > 0
    stat, dof = chi_square([o.outputs[0].token_ids for o in outputs], exact_probs(target, prompt, 1.0, -1))
    assert chi2.sf(stat, dof) > 1e-3, f"chi-square {stat:.1f} on {dof} dof"
