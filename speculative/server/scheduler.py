"""Continuous batching for the server: one engine thread owns the models; HTTP handlers only queue.

The engine thread loops: drop the rows of requests whose clients left, admit waiting requests while
the running batch has room (`max_num_seqs` sequences; a prefill joins the batch between two steps),
run one step of every running row, and hand each request what it gained to its handler's asyncio
queue (thread-safe, through the event loop). Handlers never touch tensors. A request that fails
inside the engine (its prefill, or its own per-row work) fails alone; a whole step that raises fails
the requests of that step and the server goes on with an empty batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from speculative.engine.outputs import Logprob, SpeculationMetrics
from speculative.engine.sequence import Sequence
from speculative.engine.stats import StepStats
from speculative.llm import LLM
from speculative.models import few_rows
from speculative.models.cpu_tuning import SMALL_CALL_ROWS, tune
from speculative.models.eagle import EagleHead
from speculative.models.llama import NativeCausalLM
from speculative.models.packed import PackedLinear, onednn_row_counts
from speculative.sampling_params import SamplingParams
from speculative.server.memory import release_free_memory
from speculative.server.metrics import ServerMetrics
from speculative.server.openmp import release_thread_team

SHUT_DOWN = "the server shut down before this request finished (--shutdown-timeout)"
"""The error of the requests still running when the shutdown's time is up."""

KERNEL_SHARE = 0.1
"""While requests run, the engine thread makes the next oneDNN kernel (Scheduler.start) between two
steps only as long as the time it spent making them between steps is under this share of its time
stepping; when idle it makes them one after the other."""


FAILURE_MEMORY = 10.0
"""Seconds after an error in the engine thread within which another counts as the same one recurring."""


class QueueFull(Exception):
    """The waiting queue is at its limit (HTTP 429)."""


class ShuttingDown(Exception):
    """The scheduler no longer takes requests (HTTP 503)."""


@dataclass
class SequenceDelta:
    """What one choice of a request gained since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestUpdate:
    """What a request gained in one engine step (or its prefill).

    sequences: only the choices that gained something or finished. finished: every choice has.
    metrics: the request's speculation figures, on the final update. error: the engine failed the
    request (the handler answers 500). num_cached_tokens: its prompt's tokens the prefix cache held.
    """

    sequences: list[SequenceDelta]
    finished: bool
    num_prompt_tokens: int
    num_generated_tokens: int
    metrics: SpeculationMetrics | None = None
    error: str | None = None
    num_cached_tokens: int = 0


@dataclass
class _Sent:
    """How much of one sequence its handler has: text, tokens, speculation counts."""

    text: str = ""
    tokens: int = 0
    finished: bool = False
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class RequestStream:
    """The updates of one request, as an async iterator that ends after the final one."""

    def __init__(self, request: Request, scheduler: Scheduler) -> None:
        self.request_id = request.request_id
        self._request = request
        self._scheduler = scheduler

    async def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        while True:
            update = await self._request.queue.get()
            yield update
            if update.finished or update.error is not None:
                return

    def abort(self) -> None:
        """The client is gone: its rows leave the batch at the next step. Idempotent, thread-safe."""
        self._scheduler._abort(self._request)


@dataclass
class Request:
    """One HTTP request: its sequences (n or best_of of them) and what its handler has been sent."""

    request_id: str
    number: int
    sequences: list[Sequence]
    queue: asyncio.Queue
    arrival: float
    sent: list[_Sent]
    first_token_time: float | None = None
    last_token_time: float = 0.0
    aborted: bool = False
    done: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.sequences[0].params


class Scheduler:
    """Owns `llm`'s engine in a thread and batches requests continuously.

    max_num_seqs: sequences in the running batch at most (a request's n / best_of all count).
    max_waiting: sequences that may wait for room in the running batch; beyond, `submit` raises
        QueueFull.
    max_prefill_tokens: prompt tokens prefilled between two steps at most (None: no bound). Every
        running row waits while new ones are prefilled, so the bound caps that pause (a stream's
        inter-token latency) at the cost of a later first token for requests that arrive together.
        While rows run, a waiting request whose prompt is longer than the bound is prefilled a chunk of
        at most that many tokens between two steps (Engine.begin_prefill) and joins the batch with its
        last chunk; one such prompt at a time, the oldest waiting request, and before it nothing else
        enters the batch whole in that pause. With no row running (nobody waits on it) and for a
        request that wants prompt_logprobs (all its logits at once), the oldest waiting request is
        prefilled whole whatever its length. A prompt's tokens that the prefix cache holds are not
        counted: their prefill is skipped.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        max_num_seqs: int = 32,
        max_waiting: int = 128,
        max_prefill_tokens: int | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_waiting < 0:
            raise ValueError(
                f"max_num_seqs must be >= 1 and max_waiting >= 0; got {max_num_seqs}, {max_waiting}"
            )
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1 or None; got {max_prefill_tokens}")
        self.llm = llm
        self.engine = llm.engine
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.metrics = metrics or ServerMetrics()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._prefilling: Request | None = None  # its prompt prefilled a chunk at a time
        self._num_running = 0  # sequences of the _running and _prefilling requests (read from other threads)
        self._aborted: list[Request] = []
        self._numbers = itertools.count()
        self._accepting = True
        self._deadline: float | None = None  # drain(): when the remaining requests fail
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kernels: tuple[KernelCall, ...] = ()  # start(): the engine thread makes them
        self._kernels_made = 0
        self._step_time = self._kernel_time = 0.0  # seconds of steps, of kernels made between steps

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return self._num_running

    @property
    def num_waiting(self) -> int:
        """Sequences queued for the running batch."""
        with self._lock:
            return sum(len(j.sequences) for j in self._waiting)

    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will read the streams. From
        then on this process's oneDNN matmuls meet few row counts (cpu_tuning.tune). A server
        meets ever new batch and prefill sizes, each a kernel that oneDNN would make and keep, so its
        memory would grow for thousands of requests: the engine thread makes the kernels of those few
        counts itself (kernel_calls), one matmul at a time while it has nothing else to do, and while
        requests run in at most KERNEL_SHARE of its time, so that requests are served at once and its
        memory then stays flat. This thread's OpenMP team ends (openmp.release_thread_team): the
        engine thread's forwards run at full speed only while its team is the only one."""
        tune(serving=True)
        self._kernels = kernel_calls(self.llm)
        release_thread_team()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="speculative-engine", daemon=True)
        self._thread.start()

    @property
    def kernels_left(self) -> int:
        """oneDNN kernels the engine thread has still to make (start): 0 once it made them all."""
        return len(self._kernels) - self._kernels_made

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; call from the event loop. Raises ValueError (naming the problem) when the
        models cannot take it, QueueFull, or ShuttingDown."""
        if not self._accepting:
            raise ShuttingDown("the server is shutting down and takes no new requests")
        sequences = self.llm.make_sequences(list(prompt_token_ids), params)
        if len(sequences) > self.max_num_seqs:
            raise ValueError(
                f"the request needs {len(sequences)} sequences (n / best_of), more than the "
                f"server's max_num_seqs={self.max_num_seqs}"
            )
        request = Request(
            request_id,
            next(self._numbers),
            sequences,
            asyncio.Queue(),
            time.perf_counter(),
            [_Sent(accepted_per_position=[0] * self.engine.k) for _ in sequences],
        )
        with self._lock:
            queued = sum(len(j.sequences) for j in self._waiting) + len(sequences)
            if queued - (self.max_num_seqs - self._num_running) > self.max_waiting:
                raise QueueFull(
                    f"the server is full: {self._num_running} sequences running (max_num_seqs="
                    f"{self.max_num_seqs}) and the queue is at max_waiting={self.max_waiting}; "
                    "retry later"
                )
            self._waiting.append(request)
        self._wake.set()
        return RequestStream(request, self)

    def drain(self, timeout: float) -> None:
        """Stop taking requests (`submit` raises ShuttingDown); the requests still queued or running
        `timeout` seconds from now fail with an error update saying that the server shut down. Calling
        it again keeps the first deadline. Thread-safe (the CLI calls it from its signal handler)."""
        with self._lock:
            self._accepting = False
            if self._deadline is None:
                self._deadline = time.monotonic() + timeout
        self._wake.set()

    async def shutdown(self, timeout: float) -> None:
        """`drain(timeout)`, wait for the queued and running requests to finish or fail, then stop the
        engine thread."""
        self.drain(timeout)
        while self._thread is not None and self._thread.is_alive():
            if not (self._running or self._waiting or self._prefilling):
                break
            await asyncio.sleep(0.02)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _abort(self, request: Request) -> None:
        """A waiting request leaves the queue at once (counted as aborted here); a running one's rows
        leave the batch at the engine thread's next turn."""
        with self._lock:
            if request.aborted or request.done:
                return
            request.aborted = True
            waiting = request in self._waiting
            if waiting:
                self._waiting.remove(request)
            else:
                self._aborted.append(request)
        if waiting:
            self.metrics.requests_finished.labels(finished_reason="abort").inc()
        self._wake.set()

    # The engine thread.

    def _run(self) -> None:
        """The engine thread: `_serve` until it returns (shut down). A step or a prefill that raises
        fails its own requests there (a step's: the running ones); anything else that raises
        (publishing, admitting) fails every queued and running request with its error, and the thread
        goes on serving: a thread that ended would leave every request, then and later, waiting for
        ever. An error that comes back at
        once (within FAILURE_MEMORY seconds of the last) makes the thread wait before it goes on, twice
        as long each time up to a second, rather than spin on it."""
        failures, last = 0, -FAILURE_MEMORY
        with self.engine.recording_steps() as steps:  # each step's StepStats, counted and cleared
            while True:
                try:
                    self._serve(steps)
                    return
                except Exception as error:
                    logging.getLogger(__name__).error("the engine thread failed its requests", exc_info=True)
                    steps.clear()
                    self._fail_all(f"{type(error).__name__}: {error}")
                    if self._stopping:
                        return
                    now = time.monotonic()
                    failures, last = (failures + 1 if now - last < FAILURE_MEMORY else 1), now
                    time.sleep(min(0.01 * 2**failures, 1.0))

    def _serve(self, steps: list[StepStats]) -> None:
        busy = False  # a step ran since the batch was last empty
        while True:
            with self._lock:
                aborted, self._aborted = self._aborted, []
                expired = self._deadline is not None and time.monotonic() >= self._deadline
                pending = bool(self._waiting or self._running or self._prefilling)
                admitted, chunk = self._admit() if not (self._stopping or expired) else ([], 0)
            for request in aborted:
                if not request.done:
                    self._finish(request, "abort")
            if self._stopping or (expired and pending):
                self._fail_all(SHUT_DOWN)
                self._set_gauges()
                if self._stopping:
                    return
                continue
            if chunk:
                self._prefill_chunk(chunk)
            if admitted:
                self._add(admitted)
            self._set_gauges()
            if not self._running and self._prefilling is None:
                if busy:  # the batch just emptied
                    release_free_memory()
                    busy = False
                if self._make_kernel():  # then look for requests again
                    continue
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            busy = True
            start = time.perf_counter()
            try:
                self.engine.step()
            except Exception as error:
                logging.getLogger(__name__).error("an engine step failed its requests", exc_info=True)
                self._fail_step(f"{type(error).__name__}: {error}")
                continue
            elapsed = time.perf_counter() - start
            self.metrics.engine_seconds.labels(phase="step").inc(elapsed)
            for stats in steps:
                self.metrics.engine_steps.labels(drafted=str(stats.num_query_tokens - 1)).inc()
            steps.clear()
            self._publish(list(self._running), elapsed)
            self._step_time += elapsed
            if self._kernel_time < KERNEL_SHARE * self._step_time:
                start = time.perf_counter()
                if self._make_kernel():
                    self._kernel_time += time.perf_counter() - start

    def _make_kernel(self) -> bool:
        """Make the next kernel of `start`'s list (the engine is idle, or has KERNEL_SHARE of its
        stepping time to spare); False when none is left. Once the last one is made, the heap's free
        memory goes back to the OS (its matmuls' inputs and outputs). A kernel that fails to be made
        ends the list, with a logged warning: the matmuls that need the rest make them as they come."""
        if self._kernels_made >= len(self._kernels):
            return False
        call = self._kernels[self._kernels_made]
        self._kernels_made += 1
        try:
            call.make()
        except Exception:
            logging.getLogger(__name__).warning(
                "making oneDNN kernels ahead of the requests failed; the rest are made as needed",
                exc_info=True,
            )
            self._kernels_made = len(self._kernels)
        if self._kernels_made == len(self._kernels):
            release_free_memory()
        return True

    def _admit(self) -> tuple[list[Request], int]:
        """Under the lock: the waiting requests that go into the running batch whole now, oldest first,
        and the tokens of the chunked prefill's next chunk (0: none), within max_prefill_tokens (the
        class docstring). A request whose prompt is to be prefilled in chunks becomes _prefilling."""
        admitted, room = [], self.max_num_seqs - self.num_running
        budget, chunk = self.max_prefill_tokens, 0
        if self._prefilling is not None and not self._prefilling.aborted:  # (an aborted one ends below)
            left = self.engine.prefilling.tokens_left
            chunk = left if budget is None or not self._running else min(left, budget)
            budget = None if budget is None else budget - chunk
        while self._waiting and len(self._waiting[0].sequences) <= room:
            request = self._waiting[0]
            prompt = request.sequences[0].prompt_token_ids
            tokens = len(prompt) - (
                self.engine.cached_prefix(prompt) if request.params.prompt_logprobs is None else 0
            )
            if budget is not None and tokens > budget:
                if admitted or self._prefilling is not None:
                    break
                if self._running and request.params.prompt_logprobs is None:
                    self._waiting.popleft()
                    self._prefilling, chunk = request, budget
                    room -= len(request.sequences)
                    break
            self._waiting.popleft()
            room -= len(request.sequences)
            budget = None if budget is None else budget - tokens
            admitted.append(request)
        self._running.extend(admitted)
        self._count_running()
        return admitted, chunk

    def _count_running(self) -> None:
        prefilling = [self._prefilling] if self._prefilling is not None else []
        self._num_running = sum(len(j.sequences) for j in self._running + prefilling)

    def _prefill_chunk(self, tokens: int) -> None:
        """The next `tokens` of the _prefilling request's prompt (its first chunk begins its prefill);
        with its last, it joins the running requests. If that raises, it fails alone."""
        request = self._prefilling
        start = time.perf_counter()
        try:
            if self.engine.prefilling is None:
                self._prepare(request)
                self.engine.begin_prefill(request.sequences)
            finished = self.engine.prefill_chunk(tokens)
        except Exception as error:
            self.metrics.engine_seconds.labels(phase="prefill").inc(time.perf_counter() - start)
            self._fail(request, f"{type(error).__name__}: {error}")
            return
        elapsed = time.perf_counter() - start
        self.metrics.engine_seconds.labels(phase="prefill").inc(elapsed)
        if finished is not None:
            self._count_cached([request])
            self._prefilling = None
            self._running.append(request)
            self._publish([request], elapsed)

    def _prepare(self, request: Request) -> None:
        """Give the request's sequences its prompt index (the engine shares one prefill per index) and
        count its prompt."""
        for r in request.sequences:
            r.prompt_index = request.number
        self.metrics.prompt_tokens.inc(len(request.sequences[0].prompt_token_ids))

    def _add(self, requests: list[Request]) -> None:
        """Prefill the requests together; if that raises, one at a time, so that a failing one fails alone."""
        for request in requests:
            self._prepare(request)
        self._prefill_whole(requests)

    def _prefill_whole(self, requests: list[Request]) -> None:
        """`_add`'s prefill of prepared requests."""
        start = time.perf_counter()
        try:
            self.engine.add([r for request in requests for r in request.sequences])
        except Exception as error:
            self.metrics.engine_seconds.labels(phase="prefill").inc(time.perf_counter() - start)
            if len(requests) == 1:
                self._fail(requests[0], f"{type(error).__name__}: {error}")
                return
            for request in requests:
                self._prefill_whole([request])
            return
        elapsed = time.perf_counter() - start
        self.metrics.engine_seconds.labels(phase="prefill").inc(elapsed)
        self._count_cached(requests)
        self._publish(requests, elapsed)

    def _count_cached(self, requests: list[Request]) -> None:
        """Count the prefilled requests' prompt tokens looked up in the prefix cache, and found."""
        if self.engine.prefix_cache is None:
            return
        for request in requests:
            first = request.sequences[0]
            self.metrics.prefix_cache_queries.inc(len(first.prompt_token_ids))
            self.metrics.prefix_cache_hits.inc(first.num_cached_tokens)

    def _publish(self, requests: list[Request], elapsed: float) -> None:
        """Hand each request what its sequences gained; retire the finished and failed ones."""
        now = time.perf_counter()
        for request in requests:
            if request.done:
                continue
            errors = [r.error for r in request.sequences if r.error is not None]
            if errors:
                self._fail(request, errors[0])
                continue
            deltas = self._deltas(request)
            gained = sum(len(d.token_ids) for d in deltas)
            self._count(request, gained, elapsed, now)
            finished = all(r.finished for r in request.sequences)
            if not deltas and not finished:
                continue
            if finished:
                self._retire(request)
                self.metrics.e2e_latency.observe(now - request.arrival)
                self.metrics.requests_finished.labels(finished_reason=_reason(request)).inc()
            self._send(
                request,
                RequestUpdate(
                    deltas,
                    finished,
                    len(request.sequences[0].prompt_token_ids),
                    sum(len(r.output_token_ids) for r in request.sequences),
                    _metrics(request) if finished else None,
                    num_cached_tokens=request.sequences[0].num_cached_tokens,
                ),
            )

    def _deltas(self, request: Request) -> list[SequenceDelta]:
        """Each sequence's new text and tokens. best_of > n sends the best n whole, at the end."""
        params = request.params
        if params.sampled_sequences > params.n:
            if not all(r.finished for r in request.sequences):
                return []
            best = sorted(request.sequences, key=lambda r: r.cumulative_logprob or 0.0, reverse=True)[
                : params.n
            ]
            return [
                SequenceDelta(
                    i, self._text(r), list(r.output_token_ids), r.logprobs, r.finish_reason, r.stop_reason
                )
                for i, r in enumerate(best)
            ]
        deltas = []
        for i, (r, sent) in enumerate(zip(request.sequences, request.sent)):
            if sent.finished:
                continue
            text, num_tokens = self._released(r, sent.tokens)
            new_text = text[len(sent.text) :] if len(text) > len(sent.text) else ""
            new_ids = r.output_token_ids[sent.tokens : num_tokens]
            if not new_ids and not new_text and not r.finished:
                continue
            logprobs = r.logprobs[sent.tokens : num_tokens] if r.logprobs is not None else None
            sent.text, sent.tokens, sent.finished = sent.text + new_text, num_tokens, r.finished
            deltas.append(SequenceDelta(i, new_text, new_ids, logprobs, r.finish_reason, r.stop_reason))
        return deltas

    def _text(self, r: Sequence) -> str:
        """A finished sequence's text."""
        return r.text if r.text is not None else self.llm.detokenize(r.output_token_ids, r.params)

    def _released(self, r: Sequence, num_sent: int) -> tuple[str, int]:
        """What of a sequence its handler may have now: its text, and how many of its tokens (with
        their log-probabilities), of which `num_sent` it has. While the sequence runs, the text stops
        short of a trailing incomplete character and of the characters that could still turn out to
        begin a stop string, and the tokens stop with it: those whose text is held back wait too."""
        ids = r.output_token_ids
        if r.finished:
            return self._text(r), len(ids)
        whole = self.llm.detokenize(ids, r.params)
        text = whole.rstrip("\ufffd")
        if r.params.stop:
            text = text[: max(0, len(text) - max(len(s) for s in r.params.stop) + 1)]
        if len(text) == len(whole):
            return text, len(ids)
        low, high = num_sent, len(ids)  # the most tokens whose text the released text begins with
        while low < high:
            middle = (low + high + 1) // 2
            if text.startswith(self.llm.detokenize(ids[:middle], r.params)):
                low = middle
            else:
                high = middle - 1
        return text, low

    def _count(self, request: Request, gained: int, elapsed: float, now: float) -> None:
        """Token, latency and speculation metrics of what a request gained in one step."""
        m = self.metrics
        if gained:
            m.generation_tokens.inc(gained)
            if request.first_token_time is None:
                request.first_token_time = now
                m.time_to_first_token.observe(now - request.arrival)
            else:
                for _ in range(gained):
                    m.inter_token_latency.observe(elapsed / gained)
        for r, sent in zip(request.sequences, request.sent):
            s = r.metrics
            drafts = s.drafted_per_position[0] if s.drafted_per_position else 0
            m.num_drafts.inc(drafts - sent.drafts)
            m.num_draft_tokens.inc(s.num_drafted - sent.drafted)
            m.num_accepted_tokens.inc(s.num_accepted - sent.accepted)
            for position, (now_count, before) in enumerate(
                zip(s.accepted_per_position, sent.accepted_per_position)
            ):
                if now_count > before:
                    m.accepted_per_position.labels(position=str(position)).inc(now_count - before)
            sent.drafts, sent.drafted, sent.accepted = drafts, s.num_drafted, s.num_accepted
            sent.accepted_per_position = list(s.accepted_per_position)

    def _finish(self, request: Request, reason: str) -> None:
        """Drop a running request's rows (an aborted client, or a failure)."""
        self._retire(request)
        self.engine.abort([r for r in request.sequences if not r.finished], reason)
        self.metrics.requests_finished.labels(finished_reason=reason).inc()

    def _retire(self, request: Request) -> None:
        request.done = True
        if request is self._prefilling:
            self._prefilling = None
        if request in self._running:
            self._running.remove(request)
        self._count_running()

    def _fail(self, request: Request, error: str) -> None:
        self._finish(request, "error")
        self._send(
            request, RequestUpdate([], True, len(request.sequences[0].prompt_token_ids), 0, None, error)
        )

    def _fail_step(self, error: str) -> None:
        """A step raised: its requests, the running ones, fail with its error and the engine drops its
        batch; the waiting requests and a chunked prefill under way go on."""
        self.engine.drop_batch()
        for request in list(self._running):
            self._fail(request, error)

    def _fail_all(self, error: str) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        prefilling = [self._prefilling] if self._prefilling is not None else []
        for request in waiting + prefilling + list(self._running):
            self._fail(request, error)
        self.engine.reset()

    def _send(self, request: Request, update: RequestUpdate) -> None:
        if not request.aborted and self._loop is not None:
            self._loop.call_soon_threadsafe(request.queue.put_nowait, update)

    def _set_gauges(self) -> None:
        self.metrics.running.set(self.num_running)
        self.metrics.waiting.set(self.num_waiting)


@dataclass(frozen=True)
class KernelCall:
    """One call of a PackedLinear that makes one oneDNN kernel: `rows` zero rows (plus a zero residual
    where `residual`, as a decoder layer's o and down projections add theirs) on `threads` OpenMP
    threads. oneDNN keys its kernels by the call's shapes, dtypes, post-op and threads: every layer of
    the same shape shares them. It holds the layer weakly (a layer laid out again is a new one)."""

    linear: weakref.ReferenceType[PackedLinear]
    residual: bool
    rows: int
    threads: int

    def make(self) -> None:
        """Call the layer (nothing if it is gone), on `threads` threads, restored afterwards."""
        linear = self.linear()
        if linear is None:
            return
        weight = linear.weight
        previous = torch.get_num_threads()
        if self.threads != previous:
            torch.set_num_threads(self.threads)
        try:
            with torch.no_grad():
                x = weight.new_zeros(self.rows, weight.shape[1])
                linear(x, weight.new_zeros(self.rows, weight.shape[0]) if self.residual else None)
        finally:
            if self.threads != previous:
                torch.set_num_threads(previous)


def kernel_calls(llm: LLM) -> tuple[KernelCall, ...]:
    """The calls that make every oneDNN kernel `llm`'s forwards meet under round_onednn_rows: each
    distinct kind of call (linear_calls) of every natively run model (target, draft, EAGLE head; not
    one split over ranks, whose forwards every rank must make) on each row count of
    onednn_row_counts (but the few rows that models/few_rows.py's kernel takes), on torch's threads,
    and where a model runs forwards of at most SMALL_CALL_ROWS tokens on fewer threads
    (NativeCausalLM.small_call_threads), at those counts on those threads too (a longer forward's last
    chunk, or its lm_head, meets them on torch's). One call per kernel, by row count ascending (the
    most frequent counts first). Computes nothing."""
    if llm.tensor_parallel is not None:
        return ()
    models = []
    for loaded in (llm.target, llm.draft, getattr(getattr(llm.engine, "proposer", None), "head", None)):
        model = loaded
        while model is not None and not isinstance(model, NativeCausalLM):  # loaded, compiled, bucketed
            model = getattr(model, "model", None)
        if model is not None:
            models.append(model)
    threads = torch.get_num_threads()
    calls: dict[tuple, KernelCall] = {}
    for rows in onednn_row_counts():
        for model in models:
            small = model.small_call_threads
            fewer = bool(small) and small < threads and rows <= SMALL_CALL_ROWS
            for linear, residual in linear_calls(model):
                if linear.prepacked is None:  # not oneDNN's (quantized, not on a CPU)
                    continue
                if linear.few_rows and rows <= few_rows.ROWS_MAX:  # few_rows.py's kernel's, not oneDNN's
                    continue
                for n in (small, threads) if fewer else (threads,):
                    weight, bias = linear.weight, linear.bias
                    key = (tuple(weight.shape), weight.dtype, bias is not None, residual, rows, n)
                    calls.setdefault(key, KernelCall(weakref.ref(linear), residual, rows, n))
    return tuple(calls.values())


def linear_calls(model: NativeCausalLM) -> list[tuple[PackedLinear, bool]]:
    """(layer, whether with a residual) for each PackedLinear call of `model`'s forward: each decoder
    layer's q/k/v and gate/up projections alone, its o and down projections adding the residual
    stream (llama.NativeCausalLM.run_layers), the lm_head alone, and an EAGLE head's fc alone."""
    calls = [
        (linear, residual)
        for layer in model._layers
        for linear, residual in (
            (layer.qkv, False),
            (layer.o, True),
            (layer.gate_up, False),
            (layer.down, True),
        )
    ]
    calls.append((model._lm_head, False))
    if isinstance(model, EagleHead):
        calls.append((model._fc, False))
    return calls


def _reason(request: Request) -> str:
    reasons = {r.finish_reason for r in request.sequences}
    return "length" if reasons == {"length"} else "stop"


def _metrics(request: Request) -> SpeculationMetrics:
    return SpeculationMetrics.total(r.metrics for r in request.sequences)
