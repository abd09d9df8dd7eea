"""TokenContext and SampleStrategy.process over token trees (speculative.tree's convention).

The reference for every node is the chain made of that node's path alone: a TokenContext whose block is
the tokens of the path's nodes 1 .. i, at its last position. Every tree quantity (counts, seen,
num_generated, tail, row_context) and every context-dependent processor (penalties, min_tokens, bad
words, user processors of both arities, a grammar) must give, at each real node, exactly what that chain
gives; a chain written as a tree must give exactly the chain's results.
"""

from __future__ import annotations

import torch
from conftest import byte_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative import SamplingParams
from speculative.sampling.context import TokenContext
from speculative.sampling.guided import Guide, GuidedDecodingParams
from speculative.sampling.strategy import SampleStrategy
from speculative.tree import check_tree

V = 7  # vocabulary of the quantity tests
FAST = settings(max_examples=60, deadline=None, derandomize=True)


@st.composite
def trees(draw, vocab: int = V, alphabet: list[int] | None = None) -> TokenContext:
    """A random batch of trees: ragged context lengths and node counts, padding nodes at each row's end,
    garbage (valid ids) past each row's length, prompt boundaries anywhere in the context."""
    batch, q = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    token = st.sampled_from(alphabet) if alphabet else st.integers(0, vocab - 1)
    lengths = [draw(st.integers(1, 6)) for _ in range(batch)]
    width = max(lengths) + draw(st.integers(0, 3))
    tokens = torch.tensor([[draw(token) for _ in range(width)] for _ in range(batch)])
    prompt_lengths = [draw(st.integers(1, length)) for length in lengths]
    parents = torch.full((batch, q), -1, dtype=torch.long)
    block = torch.full((batch, q - 1), -1, dtype=torch.long)
    for row in range(batch):
        for i in range(1, draw(st.integers(1, q))):
            parents[row, i] = draw(st.integers(0, i - 1))
            block[row, i - 1] = draw(token)
    check_tree(parents)
    return TokenContext(tokens, torch.tensor(lengths), torch.tensor(prompt_lengths), block, vocab, parents)


def path_chain(ctx: TokenContext, row: int, node: int) -> TokenContext:
    """The chain context of one row whose block is node's path (its last position is the node's)."""
    block = ctx.block[row].tolist()
    path = [block[i - 1] for i in ctx.path_nodes(row, node)]
    return TokenContext(
        ctx.tokens[row : row + 1],
        ctx.lengths[row : row + 1],
        ctx.prompt_lengths[row : row + 1],
        torch.tensor([path], dtype=torch.long).reshape(1, len(path)),
        ctx.vocab_size,
    )


def walk_up(parents: list[int], node: int) -> list[int]:
    """The path's nodes by following parents (independent of TokenContext.path_nodes)."""
    path = []
    while parents[node] >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@FAST
@given(trees(), st.integers(1, 9))
def test_tree_quantities_equal_each_paths_chain(ctx: TokenContext, n: int) -> None:
    tail = ctx.tail(n)
    for row in range(ctx.tokens.shape[0]):
        parents = ctx.parents[row].tolist()
        for node in range(ctx.num_positions):
            path = ctx.path_nodes(row, node)
            assert path == walk_up(parents, node)
            chain = path_chain(ctx, row, node)
            last = len(path)
            assert torch.equal(ctx.output_counts[row, node], chain.output_counts[0, last])
            assert torch.equal(ctx.seen[row, node], chain.seen[0, last])
            assert ctx.num_generated[row, node] == chain.num_generated[0, last]
            assert torch.equal(tail[row, node], chain.tail(n)[0, last])
            assert ctx.row_context(row, node) == chain.row_context(0, last)


def test_a_small_tree_by_hand() -> None:
    """Context [5, 6 | 1] (prompt 5 6); nodes 1 (3) and 2 (4) under the root, 3 (2) under 1, 4 padding."""
    parents = torch.tensor([[-1, 0, 0, 1, -1]])
    block = torch.tensor([[3, 4, 2, -1]])
    ctx = TokenContext(torch.tensor([[5, 6, 1, 0]]), torch.tensor([3]), torch.tensor([2]), block, V, parents)
    assert [ctx.row_context(0, i)[1] for i in range(5)] == [[1], [1, 3], [1, 4], [1, 3, 2], [1]]
    assert ctx.num_generated.tolist() == [[1, 2, 2, 3, 1]]
    assert ctx.tail(3).tolist() == [[[5, 6, 1], [6, 1, 3], [6, 1, 4], [1, 3, 2], [5, 6, 1]]]
    assert ctx.tail(5)[0, 0].tolist() == [-1, -1, 5, 6, 1]
    assert ctx.output_counts[0, 3].tolist() == [0, 1, 1, 1, 0, 0, 0]
    assert ctx.leaves(0) == [2, 3] and ctx.real_nodes(0) == [0, 1, 2, 3]


@FAST
@given(st.integers(1, 3), st.integers(0, 5), st.integers(1, 5), st.data())
def test_a_chain_shaped_tree_is_the_chain(batch: int, k: int, n: int, data) -> None:
    """parents [-1, 0, ..., k - 1]: every quantity equals the chain's, at every position."""
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, 5), min_size=batch, max_size=batch)))
    prompt_lengths = torch.tensor([data.draw(st.integers(1, int(length))) for length in lengths])
    tokens = torch.randint(0, V, (batch, 8), generator=torch.Generator().manual_seed(k))
    drafts = st.lists(st.integers(0, V - 1), min_size=k, max_size=k)
    block = torch.tensor(data.draw(st.lists(drafts, min_size=batch, max_size=batch)), dtype=torch.long)
    block = block.reshape(batch, k)
    parents = torch.arange(-1, k).expand(batch, k + 1)
    chain = TokenContext(tokens, lengths, prompt_lengths, block, V)
    tree = TokenContext(tokens, lengths, prompt_lengths, block, V, parents)
    assert torch.equal(tree.output_counts, chain.output_counts)
    assert torch.equal(tree.seen, chain.seen)
    assert torch.equal(tree.num_generated, chain.num_generated)
    assert torch.equal(tree.tail(n), chain.tail(n))
    for row in range(batch):
        for position in range(k + 1):
            assert tree.path_nodes(row, position) == chain.path_nodes(row, position)
            assert tree.row_context(row, position) == chain.row_context(row, position)


# --- SampleStrategy.process ---------------------------------------------------------------------------------

EOS = 256
BYTES = 257  # the byte tokenizer's vocabulary: the width of the processing tests
TOKENIZER = byte_tokenizer()
A, B, C, X = TOKENIZER.encode("abcx")
ALPHABET = [A, B, C, X, EOS]  # tree tokens: often valid under the grammar, sometimes not
GUIDE = Guide.compile(GuidedDecodingParams(regex="[ab]*c[ab]?"), TOKENIZER, BYTES)


def shift_by_output(output, logits):
    """A user processor of arity 2: depends on the output's last token and length."""
    bonus = torch.zeros_like(logits)
    if output:
        bonus[output[-1]] = 0.5 * len(output)
    return logits + bonus


def punish_prompt(prompt, output, logits):
    """A user processor of arity 3: depends on the prompt and the output."""
    punished = logits.clone()
    punished[list(prompt)] -= 1.0 + len(output)
    return punished


def row_setups() -> list[tuple[SamplingParams, list[int], list[list[int]], bool]]:
    """(params, stop ids, bad words, guided) of each row of the processing tests."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.5}
    return [
        (SamplingParams(temperature=1.0, min_tokens=4, **penalties), [EOS, C], [], False),
        (
            SamplingParams(temperature=1.0, logits_processors=[shift_by_output, punish_prompt]),
            [EOS],
            [[A, B], [B, B, C], [X]],
            False,
        ),
        (SamplingParams(temperature=1.0, repetition_penalty=2.0), [EOS], [], True),
        (
            SamplingParams(temperature=0.0, min_tokens=3, logits_processors=[punish_prompt], **penalties),
            [EOS, X],
            [[C, A]],
            True,
        ),
    ]


def strategy_for(rows: list[int], states: dict) -> SampleStrategy:
    """The strategy of the given rows of row_setups (repeats allowed), with one guide state per row."""
    setups = [row_setups()[r % 4] for r in rows]
    width = max(len(s[1]) for s in setups)
    stop_ids = torch.tensor([s[1] + [-1] * (width - len(s[1])) for s in setups])
    guides = [states.setdefault(r, GUIDE.new_state()) if s[3] else None for r, s in zip(rows, setups)]
    return SampleStrategy(
        [s[0] for s in setups],
        BYTES,
        "cpu",
        stop_ids=stop_ids,
        bad_words=[s[2] for s in setups],
        guides=guides,
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(trees(vocab=BYTES, alphabet=ALPHABET), st.integers(0, 2**31 - 1))
def test_process_on_a_tree_equals_each_path_as_a_chain(ctx: TokenContext, seed: int) -> None:
    batch, q = ctx.parents.shape
    rows = [(seed + b) % 4 for b in range(batch)]  # which of row_setups each row has
    states: dict = {}
    logits = torch.randn(batch, q, BYTES, generator=torch.Generator().manual_seed(seed))
    tree = strategy_for(rows, states)
    out = tree.process(logits, ctx)
    assert tree.take_failures() == {}
    for b, setup in enumerate(rows):
        chain_strategy = strategy_for([setup], states)  # the same guide state: masks leave it unchanged
        for node in ctx.real_nodes(b):
            chain = path_chain(ctx, b, node)
            path_logits = logits[b, [0, *ctx.path_nodes(b, node)]][None]
            expected = chain_strategy.process(path_logits, chain)[0, -1]
            assert torch.equal(out[b, node], expected), (b, node)
        assert chain_strategy.take_failures() == {}


def test_user_processors_skip_padding_nodes() -> None:
    calls = []

    def record(output, logits):
        calls.append(list(output))
        return logits + 1.0

    parents = torch.tensor([[-1, 0, 0, 2, -1, -1]])
    block = torch.tensor([[A, B, C, -1, -1]])
    ctx = TokenContext(torch.tensor([[A, B]]), torch.tensor([2]), torch.tensor([1]), block, BYTES, parents)
    strategy = SampleStrategy([SamplingParams(logits_processors=[record])], BYTES, "cpu")
    out = strategy.process(torch.zeros(1, 6, BYTES), ctx)
    assert calls == [[B], [B, A], [B, B], [B, B, C]]
    assert (out[0, :4] == 1).all() and (out[0, 4:] == 0).all()


def test_guide_masks_follow_each_nodes_path() -> None:
    """Under [ab]*c[ab]?: after "c" only a, b or EOS; after "cb" only EOS; the sibling "a" keeps [abc]."""
    parents = torch.tensor([[-1, 0, 1, 0, -1]])
    block = torch.tensor([[C, B, A, -1]])
    ctx = TokenContext(torch.tensor([[A]]), torch.tensor([1]), torch.tensor([1]), block, BYTES, parents)
    strategy = SampleStrategy([SamplingParams()], BYTES, "cpu", guides=[GUIDE.new_state()])
    allowed = strategy.process(torch.zeros(1, 5, BYTES), ctx).isfinite()
    assert allowed[0, 0].nonzero().flatten().tolist() == [A, B, C]
    assert allowed[0, 1].nonzero().flatten().tolist() == [A, B, EOS]
    assert allowed[0, 2].nonzero().flatten().tolist() == [EOS]
    assert allowed[0, 3].nonzero().flatten().tolist() == [A, B, C]
    assert allowed[0, 4].all()  # padding: untouched


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(0, 5), st.integers(-1, 5), st.integers(0, 2**31 - 1))
def test_process_on_a_chain_shaped_tree_is_the_chains(k: int, missing: int, seed: int) -> None:
    """A chain as a tree: exactly the chain's result at every used position; a missing draft (-1 in
    the chain's block, from `missing` on) is the tree's padding from there."""
    rng = torch.Generator().manual_seed(seed)
    batch = 4
    tokens = torch.tensor(ALPHABET)[torch.randint(0, 5, (batch, 6), generator=rng)]
    lengths, prompt_lengths = torch.tensor([3, 1, 6, 4]), torch.tensor([1, 1, 2, 4])
    block = torch.tensor(ALPHABET)[torch.randint(0, 5, (batch, k), generator=rng)]
    parents = torch.arange(-1, k).repeat(batch, 1)
    used = k + 1
    if 0 <= missing < k:
        block[1:, missing:] = -1  # row 0 keeps its whole chain
        parents[1:, missing + 1 :] = -1
        used = missing + 1
    logits = torch.randn(batch, k + 1, BYTES, generator=rng)
    states: dict = {}
    strategy = strategy_for(list(range(batch)), states)
    chain = strategy.process(logits, TokenContext(tokens, lengths, prompt_lengths, block, BYTES))
    tree = strategy.process(logits, TokenContext(tokens, lengths, prompt_lengths, block, BYTES, parents))
    assert torch.equal(tree[0], chain[0])
    assert torch.equal(tree[:, :used], chain[:, :used])
    assert strategy.take_failures() == {}
