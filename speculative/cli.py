"""The `speculative` command line: `speculative generate`, `bench`, `bench-serve` and `serve`.

Dispatch only: the flags are made from the dataclasses that hold them (EngineArgs, ServerArgs,
GenerateArgs below, the benchmarks' BenchConfig and LoadConfig), each field's help and default written
once there, and each command hands what they read back to the engine, the server or the benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speculative.config import GenerationConfig, SpeculativeConfig
from speculative.console import progress, quiet_transformers
from speculative.demo import smollm2
from speculative.engine.outputs import SpeculationMetrics
from speculative.engine_args import (
    EngineArgs,
    LazyArgumentParser,
    add_dataclass_args,
    add_method_shortcuts,
    arg,
    dataclass_from_cli_args,
    default_of,
    not_under_torchrun,
)
from speculative.extras import needs_extra
from speculative.methods import METHODS
from speculative.sampling_params import SamplingParams
from speculative.server.args import ServerArgs, check_serve_flags, uvicorn_options

if TYPE_CHECKING:  # the engine (torch, transformers) is imported when a command runs, not for --help
    from speculative.llm import LLM

DEFAULT_PROMPT = "Give me three tips for staying healthy."
TOY_PROMPT = "class Stack:\n    def __init__(self):\n"
"""The default prompts: a chat request for an instruction-tuned model, code for others (the toy pair
writes Python)."""
WARM_UP_TOKENS = 8
"""Tokens of `generate`'s warm-up call, which pays the first call's one-time costs (and compilation)."""


@dataclass
class GenerateArgs:
    """`speculative generate`'s own flags: the prompts and their sampling (the engine's are EngineArgs')."""

    prompt: list[str] | None = arg(  # noqa: RUF009 (arg makes a field)
        None, "a prompt (repeat for a batch)", action="append", nargs=None, default_text=repr(DEFAULT_PROMPT)
    )
    chat: bool | None = arg(
        None,
        "send each prompt as a user message through the tokenizer's chat template",
        action=argparse.BooleanOptionalAction,
        default_text="where the model has one, except the toy pair's, which continues code",
    )
    max_tokens: int = arg(128, "tokens generated per prompt at most")
    streaming_chunks: int = arg(1, "target steps between printed chunks")
    temperature: float = arg(0.0, "0 is greedy")
    top_k: int = arg(default_of(SamplingParams, "top_k"), "sample from the k likeliest tokens (-1: all)")
    top_p: float = arg(default_of(SamplingParams, "top_p"), "sample from the smallest set of this mass")
    request_seed: int | None = arg(None, "the request's seed", flags=("--seed",))
    ignore_eos: bool = arg(False, "go on after the end-of-sequence token")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculative", description="Fast, exact speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=LazyArgumentParser)
    gen = commands.add_parser("generate", help="generate text from prompts and print acceptance figures")
    add_dataclass_args(gen, GenerateArgs)
    EngineArgs.add_cli_args(gen, exclude=("seed",))  # --seed is the request's
    commands.add_parser(
        "bench",
        fill=_bench_flags,
        help="benchmark ours against Hugging Face's decoding, side by side",
        description="Every method on the same prompts in one process; writes results.json, report.md and "
        "plots. Flags left out take the defaults (or --quick's).",
    )
    commands.add_parser(
        "bench-serve",
        fill=_bench_serve_flags,
        help="benchmark `speculative serve` under load over HTTP, with and without speculation",
        description="Starts one `speculative serve` per server variant and drives it with streamed "
        "requests: closed loop at each --concurrency, open loop (Poisson) at each --rate, and an "
        "optional soak; writes results.json, report.md and load.png.",
    )
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, "
        "/health and /metrics, with continuous batching.",
    )
    EngineArgs.add_cli_args(ServerArgs.add_cli_args(serve))
    return parser


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    with needs_extra("bench", "speculative bench"):
        from speculative.bench.run import BenchConfig
    add_dataclass_args(bench, BenchConfig, all_none=True)  # None: BenchConfig's (or --quick's) default
    add_method_shortcuts(  # several heads may be measured side by side
        bench,
        only=lambda method: method.reads_hidden_states,
        more="; measured as chains of k, and trees where the method has them",
        notes={
            "eagle": " (default with the toy pair: models/demo/eagle)",
            "eagle3": " (default: the demo model's packaged head; with the toy pair models/demo/eagle3)",
        },
    )
    bench.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke test: 2 prompts a set, 24 tokens, 2 sweep points, well under a minute on 2 CPU cores",
    )


def _bench_serve_flags(load: argparse.ArgumentParser) -> None:
    with needs_extra("bench", "speculative bench-serve"):
        from speculative.bench.load import LoadConfig
    add_dataclass_args(load, LoadConfig)
    load.add_argument(
        "--serve-args",
        default="",
        help='more `speculative serve` flags for every server, one string: --serve-args="--max-num-seqs 64"',
    )
    load.add_argument(
        "--draft-args",
        default="",
        help="more `speculative serve` flags for the servers that draft (draft, adaptive), one string: "
        '--draft-args="--num-assistant-tokens 1"',
    )
    load.add_argument("--out", default="bench-serve-out", help="output directory (default: bench-serve-out)")


def generate(args: argparse.Namespace) -> int:
    """Load the pair, warm it up on the prompts (WARM_UP_TOKENS tokens, at most --max-tokens), then
    generate: stream one prompt's text, or print each completion of several; each with its figures."""
    given = dataclass_from_cli_args(GenerateArgs, args)
    params = SamplingParams(
        temperature=given.temperature,
        top_k=given.top_k,
        top_p=given.top_p,
        seed=given.request_seed,
        max_tokens=given.max_tokens,
        ignore_eos=given.ignore_eos,
    )
    engine = EngineArgs.from_cli_args(args)
    engine.check_speculative_flags()  # a bad speculative flag stops here, before anything loads
    engine, _ = engine.with_demo_pair()
    config = engine.speculative_config()
    llm = engine.create_llm()
    from speculative.bench.prompts import instruction_tuned

    instruct = llm.tokenizer is not None and instruction_tuned(llm.tokenizer)
    texts = given.prompt or [DEFAULT_PROMPT if instruct else TOY_PROMPT]
    chat = instruct if given.chat is None else given.chat
    prompts = [_chat_prompt(llm, text) for text in texts] if chat else texts
    warm_up = min(WARM_UP_TOKENS, params.max_tokens)
    compiles = engine.compile or engine.draft_compile
    flag = "--compile" if engine.compile else "--draft-compile"
    compiling = f"; {flag}: the first call compiles, a minute or more on a small CPU" if compiles else ""
    progress(f"warming up on the prompts ({warm_up} tokens{compiling})...")
    start = time.perf_counter()
    llm.generate(prompts, dataclasses.replace(params, max_tokens=warm_up, ignore_eos=True))
    cost = "warm-up and compilation" if compiles else "warm-up"
    progress(f"first call ({warm_up} tokens, {cost}) in {time.perf_counter() - start:.2f} s")
    shown = [f"user: {text}\nassistant: " if chat else text for text in texts]
    if len(prompts) > 1:
        for text, output in zip(shown, llm.generate(prompts, params)):
            print(f"{text}{output.outputs[0].text}\n")
            print(_figures(output.metrics, output.outputs[0].finish_reason, config))
        return 0
    print(shown[0], end="", flush=True)  # one prompt: print the text as it streams
    for state in llm.stream(
        prompts, params, config=GenerationConfig(streaming_chunks=given.streaming_chunks)
    ):
        print(state.new_text[0], end="", flush=True)
    print("\n")
    print(_figures(SpeculationMetrics(**state.metrics[0]), state.finish_reasons[0], config))
    return 0


def _chat_prompt(llm: LLM, text: str) -> list[int]:
    """`text` as a user message in the tokenizer's chat template, ready for the answer (ValueError
    where the model has no chat template)."""
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template; this model has none (use --no-chat)")
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _figures(m: SpeculationMetrics, finish_reason: str | None, config: SpeculativeConfig | None) -> str:
    """A completion's figures: tokens, steps and finish; the time to its first token (the prefill) and
    the decoding speed after it; with a drafter, the acceptance."""
    method = f"{config.method}, k={config.num_speculative_tokens}" if config else "autoregressive"
    if config and config.tree:
        method += f", {config.tree} tree of {config.tree_nodes}"
    if config and config.method == "draft_model" and config.options.prompt_lookup_min:
        method += f", prompt lookup first (n >= {config.options.prompt_lookup_min})"
        if config.options.num_assistant_tokens:
            method += f", the draft's own chain {config.options.num_assistant_tokens}"
    decoding = f"decoding {m.decode_tokens_per_second:.1f} tokens/s"
    speed = f"time to first token {1000 * m.first_token_s:.1f} ms, {decoding}"
    lines = [f"[{method}] {m.num_generated} tokens in {m.num_steps} steps, finish: {finish_reason}", speed]
    if config:
        per_position = " ".join(f"{a:.2f}" for a in m.acceptance_per_position)
        lines.append(
            f"acceptance rate {m.acceptance_rate:.2f} ({m.num_accepted}/{m.num_drafted} drafts), "
            f"mean accepted length {m.mean_accepted_length:.2f}, per position: {per_position}"
        )
    return "\n".join(lines)


def bench(args: argparse.Namespace) -> int:
    not_under_torchrun("speculative bench")
    with needs_extra("bench", "speculative bench"):
        from rich.console import Console

        from speculative.bench.run import BenchConfig, run_and_report

    heads = {m: getattr(args, m) for m, c in METHODS.items() if c.reads_hidden_states and getattr(args, m)}
    if args.synthetic and (args.model or args.draft_model or heads):
        raise ValueError(
            "--synthetic builds the pair: drop --model, --draft-model and the heads (--eagle, ...)"
        )
    config = BenchConfig().quick() if args.quick else BenchConfig()
    for field in dataclasses.fields(BenchConfig):
        if (
            field.name not in ("model", "draft_model", "heads")
            and getattr(args, field.name, None) is not None
        ):
            setattr(config, field.name, getattr(args, field.name))
    pair, toy = EngineArgs(model=args.model, draft_model=args.draft_model).with_demo_pair()
    config.model, config.draft_model = pair.model, pair.draft_model
    if heads or args.synthetic:
        config.heads = heads
    elif toy:
        config.heads = {m: path for m, path in config.heads.items() if Path(path).is_dir()}
    else:  # the demo model's packaged head; none for a model of one's own
        config.heads = {} if args.model else {"eagle3": str(smollm2.EAGLE3_PACKAGE)}
    run_and_report(config, Path(args.out), Console() if sys.stdout.isatty() else Console(width=130))
    return 0


def bench_serve(args: argparse.Namespace) -> int:
    with needs_extra("bench", "speculative bench-serve"):
        from speculative.bench.load import LoadConfig, run_load
        from speculative.bench.load_report import soak_lines

    pair, _ = EngineArgs(model=args.model, draft_model=args.draft_model).with_demo_pair()
    flags, drafting = shlex.split(args.serve_args), shlex.split(args.draft_args)
    config = dataclass_from_cli_args(
        LoadConfig, args, model=None, draft_model=None, serve_flags=flags, draft_flags=drafting
    )
    out = Path(args.out)
    results = run_load(config, pair.model, pair.draft_model, out)
    for line in soak_lines(results):
        print(f"soak, {line}")
    print(f"wrote {out / 'report.md'}")
    return 0


def serve(args: argparse.Namespace) -> int:
    """Serve `serve_app`'s app until SIGTERM or SIGINT: from then on new requests get 503 while running
    ones have --shutdown-timeout seconds to finish. With --replicas N > 1, N of them behind Ray Serve
    (`speculative.server.replicas.serve_replicas`)."""
    server, engine = serve_args(args)
    check_serve_flags(server, engine)  # bad flags stop here, before the server's modules load
    if server.replicas != 1:
        with needs_extra("replicas", "speculative serve --replicas"):
            from speculative.server.replicas import serve_replicas
        return serve_replicas(server, engine)
    with needs_extra("server", "speculative serve"):
        import uvicorn

        from speculative.server.app import drain, serve_app
    app = serve_app(server, engine)
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(server)))
    stop = uvicorn_server.handle_exit

    def handle_exit(sig, frame) -> None:  # uvicorn's own handler stops accepting connections and waits
        drain(app)
        stop(sig, frame)

    uvicorn_server.handle_exit = handle_exit
    uvicorn_server.run()
    return 0


def serve_args(args: argparse.Namespace | list[str]) -> tuple[ServerArgs, EngineArgs]:
    """(ServerArgs, EngineArgs) of `serve`'s parsed flags, or of its flags as a list (`serve` left out)."""
    if isinstance(args, list):
        args = build_parser().parse_args(["serve", *args])
    return ServerArgs.from_cli_args(args), EngineArgs.from_cli_args(args)


def main(argv: list[str] | None = None) -> int:
    quiet_transformers()
    try:
        args = build_parser().parse_args(argv)  # the benchmarks' flags may need the bench extra
        if int(os.environ.get("RANK", "0")) != 0:  # torchrun's other ranks: rank 0 prints the results
            sys.stdout = open(os.devnull, "w")
        return {"bench": bench, "bench-serve": bench_serve, "serve": serve}.get(args.command, generate)(args)
    except (ValueError, TypeError, OSError, ModuleNotFoundError) as error:  # bad input, a missing extra
        print(f"speculative: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
