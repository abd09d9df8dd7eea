"""Step times as the benchmark's own runs paid them: the time of every decoding call of a run.

The speed bound (timing.py) needs T_1, T_v and T_d. They are taken from the very calls that a method's
runs make (at the runs' own context lengths, under the machine's load of the moment, with the caches
as the runs leave them), so that a bound computed from them holds what the measured speedup paid for
its forward passes, and an efficiency under 1 is the engine's own work around them.

Ours: the engine's own step records (`Engine.recording_steps`: each step's drafting and verification
times). Hugging Face: forward hooks on its target and assistant models. On a GPU both read CUDA events
after the run's synchronisation, so that timing adds none.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from speculative.engine.stats import StepClock, StepStats


@dataclass
class CallTimes:
    """The decoding calls of one run, in call order.

    target: (query tokens per row, seconds) of each target forward after the prefill.
    drafting: (tokens asked per row, seconds) of each drafting call: a proposal of our engine (its k),
        or a forward of HF's assistant model (one token).
    """

    target: list[tuple[int, float]] = field(default_factory=list)
    drafting: list[tuple[int, float]] = field(default_factory=list)

    @classmethod
    def from_steps(cls, steps: list[StepStats]) -> CallTimes:
        """Our engine's steps: each one's verification, and its drafting where it drafted. The first
        drafting is left out, as HF's first calls are: a drafter takes the prompt in there (a draft
        model prefills the rows that joined at its next proposal), so that T_d is drafting alone."""
        drafting = [(s.k, s.propose_s) for s in steps if s.k]
        target = [(s.num_query_tokens, s.verify_s) for s in steps]
        return cls(target, drafting[1:])


def run_step_times(calls: list[CallTimes], k: int, tree: bool = False) -> dict[str, float | None]:
    """Mean T_1 (target, 1 token), T_v (target, k + 1 tokens; a tree method's: every verification,
    whatever its tree's size) and T_d (per drafted token, a tree's depth counting as its drafts) over
    the recorded calls of a method's runs; None where no such call was recorded.
    Means, not medians: the bound is to hold the time the runs spent in these calls."""
    t_1 = [s for c in calls for q, s in c.target if q == 1]
    t_v = [s for c in calls for q, s in c.target if (q > 1 if tree else q == k + 1)] if k else []
    drafting = [d for c in calls for d in c.drafting]
    drafted = sum(n for n, _ in drafting)
    return {
        "T_1": statistics.fmean(t_1) if t_1 else None,
        "T_v": statistics.fmean(t_v) if t_v else None,
        "T_d": sum(s for _, s in drafting) / drafted if drafted else None,
    }


@contextmanager
def hf_recording(target: torch.nn.Module, assistant: torch.nn.Module | None) -> Iterator[CallTimes]:
    """Record the forwards of Hugging Face's target (and assistant model) within the block; the
    yielded CallTimes is filled in when the block ends. Each model's first call holds the prompt and
    is left out; every later assistant call drafts one token. Each forward's query tokens: its
    input_ids' width."""
    calls = CallTimes()
    clocks: dict[str, list[tuple[int, StepClock]]] = {"target": [], "assistant": []}

    def hook(role: str, model: torch.nn.Module, stack: ExitStack) -> None:
        def start(module, args, kwargs) -> None:
            ids = args[0] if args else kwargs["input_ids"]
            clocks[role].append((ids.shape[1], StepClock(model.device)))

        stack.callback(model.register_forward_pre_hook(start, with_kwargs=True).remove)
        stack.callback(model.register_forward_hook(lambda *_: clocks[role][-1][1].mark()).remove)

    with ExitStack() as stack:
        hook("target", target, stack)
        if assistant is not None:
            hook("assistant", assistant, stack)
        yield calls
    calls.target += [(q, clock.intervals()[0]) for q, clock in clocks["target"][1:]]
    calls.drafting += [(1, clock.intervals()[0]) for _, clock in clocks["assistant"][1:]]
