"""Drafting across tokenizers (proposers/cross_tokenizer.py): a draft model with a vocabulary of its own.

A tiny pair with two byte-level BPEs trained in-process on the same little text (the target's with more
merges), and the committed demo cross-draft with the demo target: greedy output is the target's own,
sampled output follows the target's distribution (chi-square against enumerated probabilities; a proposer
that claims its one-hot drafts were drawn from a broader distribution fails it), the boundary between
committed and drafted text is handled, and the draft stays in step through rejections.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from scipy.stats import chi2
from test_distribution import LENGTH, SAMPLES, VOCAB, chi_square, exact_probs, sample
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import DEMO_DIR
from speculative.proposers import CrossTokenizerProposer, Proposal, Proposer

EOT = "<|endoftext|>"
TEXT = ["ab ba abba aab bab a b " * 20, "abab baba bb aa " * 20]
PROMPTS = ("ab ba ab", "b", "abba abba bab a", "aab")  # of different lengths


def bpe(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the letters a, b and the space, trained on TEXT: `vocab_size` tokens, EOT
    (id 0) as bos and eos."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=["a", "b", "Ġ"], show_progress=False
    )
    tok.train_from_iterator(TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT)


def pair(target_vocab: int, draft_vocab: int, k: int, seed: int = 0) -> tuple[LLM, LLM]:
    """(the target alone, the target with a random draft of its own tokenizer, k-token chains); the
    target's transformers model is `alone.hf_target`."""
    target_tokenizer, draft_tokenizer = bpe(target_vocab), bpe(draft_vocab)
    assert len(target_tokenizer) == target_vocab and len(draft_tokenizer) == draft_vocab
    target = tiny_model(vocab_size=target_vocab, hidden_size=32, eos_token_id=0, seed=seed)
    draft = tiny_model(vocab_size=draft_vocab, hidden_size=32, num_layers=1, eos_token_id=0, seed=seed + 5)
    config = SpeculativeConfig(num_speculative_tokens=k)
    cross = LLM(
        target,
        draft_model=draft,
        tokenizer=target_tokenizer,
        draft_tokenizer=draft_tokenizer,
        speculative_config=config,
        seed=11,
    )
    alone = LLM(target, tokenizer=target_tokenizer)
    alone.hf_target = target
    return alone, cross


def test_the_tokenizers_differ_and_llm_picks_cross_tokenizer_drafting() -> None:
    _, cross = pair(12, 7, 4)
    assert isinstance(cross.engine.proposer, CrossTokenizerProposer)
    assert isinstance(cross.engine.proposer, Proposer)
    assert cross.engine.proposer.prefix == []  # the BPEs add no BOS: none is put in front of the text
    target_tokenizer, draft_tokenizer = bpe(12), bpe(7)
    assert target_tokenizer("abba bab").input_ids != draft_tokenizer("abba bab").input_ids


def test_greedy_is_the_target_alone_in_a_batch_with_rejections() -> None:
    alone, cross = pair(12, 7, 4)
    tok = alone.tokenizer
    prompts = [tok(t).input_ids for t in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in alone.generate(prompts, params)]
    outputs = cross.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    drafted = sum(o.metrics.num_drafted for o in outputs)
    accepted = sum(o.metrics.num_accepted for o in outputs)
    assert accepted > 0 and drafted - accepted >= 10  # some kept, several rejected


def test_sampled_output_follows_the_target() -> None:
    alone, cross = pair(VOCAB, 6, 4)
    prompt = alone.tokenizer("ab ba").input_ids
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    outputs = cross.generate([prompt] * SAMPLES, params)
    samples = [o.outputs[0].token_ids for o in outputs]
    assert sum(o.metrics.num_drafted for o in outputs) > 0.3 * SAMPLES  # mostly rejected: a random draft
    assert sum(o.metrics.num_accepted for o in outputs) > 0.01 * SAMPLES
    stat, dof = chi_square(samples, exact_probs(alone.hf_target, prompt, 1.0, -1))
    assert chi2.sf(stat, dof) > 1e-3, f"chi-square {stat:.1f} on {dof} dof"


def test_drafts_claimed_broader_than_one_hot_fail(monkeypatch) -> None:
    """A proposer that hands its greedy (one-hot) drafts over as if drawn from the uniform distribution:
    a draft x is then kept with probability min(1, q(x) V) instead of q(x), and the output leans to the
    draft's choices."""
    propose = CrossTokenizerProposer.propose

    def uniform(self, *args) -> Proposal:
        token_ids, _, _ = propose(self, *args)
        return Proposal(token_ids, torch.full((*token_ids.shape, VOCAB), 1 / VOCAB))

    monkeypatch.setattr(CrossTokenizerProposer, "propose", uniform)
    alone, cross = pair(VOCAB, 6, 4)
    prompt = alone.tokenizer("ab ba").input_ids
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    stat, dof = chi_square(
        sample(cross, [prompt] * SAMPLES, [params] * SAMPLES),
        exact_probs(alone.hf_target, prompt, 1.0, -1),
    )
    assert chi2.sf(stat, dof) < 1e-6


def test_drafted_text_that_would_merge_with_the_committed_tail() -> None:
    """The target ended on "a"; the draft goes on "b ba b". The target's tokenizer would merge the
    committed "a" with the new "b" into "ab", which the committed tokens cannot become: the proposal is
    the draft's text tokenized from the boundary on (cut at the draft's EOS, at most k tokens)."""
    _, cross = pair(12, 7, 4)
    proposer = cross.engine.proposer
    target, draft = cross.tokenizer, bpe(7)
    ids = target.convert_tokens_to_ids
    context = target("ba ba").input_ids + [ids("a")]
    drafted = draft("b ba b").input_ids
    assert target("ba baab ba b").input_ids[-3] == ids("ab")  # the merge across the boundary
    assert proposer._target_tokens(context, drafted, 4) == ids(["b", "Ġba", "Ġb"])
    assert proposer._target_tokens(context, drafted, 2) == ids(["b", "Ġba"])
    ended = drafted + [draft.eos_token_id, *draft("a").input_ids]  # the draft's text ends at its EOS
    assert proposer._target_tokens(context, ended, 4) == ids(["b", "Ġba", "Ġb"])
    context = target("ba ba").input_ids  # no merge: the target's tokenization of the joined text
    assert proposer._target_tokens(context, draft(" ab ba b").input_ids, 4) == ids(["Ġab", "Ġba", "Ġb"])


@torch.inference_mode()  # as the engine's steps run
def test_the_draft_stays_in_step_through_rejections() -> None:
    """Step by step, rows finishing and a row joining on the way: after every step the draft's cache
    holds a fresh tokenization of the accepted text (merges across the boundary included), and it
    proposes what a new proposer prefilled with the accepted contexts proposes (its K/V rolled back
    right)."""
    alone, cross = pair(12, 7, 4)
    tok, engine, proposer = alone.tokenizer, cross.engine, cross.engine.proposer
    sequences = [
        cross.make_sequences(
            tok(t).input_ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), i
        )[0]
        for i, (t, n) in enumerate(zip(PROMPTS, (40, 12, 25, 33)))
    ]
    engine.add(sequences[1:])
    steps = 0
    while engine.batch is not None:
        batch = engine.batch
        fresh = CrossTokenizerProposer(proposer.model, bpe(7), tok)
        fresh.add_rows(batch.tokens, batch.lengths)
        expected = fresh.propose(batch.tokens, batch.lengths, 4, batch.strategy).token_ids
        got = proposer.propose(batch.tokens, batch.lengths, 4, batch.strategy).token_ids
        assert torch.equal(got, expected)
        texts = [
            tok.decode(row[:n], skip_special_tokens=True)
            for row, n in zip(batch.tokens.tolist(), batch.lengths.tolist())
        ]
        for cached, text, length in zip(proposer.cached, texts, proposer.cache.lengths.tolist()):
            ids = bpe(7)(text).input_ids  # the draft tokenizer's own tokenization of the accepted text
            assert cached[: len(ids)] == ids and length == len(cached)
        engine.step()
        steps += 1
        if steps == 3:
            engine.add(sequences[:1])
    assert sum(s.metrics.num_drafted - s.metrics.num_accepted for s in sequences) >= 5


def test_the_demo_cross_draft_drafts_for_the_demo_target() -> None:
    """The committed draft with its own tokenizer (models/demo/cross-draft, `python -m
    speculative.demo.train_cross_draft`): the target's greedy output alone, drafts accepted."""
    target, draft = (str(DEMO_DIR / name) for name in ("target", "cross-draft"))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):\n        self.items = []"]
    plain = LLM(target, dtype="float32").generate(prompts, params)
    llm = LLM(target, draft_model=draft, dtype="float32")
    assert isinstance(llm.engine.proposer, CrossTokenizerProposer)
    cross = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in cross] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_accepted for o in cross) > 0.2 * sum(o.metrics.num_drafted for o in cross)


@pytest.mark.parametrize(
    "arguments,message",
    [
        (dict(speculative_config=SpeculativeConfig(tree="dynamic")), "tree is not supported"),
        (dict(compile=True), "compile is not supported"),
    ],
)
def test_what_drafting_across_tokenizers_refuses(arguments, message) -> None:
    target_tokenizer, draft_tokenizer = bpe(12), bpe(7)
    target = tiny_model(vocab_size=12, hidden_size=32, eos_token_id=0)
    draft = tiny_model(vocab_size=7, hidden_size=32, num_layers=1, eos_token_id=0)
    with pytest.raises(ValueError, match=message):
        LLM(
            target,
            draft_model=draft,
            tokenizer=target_tokenizer,
            draft_tokenizer=draft_tokenizer,
            **arguments,
        )
