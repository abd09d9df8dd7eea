"""The step times the bench's runs paid: the engine's own step records, hooks on HF's models (bench/clock.py),
and the bound computed from them."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.bench.clock import CallTimes, hf_recording, run_step_times
from speculative.bench.timing import bound_figures, speedup_bound
from speculative.engine.stats import StepStats

PROMPT = [5, 17, 33, 2, 9, 41, 5, 17]


def _llm(method: str | None, k: int = 3) -> LLM:
    target = tiny_model(seed=0)
    draft = noisy_copy(target, 0.02) if method == "draft_model" else None
    return LLM(target, draft_model=draft, speculative_config=SpeculativeConfig(method, k) if method else None)


def _generate(llm: LLM, temperature: float = 0.0):
    params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=0)
    with llm.engine.recording_steps() as steps:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    return steps, out.metrics


def test_the_engine_records_every_step_and_no_prefill() -> None:
    steps, metrics = _generate(_llm(None))
    assert len(steps) == metrics.num_steps == 19
    assert all(
        s.k == 0 and s.num_query_tokens == 1 and s.num_drafted == 0 and s.propose_s >= 0 for s in steps
    )
    assert all(0 < s.verify_s <= s.step_s for s in steps)
    for method in ("draft_model", "ngram"):
        for temperature in (0.0, 0.8):
            steps, metrics = _generate(_llm(method, k=3), temperature)
            assert len(steps) == metrics.num_steps and all(s.num_rows == 1 for s in steps)
            assert sum(s.num_drafted for s in steps) == metrics.num_drafted
            assert sum(s.num_accepted for s in steps) == metrics.num_accepted
            # a greedy batch verifies what was proposed (an n-gram may come up short); sampled: k + 1
            assert all(
                s.num_query_tokens <= 4 if temperature == 0 else s.num_query_tokens == 4 for s in steps
            )
            assert all(s.k == 3 and s.propose_s > 0 and s.verify_s > 0 for s in steps)
    llm = _llm(None)
    _generate(llm)
    assert llm.engine.step_stats is None  # the record ends with the block


def test_call_times_from_the_engines_steps_and_the_means_per_kind_of_call() -> None:
    steps, metrics = _generate(_llm("draft_model", k=3))
    calls = CallTimes.from_steps(steps)
    assert [q for q, _ in calls.target] == [s.num_query_tokens for s in steps]
    # one proposal of k a step, the first (the draft's prefill of the prompt) left out
    assert [n for n, _ in calls.drafting] == [3] * (metrics.num_steps - 1)
    calls = [
        CallTimes(target=[(1, 2.0), (4, 6.0), (4, 8.0)], drafting=[(3, 3.0)]),
        CallTimes(target=[(1, 4.0), (2, 100.0)], drafting=[(1, 0.5), (1, 1.5)]),
    ]
    assert run_step_times(calls, 3) == {"T_1": 3.0, "T_v": 7.0, "T_d": 1.0}
    # the first proposal takes the prompt in (a draft model's prefill): not drafting, left out, after
    # plain steps too
    steps = [StepStats(1, 0, 1, 0, 0, 0.0, 1.0, 1.0), StepStats(1, 3, 4, 3, 1, 9.0, 1.0, 10.0)]
    steps.append(StepStats(1, 3, 4, 3, 3, 1.5, 1.0, 2.5))
    assert CallTimes.from_steps(steps).drafting == [(3, 1.5)]
    assert run_step_times([], 3) == {"T_1": None, "T_v": None, "T_d": None}


def test_hf_recording_leaves_out_each_models_first_call_and_removes_its_hooks() -> None:
    target, assistant = tiny_model(seed=0), tiny_model(seed=1)
    ids = torch.tensor([PROMPT])
    with torch.no_grad(), hf_recording(target, assistant) as calls:
        for model in (target, assistant):
            model(input_ids=ids)
            model(ids[:, :1])
            model(input_ids=ids[:, :4])
    assert [q for q, _ in calls.target] == [1, 4] and [n for n, _ in calls.drafting] == [1, 1]
    assert all(s > 0 for _, s in calls.target + calls.drafting)
    assert not target._forward_hooks and not target._forward_pre_hooks and not assistant._forward_hooks


def test_bound_from_the_runs_step_times() -> None:
    run = {"T_1": 8.0, "T_v": 12.0, "T_d": 2.0}
    figures = bound_figures("draft_model", 3, 0.5, 1.0, run)
    assert figures["bound"] == pytest.approx(speedup_bound(0.5, 3, 8, 12, 2))
    assert figures["efficiency"] == pytest.approx(1.0 / figures["bound"])
    # an n-gram proposal that was not clocked (HF prompt lookup) counts as free: an upper bound
    figures = bound_figures("ngram", 3, 0.5, 1.0, {"T_1": 8.0, "T_v": 12.0, "T_d": None})
    assert figures["T_d"] == 0.0 and figures["bound"] == pytest.approx(speedup_bound(0.5, 3, 8, 12, 0))
    # nothing clocked, or no plain decoding clocked: no bound
    for missing in (None, {"T_1": None, "T_v": 12.0, "T_d": 2.0}, {"T_1": 8.0, "T_v": None, "T_d": 2.0}):
        figures = bound_figures("draft_model", 3, 0.5, 1.0, missing)
        assert figures["bound"] is None and figures["efficiency"] is None
    plain = bound_figures(None, 0, None, 1.0, {"T_1": 8.0, "T_v": None, "T_d": None})
    assert plain["bound"] == 1.0 and plain["efficiency"] == 1.0 and plain["T_1"] == 8.0
