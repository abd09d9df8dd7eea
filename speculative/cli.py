"""The `speculative` command line: `speculative generate`, `bench`, `bench-serve` and `serve`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from speculative.config import GenerationConfig, SpeculativeConfig
from speculative.demo import DEMO_DIR, DEMO_DIR_ENV, smollm2
from speculative.engine.outputs import SpeculationMetrics
from speculative.extras import needs_extra
from speculative.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine (torch, transformers) is imported when a command runs, not for --help
    from speculative.llm import LLM

DEFAULT_PROMPT = "Give me three tips for staying healthy."
TOY_PROMPT = "class Stack:\n    def __init__(self):\n"
"""The default prompts: a chat request for an instruction-tuned model, code for others (the toy pair
writes Python)."""
SHUTDOWN_GRACE_S = 5.0
"""uvicorn's wait for connections after SIGTERM beyond --shutdown-timeout: the time the requests that
the timeout cut have to send their error to their clients before uvicorn drops the connections."""
WARM_UP_TOKENS = 8
"""Tokens of `generate`'s warm-up call, which pays the first call's one-time costs (and compilation)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculative", description="Fast, exact speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    engine = _engine_flags()
    gen = commands.add_parser(
        "generate", parents=[engine], help="generate text from prompts and print acceptance figures"
    )
    gen.add_argument(
        "--prompt", action="append", help=f"a prompt (repeat for a batch; default {DEFAULT_PROMPT!r})"
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        help="send each prompt as a user message through the tokenizer's chat template (default: where "
        "the model has one, except the toy pair's, which continues code)",
    )
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--streaming-chunks", type=int, default=1, help="target steps between printed chunks")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--compile",
        action="store_true",
        help="run the native forward compiled (torch.compile; "
        "the first call of each kind compiles, a minute or more on a small CPU)",
    )
    _add_bench_parser(commands)
    _add_bench_serve_parser(commands)
    _add_serve_parser(commands, engine)
    return parser


def _engine_flags() -> argparse.ArgumentParser:
    """The flags `generate` and `serve` share: the pair, the drafter, the acceptance rule and how the
    models run (a parent parser)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument(
        "--model",
        help="target model: hub id, local path, or a GGUF file (a .gguf, or a folder holding one) "
        "(default: the demo model, SmolLM2-135M-Instruct, with its draft)",
    )
    drafter = flags.add_mutually_exclusive_group()
    drafter.add_argument(
        "--draft-model",
        help="draft model sharing the target's vocabulary: hub id, local path, or a GGUF file",
    )
    drafter.add_argument("--ngram", action="store_true", help="draft by n-gram prompt lookup")
    drafter.add_argument(
        "--suffix",
        action="store_true",
        help="draft by suffix decoding: suffix tries of the request and of past responses",
    )
    _eagle_flags(drafter)
    flags.add_argument("--suffix-max-depth", type=int, default=24, help="--suffix: the tries' depth (24)")
    flags.add_argument(
        "--suffix-max-cached-requests",
        type=int,
        default=10000,
        help="--suffix: past responses cached (10000; 0: none)",
    )
    flags.add_argument(
        "--suffix-max-spec-factor",
        type=float,
        default=1.0,
        help="--suffix: drafts at most this times the match's length (1.0)",
    )
    flags.add_argument(
        "--suffix-min-token-prob",
        type=float,
        default=0.1,
        help="--suffix: the least estimated probability of a draft (0.1)",
    )
    flags.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="draft tokens per step")
    flags.add_argument(
        "--adaptive",
        action="store_true",
        help="choose k per step in [0, -k] from measured acceptance and step times",
    )
    flags.add_argument(
        "--tree",
        choices=["static", "dynamic"],
        help="verify a token tree of depth -k per step: dynamic (follows the draft's confidence) or static",
    )
    flags.add_argument(
        "--tree-width", type=int, default=2, help="a draft tree's children per expanded node (2)"
    )
    flags.add_argument("--tree-nodes", type=int, default=8, help="drafts per tree (8)")
    flags.add_argument(
        "--acceptance",
        choices=["rejection", "typical"],
        default="rejection",
        help="rejection is lossless; typical is not",
    )
    flags.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    flags.add_argument(
        "--draft-dtype",
        help="the draft model's dtype (default: --dtype); on a CPU a float32 "
        "draft beside a bfloat16 target can be faster",
    )
    flags.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    flags.add_argument("--model-impl", choices=["auto", "native", "transformers"], default="auto")
    flags.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        help="weight-only quantization of the "
        "target's and the draft's projections (CPU, native forward; int4: bfloat16 models)",
    )
    _tensor_parallel_flag(flags)
    flags.add_argument(
        "--draft-tensor-parallel-size",
        type=int,
        default=1,
        help="1 (the whole draft on every rank) or --tensor-parallel-size (the draft split too)",
    )
    return flags


def _eagle_flags(group, more: str = "") -> None:
    """--eagle PATH and --eagle3 PATH (vLLM's method names) in a mutually exclusive group: an EAGLE
    head's checkpoint directory; `more` ends their help."""
    for layout, name in (("eagle", "EAGLE-1"), ("eagle3", "EAGLE-3")):
        group.add_argument(
            f"--{layout}",
            metavar="PATH",
            help=f"draft with an {name} head (its checkpoint directory) reading the target's hidden "
            f"states; unquantized, one rank (--tree: EAGLE-2's trees){more}",
        )


def _tensor_parallel_flag(parser: argparse.ArgumentParser, default: int | None = 1) -> None:
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=default,
        help="split the target over N ranks (processes this command starts; under torchrun, its own); "
        "N must divide its attention heads, key/value heads and MLP columns; a model on transformers' "
        "forward is split by transformers' own tensor parallelism, where it has a plan for it (1)",
    )


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="benchmark ours against Hugging Face's decoding, side by side",
        description="Every method on the same prompts in one process; writes "
        "results.json, report.md and plots. Flags left out take the "
        "defaults (or --quick's).",
    )
    bench.add_argument("--model", help="target model (default: the demo model, SmolLM2-135M-Instruct)")
    bench.add_argument("--draft-model", help="draft model (default with the demo model: its trained draft)")
    _eagle_flags(
        bench.add_mutually_exclusive_group(),
        "; measured as chains of k and dynamic trees (default with the toy pair: models/demo/eagle)",
    )
    bench.add_argument(
        "--synthetic",
        choices=["1b", "7b", "tiny"],
        help="instead of --model: a synthetic Llama-shaped pair of that size, random weights, built in "
        "process, its draft the target's first layers (for speed at real sizes without a model hub)",
    )
    bench.add_argument(
        "--synthetic-acceptance",
        type=float,
        help="--synthetic: the draft's greedy agreement with the target it is calibrated to (0.8)",
    )
    bench.add_argument(
        "--prompts",
        action="append",
        help="a prompt set: a bundled one's name or a JSONL file (repeat; default: the chat, code-chat, "
        "summarize and chat-multiturn sets for an instruction-tuned model; for the toy pair code, "
        "multiturn and edit)",
    )
    bench.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, help="draft tokens per step (4)")
    bench.add_argument("--tree-nodes", type=int, help="drafts per tree of the tree methods (8)")
    bench.add_argument("--tree-width", type=int, help="a draft tree's children per expanded node (2)")
    bench.add_argument("--sweep-k", type=int, nargs="+", help="k values of the k sweep (1 .. 8)")
    bench.add_argument("--batch-size", dest="batch_sizes", type=int, nargs="+", help="batch sizes (1 4 8)")
    bench.add_argument("--max-tokens", type=int, help="tokens generated per prompt, EOS ignored (128)")
    bench.add_argument("--num-prompts", type=int, help="prompts per set, the first ones (12)")
    bench.add_argument("--sweep-prompts", type=int, help="prompts per k-sweep point (4)")
    bench.add_argument("--repeats", type=int, help="timed runs per prompt and method (1)")
    bench.add_argument("--dtype", help="float32 (default), bfloat16, float16 or auto")
    bench.add_argument("--draft-dtype", help="the draft's dtype, ours and HF's assistant (default: --dtype)")
    bench.add_argument("--device", help="cpu (default) or cuda")
    bench.add_argument("--model-impl", choices=["auto", "native", "transformers"])
    bench.add_argument("--seed", type=int)
    _tensor_parallel_flag(bench, default=None)
    bench.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="also measure ours compiled (torch.compile): autoregressive, each drafter at k",
    )
    bench.add_argument(
        "--llama-cpp",
        metavar="DIR",
        help="also measure llama.cpp: a llama.cpp checkout whose --llama-cpp-build folder "
        "holds bin/llama-server (without it the llama.cpp methods are skipped); the pair "
        "must be local folders",
    )
    bench.add_argument(
        "--llama-cpp-build",
        metavar="NAME",
        help="build folder under --llama-cpp, or an absolute path (build)",
    )
    bench.add_argument(
        "--gguf-cache",
        metavar="DIR",
        help="where the pair's GGUF files for llama.cpp are kept (~/.cache/speculative/gguf)",
    )
    bench.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        help="compare quantized weights: ours runs target and draft weight-only quantized (int4: bfloat16 "
        "models), llama.cpp GGUFs its llama-quantize makes (int8: Q8_0, int4: Q4_1); HF stays unquantized",
    )
    bench.add_argument(
        "--llama-cpp-target-gguf",
        metavar="PATH",
        help="a ready GGUF for llama.cpp's target instead of converting --model (its type must be the "
        "run's: F32, BF16, or Q8_0 / Q4_1 with --quantization)",
    )
    bench.add_argument("--out", default="bench-out", help="output directory (bench-out)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke test: 2 prompts a set, 24 tokens, 2 sweep points, well under a minute on 2 CPU cores",
    )


def _add_bench_serve_parser(commands) -> None:
    load = commands.add_parser(
        "bench-serve",
        help="benchmark `speculative serve` under load over HTTP, with and without speculation",
        description="Starts one `speculative serve` per server variant and drives it with streamed "
        "requests: closed loop at each --concurrency, open loop (Poisson) at each --rate, and an "
        "optional soak; writes results.json, report.md and load.png.",
    )
    load.add_argument("--model", help="target model (default: the demo model, SmolLM2-135M-Instruct)")
    load.add_argument("--draft-model", help="draft model (default with the demo model: its trained draft)")
    load.add_argument(
        "--prompts", help="a JSONL prompt set or a bundled set's name (default: chat, or code for the toy)"
    )
    load.add_argument("--num-prompts", type=int, default=32, help="prompts sent in turn, the first ones (32)")
    load.add_argument("--max-tokens", type=int, default=64, help="tokens per request, EOS ignored (64)")
    load.add_argument(
        "--max-tokens-range",
        type=float,
        default=0.5,
        help="each request's tokens drawn from max-tokens * (1 -+ this) (0.5); 0: all max-tokens",
    )
    load.add_argument(
        "-k", "--num-speculative-tokens", dest="k", type=int, default=4, help="draft tokens (4)"
    )
    load.add_argument(
        "--servers",
        nargs="+",
        default=["plain", "draft", "adaptive"],
        help="server variants: plain (no speculation), draft (k drafts), adaptive (k chosen per step)",
    )
    load.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="closed-loop clients")
    load.add_argument("--rate", dest="rates", type=float, nargs="*", default=[4.0], help="open-loop req/s")
    load.add_argument("--requests", type=int, default=64, help="requests per level, at least 2 per client")
    load.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every level, the servers taking turns in each (all up together): ratios to plain "
        "over the rounds (1: one server up at a time)",
    )
    load.add_argument("--soak", dest="soak_requests", type=int, default=0, help="soak requests (0: none)")
    load.add_argument("--soak-max-tokens", type=int, default=8, help="tokens per soak request (8)")
    load.add_argument("--dtype", default="float32", help="the servers' --dtype (float32)")
    load.add_argument("--compile", action="store_true", help="the servers run compiled (--compile)")
    load.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--serve-args",
        default="",
        help='more `speculative serve` flags for every server, one string: --serve-args="--max-num-seqs 64"',
    )
    load.add_argument("--out", default="bench-serve-out", help="output directory (bench-serve-out)")


def _add_serve_parser(commands, engine: argparse.ArgumentParser) -> None:
    serve = commands.add_parser(
        "serve",
        parents=[engine],
        help="serve the model over an OpenAI-compatible HTTP API",
        description="POST /v1/completions and /v1/chat/completions (streaming or "
        "not), GET /v1/models, /health and /metrics, with continuous "
        "batching.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engines serving behind Ray Serve's HTTP proxy on --host/--port (1: no Ray; more needs the "
        "replicas extra)",
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("SPECULATIVE_API_KEY"),
        help="require `Authorization: Bearer KEY` on every route but /health "
        "(default: $SPECULATIVE_API_KEY; none: open)",
    )
    serve.add_argument(
        "--served-model-name",
        help="the model's name in the API (default: --model; the demo's name, speculative-demo for the toy)",
    )
    serve.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together at most")
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=128,
        help="sequences that may wait for room in the batch (then 429)",
    )
    serve.add_argument("--max-prompt-tokens", type=int, help="longest prompt accepted (default: the context)")
    serve.add_argument(
        "--max-model-len", type=int, help="prompt + max_tokens at most (default: the models' context)"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="a request body's size at most, in bytes (then 413; default 1 MiB)",
    )
    serve.add_argument(
        "--chat-template",
        metavar="TEMPLATE",
        help="the Jinja chat template of "
        "/v1/chat/completions, or the path of a file holding it (default: the tokenizer's)",
    )
    serve.add_argument("--seed", type=int, default=0, help="seeds requests that have no seed of their own")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM or SIGINT",
    )
    serve.add_argument(
        "--timeout-request-body",
        type=float,
        default=30.0,
        help="seconds a request's body may take to arrive (then 408, and the connection closes)",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection stays open (uvicorn's flag)",
    )
    serve.add_argument(
        "--limit-concurrency",
        type=int,
        default=1024,
        help="open connections and running handlers at most; beyond, new requests get 503 (uvicorn's flag)",
    )
    serve.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=16 * 1024,
        help="bytes of a request's line and headers at most (uvicorn's flag)",
    )


def generate(args: argparse.Namespace) -> int:
    """Load the pair, warm it up on the prompts (WARM_UP_TOKENS tokens, at most --max-tokens), then
    generate: stream one prompt's text, or print each completion of several; each with its figures."""
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    model, draft, _ = _models(args.model, _draft_path(args), args.ngram or args.suffix)
    config = _speculative_config(args, draft)
    llm = _load(args, model, draft, config, compile=args.compile)
    from speculative.bench.prompts import instruction_tuned

    instruct = llm.tokenizer is not None and instruction_tuned(llm.tokenizer)
    texts = args.prompt or [DEFAULT_PROMPT if instruct else TOY_PROMPT]
    chat = instruct if args.chat is None else args.chat
    prompts = [_chat_prompt(llm, text) for text in texts] if chat else texts
    warm_up, start = min(WARM_UP_TOKENS, params.max_tokens), time.perf_counter()
    llm.generate(prompts, dataclasses.replace(params, max_tokens=warm_up, ignore_eos=True))
    cost = "warm-up and compilation" if args.compile else "warm-up"
    print(
        f"speculative: first call ({warm_up} tokens, {cost}) in {time.perf_counter() - start:.2f} s",
        file=sys.stderr,
        flush=True,
    )
    shown = [f"user: {text}\nassistant: " if chat else text for text in texts]
    if len(prompts) > 1:
        for text, output in zip(shown, llm.generate(prompts, params)):
            print(f"{text}{output.outputs[0].text}\n")
            print(_figures(output.metrics, output.outputs[0].finish_reason, config))
        return 0
    print(shown[0], end="", flush=True)  # one prompt: print the text as it streams
    for state in llm.stream(prompts, params, config=GenerationConfig(streaming_chunks=args.streaming_chunks)):
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


def _load(
    args: argparse.Namespace, model: str, draft: str | None, config: SpeculativeConfig | None, **options
) -> LLM:
    """The LLM of the engine flags (and `options`, LLM's keywords); says on stderr which dtypes its models
    run in and how long loading them took ("speculative: loaded target and draft in 2.10 s")."""
    from speculative.llm import LLM

    start = time.perf_counter()
    llm = LLM(
        model,
        draft_model=draft,
        speculative_config=config,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        device=args.device,
        model_impl=args.model_impl,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        draft_tensor_parallel_size=args.draft_tensor_parallel_size,
        **options,
    )
    loaded = time.perf_counter() - start
    models = (
        "target and draft" if llm.draft is not None else "target and EAGLE head" if _head(llm) else "target"
    )
    print(_dtypes(llm), file=sys.stderr)
    print(f"speculative: loaded {models} in {loaded:.2f} s", file=sys.stderr, flush=True)
    return llm


def _dtypes(llm: LLM) -> str:
    """One line: the dtype each model runs in and why ("speculative: target in float32 (auto: ...)"),
    and the weights' quantization, if any."""
    quantized = f", {llm.quantization} weights" if getattr(llm, "quantization", None) else ""
    if _head(llm):
        return f"speculative: target and EAGLE head in {llm.target.dtype}"
    if llm.draft is None:
        return f"speculative: target in {llm.target.dtype}{quantized}"
    if llm.draft.dtype == llm.target.dtype:
        return f"speculative: target and draft in {llm.target.dtype}{quantized}"
    return f"speculative: target in {llm.target.dtype}; draft in {llm.draft.dtype}{quantized}"


def _head(llm: LLM) -> bool:
    """Whether the LLM drafts with an EAGLE head (which runs in the target's dtype)."""
    return llm.speculative_config is not None and llm.speculative_config.method in ("eagle", "eagle3")


def _figures(m: SpeculationMetrics, finish_reason: str | None, config: SpeculativeConfig | None) -> str:
    """A completion's figures: tokens, steps and finish; the time to its first token (the prefill) and
    the decoding speed after it; with a drafter, the acceptance."""
    method = f"{config.method}, k={config.num_speculative_tokens}" if config else "autoregressive"
    if config and config.tree:
        method += f", {config.tree} tree of {config.tree_nodes}"
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


def _not_under_torchrun(command: str) -> None:
    """A ValueError under torchrun (WORLD_SIZE > 1): `command` starts its own ranks."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"{command} starts its own tensor-parallel ranks (--tensor-parallel-size); "
            "run it without torchrun"
        )


def bench(args: argparse.Namespace) -> int:
    _not_under_torchrun("speculative bench")
    with needs_extra("bench", "speculative bench"):
        from rich.console import Console

        from speculative.bench.run import BenchConfig, run_and_report

    config = BenchConfig().quick() if args.quick else BenchConfig()
    if args.synthetic and (args.model or args.draft_model or args.eagle or args.eagle3):
        raise ValueError("--synthetic builds the pair: drop --model, --draft-model, --eagle and --eagle3")
    config.model, config.draft_model, toy = _models(args.model, args.draft_model)
    config.eagle_method = "eagle3" if args.eagle3 else "eagle"
    demo_head = toy and not args.synthetic and Path(config.eagle).is_dir()
    config.eagle = args.eagle or args.eagle3 or (config.eagle if demo_head else None)
    fields = (
        "prompts",
        "k",
        "tree_nodes",
        "tree_width",
        "sweep_k",
        "batch_sizes",
        "max_tokens",
        "num_prompts",
        "sweep_prompts",
        "repeats",
        "dtype",
        "draft_dtype",
        "device",
        "model_impl",
        "seed",
        "compile",
        "tensor_parallel_size",
        "llama_cpp",
        "llama_cpp_build",
        "gguf_cache",
        "synthetic",
        "synthetic_acceptance",
        "quantization",
        "llama_cpp_target_gguf",
    )
    for name in fields:
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    run_and_report(config, Path(args.out), Console() if sys.stdout.isatty() else Console(width=130))
    return 0


def bench_serve(args: argparse.Namespace) -> int:
    with needs_extra("bench", "speculative bench-serve"):
        from speculative.bench.load import LoadConfig, run_load
        from speculative.bench.load_report import soak_lines

    names = ("prompts", "num_prompts", "max_tokens", "max_tokens_range", "k", "servers", "concurrency")
    names += ("rates", "requests", "rounds")
    names += ("soak_requests", "soak_max_tokens", "dtype", "compile", "temperature", "seed")
    config = LoadConfig(
        **{name: getattr(args, name) for name in names}, serve_flags=shlex.split(args.serve_args)
    )
    target, draft, _ = _models(args.model, args.draft_model)
    out = Path(args.out)
    results = run_load(config, target, draft, out)
    for line in soak_lines(results):
        print(f"soak, {line}")
    print(f"wrote {out / 'report.md'}")
    return 0


def serve(args: argparse.Namespace) -> int:
    """Serve `serve_app(args)` until SIGTERM or SIGINT: from then on new requests get 503 while running
    ones have --shutdown-timeout seconds to finish. With --replicas N > 1, N of them behind Ray Serve
    (`speculative.server.replicas.serve_replicas`)."""
    if args.replicas != 1:
        check_serve_flags(args)
        with needs_extra("replicas", "speculative serve --replicas"):
            from speculative.server.replicas import serve_replicas
        return serve_replicas(args)
    with needs_extra("server", "speculative serve"):
        import uvicorn

        from speculative.server.app import drain
    app = serve_app(args)
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(args)))
    stop = server.handle_exit

    def handle_exit(sig, frame) -> None:  # uvicorn's own handler stops accepting connections and waits
        drain(app)
        stop(sig, frame)

    server.handle_exit = handle_exit
    server.run()
    return 0


def uvicorn_options(args: argparse.Namespace) -> dict:
    """uvicorn.Config's keywords from `serve`'s flags (checked by `serve_app`)."""
    return {
        "host": args.host,
        "port": args.port,
        "log_level": "info",
        "timeout_graceful_shutdown": args.shutdown_timeout + SHUTDOWN_GRACE_S,
        "timeout_keep_alive": args.timeout_keep_alive,
        "limit_concurrency": args.limit_concurrency,
        "h11_max_incomplete_event_size": args.h11_max_incomplete_event_size,
    }


def check_serve_flags(args: argparse.Namespace) -> str | None:
    """--chat-template's template (None: the tokenizer's); ValueError naming the flag for a bad value
    of `serve`'s own flags (the engine's are checked as the models load)."""
    _not_under_torchrun("speculative serve")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1; got {args.replicas}")
    if args.replicas > 1 and (args.tensor_parallel_size != 1 or args.draft_tensor_parallel_size != 1):
        raise ValueError("--replicas runs each engine in one process: --tensor-parallel-size must be 1")
    if args.replicas > 1 and args.device != "cpu":
        raise ValueError(f"--replicas runs on the CPU only (--device cpu); got --device {args.device}")
    for flag in (
        "max_prompt_tokens",
        "max_model_len",
        "max_request_bytes",
        "timeout_keep_alive",
        "limit_concurrency",
        "h11_max_incomplete_event_size",
    ):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0; got {args.shutdown_timeout}")
    if not args.timeout_request_body > 0:
        raise ValueError(f"--timeout-request-body must be > 0; got {args.timeout_request_body}")
    return None if args.chat_template is None else _chat_template(args.chat_template)


def serve_app(args: argparse.Namespace, replica: str | None = None):
    """The app `speculative serve` runs (FastAPI, not started): the flags checked, --chat-template
    before the models load, then the LLM (with the template as its tokenizer's), its scheduler and the
    OpenAI-compatible app (`replica`: create_app's). ValueError naming the flag for a bad value."""
    template = check_serve_flags(args)
    with needs_extra("server", "speculative serve"):
        from speculative.server.app import create_app
        from speculative.server.scheduler import Scheduler

    model, draft, toy = _models(args.model, _draft_path(args), args.ngram or args.suffix)
    name = args.served_model_name or args.model or ("speculative-demo" if toy else smollm2.NAME)
    llm = _load(args, model, draft, _speculative_config(args, draft), seed=args.seed)
    if template is not None:
        if llm.tokenizer is None:
            raise ValueError(f"--chat-template needs the model's tokenizer, and {model} has none")
        llm.tokenizer.chat_template = template
    context = min(m.model.max_length for m in (llm.target, llm.draft) if m is not None)
    if args.max_model_len is not None and args.max_model_len > context:
        raise ValueError(
            f"--max-model-len {args.max_model_len} is more than the models' context of {context}"
        )
    scheduler = Scheduler(llm, max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting)
    return create_app(
        scheduler,
        model_name=name,
        tokenizer=llm.tokenizer,
        api_key=args.api_key,
        max_prompt_tokens=args.max_prompt_tokens,
        max_model_len=args.max_model_len or context,
        shutdown_timeout=args.shutdown_timeout,
        max_request_bytes=args.max_request_bytes,
        request_body_timeout=args.timeout_request_body,
        replica=replica,
    )


def _chat_template(value: str) -> str:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("RANK", "0") != "0":  # torchrun's other ranks: rank 0 prints the results
        sys.stdout = open(os.devnull, "w")
    quiet_transformers()
    try:
        return {"bench": bench, "bench-serve": bench_serve, "serve": serve}.get(args.command, generate)(args)
    except (ValueError, TypeError, OSError, ModuleNotFoundError) as error:  # bad input, a missing extra
        print(f"speculative: error: {error}", file=sys.stderr)
        return 2


def quiet_transformers() -> None:
    """No weight-loading bars or warnings from transformers in the CLI's output: by its environment
    variables, read when it is imported (not before a command needs it), or directly where it is."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()


def _models(model: str | None, draft: str | None, modelless: bool = False) -> tuple[str, str | None, bool]:
    """(target, draft, toy) of --model and --draft-model (or --eagle, --eagle3); without --model the demo
    pair, speculating with its draft unless a drafter flag says otherwise: the real demo model
    (speculative.demo.smollm2, fetched and cached on first use), or the bundled toy pair (toy True)
    under SPECULATIVE_DEMO=toy or where the real one cannot be had (saying why on stderr). OSError
    saying how to get the toy pair where it is needed and missing."""
    if model is not None:
        return model, draft, False
    if not smollm2.toy_requested():
        try:
            pair = smollm2.demo_pair()
            return str(pair.target), draft or (None if modelless else str(pair.draft)), False
        except smollm2.DemoUnavailable as error:
            print(
                f"speculative: {error}; running the bundled toy pair instead ({smollm2.DEMO_ENV}=toy "
                "goes there directly)",
                file=sys.stderr,
            )
    if not (DEMO_DIR / "target").is_dir():
        raise OSError(
            f"the demo pair is not at {DEMO_DIR}: pass --model, set {DEMO_DIR_ENV} to the pair's "
            f"folder, or train it with `python -m speculative.demo.train --out models/demo`"
        )
    return str(DEMO_DIR / "target"), draft or (None if modelless else str(DEMO_DIR / "draft")), True


def _draft_path(args: argparse.Namespace) -> str | None:
    """The drafter's directory: --draft-model's, --eagle's or --eagle3's (None: none given)."""
    return args.draft_model or args.eagle or args.eagle3


def _speculative_config(args: argparse.Namespace, draft: str | None) -> SpeculativeConfig | None:
    """The SpeculativeConfig the flags ask for; None (plain decoding) without a drafter."""
    if not (args.ngram or args.suffix or draft):
        return None
    methods = {"ngram": args.ngram, "suffix": args.suffix, "eagle": args.eagle, "eagle3": args.eagle3}
    suffix = {
        "suffix_decoding_max_tree_depth": args.suffix_max_depth,
        "suffix_decoding_max_cached_requests": args.suffix_max_cached_requests,
        "suffix_decoding_max_spec_factor": args.suffix_max_spec_factor,
        "suffix_decoding_min_token_prob": args.suffix_min_token_prob,
    }
    return SpeculativeConfig.from_dict(
        {
            "method": next((method for method, given in methods.items() if given), "draft_model"),
            "adaptive": args.adaptive,
            "num_speculative_tokens": args.num_speculative_tokens,
            "acceptance": args.acceptance,
            "tree": args.tree,
            "tree_width": args.tree_width,
            "tree_nodes": args.tree_nodes,
            **(suffix if args.suffix else {}),
        }
    )


if __name__ == "__main__":
    sys.exit(main())
