"""The bench's clock of the runs' own calls (bench/clock.py) and the bound computed from it."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.bench.clock import CallTimes, hf_recording, recording, run_step_times
from speculative.bench.timing import StepTimes, bound_figures, speedup_bound

PROMPT = [5, 17, 33, 2, 9, 41, 5, 17]


def _llm(method: str | None, k: int = 3, compiled: bool = False) -> LLM:
    target = tiny_model(seed=0)
    draft = noisy_copy(target, 0.02) if method == "draft_model" else None
    return LLM(target, draft_model=draft, speculative_config=SpeculativeConfig(method, k) if method else None,
               compile=compiled)


def _generate(llm: LLM) -> tuple[CallTimes, object]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with recording(llm) as calls:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    return calls, out.metrics


def test_recording_holds_every_decoding_call_and_no_prefill() -> None:
    calls, metrics = _generate(_llm(None))
    assert [q for q, _ in calls.target] == [1] * metrics.num_steps and calls.drafting == []
    calls, metrics = _generate(_llm("draft_model", k=3))
    # greedy draft model: every step verifies k + 1 tokens after k one-token draft forwards
    assert len(calls.target) == metrics.num_steps and {q for q, _ in calls.target} <= {1, 4}
    assert sum(n for n, _ in calls.drafting) == metrics.num_drafted
    assert all(n == 1 and s > 0 for n, s in calls.drafting)
    calls, metrics = _generate(_llm("ngram", k=3))  # proposals: one call each, k tokens asked
    assert [n for n, _ in calls.drafting] == [3] * metrics.num_steps


def test_recording_times_a_compiled_drafting_as_one_call_and_restores_the_models() -> None:
    llm = _llm("draft_model", k=3, compiled=True)
    before = (llm.engine.target.forward, llm.draft.model.greedy_decode)
    calls, metrics = _generate(llm)
    assert [n for n, _ in calls.drafting] == [3] * metrics.num_steps  # one greedy_decode of k per step
    assert "forward" not in vars(llm.engine.target) and "greedy_decode" not in vars(llm.draft.model)
    assert (llm.engine.target.forward, llm.draft.model.greedy_decode) == before


def test_run_step_times_are_means_per_kind_of_call() -> None:
    calls = [CallTimes(target=[(1, 2.0), (4, 6.0), (4, 8.0)], drafting=[(3, 3.0)]),
             CallTimes(target=[(1, 4.0), (2, 100.0)], drafting=[(1, 0.5), (1, 1.5)]), None]
    assert run_step_times(calls, 3) == {"T_1": 3.0, "T_v": 7.0, "T_d": 1.0}
    assert run_step_times([None], 3) == {"T_1": None, "T_v": None, "T_d": None}


def test_hf_recording_leaves_out_each_models_first_call() -> None:
    target, assistant = tiny_model(seed=0), tiny_model(seed=1)
    ids = torch.tensor([PROMPT])
    with hf_recording(target, assistant) as calls:
        for model in (target, assistant):
            model(input_ids=ids)
            model(input_ids=ids[:, :1])
            model(input_ids=ids[:, :4])
    assert [q for q, _ in calls.target] == [1, 4] and [n for n, _ in calls.drafting] == [1, 1]
    assert "forward" not in vars(target)


TIMES = StepTimes(context=100, t_1=10.0, t_v={3: 12.0}, t_d=1.0, t_ngram={3: 0.6})


def test_bound_uses_the_runs_step_times_and_keeps_the_timers_as_a_cross_check() -> None:
    run = {"T_1": 8.0, "T_v": 12.0, "T_d": 2.0}
    figures = bound_figures("draft_model", 3, 0.5, 1.0, TIMES, run)
    assert figures["step_times"] == "runs"
    assert figures["bound"] == pytest.approx(speedup_bound(0.5, 3, 8, 12, 2))
    assert figures["efficiency"] == pytest.approx(1.0 / figures["bound"])
    assert figures["bound_timer"] == pytest.approx(1.25)  # E 1.875 * 10 / (3 * 1 + 12)
    # an n-gram proposal that was not clocked (HF prompt lookup) costs the timer's proposal / k
    figures = bound_figures("ngram", 3, 0.5, 1.0, TIMES, {"T_1": 8.0, "T_v": 12.0, "T_d": None})
    assert figures["step_times"] == "runs" and figures["T_d"] == pytest.approx(0.2)
    # nothing clocked (not CPU), or no plain decoding clocked: the timer's
    for missing in (None, {"T_1": None, "T_v": 12.0, "T_d": 2.0}, {"T_1": 8.0, "T_v": None, "T_d": 2.0}):
        figures = bound_figures("draft_model", 3, 0.5, 1.0, TIMES, missing)
        assert figures["step_times"] == "timer" and figures["bound"] == pytest.approx(1.25)
    plain = bound_figures(None, 0, None, 1.0, TIMES, {"T_1": 8.0, "T_v": None, "T_d": None})
    assert plain["bound"] == 1.0 and plain["efficiency"] == 1.0 and plain["T_1"] == 8.0
