"""Guided decoding masks (speculative.sampling.guided) on the in-process byte tokenizer.

Random walks check every mask against an oracle: a fresh state that accepts the same tokens, with its
mask computed by llguidance's plain single-matcher call (not the executor path the module uses).
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from conftest import byte_tokenizer

from speculative.sampling.guided import Guide, GuidedDecodingParams, GuideState, allowed_for_blocks

EOS = 256
N_TOK = 257  # the byte tokenizer's vocabulary

COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": COLORS}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]+"
CHOICES = ["red", "green", "blue", "rouge", "réponse"]
GRAMMAR = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


TOK = byte_tokenizer()


@pytest.fixture(scope="module")
def tok():
    return TOK


def oracle_mask(state: GuideState, vocab_size: int) -> torch.Tensor:
    """The state's allowed tokens by llguidance's single-matcher bitmask, as bool [vocab_size]."""
    words = np.frombuffer(state._matcher.compute_bitmask(), dtype=np.uint8)
    bits = np.unpackbits(words, bitorder="little")[:N_TOK].astype(bool)
    out = torch.zeros(vocab_size, dtype=torch.bool)
    out[:N_TOK] = torch.from_numpy(bits)
    return out


def fresh_after(guide: Guide, tokens: list[int]) -> GuideState:
    state = guide.new_state()
    state.accept(tokens)
    return state


def random_drafts(guide: Guide, committed: list[int], rng: random.Random, k: int) -> list[int]:
    """k drafts: a valid continuation, sometimes corrupted at a random position."""
    scratch = fresh_after(guide, committed)
    drafts = []
    for _ in range(k):
        allowed = oracle_mask(scratch, guide.vocab_size).nonzero().flatten().tolist()
        t = rng.choice(allowed)
        drafts.append(t)
        scratch.accept([t])
    if rng.random() < 0.5 and k:
        drafts[rng.randrange(k)] = rng.randrange(guide.vocab_size)  # usually invalid, sometimes out of range
    return drafts


def check_block(guide: Guide, state: GuideState, committed: list[int], drafts: list[int]) -> torch.Tensor:
    """allowed_for_block(drafts) against the oracle, row by row; returns the block."""
    block = state.allowed_for_block(drafts)
    assert block.dtype == torch.bool and block.shape == (len(drafts) + 1, guide.vocab_size)
    assert not block[:, N_TOK:].any(), "ids past the tokenizer must never be allowed"
    ref = fresh_after(guide, committed)
    for j in range(len(drafts) + 1):
        expected = oracle_mask(ref, guide.vocab_size)
        assert torch.equal(block[j], expected), f"row {j} after drafts {drafts[:j]}"
        if j == len(drafts):
            break
        t = drafts[j]
        if not (t < guide.vocab_size and expected[t]):  # invalid draft: later rows are never reached
            assert block[j + 1 :, :N_TOK].all()
            break
        ref.accept([t])
    return block


def walk(guide: Guide, rng: random.Random, max_steps: int = 400) -> list[int]:
    """Emit uniformly random allowed tokens, checking blocks of random drafts, until finished."""
    state = guide.new_state()
    committed: list[int] = []
    for _ in range(max_steps):
        if state.finished:
            break
        drafts = random_drafts(guide, committed, rng, rng.randrange(0, 5))
        block = check_block(guide, state, committed, drafts)
        row0 = block[0]
        assert bool(row0[EOS]) == state.can_end, "EOS allowed exactly when the grammar can end"
        before = state.allowed_for_block([])
        assert torch.equal(before[0], row0), "allowed_for_block must leave the state unchanged"
        if rng.random() < 0.3 and drafts:  # commit several tokens at once: a valid prefix of the drafts
            n = 0
            while n < len(drafts) and block[n, drafts[n]] and drafts[n] != EOS:
                n += 1
            emitted = drafts[:n] + [rng.choice(block[n].nonzero().flatten().tolist())]
        else:
            emitted = [rng.choice(row0.nonzero().flatten().tolist())]
        state.accept(emitted)
        committed += emitted
        if EOS in emitted:
            assert state.finished
    assert state.finished, f"walk did not finish: {committed}"
    end = state.allowed_for_block([EOS])
    only_eos = torch.zeros(guide.vocab_size, dtype=torch.bool)
    only_eos[EOS] = True
    assert torch.equal(end[0], only_eos) and torch.equal(end[1], only_eos)
    assert committed[-1] == EOS or EOS not in committed
    return [t for t in committed if t != EOS]


def text_of(tok, tokens: list[int]) -> str:
    return tok.decode(tokens)


def ids(text: str) -> list[int]:
    return TOK.encode(text)


# --- parameters --------------------------------------------------------------------------------


def test_params_need_exactly_one_field():
    with pytest.raises(ValueError, match="none"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="regex, choice"):
        GuidedDecodingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="json, json_object"):
        GuidedDecodingParams(json={"type": "object"}, json_object=True)
    with pytest.raises(ValueError):
        GuidedDecodingParams(choice=[])
    with pytest.raises(ValueError):
        GuidedDecodingParams(choice="abc")
    assert GuidedDecodingParams(json_object=True).kind() == "json_object"


@pytest.mark.parametrize(
    "params",
    [
        GuidedDecodingParams(regex="[0-9"),
        GuidedDecodingParams(json="{not json"),
        GuidedDecodingParams(json={"type": "no-such-type"}),
        GuidedDecodingParams(grammar="start: undefined_rule"),
    ],
)
def test_bad_constraint_is_value_error_at_compile(tok, params):
    with pytest.raises(ValueError):
        Guide.compile(params, tok, N_TOK)


def test_compile_is_cached(tok):
    a = Guide.compile(GuidedDecodingParams(json=SCHEMA), tok, N_TOK)
    assert Guide.compile(GuidedDecodingParams(json=json.dumps(SCHEMA)), tok, N_TOK) is a
    assert Guide.compile(GuidedDecodingParams(json=SCHEMA), tok, N_TOK + 3) is not a
    assert Guide.compile(GuidedDecodingParams(json=SCHEMA), byte_tokenizer(), N_TOK) is not a


# --- random walks --------------------------------------------------------------------------------


def test_json_schema_walks(tok):
    guide = Guide.compile(GuidedDecodingParams(json=SCHEMA), tok, N_TOK)
    rng = random.Random(0)
    for _ in range(50):
        value = json.loads(text_of(tok, walk(guide, rng)))
        assert set(value) == {"color", "ok"}
        assert value["color"] in COLORS and isinstance(value["ok"], bool)


def test_json_object_walks(tok):
    guide = Guide.compile(GuidedDecodingParams(json_object=True), tok, N_TOK)
    rng = random.Random(1)
    done = 0
    for _ in range(10):
        state, committed = guide.new_state(), []
        # any JSON object: steer toward closing it (uniform walks inside strings run long)
        for _ in range(300):
            if state.finished:
                break
            allowed = state.allowed_for_block([])[0].nonzero().flatten().tolist()
            close = [t for t in allowed if t in [EOS] + ids('}"0')]
            t = rng.choice(close if close and rng.random() < 0.7 else allowed)
            state.accept([t])
            committed.append(t)
        if state.finished:
            assert isinstance(json.loads(text_of(tok, [t for t in committed if t != EOS])), dict)
            done += 1
    assert done >= 5


def test_regex_walks(tok):
    guide = Guide.compile(GuidedDecodingParams(regex=REGEX), tok, N_TOK + 7)  # logits wider than vocab
    rng = random.Random(2)
    for _ in range(15):
        assert re.fullmatch(REGEX, text_of(tok, walk(guide, rng)))


def test_choice_walks(tok):
    guide = Guide.compile(GuidedDecodingParams(choice=CHOICES), tok, N_TOK)
    rng = random.Random(3)
    seen = set()
    for _ in range(20):
        text = text_of(tok, walk(guide, rng))
        assert text in CHOICES
        seen.add(text)
    assert len(seen) >= 3


def _parse_expr(s: str, i: int = 0) -> int:
    """Index after an expr starting at i (the grammar above), or raise."""
    i = _parse_term(s, i)
    while i < len(s) and s[i] in "+-":
        i = _parse_term(s, i + 1)
    return i


def _parse_term(s: str, i: int) -> int:
    if i < len(s) and s[i] == "(":
        i = _parse_expr(s, i + 1)
        assert s[i] == ")"
        return i + 1
    m = re.compile(r"[0-9]{1,3}").match(s, i)
    assert m, (s, i)
    return m.end()


def test_grammar_walks(tok):
    guide = Guide.compile(GuidedDecodingParams(grammar=GRAMMAR), tok, N_TOK + 7)
    rng = random.Random(4)
    for _ in range(15):
        text = text_of(tok, walk(guide, rng))
        assert _parse_expr(text) == len(text), text


# --- state handling --------------------------------------------------------------------------------


def test_allowed_for_block_leaves_state_unchanged(tok):
    guide = Guide.compile(GuidedDecodingParams(regex=REGEX), tok, N_TOK)
    state = guide.new_state()
    state.accept(ids("12"))
    before = state.allowed_for_block([])
    for drafts in (ids("3-ab"), ids("3-ab") + [EOS, EOS], ids("x12"), ids("3") + [300, 5], []):
        first = state.allowed_for_block(drafts)
        again = state.allowed_for_block(drafts)
        assert torch.equal(first, again)
        assert torch.equal(state.allowed_for_block([])[0], before[0])
    block = state.allowed_for_block(ids("3-a") + [EOS, EOS])
    assert block[3, EOS] and block[3, :256].sum() == 26  # after "123-a": a letter or EOS
    only_eos = torch.zeros(N_TOK, dtype=torch.bool)
    only_eos[EOS] = True
    assert torch.equal(block[4], only_eos) and torch.equal(block[5], only_eos)  # finished after EOS
    assert not block[:3, EOS].any()  # EOS not before the grammar can end


def test_accept_disallowed_raises_and_commits_nothing(tok):
    guide = Guide.compile(GuidedDecodingParams(regex=REGEX), tok, N_TOK + 7)
    state = guide.new_state()
    state.accept(ids("12"))
    before = state.allowed_for_block([])
    for bad in (ids("a"), ids("3-1"), [EOS], ids("3") + [N_TOK + 2], [-1]):
        with pytest.raises(ValueError):
            state.accept(bad)
        assert torch.equal(state.allowed_for_block([]), before)
        assert state.num_accepted == 2
    state.accept(ids("3-z"))
    assert state.can_end and not state.finished
    state.accept([EOS])
    assert state.finished
    state.accept([EOS])  # EOS again once finished: allowed, a no-op
    with pytest.raises(ValueError):
        state.accept(ids("q"))


def test_advance_valid_prefix_and_rollback(tok):
    """Drafting walks: advance counts what the grammar allows (EOS after its end included), valid_prefix
    looks without moving, rollback undoes every advance; nothing is committed."""
    guide = Guide.compile(GuidedDecodingParams(regex=REGEX), tok, N_TOK)
    state = guide.new_state()
    state.accept(ids("12"))
    before = state.allowed_for_block([])
    assert state.advance(ids("3-")) == 2
    assert torch.equal(state.allowed_for_block([]), fresh_after(guide, ids("123-")).allowed_for_block([]))
    assert state.valid_prefix(ids("ab") + [EOS, EOS] + ids("c")) == 4
    assert state.valid_prefix(ids("a1")) == 1 and state.valid_prefix([N_TOK + 1]) == 0
    assert state.advance(ids("q") + [EOS, EOS]) == 3 and state.finished
    state.rollback()
    assert torch.equal(state.allowed_for_block([]), before) and state.num_accepted == 2
    state.accept(ids("3-z"))  # commits as if no walk had happened
    assert state.can_end


def test_batched_blocks_match_single(tok):
    guides = [
        Guide.compile(GuidedDecodingParams(regex=REGEX), tok, N_TOK),
        Guide.compile(GuidedDecodingParams(json=SCHEMA), tok, N_TOK),
        Guide.compile(GuidedDecodingParams(choice=CHOICES), tok, N_TOK),
    ]
    states = [g.new_state() for g in guides]
    states[0].accept(ids("4"))
    drafts = [ids("56-q"), ids('{"c'), ids("rx")]
    blocks = allowed_for_blocks(states, drafts)
    for state, d, block in zip(states, drafts, blocks):
        assert torch.equal(block, state.allowed_for_block(d))
    with pytest.raises(ValueError):
        allowed_for_blocks([states[0], states[0]], [[], []])


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
def test_constraints_at_a_dead_end_fail_their_row_alone(speculate):
    """allowed_token_ids {"{", "a"} with a JSON object grammar: "{" first, then nothing is allowed by
    both (and allowed_token_ids {"a"} with bad_words ["a"]: nothing from the start). Each such row
    ends with finish_reason "error" and NoTokenAllowed's message, never a forbidden token; the row
    beside them runs as it would alone."""
    from conftest import noisy_copy, tiny_model

    from speculative import LLM, SamplingParams, SpeculativeConfig

    target = tiny_model("llama", vocab_size=N_TOK, eos_token_id=EOS, bos_token_id=EOS)
    kwargs = dict(
        draft_model=noisy_copy(target, 0.02), speculative_config=SpeculativeConfig(num_speculative_tokens=3)
    )
    llm = LLM(target, tokenizer=TOK, **(kwargs if speculate else {}))
    brace, a = (TOK.convert_tokens_to_ids(TOK.tokenize(c))[0] for c in "{a")
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=8,
            allowed_token_ids=[brace, a],
            guided_decoding=GuidedDecodingParams(json_object=True),
        ),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=[a], bad_words=["a"]),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    prompt = TOK("x = ")["input_ids"]
    rows = [llm.make_sequences(prompt, p, index) for index, p in enumerate(params)]
    for index, row in enumerate(rows):
        for s in row:
            s.prompt_index = index
    llm.engine.add([s for row in rows for s in row])
    while not all(s.finished for row in rows for s in row):
        llm.engine.step()
    (dead,), (banned,), (fine,) = rows
    assert dead.finish_reason == "error" and dead.output_token_ids == [brace]
    assert dead.error == (
        "SamplingParams.allowed_token_ids and guided_decoding leave no token allowed after 1 generated tokens"
    )
    assert banned.finish_reason == "error" and banned.output_token_ids == []
    assert banned.error.startswith("SamplingParams.allowed_token_ids and bad_words leave no token allowed")
    alone = llm.generate([prompt], params[2])[0].outputs[0]
    assert fine.finish_reason == "length" and fine.output_token_ids == alone.token_ids
