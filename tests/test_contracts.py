"""The public contracts: Inferencer, Drafter, KV caches, proposers; and rows leaving the batch."""

from __future__ import annotations

import torch
from conftest import noisy_copy, tiny_model
from exactness import assert_greedy_equal, hf_greedy

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import DEMO_DIR
from speculative.inference import DecodeOutput, Inferencer, ModelInferencer, PrefillOutput
from speculative.kv_cache import KVCache
from speculative.models.hf import HFCausalLM
from speculative.models.llama import NativeCausalLM
from speculative.models.loading import load_model
from speculative.proposers import Drafter, DraftOut, NgramProposer, Proposer
from speculative.sampling import SampleStrategy


def _models():
    hf = tiny_model("llama")
    return hf, NativeCausalLM.from_hf(hf), HFCausalLM(hf)


def test_inferencer_prefill_and_decode_shapes_and_cache() -> None:
    hf, *models = _models()
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    for model in models:
        inferencer = ModelInferencer(model, eos_token_ids=[])
        assert isinstance(inferencer, Inferencer)
        cache = model.new_cache(2, 64)
        assert isinstance(cache, KVCache)
        strategy = SampleStrategy.greedy(2, model.vocab_size)
        pre = inferencer.prefill(prompt, cache, strategy)
        assert isinstance(pre, PrefillOutput)
        assert pre.token_ids.shape == (2, 1) and pre.token_logits.shape == (2, 4, model.vocab_size)
        assert cache.lengths.tolist() == [4, 4]
        dec = inferencer.decode(pre.token_ids, cache, 5, strategy)
        assert isinstance(dec, DecodeOutput)
        assert dec.token_ids.shape == (2, 5) and dec.token_logits.shape == (2, 5, model.vocab_size)
        assert cache.lengths.tolist() == [4 + 5, 4 + 5]  # the query and every token but the last
        for row in range(2):
            want = hf_greedy(hf, prompt[row].tolist(), 6, None)
            assert [pre.token_ids[row, 0].item()] + dec.token_ids[row].tolist() == want
            assert torch.equal(dec.token_logits[row].argmax(-1), dec.token_ids[row])


def test_decode_stops_each_row_at_its_eos() -> None:
    hf, model, _ = _models()
    prompt = [[5, 6, 7], [9, 10, 11]]
    free = [hf_greedy(hf, p, 12, None) for p in prompt]
    eos = free[0][3]  # row 0 emits it as its 4th token
    inferencer = ModelInferencer(model, eos_token_ids=[eos])
    cache = model.new_cache(2, 64)
    strategy = SampleStrategy.greedy(2, model.vocab_size)
    first = inferencer.prefill(torch.tensor(prompt), cache, strategy)
    dec = inferencer.decode(first.token_ids, cache, 11, strategy)
    row0 = dec.token_ids[0].tolist()
    stop = row0.index(eos)
    assert row0[: stop + 1] == free[0][1 : stop + 2] and all(t == -1 for t in row0[stop + 1 :])
    assert cache.lengths[0].item() == 3 + 1 + stop  # query and tokens before the EOS
    if eos not in free[1][1:]:
        assert dec.token_ids.shape[1] == 11 and -1 not in dec.token_ids[1].tolist()
    cache = model.new_cache(2, 64)
    inferencer.prefill(torch.tensor(prompt)[:, :1], cache, strategy)
    again = inferencer.decode(torch.tensor(prompt)[:, 1:], cache, 12, strategy)  # a query of 2 tokens
    assert again.token_ids[0].tolist()[: stop + 2] == free[0][: stop + 2]
    assert cache.lengths[0].item() == 3 + 1 + stop


class OnlyInferencer:
    """An Inferencer that is not a ModelInferencer: its decode takes one-token queries only."""

    def __init__(self, inner: ModelInferencer) -> None:
        self.inner = inner

    def prefill(self, query_token_ids, kv_cache, sample_strategy):
        return self.inner.prefill(query_token_ids, kv_cache, sample_strategy)

    def decode(self, query_token_ids, kv_cache, max_new_tokens, sample_strategy):
        assert query_token_ids.shape[1] == 1
        return self.inner.decode(query_token_ids, kv_cache, max_new_tokens, sample_strategy)


def test_drafter_delegates_to_its_inferencer() -> None:
    hf, model, _ = _models()
    for inferencer in (ModelInferencer(model), OnlyInferencer(ModelInferencer(model))):
        drafter = Drafter(inferencer)
        cache = model.new_cache(1, 64)
        strategy = SampleStrategy.greedy(1, model.vocab_size)
        out = drafter.draft(torch.tensor([[5, 6, 7]]), cache, 4, strategy)
        assert isinstance(out, DraftOut) and out.token_ids.shape == (1, 4)
        assert out.token_logits.shape == (1, 4, model.vocab_size)
        assert out.token_ids[0].tolist() == hf_greedy(hf, [5, 6, 7], 4, None)
        assert torch.equal(out.token_logits[0].argmax(-1), out.token_ids[0])
        assert cache.lengths.item() == 3 + 3  # query + every draft but the last


def test_hf_cache_rollback_per_row_equals_fresh_forward() -> None:
    hf, _, model = _models()
    ids = torch.randint(2, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = [hf(ids[i : i + 1]).logits[0] for i in range(2)]
    cache = model.new_cache(2, 64)
    model.forward(ids[:, :5], cache)
    model.forward(ids[:, 5:9], cache)  # 4 drafts per row
    cache.rollback(torch.tensor([6, 8]))  # row 0 keeps 1, row 1 keeps 3
    logits = model.forward(torch.stack([ids[0, 6:9], ids[1, 8:11]]), cache)
    assert torch.allclose(logits[0], reference[0][6:9], atol=1e-4)
    assert torch.allclose(logits[1], reference[1][8:11], atol=1e-4)
    assert cache.lengths.tolist() == [9, 11]


def test_ngram_proposer() -> None:
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert isinstance(proposer, Proposer)
    tokens = torch.tensor(
        [
            [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3, 0, 0],  # "1 2 3" last seen followed by 7 8 1
            [4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # no earlier occurrence of "8"
            [5, 1, 5, 2, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # only n=1 matches: most recent "5" -> 2
        ]
    )
    lengths = torch.tensor([12, 5, 5])
    strategy = SampleStrategy.greedy(3, 16)
    proposal = proposer.propose(tokens, lengths, 3, strategy)
    assert proposal.probs is None
    assert proposal.token_ids.tolist() == [[7, 8, 1], [-1, -1, -1], [2, 5, -1]]
    # only as wide as the longest row's proposal, empty when no row has one
    assert proposer.propose(tokens[1:], lengths[1:], 3, strategy).token_ids.tolist() == [[-1, -1], [2, 5]]
    assert proposer.propose(tokens[1:2], lengths[1:2], 3, strategy).token_ids.shape == (1, 0)


class WidthModel:
    """Wraps a model and records the query width (tokens per row) of every forward after the prefill."""

    def __init__(self, model) -> None:
        self.model, self.widths = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, input_ids, cache, num_tokens=None, logits_indices=None):
        self.widths.append(input_ids.shape[1])
        return self.model.forward(input_ids, cache, num_tokens, logits_indices)


def test_ngram_verifies_only_what_was_proposed() -> None:
    """Greedy: a step verifies 1 + the longest row's proposal, a plain step when there is none, and the
    text stays the target's. Sampled: always k + 1 (random draws are made per position of k)."""
    hf = tiny_model("llama")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]  # "5 6 7" matches: 8 9 10 11 12 proposed first
    spec = SpeculativeConfig("ngram", num_speculative_tokens=8)
    counting = WidthModel(NativeCausalLM.from_hf(hf))
    out = (
        LLM(counting, speculative_config=spec)
        .generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    assert_greedy_equal(hf, prompt, out, hf_greedy(hf, prompt, 24, None))
    expected, done, proposer = [], 1, NgramProposer(1, 3)  # the prefill gave the first token
    while done < 24:  # replay the proposals on the final text
        context = torch.tensor([prompt + out[:done]])
        drafts = proposer.propose(context, torch.tensor([context.shape[1]]), 8, SampleStrategy.greedy(1, 96))
        drafts = drafts.token_ids[0].tolist()
        expected.append(1 + len(drafts))
        accepted = next(
            (i for i, t in enumerate(drafts) if done + i >= 24 or t != out[done + i]), len(drafts)
        )
        done += accepted + 1
    assert counting.widths[1 : len(expected) + 1] == expected
    assert 1 in expected and any(1 < w < 9 for w in expected)  # plain steps and narrowed ones
    counting.widths.clear()
    LLM(counting, speculative_config=spec, seed=0).generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    )
    assert set(counting.widths[1:]) == {9}


def test_the_draft_re_encodes_nothing_after_a_rejection() -> None:
    """A step's first draft forward feeds only the last token, unless some row kept its whole block
    (all k drafts and the bonus: the draft has not seen x_k); its first forward after the prefill too."""
    hf = tiny_model("llama")
    prompt, k = [5, 6, 7, 8], 3
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for draft, scale in ((hf, 0.0), (noisy_copy(hf, 0.05), 0.05)):
        counting = WidthModel(NativeCausalLM.from_hf(draft))
        out = LLM(
            hf, draft_model=counting, speculative_config=SpeculativeConfig(num_speculative_tokens=k)
        ).generate([prompt], params)[0]
        assert_greedy_equal(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 40, None))
        steps, whole = out.metrics.num_steps, out.metrics.accepted_per_position[k - 1]  # all k accepted
        firsts = counting.widths[1::k][:steps]  # each step's first draft forward, after the prefill
        assert len(counting.widths) == 1 + steps * k and set(counting.widths[1:]) <= {1, 2}
        assert firsts[0] == 1 and firsts.count(2) in (whole - 1, whole)  # the last step has no successor
        if scale == 0.0:
            assert firsts == [1] + [2] * (steps - 1)
        else:
            assert firsts.count(1) > steps // 2


class CountingModel:
    """Wraps a model and records the batch size of every forward."""

    def __init__(self, model) -> None:
        self.model, self.batch_sizes = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, input_ids, cache, num_tokens=None, logits_indices=None):
        self.batch_sizes.append(input_ids.shape[0])
        return self.model.forward(input_ids, cache, num_tokens, logits_indices)


def test_finished_rows_leave_the_batch() -> None:
    hf = tiny_model("llama")
    counting = CountingModel(NativeCausalLM.from_hf(hf))
    llm = LLM(
        counting,
        draft_model=noisy_copy(hf, 0.02),
        speculative_config=SpeculativeConfig(num_speculative_tokens=2),
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 8, 30)]
    outputs = llm.generate([[5, 6], [7, 8, 9], [10]], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 8, 30]
    sizes = counting.batch_sizes
    assert sizes[0] == 3 and sizes[-1] == 1 and 2 in sizes and sizes == sorted(sizes, reverse=True)
    for prompt, out in zip([[5, 6], [7, 8, 9], [10]], outputs):
        assert_greedy_equal(
            hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, len(out.outputs[0].token_ids), None)
        )


def test_typical_acceptance_in_the_engine() -> None:
    """At temperature 0 the target is one-hot, so typical acceptance keeps greedy output exact;
    at temperature > 0 it runs and reports its figures."""
    hf = tiny_model("llama")
    config = SpeculativeConfig(num_speculative_tokens=3, acceptance="typical")
    llm = LLM(hf, draft_model=noisy_copy(hf, 0.02), speculative_config=config)
    prompts = [[5, 6, 7], [9]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    for prompt, out in zip(prompts, greedy):
        assert_greedy_equal(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 20, 1))
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=0))
    assert all(len(o.outputs[0].token_ids) == 20 and o.metrics.num_accepted > 0 for o in sampled)


def test_request_figures() -> None:
    hf = tiny_model("llama")
    llm = LLM(hf, draft_model=hf, speculative_config=SpeculativeConfig(num_speculative_tokens=4))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True))[0]
    m = out.metrics
    assert m.num_generated == 21 and m.num_steps == 4  # 1 from the prefill, then 4 steps of 5
    assert m.num_drafted == 16 and m.num_accepted == 16 and m.acceptance_rate == 1.0
    assert m.acceptance_per_position == [1.0] * 4 and m.mean_accepted_length == 5.0
    assert m.tokens_per_second > 0


def test_a_model_object_without_a_config_takes_eos_from_its_tokenizer() -> None:
    """An LLM built on an already-wrapped model (no generation config of its own) stops at the EOS
    of the tokenizer it is given, as the same model loaded from its directory does."""
    path = str(DEMO_DIR / "target")
    native = load_model(path, "float32").model
    from_object = LLM(native, tokenizer=path)
    assert from_object.target.eos_token_ids == LLM(path, dtype="float32").target.eos_token_ids == [0]
