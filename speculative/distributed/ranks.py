"""Tensor-parallel ranks spawned by this process: it is rank 0, its children ranks 1 .. N-1.

Each child is `python -m speculative.rank_worker` (RANK_PROGRAM), started with subprocess (so a script needs
no `if __name__ == "__main__"` guard), talking to rank 0 over a socket pair in pickled messages
(kind, handle, payload), and joined with it in torch.distributed's default group. For each
tensor-parallel LLM built here (handle h), every child builds the same LLM from the same arguments
("build"), and then makes every engine call rank 0 makes (mirror.py), in the same order, until rank 0
drops the LLM ("drop").

While they run, every rank (this one too) computes on torch.get_num_threads() // N threads, so that
N ranks share the CPU, and so that the computations every rank repeats (the draft model, the norms)
are the same kernels and give the same bits; shutdown() gives this process its threads back. The ranks
stay up for this process's next tensor-parallel LLM of the same size, until it exits or shutdown().

Failures: a child that exits (it exits on any error of an engine call, saying why first) is noticed at
once by a thread watching it, and the ranks are stopped; a collective that meets a rank that is gone
raises at once (gloo and NCCL notice closed connections), and one whose peer hangs after
backend.TIMEOUT. From then on every call of the LLMs on these ranks raises a RuntimeError saying what
happened; a new tensor-parallel LLM starts new ranks.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from speculative.distributed.backend import TIMEOUT, backend

RANK_PROGRAM = "speculative.rank_worker"
"""The module each child runs (`python -m`): it builds LLMs, a layer above this package, so it is named
here, not imported."""
STOP_GRACE_S = 1.0
"""How long stopping waits for the children to exit on their own (and say why) before ending them."""

_current: Ranks | None = None


def current() -> Ranks | None:
    """The ranks this process spawned, if any (broken ones included)."""
    return _current


def start(size: int, device_type: str) -> Ranks:
    """Spawn `size - 1` ranks, ending the ranks of another size spawned before, unless an LLM still
    uses them (a ValueError)."""
    global _current
    if _current is not None:
        if _current.live and _current.failure is None:
            raise ValueError(
                f"tensor_parallel_size={size}: this process already runs {_current.size} tensor-parallel "
                f"ranks for {len(_current.live)} LLM(s); drop those LLMs, or call "
                "speculative.distributed.shutdown(), first"
            )
        shutdown()
    _current = Ranks(size, device_type)
    return _current


def shutdown() -> None:
    """End the ranks this process spawned and give it its threads back (also done at exit). The LLMs
    built on them raise a RuntimeError from then on."""
    global _current
    if _current is not None:
        _current.close()
        _current = None


atexit.register(shutdown)


def send(connection: Connection, message: tuple) -> None:
    """Send a message, pickled here (plain pickle: tensors travel by value)."""
    connection.send_bytes(pickle.dumps(message))


def receive(connection: Connection) -> tuple:
    """The next message (EOFError once the other end is gone)."""
    return pickle.loads(connection.recv_bytes())


class _Child:
    """One spawned rank: its process and its end of the socket pair."""

    def __init__(self, rank: int, size: int, port: int, threads: int, device_type: str) -> None:
        self.rank = rank
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds the package
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", RANK_PROGRAM, str(theirs.fileno())]
        command += [str(rank), str(size), str(port), str(threads), device_type]
        # LOCAL_RANK as torchrun sets it: transformers' tensor parallelism takes its GPU from it
        environment = {**os.environ, "PYTHONPATH": path, "LOCAL_RANK": str(rank)}
        self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), env=environment)
        theirs.close()
        self.connection = Connection(ours.detach())
        self.error: str | None = None  # what it said failed, before it exited
        self._reading = threading.Lock()  # the engine's thread waits for answers, a watcher reads errors

    def expect(self, kind: str, handle: int | None = None) -> Any:
        """Wait for its message of `kind` (for `handle`), skipping others (an "error" is kept as
        `error`): its payload. A RuntimeError if it exits first."""
        while True:
            with self._reading:
                message = _next(self.connection, 0.1)
            if message is not None and message[0] == "error":
                self.error = message[2]
            elif message is not None and message[:2] == (kind, handle):
                return message[2]
            if self.process.poll() is not None:
                raise RuntimeError(f"tensor-parallel {self.describe()}")

    def describe(self) -> str:
        """How it exited: "rank r exited with code c: what it said failed" (call once it has exited)."""
        code = self.process.poll()
        with self._reading:
            while self.error is None and (message := _next(self.connection, 0)) is not None:
                if message[0] == "error":
                    self.error = message[2]
        return f"rank {self.rank} exited with code {code}" + (f": {self.error}" if self.error else "")


def _next(connection: Connection, timeout: float) -> tuple | None:
    """The next message if one comes within `timeout` seconds; None if none does, or the other end is
    gone."""
    try:
        return receive(connection) if connection.poll(timeout) else None
    except (EOFError, OSError):
        return None


class Ranks:
    """Ranks 1 .. size-1 as child processes, joined with this process (rank 0) in the default group.

    live: the handles of the LLMs built on every rank and not dropped yet. failure: None while every
    rank runs; once they were stopped, why (and every later `send` raises a RuntimeError saying it).
    """

    def __init__(self, size: int, device_type: str) -> None:
        self.size = size
        self.live: set[int] = set()
        self.failure: str | None = None
        self._handles = itertools.count()
        self._lock = threading.Lock()  # stopping
        self._sending = threading.Lock()  # one message at a time on each connection
        self._dropped: deque[int] = deque()  # LLMs dropped since the last send
        self._closing = False
        self._threads = torch.get_num_threads()
        threads = max(1, self._threads // size)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.children = [_Child(rank, size, store.port, threads, device_type) for rank in range(1, size)]
        try:
            for child in self.children:
                child.expect("started")
            if device_type == "cuda":
                torch.cuda.set_device(0)
            dist.init_process_group(
                backend(device_type), store=store, rank=0, world_size=size, timeout=TIMEOUT
            )
        except BaseException:
            self._end_children()
            raise
        torch.set_num_threads(threads)
        for child in self.children:
            threading.Thread(target=self._watch, args=(child,), daemon=True).start()

    def _watch(self, child: _Child) -> None:
        child.process.wait()
        if not self._closing:
            self.stop(f"rank {child.rank} exited")

    @contextmanager
    def building(self, arguments: dict[str, Any]) -> Iterator[int]:
        """Every other rank builds an LLM from `arguments` (LLM's keywords) while this one builds its
        own in the block; yields the LLM's handle. After the block, waits for the others: a RuntimeError
        naming the rank that failed. If the block raises, waits for them to be done too, then re-raises
        (what they built is dropped)."""
        handle = next(self._handles)
        self.send(handle, "build", arguments)
        try:
            yield handle
        except BaseException:
            self._built(handle, strict=False)
            raise
        self._built(handle, strict=True)
        self.live.add(handle)

    def _built(self, handle: int, strict: bool) -> None:
        """Wait for every other rank to answer the build of `handle`; with `strict`, a RuntimeError for
        the first that failed (after dropping the LLM everywhere), else drop it quietly."""
        failures = []
        for child in self.children:
            try:
                error = child.expect("built", handle)
            except RuntimeError as exited:
                failure = self.stop(str(exited))
                if strict:
                    raise RuntimeError(failure) from None
                return
            if error is not None:
                failures.append(f"rank {child.rank} could not build the LLM:\n{error}")
        if failures or not strict:
            self.drop(handle)
        if failures and strict:
            raise RuntimeError(failures[0])

    def send(self, handle: int, kind: str, payload: Any = None) -> None:
        """Send a call to every other rank. A ValueError when the payload does not pickle (nothing is
        sent); a RuntimeError when the ranks were stopped."""
        try:
            data = pickle.dumps((kind, handle, payload))
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            raise ValueError(
                f"tensor_parallel_size > 1 sends each call to every rank, pickled, and this {kind}'s "
                f"arguments do not pickle ({error}); SamplingParams.logits_processors, for one, must be "
                "functions defined at the top level of a module"
            ) from None
        if self.failure is not None:
            raise RuntimeError(f"the tensor-parallel ranks were stopped: {self.failure}")
        try:
            with self._sending:
                messages = []
                while self._dropped:
                    messages.append(pickle.dumps(("drop", self._dropped.popleft(), None)))
                for child in self.children:
                    for message in (*messages, data):
                        child.connection.send_bytes(message)
        except OSError as error:
            raise RuntimeError(self.stop(f"rank 0 could not reach a rank ({error})")) from None

    def drop(self, handle: int) -> None:
        """Every other rank forgets the LLM `handle`, told with the next message sent (this is an LLM's
        finalizer, which the garbage collector may run in any thread, amid a send)."""
        self.live.discard(handle)
        self._dropped.append(handle)

    def stop(self, reason: str) -> str:
        """End every rank after a failure (the first reason counts): waits up to STOP_GRACE_S for the
        children to exit on their own and say why, then ends the rest. Returns the failure: what became
        of the children that had exited (the likelier cause), then the reason."""
        with self._lock:
            if self.failure is None:
                deadline = time.monotonic() + STOP_GRACE_S
                while time.monotonic() < deadline and any(c.process.poll() is None for c in self.children):
                    time.sleep(0.02)
                exited = [c.describe() for c in self.children if c.process.poll() is not None]
                self.failure = "; ".join([*exited, reason])
                self._end_children()
        return f"the tensor-parallel ranks were stopped: {self.failure}"

    def _end_children(self) -> None:
        for child in self.children:
            if child.process.poll() is None:
                child.process.kill()
            child.process.wait()

    def close(self) -> None:
        """End the children (asking first), leave the group and give this process its threads back."""
        self._closing = True
        for child in self.children:
            try:
                send(child.connection, ("exit", None, None))
            except OSError:
                pass
        for child in self.children:
            try:
                child.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            child.connection.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)
