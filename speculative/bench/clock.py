"""Step times as the benchmark's own runs paid them: the wall time of every decoding call of a run.

The bound of DESIGN.md section 4 needs T_1, T_v and T_d. StepTimer (timing.py) times them in loops of
their own, at one context length; `recording` and `hf_recording` time the very calls that a method's
runs make (at the runs' own context lengths, under the machine's load of the moment, with the caches
as the runs leave them), so that a bound computed from them holds what the measured speedup paid for
its forward passes, and an efficiency under 1 is the engine's own work around them.

CPU only: timing single calls on a CUDA device would need a synchronisation after each, which the
runs do not make; there the recordings are None and the bound uses StepTimer's times.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from speculative.llm import LLM
from speculative.proposers import DraftModelProposer, NgramProposer

Record = Callable[[tuple, dict, float], None]  # (args, kwargs, seconds) of one call


@dataclass
class CallTimes:
    """The decoding calls of one run, in call order.

    target: (query tokens per row, seconds) of each target forward after the prefill.
    drafting: (tokens drafted per row, seconds) of each drafting call: a draft model's forward (one
        token), a compiled draft's `greedy_decode` (its steps) or an n-gram proposal (its k).
    Prefill forwards (ours: those given `num_tokens`; HF: each model's first call) are left out.
    """

    target: list[tuple[int, float]] = field(default_factory=list)
    drafting: list[tuple[int, float]] = field(default_factory=list)


def run_step_times(calls: list[CallTimes | None], k: int) -> dict[str, float | None]:
    """Mean T_1 (target, 1 token), T_v (target, k + 1 tokens) and T_d (per drafted token) over the
    recorded calls of a method's runs; None where no such call was recorded (or nothing was: not CPU).
    Means, not medians: the bound is to hold the time the runs spent in these calls."""
    recorded = [c for c in calls if c is not None]
    t_1 = [s for c in recorded for q, s in c.target if q == 1]
    t_v = [s for c in recorded for q, s in c.target if q == k + 1] if k else []
    drafting = [d for c in recorded for d in c.drafting]
    drafted = sum(n for n, _ in drafting)
    return {"T_1": statistics.fmean(t_1) if t_1 else None, "T_v": statistics.fmean(t_v) if t_v else None,
            "T_d": sum(s for _, s in drafting) / drafted if drafted else None}


@contextmanager
def _timed(obj: object, name: str, record: Record, busy: list[bool]) -> Iterator[None]:
    """Within the block, obj.<name>(...) is timed and `record`ed, unless it is called from inside
    another timed call sharing `busy` (a compiled greedy_decode that steps through forward)."""
    original = getattr(obj, name)
    shadowed = name in vars(obj)

    @functools.wraps(original)  # its signature too, which Hugging Face's generate inspects
    def timed(*args, **kwargs):
        if busy[0]:
            return original(*args, **kwargs)
        busy[0] = True
        try:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            record(args, kwargs, time.perf_counter() - start)
            return out
        finally:
            busy[0] = False

    setattr(obj, name, timed)
    try:
        yield
    finally:
        if shadowed:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    return args[position] if len(args) > position else kwargs[name]


@contextmanager
def recording(llm: LLM) -> Iterator[CallTimes | None]:
    """Record the decoding calls of `llm`'s engine within the block (None off CPU)."""
    engine = llm.engine
    if engine.target.device.type != "cpu":
        yield None
        return
    calls = CallTimes()

    def target(args: tuple, kwargs: dict, seconds: float) -> None:
        if kwargs.get("num_tokens") is None:  # the engine's prefills give num_tokens
            calls.target.append((_argument(args, kwargs, 0, "input_ids").shape[1], seconds))

    def draft_forward(args: tuple, kwargs: dict, seconds: float) -> None:
        if kwargs.get("num_tokens") is None:  # the draft's prefill (add_rows) gives num_tokens
            calls.drafting.append((1, seconds))

    def drafted(position: int, name: str) -> Record:
        return lambda args, kwargs, seconds: calls.drafting.append((_argument(args, kwargs, position, name),
                                                                    seconds))

    with ExitStack() as stack:
        stack.enter_context(_timed(engine.target, "forward", target, [False]))
        proposer = engine.proposer
        if isinstance(proposer, DraftModelProposer):
            busy = [False]
            stack.enter_context(_timed(proposer.model, "forward", draft_forward, busy))
            if getattr(proposer.model, "greedy_decode", None) is not None:
                stack.enter_context(_timed(proposer.model, "greedy_decode", drafted(2, "steps"), busy))
        elif isinstance(proposer, NgramProposer):
            stack.enter_context(_timed(proposer, "propose", drafted(2, "num_tokens"), [False]))
        yield calls


@contextmanager
def hf_recording(target: torch.nn.Module, assistant: torch.nn.Module | None) -> Iterator[CallTimes | None]:
    """Record the forwards of Hugging Face's target (and assistant model) within the block (None off
    CPU). Each model's first call holds the prompt and is left out; every later assistant call
    drafts one token."""
    if target.device.type != "cpu":
        yield None
        return
    calls = CallTimes()
    seen = {"target": False, "assistant": False}

    def record(role: str) -> Record:
        def add(args: tuple, kwargs: dict, seconds: float) -> None:
            if not seen[role]:
                seen[role] = True
            elif role == "target":
                calls.target.append((_argument(args, kwargs, 0, "input_ids").shape[1], seconds))
            else:
                calls.drafting.append((1, seconds))
        return add

    with ExitStack() as stack:
        stack.enter_context(_timed(target, "forward", record("target"), [False]))
        if assistant is not None:
            stack.enter_context(_timed(assistant, "forward", record("assistant"), [False]))
        yield calls
