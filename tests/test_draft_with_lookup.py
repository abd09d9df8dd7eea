"""A draft model with prompt lookup first (DraftModelConfig.prompt_lookup_min): exact, greedy and
sampled, and the draft's cache follows the context where a row kept lookup tokens the draft did not
propose."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from exactness import assert_greedy_equal, hf_greedy
from scipy.stats import chi2
from test_distribution import LENGTH, SAMPLES, chi_square, exact_probs
from test_distribution import pair as pair
from test_greedy_exactness import MAX_TOKENS, PROMPTS

import speculative.proposers.draft_with_lookup as hybrid_module
from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.engine_args import EngineArgs
from speculative.methods import DraftModelConfig
from speculative.models.llama import NativeCausalLM
from speculative.proposers.draft_model import DraftModelProposer
from speculative.sampling import SampleStrategy


def hybrid(k: int, low: int = 1, own: int = 0, **config) -> SpeculativeConfig:
    options = DraftModelConfig(prompt_lookup_min=low, num_assistant_tokens=own)
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, options=options, **config)


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama"), tiny_model("llama", num_layers=1, seed=7)


def test_greedy_matches_target_alone(models) -> None:
    target, draft = models
    expected = [hf_greedy(target, p, MAX_TOKENS, 1) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    accepted = 0
    for k in (1, 3, 8):
        llm = LLM(target, draft_model=draft, speculative_config=hybrid(k))
        for batch in (PROMPTS[:1], PROMPTS, PROMPTS[2:3]):
            for prompt, out in zip(batch, llm.generate(batch, params)):
                assert_greedy_equal(target, prompt, out.outputs[0].token_ids, expected[PROMPTS.index(prompt)])
                accepted += out.metrics.num_accepted
    assert accepted > 0


@pytest.mark.parametrize("chain", [1, 2])
def test_the_drafts_own_chain_may_be_shorter_than_a_lookups(models, monkeypatch, chain) -> None:
    """num_assistant_tokens=1 or 2 at k = 4: a row without a match proposes the draft's chain (the rest
    -1), a row with one up to 4 lookup tokens at batch 1, max(chain, 4 // B) in a greedy batch of B;
    greedy output stays the target's, and every draft the model proposes is its greedy continuation of
    the context (its cache cut back after long lookups)."""
    target, draft = models
    widths, own, wrong = [], [], 0
    propose = hybrid_module.DraftWithLookupProposer.propose
    draft_propose = DraftModelProposer.propose

    def recorded(self, tokens, lengths, num_tokens, strategy):
        proposal = propose(self, tokens, lengths, num_tokens, strategy)
        rows = len(lengths)
        widths.extend((rows, w) for w in (proposal.token_ids >= 0).sum(dim=1).tolist())
        return proposal

    def checked(self, tokens, lengths, num_tokens, strategy):
        nonlocal wrong
        proposal = draft_propose(self, tokens, lengths, num_tokens, strategy)
        own.append(proposal.token_ids.shape[1])
        for b, n in enumerate(lengths.tolist()):
            wrong += proposal.token_ids[b].tolist() != hf_greedy(
                draft, tokens[b, :n].tolist(), num_tokens, None
            )
        return proposal

    monkeypatch.setattr(hybrid_module.DraftWithLookupProposer, "propose", recorded)
    monkeypatch.setattr(DraftModelProposer, "propose", checked)
    llm = LLM(target, draft_model=draft, speculative_config=hybrid(4, own=chain))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for batch in (PROMPTS[2:3], PROMPTS):
        for prompt, out in zip(batch, llm.generate(batch, params)):
            assert out.outputs[0].token_ids == hf_greedy(target, prompt, MAX_TOKENS, 1)
    assert set(own) == {chain} and wrong == 0
    assert (1, chain) in widths and (1, 4) in widths  # batch 1: the draft's chain, a lookup's 4
    assert all(w <= max(chain, 4 // rows) for rows, w in widths)  # a batch's lookups shrink with it


@pytest.mark.parametrize("broken", [False, True])
def test_the_drafts_cache_follows_the_context(models, monkeypatch, broken) -> None:
    """Every chain the draft model proposes is its greedy continuation of the row's context, computed
    afresh, where rows kept lookup tokens the draft had not proposed (its cache cut, in a batch of one
    and in a batch of several). Without the cut (broken) the draft drafts from K/V of tokens that are not the
    context's, and its chains differ."""
    target, draft = models
    proposals, cuts = [], 0
    propose, rewind = DraftModelProposer.propose, DraftModelProposer.rewind

    def recorded(self, tokens, lengths, num_tokens, strategy):
        proposal = propose(self, tokens, lengths, num_tokens, strategy)
        for b, n in enumerate(lengths.tolist()):
            proposals.append((tokens[b, :n].tolist(), proposal.token_ids[b].tolist()))
        return proposal

    def counted(self, lengths):
        nonlocal cuts
        rewind(self, lengths)
        cuts += self._short

    monkeypatch.setattr(DraftModelProposer, "propose", recorded)
    monkeypatch.setattr(DraftModelProposer, "rewind", (lambda self, lengths: None) if broken else counted)
    llm = LLM(target, draft_model=draft, speculative_config=hybrid(4))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm.generate(PROMPTS[2:3], params)
    llm.generate(PROMPTS, params)
    wrong = sum(drafts != hf_greedy(draft, context, len(drafts), None) for context, drafts in proposals)
    if broken:
        assert wrong > 0
    else:
        assert wrong == 0 and cuts > 0


def test_rows_cut_by_different_amounts_are_fed_again(models) -> None:
    """A rewind that cuts a row by more tokens than another row holds: the next proposal first feeds
    each row what it lacks, and every row's chain is again the draft's greedy continuation."""
    _, hf_draft = models
    proposer = DraftModelProposer(NativeCausalLM.from_hf(hf_draft))
    contexts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4]]
    tokens = torch.zeros(2, 32, dtype=torch.long)
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = torch.tensor(context)
    lengths = torch.tensor([len(c) for c in contexts])
    strategy = SampleStrategy.greedy(2, hf_draft.config.vocab_size)
    proposer.add_rows(tokens, lengths)
    drafts = proposer.propose(tokens, lengths, 4, strategy).token_ids
    for row in range(2):  # the step keeps two drafts in row 0 and none in row 1
        kept = drafts[row, :2].tolist() if row == 0 else []
        tokens[row, lengths[row] : lengths[row] + len(kept) + 1] = torch.tensor([*kept, 40 + row])
    lengths = lengths + torch.tensor([3, 1])
    proposer.on_commit(lengths, int(lengths.max()), 3)
    proposer.rewind(torch.tensor([int(lengths[0]) - 5, int(lengths[1])]))  # 4 tokens from row 0; row 1 has 2
    assert proposer._short
    drafts = proposer.propose(tokens, lengths, 4, strategy).token_ids
    for row in range(2):
        assert drafts[row].tolist() == hf_greedy(hf_draft, tokens[row, : lengths[row]].tolist(), 4, None)


def _sampled_p_value(pair, llm: LLM) -> float:
    target, _ = pair
    prompt = [2, 3, 2, 3, 2, 3, 2]
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    outputs = llm.generate([prompt] * SAMPLES, params)
    assert sum(o.metrics.num_accepted for o in outputs) > 0
    stat, dof = chi_square([o.outputs[0].token_ids for o in outputs], exact_probs(target, prompt, 1.0, -1))
    return chi2.sf(stat, dof)


@pytest.mark.parametrize("own", [0, 1], ids=["k", "own-chain-1"])
@pytest.mark.parametrize("broken", [False, True])
def test_sampled_output_matches_target(pair, monkeypatch, broken, own) -> None:
    """Rows that proposed the lookup's tokens drew them from a one-hot distribution; scored with the
    draft's probabilities instead (broken), the same test fails. Also where the draft's own chain is
    shorter than the lookup's (num_assistant_tokens=1 at k = 2)."""
    if broken:
        monkeypatch.setattr(hybrid_module, "_lookup_one_hot", lambda probs, looked, chosen: probs)
    target, draft = pair
    llm = LLM(target, draft_model=draft, speculative_config=hybrid(2, low=2, own=own), seed=3)
    p_value = _sampled_p_value(pair, llm)
    assert p_value < 1e-6 if broken else p_value > 1e-3


def test_options_are_checked_where_given(models) -> None:
    target, draft = models
    with pytest.raises(
        ValueError, match=r"DraftModelConfig\.prompt_lookup_min must be 0 \(off\) or an integer >= 1"
    ):
        DraftModelConfig(prompt_lookup_min=-1)
    with pytest.raises(ValueError, match=r"DraftModelConfig\.prompt_lookup_max must be an integer >= "):
        DraftModelConfig(prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"num_assistant_tokens must be 0 without prompt_lookup_min"):
        DraftModelConfig(num_assistant_tokens=1)
    with pytest.raises(ValueError, match=r"num_assistant_tokens must be an integer in \[0, 32\]"):
        DraftModelConfig(prompt_lookup_min=2, num_assistant_tokens=33)
    with pytest.raises(ValueError, match="tree is not supported with prompt_lookup_min"):
        LLM(target, draft_model=draft, speculative_config=hybrid(2, tree="static"))


def test_the_flags_ask_for_it() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--draft-model", "d", "--prompt-lookup-min", "2"]))
    config = args.speculative_config()
    assert config.method == "draft_model" and config.options == DraftModelConfig(prompt_lookup_min=2)
    assert "(default: draft_model 0, ngram 1)" in " ".join(parser.format_help().split())
    flags = ["--draft-model", "d", "--prompt-lookup-min", "2", "--num-assistant-tokens", "1"]
    config = EngineArgs.from_cli_args(parser.parse_args(flags)).speculative_config()
    assert config.options == DraftModelConfig(prompt_lookup_min=2, num_assistant_tokens=1)
