"""Drafters that see the grammar (speculative/proposers/grammar.py): a draft model draws guided rows
under their grammar's mask, deterministic proposals are cut where the grammar forbids a draft.

The output stays exact (greedy: the target's own tokens under the grammar; sampled: a chi-square test
against probabilities enumerated with masks written by hand, which catches a rule given the unmasked
draft distribution), and guided rows accept about as often as unguided ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import byte_tokenizer, char_tokenizer, noisy_copy, tiny_model
from scipy.stats import chi2
from test_distribution import LENGTH, SAMPLES, VOCAB, chi_square

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.proposers.base import Proposal
from speculative.proposers.grammar import GrammarWalk, cut_to_grammar
from speculative.sampling.guided import Guide, GuidedDecodingParams
from speculative.tree import check_tree

BYTES = byte_tokenizer()
EOS = 256
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "name", "ok", "count"],
    "additionalProperties": False,
}


def ids(text: str) -> list[int]:
    return BYTES.encode(text)


def draft_blind(patch: pytest.MonkeyPatch) -> None:
    """Drafting as before grammar.py: the draft model does not see the grammar."""
    patch.setattr(GrammarWalk, "choose", lambda self, next_tokens: next_tokens)
    patch.setattr(GrammarWalk, "masked", lambda self, logits: logits)


# --- the walk and the cut --------------------------------------------------------------------------------


def test_walk_draws_under_the_targets_masks_and_rolls_back():
    """Each position's mask is the one the target's verification computes after the drafts before it
    (allowed_for_block), through a draft EOS (then EOS only); the matchers end where they started."""
    regex = Guide.compile(GuidedDecodingParams(regex="[0-9]{2}[a-z]"), BYTES, 257)
    schema = Guide.compile(GuidedDecodingParams(json=SCHEMA), BYTES, 257)
    states = [regex.new_state(), None, schema.new_state()]
    states[0].accept(ids("4"))
    states[2].accept(ids('{"color":"r'))
    before = [s.allowed_for_block([]) if s else None for s in states]
    scores = torch.randn(3, 257, generator=torch.Generator().manual_seed(0))
    scores[0, EOS] = 100.0  # row 0 draws EOS as soon as the grammar allows it

    walk = GrammarWalk(states, 257)
    choose = walk.choose(lambda logits: logits.max(dim=-1).indices)
    drafts = torch.stack([choose(scores.clone()) for _ in range(4)], dim=1)  # [3, 4]
    masked = walk.masked(scores[:, None].expand(3, 4, 257))
    rows = drafts.tolist()
    assert rows[0][2:] == [EOS, EOS] and rows[0][0] in ids("0123456789")
    for row, state in enumerate(states):
        allowed = state.allowed_for_block(rows[row]) if state else torch.ones(5, 257, dtype=torch.bool)
        assert torch.equal(torch.isfinite(masked[row]), allowed[:4]), row
        assert state is None or torch.equal(state.allowed_for_block([]), before[row])
    assert states[0].num_accepted == 1 and states[2].num_accepted == len(ids('{"color":"r'))


def test_cut_chains_at_the_first_forbidden_draft():
    guide = Guide.compile(GuidedDecodingParams(regex="[0-9]+x"), BYTES, 257)
    states = [guide.new_state(), None, guide.new_state()]
    chains = torch.tensor([ids("12a3"), ids("abc") + [-1], ids("5x") + [EOS] + ids("7")])
    token_ids, probs, parents = cut_to_grammar(Proposal(chains, None), states)
    assert probs is None and parents is None
    assert token_ids.tolist() == [ids("12") + [-1], ids("abc"), ids("5x") + [EOS]]  # narrowed to 3
    assert states[0].valid_prefix(ids("5x") + [EOS, EOS]) == 4  # EOS after the end: allowed, a no-op
    only_guided = cut_to_grammar(Proposal(chains[[0]], None), states[:1])[0]
    assert only_guided.tolist() == [ids("12")]
    assert cut_to_grammar(Proposal(chains[[0]][:, 2:], None), states[:1])[0].shape == (1, 0)


def test_cut_prunes_forbidden_subtrees():
    """Node i's token is tokens[i - 1]; a node the grammar forbids after its path becomes padding with
    everything below it, the rest stays."""
    guide = Guide.compile(GuidedDecodingParams(regex="[0-9]+x"), BYTES, 257)
    # nodes 1-6: "1" and "a" under the root, "2" and "a" under 1, "x" under 3, "3" under 2; 7 padding.
    # Paths: "1", "12", "12x" allowed; "a", "1a" forbidden; "a3" below a forbidden node.
    tokens = torch.tensor([ids("1a2ax3") + [-1]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2, -1]])
    cut = cut_to_grammar(Proposal(tokens, None, parents), [guide.new_state()])
    check_tree(cut.parents)
    assert cut.parents.tolist() == [[-1, 0, -1, 1, -1, 3, -1, -1]]
    assert cut.token_ids.tolist() == [ids("1") + [-1] + ids("2") + [-1] + ids("x") + [-1, -1]]


# --- exactness ---------------------------------------------------------------------------------------------

GREEDY_CONFIGS = {
    "draft": dict(draft=True),
    "draft_tree": dict(draft=True, tree="dynamic", tree_width=2, tree_nodes=6),
    "ngram": dict(method="ngram"),
    "ngram_tree": dict(method="ngram", tree="static", tree_nodes=6),
    "suffix": dict(method="suffix"),
}


@pytest.fixture(scope="module")
def byte_pair():
    target = tiny_model("llama", vocab_size=257, eos_token_id=EOS, bos_token_id=EOS)
    return target, noisy_copy(target, 0.05)


def greedy_outputs(byte_pair, config: dict | None, ignore_eos: bool = False) -> list:
    """Greedy JSON after three prompts: the target alone (config None) or speculating with `config`."""
    target, draft = byte_pair
    config = dict(config or {})
    kwargs = dict(draft_model=draft) if config.pop("draft", False) else {}
    if config or kwargs:
        kwargs["speculative_config"] = SpeculativeConfig(num_speculative_tokens=4, **config)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=80,
        ignore_eos=ignore_eos,
        guided_decoding=GuidedDecodingParams(json=SCHEMA),
    )
    llm = LLM(target, tokenizer=BYTES, **kwargs)
    return llm.generate(['x = {"a": 1}\ny = ', "{", 'config = {"color": "red", "name": "'], params)


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(byte_pair) -> list[list[int]]:
    return token_ids(greedy_outputs(byte_pair, None))


@pytest.mark.parametrize("config", list(GREEDY_CONFIGS.values()), ids=list(GREEDY_CONFIGS))
def test_greedy_guided_output_is_the_target_alone(byte_pair, plain, config):
    """Every drafter, chains and trees, to the grammar's end (EOS)."""
    spec = greedy_outputs(byte_pair, config)
    assert token_ids(spec) == plain
    assert all(o.outputs[0].finish_reason == "stop" for o in spec)
    assert sum(o.metrics.num_accepted for o in spec) > 0


def test_greedy_guided_drafting_past_the_grammars_end(byte_pair):
    """With ignore_eos a row goes on after the grammar's end, where it allows only EOS: the draft
    model drafts EOS there too, and the output stays the target's."""
    spec = greedy_outputs(byte_pair, GREEDY_CONFIGS["draft"], ignore_eos=True)
    assert token_ids(spec) == token_ids(greedy_outputs(byte_pair, None, ignore_eos=True))
    ended = [o.outputs[0].token_ids for o in spec if o.outputs[0].token_ids[-1] == EOS]
    assert ended and all(ids[-8:] == [EOS] * 8 for ids in ended)


def test_greedy_guided_output_is_the_blind_drafters(byte_pair, monkeypatch):
    """The grammar-aware draft model and the blind one (drafting as before) give the same tokens; the
    aware one has more of its drafts accepted."""
    aware = greedy_outputs(byte_pair, GREEDY_CONFIGS["draft"])
    draft_blind(monkeypatch)
    blind = greedy_outputs(byte_pair, GREEDY_CONFIGS["draft"])
    assert token_ids(aware) == token_ids(blind)
    assert sum(o.metrics.num_accepted for o in aware) > sum(o.metrics.num_accepted for o in blind)


CHARS = "abcd012"  # ids 0-6, EOS 7: VOCAB tokens
REGEX = "[ab][0-2a][cd1]+"
ALLOWED = [set("ab"), set("012a"), set("cd1")]  # each of the first three positions' characters, by hand
PROMPT = [0, 4, 3]  # "a0d"
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def char_pair():
    """test_distribution's pair, on the character tokenizer's vocabulary (EOS 7)."""
    ends = dict(eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1)
    target = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, seed=0, **ends)
    draft = tiny_model("llama", vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=5, **ends)
    return target, draft


def exact_guided_probs(model) -> np.ndarray:
    """P(x_1..x_3 | PROMPT) under the target with the hand-written masks and TEMPERATURE, enumerated."""
    masks = torch.zeros(LENGTH, VOCAB, dtype=torch.bool)
    for position, chars in enumerate(ALLOWED):
        masks[position, [CHARS.index(c) for c in chars]] = True

    def dist(output: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + output])).logits[0, -1].double()
        return (logits.masked_fill(~masks[len(output)], float("-inf")) / TEMPERATURE).softmax(-1)

    probs = np.zeros((VOCAB,) * LENGTH)
    q1 = dist([])
    for a in masks[0].nonzero().flatten().tolist():
        q2 = dist([a])
        for b in masks[1].nonzero().flatten().tolist():
            probs[a, b] = (q1[a] * q2[b] * dist([a, b])).numpy()
    return probs.ravel()


def guided_p_value(char_pair, method: str) -> float:
    """The chi-square p-value of SAMPLES guided continuations drafted by `method` (k = 2)."""
    target, draft = char_pair
    llm = LLM(
        target,
        draft_model=draft if method == "draft_model" else None,
        tokenizer=char_tokenizer(CHARS),
        speculative_config=SpeculativeConfig(method, num_speculative_tokens=2),
        seed=21,
    )
    params = SamplingParams(
        temperature=TEMPERATURE, max_tokens=LENGTH, guided_decoding=GuidedDecodingParams(regex=REGEX)
    )
    outputs = llm.generate([PROMPT] * SAMPLES, params)
    samples = [o.outputs[0].token_ids for o in outputs]
    assert all(len(s) == LENGTH for s in samples)
    assert sum(o.metrics.num_accepted for o in outputs) > SAMPLES // 5
    stat, dof = chi_square(samples, exact_guided_probs(target))
    return chi2.sf(stat, dof)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampled_guided_drafting_is_exact(char_pair, method):
    assert guided_p_value(char_pair, method) > 1e-3


def test_unmasked_draft_probs_in_the_rule_fail(char_pair, monkeypatch):
    """Drafting under the mask but giving the rule the unmasked draft distribution is caught."""
    monkeypatch.setattr(GrammarWalk, "masked", lambda self, logits: logits)
    assert guided_p_value(char_pair, "draft_model") < 1e-6


# --- acceptance ----------------------------------------------------------------------------------------


def acceptance(llm: LLM, guided: bool) -> float:
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=64,
        ignore_eos=not guided,
        guided_decoding=GuidedDecodingParams(json=SCHEMA) if guided else None,
    )
    outputs = llm.generate(["x = ", "{", "data = ", "print("], params)
    return sum(o.metrics.num_accepted for o in outputs) / sum(o.metrics.num_drafted for o in outputs)


def test_guided_rows_accept_as_often_as_unguided(monkeypatch):
    """On a target and its slightly noisy copy, sampled JSON rows accept at least as often as unguided
    rows on the same prompts; drafting blind to the grammar (as before) accepted few drafts."""
    target = tiny_model("llama", vocab_size=257, eos_token_id=EOS, bos_token_id=EOS)
    llm = LLM(
        target,
        draft_model=noisy_copy(target, 0.02),
        tokenizer=BYTES,
        speculative_config=SpeculativeConfig(num_speculative_tokens=4),
    )
    guided, unguided = acceptance(llm, True), acceptance(llm, False)
    draft_blind(monkeypatch)
    blind = acceptance(llm, True)
    assert guided > 0.6 and guided > unguided - 0.1 and blind < 0.2, (guided, unguided, blind)
