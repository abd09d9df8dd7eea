"""Prefix caching: a prompt that begins as an earlier one did prefills only the rest, from the K/V the
cache kept, and gives what it gives without the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, save_eagle_head_for, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.kv_cache import StaticKVCache
from speculative.methods.draft_model import DraftModelConfig
from speculative.precompile import PreCompileConfig
from speculative.prefix_cache import PrefixCache
from speculative.proposers import PrefixCachingProposer, Proposal
from speculative.sampling import SampleStrategy

SHARED = [(7 * i) % 90 + 2 for i in range(40)]  # a system prompt's worth of tokens
PROMPTS = [SHARED + [5, 6, 7], SHARED + [9] * 12, SHARED[:35], SHARED + list(range(20, 44))]
SETUPS = ["plain", "draft", "draft tree", "draft with lookup", "eagle", "eagle tree"]


def _llm(setup: str, tmp_path, noise: float = 0.03, **options) -> LLM:
    target = tiny_model("llama", num_layers=2)
    if setup == "plain":
        return LLM(target, **options)
    if setup.startswith("eagle"):
        head = save_eagle_head_for(target, tmp_path / "eagle")
        tree = "dynamic" if setup == "eagle tree" else None
        config = SpeculativeConfig(
            method="eagle", num_speculative_tokens=3, tree=tree, tree_width=2, tree_nodes=6
        )
        return LLM(target, draft_model=head, speculative_config=config, **options)
    tree = "dynamic" if setup == "draft tree" else None
    lookup = DraftModelConfig(prompt_lookup_min=1) if setup == "draft with lookup" else None
    config = SpeculativeConfig(
        num_speculative_tokens=3, tree=tree, tree_width=2, tree_nodes=6, options=lookup
    )
    return LLM(target, draft_model=noisy_copy(target, noise), speculative_config=config, **options)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=8, ignore_eos=True),
    ]


def _texts(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("setup", SETUPS)
def test_prompts_sharing_a_prefix_give_what_they_give_without_the_cache(setup, tmp_path) -> None:
    """Alone and in one batch, the first time (the cache filling as they go) and again (every prompt
    found but its last block or token): the same tokens as without the cache, and the same drafts
    accepted."""
    without = _llm(setup, tmp_path)
    expected = _texts(without.generate(PROMPTS, _params()))
    accepted = [o.metrics.num_accepted for o in without.generate(PROMPTS, _params())]
    llm = _llm(setup, tmp_path, enable_prefix_caching=True)
    first = [llm.generate([p], params)[0] for p, params in zip(PROMPTS, _params())]
    assert _texts(first) == expected
    assert [o.num_cached_tokens for o in first] == [0, 32, 32, 32]  # the first prompt's 2 whole blocks
    again = llm.generate(PROMPTS, _params())
    assert _texts(again) == expected
    assert [o.metrics.num_accepted for o in again] == accepted
    assert all(o.num_cached_tokens >= 32 for o in again)


def test_a_prefill_feeds_only_what_the_cache_lacks(monkeypatch) -> None:
    llm = LLM(tiny_model("llama", num_layers=2), enable_prefix_caching=True)
    once = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([SHARED], once)  # 40 tokens: blocks of 16 keep 32
    fed = []
    forward = llm.engine.target.forward

    def counted(ids, *args, **kwargs):
        fed.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(llm.engine.target, "forward", counted)
    (out,) = llm.generate([SHARED + [3] * 10], once)
    assert out.num_cached_tokens == 32
    assert fed == [18]  # 50 tokens, 32 of them found


def test_a_cached_prefix_gives_the_log_probabilities_of_a_whole_prefill() -> None:
    """The K/V found are the target's own: every generated token's log-probabilities (the first's
    from the prefill's logits) match a whole prefill's to float rounding."""
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    prompt = SHARED + [3] * 10
    (expected,) = LLM(tiny_model("llama", num_layers=2)).generate([prompt], params)
    llm = LLM(tiny_model("llama", num_layers=2), enable_prefix_caching=True)
    llm.generate([SHARED], params)
    (out,) = llm.generate([prompt], params)
    assert out.num_cached_tokens == 32
    for got, want in zip(out.outputs[0].logprobs, expected.outputs[0].logprobs, strict=True):
        assert got.keys() == want.keys()
        for token in want:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-5)


def test_a_next_turn_starts_from_the_last_turns_answer(tmp_path) -> None:
    """A finished request leaves its prompt and answer (all but the answer's last token) in the cache,
    and a next turn that repeats both finds them."""
    without = _llm("draft", tmp_path)
    llm = _llm("draft", tmp_path, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (first,) = llm.generate([SHARED[:20]], params)
    turn = SHARED[:20] + first.outputs[0].token_ids + [4, 5, 6]  # 53 tokens
    (second,) = llm.generate([turn], params)
    assert second.num_cached_tokens == 48  # 49 tokens held: 3 whole blocks
    assert second.outputs[0].token_ids == without.generate([turn], params)[0].outputs[0].token_ids


def _two_turns(llm: LLM, first_prompt: list[int]) -> tuple[list[int], object]:
    """A first turn, then a next one that repeats its prompt and answer; returns the next turn's
    prompt and output."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (first,) = llm.generate([first_prompt], params)
    turn = first_prompt + first.outputs[0].token_ids + [4, 5, 6]
    (second,) = llm.generate([turn], params)
    return turn, second


def test_a_draft_takes_in_only_what_the_cache_lacks_of_a_next_turn(tmp_path, monkeypatch) -> None:
    """The draft's prefill of a next turn starts after the blocks that hold its K/V: the first turn's
    prompt (given at its prefill) and what the first turn's row held when it finished."""
    llm = _llm("draft", tmp_path, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (first,) = llm.generate([SHARED[:20]], params)
    turn = SHARED[:20] + first.outputs[0].token_ids + [4, 5, 6]  # 53 tokens
    found = llm.engine.prefix_cache.match_draft(turn + [0]).num_tokens  # of the context its prefill sees
    assert found == 48  # the prompt's block and two of the answer's
    draft = llm.engine.proposer.model
    fed = []
    forward = draft.forward

    def counted(ids, *args, **kwargs):
        fed.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(draft, "forward", counted)
    (second,) = llm.generate([turn], params)
    assert (
        fed[0] == 53 - found
    )  # its prefill: the context (53 + 1 tokens) but the last, less the blocks found
    assert (
        second.outputs[0].token_ids
        == _llm("draft", tmp_path).generate([turn], params)[0].outputs[0].token_ids
    )


def test_the_engine_hands_its_prefix_cache_to_a_draft_alone(tmp_path) -> None:
    llm = _llm("draft with lookup", tmp_path, enable_prefix_caching=True)
    assert isinstance(llm.engine.proposer, PrefixCachingProposer)
    assert llm.engine.proposer.draft.prefix_cache is llm.engine.prefix_cache is not None
    llm.engine.use_prefix_cache(None)  # set aside: neither looks up nor keeps anything
    assert llm.engine.proposer.draft.prefix_cache is None
    assert not isinstance(_llm("eagle", tmp_path).engine.proposer, PrefixCachingProposer)


def _blocks_with(llm: LLM, part: str) -> list[tuple[list[int], torch.Tensor]]:
    """Every block that holds `part` ("draft_kv", "features"): the tokens up to its end, and the part."""
    found, stack = [], [(llm.engine.prefix_cache.root, [])]
    while stack:
        block, tokens = stack.pop()
        for key, child in block.children.items():
            if getattr(child, part) is not None:
                found.append((tokens + list(key), getattr(child, part)))
            stack.append((child, tokens + list(key)))
    return found


@pytest.mark.parametrize("setup", ["draft", "draft tree", "draft with lookup"])
def test_the_draft_kv_kept_are_the_drafts_own_of_those_tokens(setup, tmp_path) -> None:
    """Each block's draft K/V, given at a prefill that started from blocks found (the next turn's) or at
    a row's end (after steps whose drafts, or a lookup's tokens, the cache held past the context), equal
    the draft's K/V of the same tokens in one forward, to float rounding."""
    llm = _llm(setup, tmp_path, noise=0.5, enable_prefix_caching=True)  # a draft that is often wrong
    for length in range(17, 41, 3):  # rows that end at many points of a block
        params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
        llm.generate([[5, 6, 7, 8] * 5 + [length]], params)  # a lookup finds matches
    _two_turns(llm, SHARED[:20])
    blocks = _blocks_with(llm, "draft_kv")
    assert len(blocks) >= 15
    proposer = llm.engine.proposer
    _assert_drafts_own(getattr(proposer, "draft", proposer).model, blocks)


def _assert_drafts_own(draft, blocks: list[tuple[list[int], torch.Tensor]]) -> None:
    """Each block's draft K/V equal the draft's K/V of its tokens in one forward of all up to its end."""
    for tokens, kv in blocks:
        cache = draft.new_cache(1, len(tokens) + 1)
        draft.forward(torch.tensor([tokens]), cache, logits_indices=torch.zeros(1, 1, dtype=torch.long))
        whole = torch.stack([b[0, :, len(tokens) - 16 : len(tokens)] for b in (*cache.keys, *cache.values)])
        assert torch.allclose(kv, whole, rtol=1e-4, atol=1e-4), f"the block ending at token {len(tokens)}"


def test_a_finished_row_gives_no_draft_kv_of_lookup_tokens_its_draft_did_not_propose(tmp_path) -> None:
    """Where a row's last step kept a lookup's tokens, the draft cache holds the K/V of the draft's own
    tokens at their positions: the row gives the prefix cache only what came before that step."""
    llm = _llm("draft with lookup", tmp_path, noise=0.5, enable_prefix_caching=True)
    proposer = llm.engine.proposer
    context = [5, 6, 7, 8] * 7 + [5, 6, 7]  # 31 tokens: a lookup proposes 8, 5, 6
    tokens = torch.zeros(1, 64, dtype=torch.long)
    tokens[0, :31] = torch.tensor(context)
    proposer.add_rows(tokens, torch.tensor([31]))
    proposal = proposer.propose(tokens, torch.tensor([31]), 3, SampleStrategy.greedy(1, 96))
    assert proposal.token_ids.tolist() == [[8, 5, 6]]
    assert proposer._step[2].item() == 0  # the draft's own first token is not 8
    tokens[0, 31:35] = torch.tensor([8, 5, 6, 7])  # the step keeps the lookup's three and a fourth
    llm.engine.prefix_cache.store(tokens[0, :35].tolist(), llm.engine.target.new_cache(1, 64), 0, 34)
    proposer.on_finish(tokens, torch.tensor([35]), torch.tensor([0]))
    blocks = _blocks_with(llm, "draft_kv")
    assert [len(t) for t, _ in blocks] == [16]  # not the block of slots 16-31, whose slot 31 the step wrote
    _assert_drafts_own(proposer.draft.model, blocks)


def test_an_eagle_heads_next_turn_finds_its_last_answer_too(tmp_path) -> None:
    """The engine keeps the hidden states of a row's generated tokens for a proposer that reads them,
    so that its finished row's blocks hold them and a next turn finds its prompt and answer."""
    without = _llm("eagle", tmp_path)
    llm = _llm("eagle", tmp_path, enable_prefix_caching=True)
    turn, second = _two_turns(llm, SHARED[:20])
    (alone,) = without.generate([turn], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert second.num_cached_tokens == 48  # 49 tokens held: the prompt's block and two of the answer's
    assert second.outputs[0].token_ids == alone.outputs[0].token_ids
    assert second.metrics.num_accepted == alone.metrics.num_accepted
    assert not llm.engine.context_features._records  # every finished row's record was taken


def test_a_resumed_eagle_row_keeps_the_hidden_states_of_its_answer(tmp_path) -> None:
    """A row paused and resumed (its cache rebuilt from its tokens) still leaves the hidden states of
    its whole answer, so that a next turn finds it."""
    llm = _llm("eagle", tmp_path, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    sequences = llm.make_sequences(SHARED[:20], params)
    run = llm.engine.generate(sequences, chunk_steps=3)
    next(run)
    run.close()  # paused after its prefill and two steps
    assert 0 < len(sequences[0].output_token_ids) < 30
    llm.engine.run(sequences)
    (second,) = llm.generate([SHARED[:20] + sequences[0].output_token_ids + [4, 5, 6]], params)
    assert second.num_cached_tokens == 48


def test_the_hidden_states_kept_are_the_targets_own_of_those_tokens(tmp_path, monkeypatch) -> None:
    """A finished row's blocks hold the target's hidden states of its generated tokens as one forward
    over them computes them, wherever its steps' kept tokens fell: an oracle drafter (the target's own
    answer, its third draft wrong at every other step) keeps whole chains and cut ones, and the
    answers end at several points of a block."""
    llm = _llm("eagle", tmp_path, enable_prefix_caching=True)
    plain = LLM(tiny_model("llama", num_layers=2))
    proposer, context = llm.engine.proposer, []
    propose = proposer.propose

    def oracle(tokens, lengths, num_tokens, strategy) -> Proposal:
        propose(tokens, lengths, num_tokens, strategy)  # the head's own work, its drafts set aside
        at = int(lengths[0])
        drafts = (context[at : at + num_tokens] + [-1] * num_tokens)[:num_tokens]
        if at % 2 and num_tokens >= 3:
            drafts[2] = (drafts[2] + 1) % 96
        return Proposal(torch.tensor([drafts]), None)

    monkeypatch.setattr(proposer, "propose", oracle)
    accepted = 0
    for length, max_tokens in ((20, 30), (27, 25), (33, 31)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        answer = plain.generate([SHARED[:length]], params)[0].outputs[0].token_ids
        context[:] = SHARED[:length] + answer
        (out,) = llm.generate([SHARED[:length]], params)
        assert out.outputs[0].token_ids == answer
        accepted += out.metrics.num_accepted
    assert accepted >= 40
    blocks = _blocks_with(llm, "features")
    assert len(blocks) >= 7
    target = llm.engine.target
    for tokens, features in blocks:
        cache = target.new_cache(1, len(tokens) + 1)
        first = torch.zeros(1, 1, dtype=torch.long)
        _, hidden = target.forward(
            torch.tensor([tokens]), cache, logits_indices=first, hidden_layers=llm.engine.hidden_layers
        )
        assert torch.allclose(features, hidden[0, -16:], rtol=1e-4, atol=1e-4), (
            f"the block ending at {len(tokens)}"
        )


def test_a_chunked_prefill_starts_after_the_cached_prefix(tmp_path) -> None:
    without = _llm("draft", tmp_path)
    llm = _llm("draft", tmp_path, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm.generate([SHARED], SamplingParams(temperature=0.0, max_tokens=1))
    prompt = SHARED + list(range(30, 50))  # 60 tokens, 32 held
    sequences = llm.make_sequences(prompt, params)
    engine = llm.engine
    engine.begin_prefill(sequences)
    assert engine.prefilling.tokens_left == 28
    chunks = 0
    while engine.prefill_chunk(8) is None:
        chunks += 1
    assert chunks == 3  # 8 + 8 + 8, then the last 4 join
    while engine.sequences:
        engine.step()
    assert sequences[0].num_cached_tokens == 32
    assert sequences[0].output_token_ids == without.generate([prompt], params)[0].outputs[0].token_ids


def test_prompt_logprobs_are_computed_from_a_whole_prefill() -> None:
    llm = LLM(tiny_model("llama", num_layers=2), enable_prefix_caching=True)
    plain = LLM(tiny_model("llama", num_layers=2))
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    llm.generate([SHARED], params)
    (out,) = llm.generate([SHARED + [3, 4]], params)
    (expected,) = plain.generate([SHARED + [3, 4]], params)
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(expected.prompt_logprobs) == 42


def _cache_of(tokens: int, value: float) -> StaticKVCache:
    """One row of one layer holding `tokens` tokens, every K/V element `value` plus its position."""
    cache = StaticKVCache(1, 1, 1, 64, 2, torch.float32, "cpu")
    filled = value + torch.arange(64, dtype=torch.float32)[None, None, :, None].expand(1, 1, 64, 2)
    for buffer in (*cache.keys, *cache.values):
        buffer.copy_(filled)
    cache.advance(tokens, tokens)
    return cache


def test_blocks_load_back_as_stored_and_leave_the_last_token_to_feed() -> None:
    prefixes = PrefixCache(max_tokens=64, block_size=16)
    tokens = list(range(100, 140))
    prefixes.store(tokens, _cache_of(40, 1000.0), 0, 40)
    assert prefixes.num_tokens == 32
    assert prefixes.match(tokens[:33]).num_tokens == 32
    assert prefixes.match(tokens[:32]).num_tokens == 16  # a prompt of 32 must feed its last token
    assert prefixes.match([1] + tokens[1:33]).num_tokens == 0  # a block follows the very same tokens
    assert prefixes.match(tokens, with_features=True).num_tokens == 0  # none were given
    assert prefixes.peek(tokens[:33]) == 32  # what match would find, counted nowhere
    empty = StaticKVCache(1, 2, 1, 64, 2, torch.float32, "cpu")
    prefixes.load(prefixes.match(tokens), empty, [1])
    assert torch.equal(empty.keys[0][1, 0, :32, 0], 1000.0 + torch.arange(32.0))
    assert not empty.keys[0][0].any()
    assert (prefixes.queries, prefixes.hits) == (33 + 32 + 33 + 40 + 40, 32 + 16 + 32)


def test_the_cache_keeps_its_bound_dropping_the_least_recently_used_first() -> None:
    prefixes = PrefixCache(max_tokens=64, block_size=16)  # 4 blocks; past them, down to 3
    a, b, c = ([base + i for i in range(33)] for base in (100, 200, 300))
    prefixes.store(a, _cache_of(32, 0.0), 0, 32)
    prefixes.store(b, _cache_of(32, 0.0), 0, 32)
    assert prefixes.match(a).num_tokens == 32  # a is used after b
    prefixes.store(c, _cache_of(32, 0.0), 0, 32)  # 6 blocks: b's two go, then a's last
    assert prefixes.num_blocks == 3
    assert [prefixes.match(t).num_tokens for t in (a, b, c)] == [16, 0, 32]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(model_impl="transformers"), "needs the native forward"),
        (dict(precompile=PreCompileConfig(batch_size=1, prefill_length=[64])), "precompile"),
        (dict(prefix_cache_tokens=8), "prefix_cache_tokens must be an int >= 16"),
    ],
)
def test_prefix_caching_refuses_what_it_cannot_run(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model("llama", num_layers=2), enable_prefix_caching=True, **options)
