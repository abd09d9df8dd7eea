"""SpeculativeConfig(method="self_draft"): a quantized copy of the target drafts on the target's own KV
cache. Greedy output is the target's own (eager and compiled, rows joining a running batch, plain
steps between drafting ones), sampled output follows the target's distribution (a chi-square test
that a proposer lying about its probabilities fails), the copy leaves the target's cache as the
target alone would have it, takes in nothing when rows join or plain steps pass, attends query by query
only beside a seeded sampled row, and the settings it cannot run with are refused by name. Tiny
in-process models."""

from __future__ import annotations

import itertools
import re

import pytest
import test_distribution as dist
import torch
from conftest import tiny_model
from exactness import hf_greedy
from scipy.stats import chi2

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.cli import main
from speculative.models.attention import FusedAttention, QueryByQueryAttention
from speculative.precompile import PreCompileConfig
from speculative.proposers import self_draft as self_draft_module
from speculative.proposers.self_draft import SelfDraftProposer

PROMPTS = [[5, 6, 7], [9, 10, 11, 12] * 3, [3, 4, 5] * 6 + [8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_model("llama", hidden_size=128, num_layers=3)


def self_draft(target, k: int = 4, **options) -> LLM:
    config = SpeculativeConfig("self_draft", k, adaptive=options.pop("adaptive", False))
    return LLM(target, dtype="float32", speculative_config=config, **options)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_greedy_output_is_the_targets_own(target, compiled) -> None:
    """Rows of different lengths in one batch, then one row alone; compiled, the copy drafts its k
    tokens in one call (greedy_decode). The w8a8 copy keeps most drafts."""
    llm = self_draft(target, compile=compiled)
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(target, prompt, 24, None)
    assert llm.target.model.model.quantization is None if compiled else llm.target.model.quantization is None
    assert llm.draft_quantization == "w8a8"
    rate = sum(o.metrics.num_accepted for o in outputs) / sum(o.metrics.num_drafted for o in outputs)
    assert rate > 0.8
    alone = llm.generate(PROMPTS[1:2], GREEDY)[0]
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_rows_joining_and_plain_steps_cost_the_copy_nothing(target, monkeypatch) -> None:
    """Rows prefilled while others run, and plain steps (k = 0) between drafting ones: the copy runs
    only in drafting steps, k forwards of one token a row each, and the output is the target's own."""
    llm = self_draft(target, k=3)
    proposer = llm.engine.proposer
    assert isinstance(proposer, SelfDraftProposer)
    fed, forward = [], proposer.model.forward

    def counted(ids, *args, **kwargs):
        fed.append(ids.shape)
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(proposer.model, "forward", counted)
    ks = itertools.cycle([3, 0, 2, 3, 0, 0, 1])
    chosen = []
    llm.engine.draft_length.choose = lambda rows, backlog=None: chosen.append(next(ks)) or chosen[-1]
    engine = llm.engine
    *_, sequences = llm.inputs.prepare([PROMPTS[0]], GREEDY)
    engine.add(sequences)
    engine.step()
    _, _, _, more = llm.inputs.prepare(
        PROMPTS[1:], [GREEDY, SamplingParams(temperature=1.0, top_k=1, n=2, max_tokens=16, ignore_eos=True)]
    )
    engine.add(more)
    while engine.batch is not None:
        engine.step()
    for s in sequences + more:
        prompt = s.prompt_token_ids
        assert s.output_token_ids == hf_greedy(target, prompt, len(s.output_token_ids), None)
    assert all(q == 1 for _, q in fed)  # one token a row a forward: no prefill, no catch-up
    assert len(fed) == sum(chosen)  # k forwards in each step that drafts k
    assert 4 in {batch for batch, _ in fed}  # the running row, the new one and the n = 2 pair


def test_the_targets_cache_is_what_the_target_alone_makes(target) -> None:
    """After drafting steps, every cached position holds the target's own K/V (the verification wrote
    over the copy's), and the lengths are the contexts' but their last tokens."""
    llm = self_draft(target)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    *_, sequences = llm.inputs.prepare(PROMPTS, params)
    engine.add(sequences)
    for _ in range(4):
        engine.step()
    cache, batch = engine.cache, engine.batch
    assert cache.lengths.tolist() == [n - 1 for n in batch.host_lengths]
    native = llm.target.model
    for row, n in enumerate(batch.host_lengths):
        fresh = native.new_cache(1, 64)
        native.forward(batch.tokens[row : row + 1, : n - 1], fresh)
        for layer in range(len(cache.keys)):
            for mine, alone in ((cache.keys, fresh.keys), (cache.values, fresh.values)):
                torch.testing.assert_close(mine[layer][row, :, : n - 1], alone[layer][0, :, : n - 1])


@pytest.mark.parametrize("lying", [False, True], ids=["honest", "lying"])
def test_sampled_output_follows_the_target(monkeypatch, lying) -> None:
    """Chi-square over every 3-token continuation (test_distribution.py's helpers) at temperature 0.8
    and top-k 6, k = 2; the same test fails when the proposal claims other probabilities than its
    drafts were drawn from (each token's claimed as the next token's)."""
    if lying:
        original = SelfDraftProposer.propose

        def propose(self, *args):
            proposal = original(self, *args)
            return proposal._replace(probs=proposal.probs.roll(1, dims=-1))

        monkeypatch.setattr(SelfDraftProposer, "propose", propose)
    small = tiny_model("llama", vocab_size=dist.VOCAB, hidden_size=32, num_layers=2, seed=0)
    llm = LLM(small, speculative_config=SpeculativeConfig("self_draft", 2), seed=11)
    prompt = [2, 3, 2, 5]
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=dist.LENGTH, ignore_eos=True)
    samples = dist.sample(llm, [prompt] * dist.SAMPLES, [params] * dist.SAMPLES)
    p_value = chi2.sf(*dist.chi_square(samples, dist.exact_probs(small, prompt, 0.8, 6)))
    assert p_value < 1e-6 if lying else p_value > 1e-3


def test_the_copy_attends_query_by_query_only_beside_a_seeded_sampled_row(target, monkeypatch) -> None:
    """The w8a8 copy's drafts are row-exact (one SDPA call a query) in a batch holding a seeded sampled
    row, whose text must not depend on its neighbours, and batched (one call a layer) in any other."""
    llm = self_draft(target)
    native = llm.draft.model
    backends = []

    def spy(model, *args):
        backends.append(type(native.attention_backend))
        return draft_chain(model, *args)

    draft_chain = self_draft_module.draft_chain
    monkeypatch.setattr(self_draft_module, "draft_chain", spy)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    greedy_seeded = SamplingParams(temperature=0.0, seed=5, max_tokens=24, ignore_eos=True)
    for params, expected in (
        ([GREEDY] * 3, FusedAttention),
        ([GREEDY, sampled, greedy_seeded], FusedAttention),
        ([GREEDY, seeded, sampled], QueryByQueryAttention),
    ):
        backends.clear()
        outputs = llm.generate(PROMPTS, params)
        assert backends and set(backends) == {expected}, params
        assert outputs[0].outputs[0].token_ids == hf_greedy(target, PROMPTS[0], 24, None)


def test_int8_copy_adaptive_k_and_prefix_caching(target) -> None:
    """draft_quantization picks the copy's quantization; adaptive k runs over it, and so does the
    prefix cache (the second pass prefills from the blocks the first one kept)."""
    llm = self_draft(target, adaptive=True, draft_quantization="int8", enable_prefix_caching=True)
    assert llm.draft.model.quantization == "int8" and llm.draft_quantization == "int8"
    for _ in range(2):
        outputs = llm.generate(PROMPTS, GREEDY)
        for prompt, output in zip(PROMPTS, outputs):
            assert output.outputs[0].token_ids == hf_greedy(target, prompt, 24, None)
    assert any(o.num_cached_tokens for o in outputs)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"draft_model": "x"}, r'method="self_draft"\) uses no draft model; drop draft_model'),
        ({"quantization": "int8"}, "needs a float target on one rank, not precompiled .*: drop quantization"),
        ({"precompile": PreCompileConfig([1])}, "drop precompile"),
        ({"draft_dtype": "bfloat16"}, "draft_dtype is a draft model's dtype"),
        ({"model_impl": "transformers"}, "needs the native forward on a CPU for the target .* HFCausalLM"),
        ({"tree": "dynamic"}, r"SpeculativeConfig.tree is not supported with method=\"self_draft\""),
        ({"draft_quantization": "fp8"}, r"draft_quantization must be None, 'int8'.*; got 'fp8'"),
    ],
)
def test_settings_it_cannot_run_with_are_refused_by_name(target, options, message) -> None:
    tree = {"tree": options.pop("tree")} if "tree" in options else {}
    config = SpeculativeConfig("self_draft", 3, **tree)
    with pytest.raises(ValueError, match=message):
        LLM(target, speculative_config=config, **options)


def test_cli_self_draft(model_dirs, capsys) -> None:
    """--method self_draft on the CLI: the load line names the copy's quantization."""
    args = ["generate", "--model", model_dirs["target"], "--method", "self_draft", "--dtype", "float32"]
    assert main([*args, "--max-tokens", "4", "--prompt", "ab"]) == 0
    assert re.search(r"; draft in float32 \(.*\), w8a8 weights", capsys.readouterr().err)
