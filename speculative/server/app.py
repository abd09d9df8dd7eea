"""The HTTP layer: an OpenAI-compatible FastAPI app in front of a Scheduler.

Handlers validate, tokenize and submit; the scheduler's engine thread owns the models, so no handler
touches a tensor. Every error is OpenAI's error JSON (`protocol.APIError`), never a bare 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from speculative.console import progress
from speculative.demo import smollm2
from speculative.engine.outputs import SpeculationMetrics
from speculative.engine_args import EngineArgs
from speculative.extras import needs_extra
from speculative.methods import METHODS
from speculative.sampling_params import SamplingParams
from speculative.server.args import ServerArgs, check_serve_flags

with needs_extra("server", "speculative.server"):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from speculative.server import protocol as P
    from speculative.server.scheduler import QueueFull, RequestStream, RequestUpdate, Scheduler, ShuttingDown

if TYPE_CHECKING:
    from speculative.llm import LLM

log = logging.getLogger("speculative.server")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
"""Labels of the requests-by-status counter; any other /v1 path counts as "other"."""
DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks that its client is still there."""
CLIENT_CLOSED = 499
"""The status counted for a request whose client left before its answer (nginx's convention)."""
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""A request body's size at most (`serve --max-request-bytes`); beyond, 413."""
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
"""Seconds a request's body may take to arrive (`serve --timeout-request-body`); beyond, 408."""
DEFAULT_SEND_TIMEOUT_S = 30.0
"""Seconds one write of a response may wait for its client to read (`serve --timeout-send`): a client
that reads nothing that long while the connection's buffers are full is dropped, as if it had left."""
REPLICA_HEADER = "x-speculative-replica"
"""The response header naming the replica that answered (`create_app(replica=...)`)."""


def create_app(
    scheduler: Scheduler,
    *,
    model_name: str,
    tokenizer,
    api_key: str | None,
    max_prompt_tokens: int | None,
    max_model_len: int,
    shutdown_timeout: float = 30.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
    send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
    replica: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `scheduler`'s model as `model_name`.

    tokenizer: the model's (text prompts, chat templates, token texts); None accepts token ids only.
    api_key: when set, every route but /health needs `Authorization: Bearer <api_key>` (else 401).
    max_prompt_tokens: longest prompt taken (None: no limit but the context); max_model_len: prompt
    plus max_tokens at most; max_request_bytes: a request body's size at most (else 413, read no
    further); request_body_timeout: seconds the body may take to arrive (else 408: a client that
    sends slowly holds no handler longer). Both close the connection. send_timeout: seconds one write
    of a response may wait for the client to read; a client that reads nothing that long is dropped
    as if it had left (its request aborted, its rows freed; counted 499). replica: when set, every response
    names it in the REPLICA_HEADER header (one of several behind a proxy). n and best_of are at most
    the scheduler's max_num_seqs. The lifespan starts the scheduler and, on shutdown, lets running
    requests finish within shutdown_timeout seconds.
    `drain(app)` (the CLI calls it on SIGTERM) starts that shutdown early.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await scheduler.shutdown(shutdown_timeout)

    app = FastAPI(
        title="speculative", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan
    )
    app.state.draining = False
    app.state.compiling = None  # a thread compiling the models' graphs in the background (serve_app)
    app.state.scheduler, app.state.shutdown_timeout = scheduler, shutdown_timeout
    limits = _Limits(tokenizer, max_prompt_tokens, max_model_len)
    app.add_middleware(
        _Gate,
        api_key=api_key,
        metrics=scheduler.metrics,
        max_request_bytes=max_request_bytes,
        request_body_timeout=request_body_timeout,
        send_timeout=send_timeout,
        replica=replica,
    )
    _add_error_handlers(app)
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        _check_model(body.model, model_name)
        body.check_limits(scheduler.max_num_seqs)
        prompts = [limits.encode(p) for p in body.prompts()]
        params = [body.sampling_params(limits.budget(ids, body.max_tokens, "max_tokens")) for ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        decode = limits.decode_token
        offsets: dict[int, int] = {}  # each choice's text_offset after the tokens rendered so far

        def render(index: int, seq, chunk: bool) -> dict:
            lp = None
            if seq.logprobs is not None:
                lp = P.completion_logprobs(seq.token_ids, seq.logprobs, decode, offsets.get(index, 0))
                offsets[index] = P.end_offset(lp, offsets.get(index, 0))
            return P.completion_choice(index, seq.text, lp, seq.finish_reason, seq.stop_reason)

        answer = _Answer(
            request_id,
            created=int(time.time()),
            model=model_name,
            object="text_completion",
            chunk_object="text_completion",
            render=render,
            n=params[0].n,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            speculation_metrics=body.return_speculation_metrics,
            prefix_caching=scheduler.engine.prefix_cache is not None,
        )
        return await _respond(scheduler, request, answer, prompts, params, bool(body.stream))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model, model_name)
        body.check_limits(scheduler.max_num_seqs)
        ids = limits.apply_chat_template([m.template_input() for m in body.messages])
        params = body.sampling_params(limits.budget(ids, body.requested_max_tokens, "max_completion_tokens"))
        num_top, decode = body.top_logprobs or 0, limits.decode_token

        def render(index: int, seq, chunk: bool) -> dict:
            lp = (
                None
                if seq.logprobs is None
                else P.chat_logprobs(seq.token_ids, seq.logprobs, num_top, decode)
            )
            return P.chat_choice(index, seq.text, lp, seq.finish_reason, seq.stop_reason, chunk=chunk)

        answer = _Answer(
            f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            object="chat.completion",
            chunk_object="chat.completion.chunk",
            render=render,
            n=params.n,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            speculation_metrics=body.return_speculation_metrics,
            first_choices=[
                P.chat_choice(i, "", None, None, None, role=True, chunk=True) for i in range(params.n)
            ],
            prefix_caching=scheduler.engine.prefix_cache is not None,
        )
        return await _respond(scheduler, request, answer, [ids], [params], bool(body.stream))

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "speculative",
                    "max_model_len": max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health(request: Request) -> Response:
        if request.app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        compiling = request.app.state.compiling
        if compiling is not None and compiling.is_alive():  # serving, the compiled models eager until then
            return JSONResponse({"status": "ok", "compiling": True})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(scheduler.metrics.exposed()), media_type=CONTENT_TYPE_LATEST)

    return app


def drain(app: FastAPI) -> None:
    """Begin a graceful shutdown: new /v1 requests and /health get 503, and the requests still running
    shutdown_timeout seconds from now end with an error (a streamed one: an error event, then
    [DONE]; else a 500) instead of a dropped connection. Safe to call from a signal handler."""
    app.state.draining = True
    app.state.scheduler.drain(app.state.shutdown_timeout)


def _compile_ahead(llm: LLM) -> threading.Thread | None:
    """The graphs of the compiled models among the target (--compile) and a draft model (--draft-compile,
    or --compile), compiled ahead of the requests (none waits while one compiles): at batch 1 and
    larger, the target's plain step and verifications of 2 .. k + 1 tokens, the draft's drafting of
    1 .. k tokens from 1 or 2. A thread of their own compiles them, returned, while the server answers
    with the models eager; None where no such model is compiled. (An EAGLE head's compiled calls
    compile on their first use.)"""
    from speculative.models.compiled import (
        CompiledCausalLM,
        compile_in_background,
        warm_up_draft,
        warm_up_pair,
    )
    from speculative.precompile import PreCompileConfig

    config = llm.speculative_config
    k = config.num_speculative_tokens if config is not None else 0
    target, draft = llm.target.model, llm.draft.model if llm.draft is not None else None
    models = {
        name: m for name, m in (("target", target), ("draft model", draft)) if isinstance(m, CompiledCausalLM)
    }
    if not models:
        return None
    names = " and the ".join(models)

    def warm_up() -> None:
        shapes = PreCompileConfig(batch_size=[1, 2])
        if "target" in models:
            warm_up_pair(target, None, shapes, k, every_width=True)
        if "draft model" in models:
            warm_up_draft(draft, shapes, k, every_draft_length=True)

    def done(error: BaseException | None, seconds: float) -> None:
        if error is None:
            progress(f"compiled the {names}'s graphs in {seconds:.1f} s: they run compiled from now on")
        else:
            progress(f"compiling the {names}'s graphs failed ({error!r}): they keep running eagerly")

    progress(
        f"compiling the {names}'s graphs in the background (a minute or more on a small CPU; eager until "
        "then, /health says compiling)"
    )
    return compile_in_background(list(models.values()), warm_up, done)


def serve_app(server: ServerArgs, engine: EngineArgs, replica: str | None = None) -> FastAPI:
    """The app `speculative serve` runs (not started): the flags checked, --chat-template before the
    models load, then the LLM (with the template as its tokenizer's), its scheduler and the
    OpenAI-compatible app (`replica`: create_app's). ValueError naming the flag for a bad value."""
    template = check_serve_flags(server, engine)
    given, (engine, toy) = engine.model, engine.with_demo_pair()
    if given is None and not toy:
        engine = engine.demo_server_defaults()
    name = server.served_model_name or given or ("speculative-demo" if toy else smollm2.NAME)
    llm = engine.create_llm()
    if template is not None:
        if llm.tokenizer is None:
            raise ValueError(f"--chat-template needs the model's tokenizer, and {engine.model} has none")
        llm.tokenizer.chat_template = template
    context = min(m.model.max_length for m in (llm.target, llm.draft) if m is not None)
    if server.max_model_len is not None and server.max_model_len > context:
        raise ValueError(
            f"--max-model-len {server.max_model_len} is more than the models' context of {context}"
        )
    compiling = _compile_ahead(llm)
    config = llm.speculative_config
    if (
        (engine.compile or engine.draft_compile)
        and config is not None
        and METHODS[config.method].reads_hidden_states
    ):
        flag = "--compile" if engine.compile else "--draft-compile"
        progress(f"{flag}: the drafter's calls compile on their first use (a minute or more on a small CPU)")
    scheduler = Scheduler(
        llm,
        max_num_seqs=server.max_num_seqs,
        max_waiting=server.max_waiting,
        max_prefill_tokens=server.max_prefill_tokens,
    )
    app = create_app(
        scheduler,
        model_name=name,
        tokenizer=llm.tokenizer,
        api_key=server.api_key,
        max_prompt_tokens=server.max_prompt_tokens,
        max_model_len=server.max_model_len or context,
        shutdown_timeout=server.shutdown_timeout,
        max_request_bytes=server.max_request_bytes,
        request_body_timeout=server.timeout_request_body,
        send_timeout=server.timeout_send,
        replica=replica,
    )
    app.state.compiling = compiling
    return app


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise P.APIError(
            404,
            f"The model `{requested}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )


@dataclass
class _Limits:
    """Tokenization and the server's length limits."""

    tokenizer: object
    max_prompt_tokens: int | None
    max_model_len: int

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise P.APIError(
                    400, "the model has no tokenizer: send the prompt as token ids", param="prompt"
                )
            prompt = self.tokenizer(prompt)["input_ids"]
        if not prompt:
            raise P.APIError(400, "prompt is empty: it needs at least one token", param="prompt")
        return prompt

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise P.APIError(
                400,
                "the model's tokenizer has no chat template, so chat completions are not "
                "available: use /v1/completions with a prompt",
                param="messages",
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as error:
            raise P.APIError(
                400, f"the chat template refused these messages: {error}", param="messages"
            ) from None
        return self.encode(list(ids))

    def budget(self, ids: list[int], max_tokens: int | None, field: str) -> int:
        """The request's max_tokens, or what the context leaves when it has none; 400 past the limits."""
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise P.APIError(
                400,
                f"the prompt has {len(ids)} tokens, more than this server's limit of "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)",
                param="prompt",
                code="context_length_exceeded",
            )
        room = self.max_model_len - len(ids)
        if max_tokens is None:
            if room < 1:
                raise P.APIError(
                    400,
                    f"the prompt has {len(ids)} tokens, leaving no room in the model's "
                    f"context of {self.max_model_len} tokens (max_model_len)",
                    param="prompt",
                    code="context_length_exceeded",
                )
            return room
        if max_tokens > room:
            raise P.APIError(
                400,
                f"the prompt ({len(ids)} tokens) plus {field} ({max_tokens}) is "
                f"{len(ids) + max_tokens} tokens, more than the model's context of "
                f"{self.max_model_len} (max_model_len)",
                param=field,
                code="context_length_exceeded",
            )
        return max_tokens

    def decode_token(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else ""


@dataclass
class _Answer:
    """How one request's updates become its endpoint's response or chunks.

    render(index, sequence, chunk) -> a choice dict, from a SequenceDelta (or the summed `_Choice`):
    its text, token_ids, logprobs, finish_reason and stop_reason; called on each choice's deltas in
    order (a chunk each), or once on the whole choice.
    first_choices: sent in a chunk before any text (chat's role).
    """

    request_id: str
    created: int
    model: str
    object: str
    chunk_object: str
    render: Callable[..., dict]
    n: int
    include_usage: bool
    continuous_usage: bool = False
    speculation_metrics: bool = False
    first_choices: list[dict] = field(default_factory=list)
    prefix_caching: bool = False

    def chunk(self, choices: list[dict], usage: dict | None = None, speculation: dict | None = None) -> str:
        body = P.response_object(
            self.chunk_object,
            self.request_id,
            self.created,
            self.model,
            choices,
            usage,
            with_usage=self.include_usage,
            speculation_metrics=speculation,
        )
        return _event(body)

    def usage(self, prompts: list[list[int]], generated: int, cached: list[int]) -> dict:
        """The usage object: prompt and generated tokens, and where the server caches prefixes the
        prompt tokens it found cached (`cached`, per prompt)."""
        return P.usage(sum(map(len, prompts)), generated, sum(cached) if self.prefix_caching else None)

    def usage_so_far(self, prompts: list[list[int]], generated: int, cached: list[int]) -> dict | None:
        """A text chunk's usage: the tokens so far where the request asked for it on every chunk
        (continuous_usage_stats), else None."""
        return self.usage(prompts, generated, cached) if self.continuous_usage else None

    def speculation(self, metrics: list[SpeculationMetrics | None]) -> dict | None:
        """The prompts' final metrics added up, in vLLM's names, when the request asked for them."""
        if not self.speculation_metrics:
            return None
        return SpeculationMetrics.total(m for m in metrics if m is not None).vllm_fields()


async def _respond(
    scheduler: Scheduler,
    request: Request,
    answer: _Answer,
    prompts: list[list[int]],
    params: list[SamplingParams],
    stream: bool,
) -> Response:
    streams = _submit(scheduler, prompts, params, answer.request_id)
    if stream:
        return StreamingResponse(
            _sse(request, answer, streams, prompts),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    collect = asyncio.ensure_future(_collect(answer, streams))
    try:  # a client that leaves before the answer frees its rows too
        while not collect.done():
            await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
            if not collect.done() and await request.is_disconnected():
                return Response(status_code=CLIENT_CLOSED)
        choices, num_generated, metrics, cached = collect.result()
    finally:
        collect.cancel()
    body = P.response_object(
        answer.object,
        answer.request_id,
        answer.created,
        answer.model,
        choices,
        answer.usage(prompts, num_generated, cached),
        speculation_metrics=answer.speculation(metrics),
    )
    return JSONResponse(body)


def _submit(
    scheduler: Scheduler, prompts: list[list[int]], params: list[SamplingParams], request_id: str
) -> list[RequestStream]:
    """One stream per prompt, or none and the scheduler's refusal as an APIError."""
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(scheduler.submit(ids, p, request_id if len(prompts) == 1 else f"{request_id}-{i}"))
    except BaseException as error:
        for s in streams:
            s.abort()
        if isinstance(error, QueueFull):
            raise P.APIError(429, f"the server's queue is full, try again later ({error})") from None
        if isinstance(error, ShuttingDown):
            raise P.APIError(503, "the server is shutting down and takes no new requests") from None
        if isinstance(error, (ValueError, TypeError)):
            raise P.invalid_request(error) from None
        raise
    return streams


@dataclass
class _Choice:
    """One choice's text, tokens and log-probabilities so far (a SequenceDelta's fields, summed)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def _collect(
    answer: _Answer, streams: list[RequestStream]
) -> tuple[list[dict], int, list[SpeculationMetrics | None], list[int]]:
    """Every update of the streams -> the rendered choices, the tokens generated, each prompt's
    final speculation metrics and its tokens the prefix cache held."""
    choices: dict[int, _Choice] = {}
    generated = [0] * len(streams)
    cached = [0] * len(streams)
    metrics: list[SpeculationMetrics | None] = [None] * len(streams)
    async with aclosing(_merge(streams)) as updates:
        async for prompt, update in updates:
            if update.error is not None:
                raise _failure(update.error)
            generated[prompt] = update.num_generated_tokens
            cached[prompt] = update.num_cached_tokens
            metrics[prompt] = update.metrics or metrics[prompt]
            for delta in update.sequences:
                choice = choices.setdefault(prompt * answer.n + delta.index, _Choice())
                choice.text += delta.text
                choice.token_ids.extend(delta.token_ids)
                if delta.logprobs is not None:
                    choice.logprobs = choice.logprobs or []
                    choice.logprobs.extend(delta.logprobs)
                if delta.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
    return [answer.render(i, c, False) for i, c in sorted(choices.items())], sum(generated), metrics, cached


async def _sse(
    request: Request, answer: _Answer, streams: list[RequestStream], prompts: list[list[int]]
) -> AsyncIterator[str]:
    """The server-sent events of a streamed request: one chunk per update (several tokens when a step
    accepted several), the usage chunk when asked, then [DONE]. Whatever ends it early (the client
    leaving cancels it) aborts the request's unfinished sequences."""
    request.state.status = CLIENT_CLOSED
    generated, cached = [0] * len(streams), [0] * len(streams)
    metrics: list[SpeculationMetrics | None] = [None] * len(streams)
    async with aclosing(_merge(streams)) as updates:
        if answer.first_choices:
            yield answer.chunk(answer.first_choices, answer.usage_so_far(prompts, 0, cached))
        async for prompt, update in updates:
            if request.state.client_stalled.is_set():  # dropped by _Gate: end as if it had left
                break
            if update.error is not None:
                failure = _failure(update.error)
                request.state.status = failure.status
                yield _event(failure.body())
                break
            generated[prompt] = update.num_generated_tokens
            cached[prompt] = update.num_cached_tokens
            metrics[prompt] = update.metrics or metrics[prompt]
            choices = []
            for delta in update.sequences:
                choices.append(answer.render(prompt * answer.n + delta.index, delta, True))
            if choices:
                yield answer.chunk(choices, answer.usage_so_far(prompts, sum(generated), cached))
        else:
            speculation = answer.speculation(metrics)
            if answer.include_usage or speculation is not None:
                yield answer.chunk([], answer.usage(prompts, sum(generated), cached), speculation)
            request.state.status = 200
    yield "data: [DONE]\n\n"


def _failure(error: str) -> P.APIError:
    """A request that the engine failed: a 400 naming the field when its own parameters did (errors
    that begin "SamplingParams.", as NoTokenAllowed's), else a 500."""
    if error.startswith("SamplingParams."):
        return P.invalid_request(ValueError(error))
    return P.APIError(500, f"the engine failed this request: {error}")


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestUpdate]]:
    """(stream index, update) from several streams as they come, each to its end. Closing it early
    aborts the streams not at their end."""
    queue: asyncio.Queue = asyncio.Queue()
    ended = [False] * len(streams)

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for update in stream:
                queue.put_nowait((i, update))
        except Exception as error:
            queue.put_nowait((i, error))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while not all(ended):
            i, update = await queue.get()
            if isinstance(update, Exception):
                raise update
            if update is None:
                ended[i] = True
            else:
                yield i, update
    finally:
        for task, stream, done in zip(tasks, streams, ended):
            task.cancel()
            if not done:
                stream.abort()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Gate:
    """Pure ASGI middleware: the API key, draining (503), the body's size (413, the body read no
    further than the limit) and time to arrive (408), counting /v1 requests by status, and naming
    the replica in every response's headers (when it has a name), and dropping a client that reads
    nothing for send_timeout seconds: the write waiting for it is given up, the app's later writes
    are dropped, and `request.state.client_stalled` (an asyncio.Event) is set, on which a stream ends
    at its next update as when its client leaves (its rows freed); uvicorn then closes the connection
    (the response is incomplete).

    A streamed request is counted when its stream ends, with the status its handler leaves in
    `request.state.status` (200, 499 when the client left, 400 or 500 when the engine failed it)."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        metrics,
        max_request_bytes: int,
        request_body_timeout: float,
        send_timeout: float,
        replica: str | None,
    ) -> None:
        self.app, self.metrics, self.max_request_bytes = app, metrics, max_request_bytes
        self.request_body_timeout, self.send_timeout = request_body_timeout, send_timeout
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.replica = [(REPLICA_HEADER.encode(), replica.encode())] if replica else []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        counted = path.startswith("/v1/")
        status = 500
        stalled = asyncio.Event()  # the client read nothing for send_timeout seconds

        async def send_and_note(message) -> None:
            nonlocal status
            if stalled.is_set():
                return
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *self.replica]}
            try:
                async with asyncio.timeout(self.send_timeout):
                    await send(message)
            except TimeoutError:
                stalled.set()
                log.warning("%s: dropped a client that read nothing for %g s", path, self.send_timeout)

        try:
            error, headers = self._refusal(scope, path), None
            if error is None:
                try:
                    body = await self._body(scope, receive)
                except P.APIError as unread:  # the rest of the body is not read: the connection closes
                    error, headers = unread, {"Connection": "close"}
            if error is not None:
                response = JSONResponse(error.body(), status_code=error.status, headers=headers)
                await response(scope, receive, send_and_note)
            else:
                scope.setdefault("state", {})["client_stalled"] = stalled
                await self.app(scope, _replay(body, receive), send_and_note)
        finally:
            if counted:
                status = scope.get("state", {}).get("status", status)
                self.metrics.request_finished(status, path if path in ENDPOINTS else "other")

    async def _body(self, scope, receive) -> bytes:
        """The whole request body; APIError 413 (read no further) when it is over the limit, 408 when
        it has not all come within request_body_timeout seconds."""
        too_large = P.APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_request_bytes} bytes "
            "(--max-request-bytes)",
            code="request_too_large",
        )
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise too_large
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.request_body_timeout):
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        break  # the client left: the app gets what came, then the disconnect
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_request_bytes:
                        raise too_large
                    more = message.get("more_body", False)
        except TimeoutError:
            raise P.APIError(
                408,
                f"the request body did not arrive within {self.request_body_timeout:g} s "
                "(--timeout-request-body)",
                code="request_timeout",
            ) from None
        return b"".join(chunks)

    def _refusal(self, scope, path: str) -> P.APIError | None:
        if self.expected is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return P.APIError(
                    401,
                    "a valid API key is required: send `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                )
        if path.startswith("/v1/") and scope["app"].state.draining:
            return P.APIError(503, "the server is shutting down and takes no new requests")
        return None


def _replay(body: bytes, receive):
    """An ASGI receive that gives the body already read, then passes on to `receive` (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(P.APIError)
    async def api_error(request: Request, error: P.APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error.errors())
        return JSONResponse(P.error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}; this server has POST /v1/completions, "
                f"POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics"
            )
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return JSONResponse(
            P.APIError(error.status_code, message).body(),
            status_code=error.status_code,
            headers=error.headers,
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(
            P.error_body(f"internal error: {type(error).__name__}: {error}", "server_error"), status_code=500
        )


def _validation_message(errors) -> tuple[str, str | None]:
    """pydantic's errors -> one message naming the fields (at most three), and the first field's path."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    parts, params = [], []
    for error in errors[:3]:
        path = _path(error["loc"][1:])
        if not path:
            reason = "is missing" if error["type"] == "missing" else "must be a JSON object"
            parts.append(f"the request body {reason}")
            continue
        params.append(path)
        parts.append(f"{path} is required" if error["type"] == "missing" else f"{path}: {error['msg']}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, params[0] if params else None


def _path(loc) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
