"""What each engine step did and how long its parts took, for whoever asks (the benchmark, a server).

`Engine.recording_steps()` collects a `StepStats` per step (vLLM's SpecDecodingStats, plus the step's
times). Times are wall-clock on a CPU; on a GPU they come from CUDA events read after the step's own
host synchronisation, so recording adds no sync of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class StepStats:
    """One step of the running batch.

    num_rows: rows in the step. k: draft tokens asked of the proposer per row (0: a plain step).
    num_query_tokens: tokens per row in the target's forward (1 for a plain step, 1 + the drafts
    verified otherwise: fewer than k + 1 where a greedy batch's proposal came up short).
    num_drafted / num_accepted: draft tokens proposed and kept, over the rows. propose_s: drafting;
    verify_s: the target's forward; step_s: the whole step as the host saw it (drafting, forward,
    acceptance, the commit and its host sync, rolling the caches back).
    """

    num_rows: int
    k: int
    num_query_tokens: int
    num_drafted: int
    num_accepted: int
    propose_s: float
    verify_s: float
    step_s: float


class StepClock:
    """Marks taken through a step; `intervals()` gives the seconds between consecutive marks, once every
    mark's work is done (on a GPU: read after a host synchronisation that follows the last mark)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (the events are complete once the step has synced)."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [start.elapsed_time(end) / 1e3 for start, end in pairs]
        return [end - start for start, end in pairs]
