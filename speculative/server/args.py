"""ServerArgs: what `speculative serve` takes beyond the engine (EngineArgs), each field's help and default
written once; its flags are made from them (`ServerArgs.add_cli_args`). `check_serve_flags` and
`uvicorn_options` read them. Imports no torch, nor the server extra: `--help` and bad flags answer at once.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from speculative.engine_args import (
    EngineArgs,
    add_dataclass_args,
    arg,
    dataclass_from_cli_args,
    not_under_torchrun,
)

SHUTDOWN_GRACE_S = 5.0
"""uvicorn's wait for connections after SIGTERM beyond --shutdown-timeout and --timeout-send: a
request that the shutdown timeout cut sends its error event to a client that reads (each write given
--timeout-send at most, after which the client is dropped) and then its connection closes; only a
connection still open after all of it is dropped by uvicorn."""


@dataclass
class ServerArgs:
    """`speculative serve`'s own flags, by their names (the engine's are EngineArgs')."""

    host: str = arg("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = arg(8000, "port to listen on")
    replicas: int = arg(
        1,
        "engines serving behind Ray Serve's HTTP proxy on --host/--port (1: no Ray; more needs the "
        "replicas extra)",
    )
    api_key: str | None = arg(
        None,
        "require `Authorization: Bearer KEY` on every route but /health",
        env="SPECULATIVE_API_KEY",
        default_text="$SPECULATIVE_API_KEY; none: open",
    )
    served_model_name: str | None = arg(
        None,
        "the model's name in the API",
        default_text="--model; the demo's name, speculative-demo for the toy",
    )
    max_num_seqs: int = arg(32, "sequences decoded together at most")
    max_waiting: int = arg(128, "sequences that may wait for room in the batch (then 429)")
    max_prefill_tokens: int | None = arg(
        None,
        "prompt tokens prefilled between two decoding steps at most (a longer prompt goes in chunks of "
        "that many, one between two steps): a smaller figure keeps the running streams' pauses short "
        "while new requests arrive",
        default_text="no bound",
    )
    max_prompt_tokens: int | None = arg(None, "longest prompt accepted", default_text="the context")
    max_model_len: int | None = arg(None, "prompt + max_tokens at most", default_text="the models' context")
    max_request_bytes: int = arg(
        1 << 20, "a request body's size at most, in bytes (then 413)", default_text="1 MiB"
    )
    chat_template: str | None = arg(
        None,
        "the Jinja chat template of /v1/chat/completions, or the path of a file holding it",
        metavar="TEMPLATE",
        default_text="the tokenizer's",
    )
    shutdown_timeout: float = arg(30.0, "seconds running requests get to finish after SIGTERM or SIGINT")
    timeout_request_body: float = arg(
        30.0, "seconds a request's body may take to arrive (then 408, and the connection closes)"
    )
    timeout_send: float = arg(
        30.0,
        "seconds one write of a response may wait for its client to read; a client that reads nothing "
        "that long is dropped and its request aborted",
    )
    timeout_keep_alive: int = arg(5, "seconds an idle keep-alive connection stays open (uvicorn's flag)")
    limit_concurrency: int = arg(
        1024,
        "open connections and running handlers at most; beyond, new requests get 503 (uvicorn's flag)",
    )
    h11_max_incomplete_event_size: int = arg(
        16 * 1024, "bytes of a request's line and headers at most (uvicorn's flag)"
    )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_dataclass_args(parser.add_argument_group("server", "the HTTP server and its limits"), ServerArgs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return dataclass_from_cli_args(cls, args)


def uvicorn_options(server: ServerArgs) -> dict:
    """uvicorn.Config's keywords from `serve`'s flags (checked by `check_serve_flags`)."""
    return {
        "host": server.host,
        "port": server.port,
        "log_level": "info",
        "timeout_graceful_shutdown": server.shutdown_timeout + server.timeout_send + SHUTDOWN_GRACE_S,
        "timeout_keep_alive": server.timeout_keep_alive,
        "limit_concurrency": server.limit_concurrency,
        "h11_max_incomplete_event_size": server.h11_max_incomplete_event_size,
    }


def check_serve_flags(server: ServerArgs, engine: EngineArgs) -> str | None:
    """--chat-template's template (None: the tokenizer's); ValueError naming the flag for a bad value
    of `serve`'s own flags and the speculative ones (the rest of the engine's are checked as the models
    load)."""
    not_under_torchrun("speculative serve")
    if server.replicas < 1:
        raise ValueError(f"--replicas must be >= 1; got {server.replicas}")
    if server.replicas > 1 and (engine.tensor_parallel_size != 1 or engine.draft_tensor_parallel_size != 1):
        raise ValueError("--replicas runs each engine in one process: --tensor-parallel-size must be 1")
    if server.replicas > 1 and engine.device != "cpu":
        raise ValueError(f"--replicas runs on the CPU only (--device cpu); got --device {engine.device}")
    for flag in (
        "max_prefill_tokens",
        "max_prompt_tokens",
        "max_model_len",
        "max_request_bytes",
        "timeout_keep_alive",
        "limit_concurrency",
        "h11_max_incomplete_event_size",
    ):
        if getattr(server, flag) is not None and getattr(server, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(server, flag)}")
    if server.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0; got {server.shutdown_timeout}")
    for flag in ("timeout_request_body", "timeout_send"):
        if not getattr(server, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0; got {getattr(server, flag)}")
    engine.check_speculative_flags()  # the speculative flags, before anything loads
    return None if server.chat_template is None else chat_template(server.chat_template)


def chat_template(value: str) -> str:
    """--chat-template's template: the text of the file that `value` names, else `value` itself.
    ValueError naming the flag when it is not valid Jinja (compiled as transformers compiles chat
    templates, by rendering a one-message chat; errors that only the tokenizer's variables or real
    messages would avoid are left to the requests, which get them as 400s)."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    template = Path(value).read_text(encoding="utf-8") if os.path.isfile(value) else value
    try:
        render_jinja_template(
            [[{"role": "user", "content": "hello"}]], chat_template=template, add_generation_prompt=True
        )
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(
            f"--chat-template is not a valid Jinja template: {error.message} (line "
            f"{error.lineno}); give a template or the path of a file holding one"
        ) from None
    except jinja2.TemplateError:
        pass
    return template
