"""Rank 0's engine calls, made on every spawned rank too: LeaderEngine sends them, Follower replays them.

Every rank runs the same engine (SPMD): the same batch, the same steps, the same drafts and the same
acceptance. Rank 0 alone is driven from outside (LLM.generate, the server's scheduler), and only the
calls that change the running batch need to reach the others: `add`, `step`, `abort`, `reset` and
`clear_proposer_cache`. A call's payload carries what the other ranks cannot know: the sequences that
join (prompt, SamplingParams, output so far, generator state; each rank makes its own grammar
state) and the state of the generator shared by unseeded rows (`LLM.resume` sets it); an aborted
sequence is named by its key (`id()` on rank 0, whose engine holds it while it runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from speculative.distributed.ranks import Ranks
from speculative.engine.engine import Engine
from speculative.engine.sequence import Sequence as EngineSequence


class _Wired(NamedTuple):
    """A sequence as it travels: its key on rank 0, its record without its generator and grammar state,
    and its generator's state (None: the shared generator)."""

    key: int
    sequence: EngineSequence
    generator_state: Tensor | None


def _wire(s: EngineSequence) -> _Wired:
    state = s.generator.get_state() if s.generator is not None else None
    return _Wired(id(s), dataclasses.replace(s, generator=None, guide=None), state)


class LeaderEngine(Engine):
    """Rank 0's Engine among ranks it spawned (ranks.py): each call that changes the running batch is
    sent to the other ranks (LLM `handle` there) before it is made here; calls made within such a call
    (Engine.generate's, a step's own reset) are not sent again.

    An exception in a call stops every rank: they may no longer agree on the batch. It comes out as a
    RuntimeError saying so (a KeyboardInterrupt as itself), and every later call raises one too.
    """

    def __init__(self, ranks: Ranks, handle: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks, self.handle = ranks, handle
        self._inside = False

    def add(self, sequences: list[EngineSequence], eos_token_ids: Sequence[int] | None = None):
        payload = ([_wire(s) for s in sequences], self.generator.get_state(), eos_token_ids)
        return self._mirror("add", payload, super().add, sequences, eos_token_ids)

    def step(self):
        return self._mirror("step", None, super().step)

    def abort(self, sequences: list[EngineSequence], reason: str = "abort") -> None:
        return self._mirror("abort", ([id(s) for s in sequences], reason), super().abort, sequences, reason)

    def reset(self) -> None:
        return self._mirror("reset", None, super().reset)

    def clear_proposer_cache(self) -> None:
        return self._mirror("clear_proposer_cache", None, super().clear_proposer_cache)

    def _mirror(self, name: str, payload: Any, call: Callable[..., Any], *args: Any) -> Any:
        if self._inside:
            return call(*args)
        self.ranks.send(self.handle, name, payload)
        self._inside = True
        try:
            return call(*args)
        except Exception as error:
            failure = f"rank 0's {name} raised {type(error).__name__}: {error}"
            raise RuntimeError(self.ranks.stop(failure)) from error
        except BaseException as error:
            self.ranks.stop(f"rank 0's {name} was interrupted ({type(error).__name__})")
            raise
        finally:
            self._inside = False


class Follower:
    """Makes rank 0's engine calls on this rank's LLM, which was built from the same arguments."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.sequences: dict[int, EngineSequence] = {}  # rank 0's key -> this rank's copy, while it runs

    def replay(self, name: str, payload: Any) -> None:
        """Make the engine call `name` that rank 0 sent, with its payload (LeaderEngine)."""
        engine = self.llm.engine
        if name == "add":
            wired, generator_state, eos_token_ids = payload
            engine.generator.set_state(generator_state)
            engine.add([self._sequence(w) for w in wired], eos_token_ids)
        elif name == "abort":
            keys, reason = payload
            engine.abort([self.sequences[k] for k in keys if k in self.sequences], reason)
        elif name in ("step", "reset", "clear_proposer_cache"):
            getattr(engine, name)()
        else:
            raise ValueError(f"unknown engine call {name!r}")
        running = {id(s) for s in engine.sequences}
        self.sequences = {k: s for k, s in self.sequences.items() if id(s) in running}

    def _sequence(self, wired: _Wired) -> EngineSequence:
        s = wired.sequence
        if wired.generator_state is not None:
            s.generator = torch.Generator(device=self.llm.device)
            s.generator.set_state(wired.generator_state)
        self.llm.inputs.attach_aids(s)
        self.sequences[wired.key] = s
        return s
