"""llama.cpp as a baseline: `llama-server` processes behind the bench's `Method` interface.

`speculative bench --llama-cpp DIR [--llama-cpp-build NAME]` takes a llama.cpp checkout DIR whose build
folder DIR/NAME (default "build") holds `bin/llama-server`; the checkout's `convert_hf_to_gguf.py` turns
the pair into GGUF files in the bench's dtype (gguf_cache.py). One server runs per method, started
before the runs and stopped after them (or on an error or Ctrl-C; on Linux a server also dies with the
bench's process):

- `llamacpp`: the target alone;
- `llamacpp_draft`: target + draft model (`--spec-type draft-simple -md`), exactly k drafts per step
  like ours (`--spec-draft-n-max k --spec-draft-n-min 0 --spec-draft-p-min 0`);
- `llamacpp_draft_default`: target + draft with llama.cpp's own default draft settings, where its
  default n_max (read from `llama-server --help`) is not k.

Each server runs with the bench's thread count (`-t -tb -td -tbd`), one slot (`--parallel 1`), no
prompt cache (`--cache-ram 0`, and `cache_prompt: false` per request), the models' context, KV caches
in the models' dtypes (as ours; llama.cpp's default would be f16), flash attention as llama.cpp
chooses. A prompt goes to the native `/completion` endpoint as token ids (no BOS added), decoded
greedily (temperature 0, top-k 1, the sampler chain cut to those two) for exactly max_tokens tokens
(`ignore_eos`), and the generated ids come back (`return_tokens`). Batch 1 only: `--parallel 1`
decodes one sequence at a time.

With `speculative bench --quantization int8 | int4 | w8a8 | w4a8` the servers run GGUFs of the llama.cpp type
of the same kind (gguf_cache.QUANT_TYPES: Q8_0, Q4_1), quantized from the f32 conversions by the checkout's
own `llama-quantize`, which must then be built beside llama-server (the KV caches stay in the bench's dtype).
`--llama-cpp-target-gguf PATH` gives the target's GGUF ready-made instead (a published file, e.g. the one our
float copy was dequantized from); its type must be the run's (check_gguf_type), and the draft is still
converted (and quantized).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from speculative.bench.gguf_cache import (
    DEFAULT_CACHE,
    OUTTYPES,
    check_gguf_type,
    expected_gguf_type,
    gguf_file,
    quantize_binary,
    quantized_gguf_file,
)
from speculative.bench.methods import Generation, Method
from speculative.bench.server_process import ServerProcess, free_port

if TYPE_CHECKING:
    import httpx  # the llamacpp extra's; imported where a server is used

NAMES = {
    "llamacpp": "llama.cpp",
    "llamacpp_draft": "llama.cpp draft",
    "llamacpp_draft_default": "llama.cpp draft, defaults",
}


def server_binary(checkout: str | Path, build: str = "build") -> Path:
    """DIR/NAME/bin/llama-server (NAME may also be an absolute build folder)."""
    return Path(checkout) / build / "bin" / "llama-server"


def llama_cpp_unavailable(
    checkout: str | None, build: str = "build", quantization: str | None = None
) -> str | None:
    """Why the llama.cpp methods cannot run (a note for the results), or None when they can; a quantized
    run (any `quantization`) also needs llama-quantize."""
    if checkout is None:
        return "no --llama-cpp given (a llama.cpp checkout with llama-server built)"
    binaries = [server_binary(checkout, build)] + ([quantize_binary(checkout, build)] if quantization else [])
    for binary in binaries:
        if not binary.is_file():
            return (
                f"{binary} not found (--llama-cpp {checkout} --llama-cpp-build {build}: build "
                f"{binary.name} there)"
            )
    if not (Path(checkout) / "convert_hf_to_gguf.py").is_file():
        return f"{checkout} has no convert_hf_to_gguf.py (--llama-cpp must be a llama.cpp checkout)"
    missing = [m for m in ("httpx", "sentencepiece") if importlib.util.find_spec(m) is None]
    if missing:
        return f"--llama-cpp needs {' and '.join(missing)}: pip install -e '.[llamacpp]'"
    return None


def skipped_entries(note: str, names: Sequence[str] = tuple(NAMES)) -> dict[str, dict]:
    """The skipped-method entries of the results for the llama.cpp methods `names`."""
    return {name: {"label": NAMES[name], "note": note} for name in names}


def default_draft_max(binary: str | Path) -> int | None:
    """llama-server's default n_max for draft-model speculation, from its --help; None where not found."""
    result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, check=False, timeout=60)
    found = re.search(
        r"--spec-draft-n-max N\s+number of tokens to draft[^(]*\(default: (\d+)\)",
        result.stdout + result.stderr,
    )
    return int(found.group(1)) if found else None


def server_version(binary: str | Path) -> str:
    """What `llama-server --version` says of its build (version number and commit), on one line."""
    result = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, check=False, timeout=60
    )
    return "; ".join(line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip())


def server_args(
    target: Path,
    draft: Path | None,
    k: int | None,
    threads: int,
    context: int,
    port: int,
    kv: tuple[str, str] = ("f32", "f32"),
) -> list[str]:
    """llama-server's arguments: the target GGUF, and with `draft` a draft GGUF drafting exactly k tokens
    per step (k None: llama.cpp's default draft settings); `threads` for every pass, one slot, no prompt
    cache, a context of `context` tokens, on 127.0.0.1:port; the KV caches of target and draft in the
    types `kv` (GGUF names, the models' own dtypes as ours keeps them; llama.cpp's default is f16)."""
    args = [
        "-m",
        str(target),
        "-c",
        str(context),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        "1",
        "--cache-ram",
        "0",
        "--no-cache-prompt",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-ctk",
        kv[0],
        "-ctv",
        kv[0],
    ]
    if draft is not None:
        args += [
            "--spec-type",
            "draft-simple",
            "-md",
            str(draft),
            "-td",
            str(threads),
            "-tbd",
            str(threads),
            "-ctkd",
            kv[1],
            "-ctvd",
            kv[1],
        ]
        if k is not None:
            args += ["--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    return args


def request_body(prompt: Sequence[int], max_tokens: int) -> dict:
    """The /completion request of one prompt (token ids): greedy, exactly max_tokens tokens, no cache."""
    return {
        "prompt": [int(t) for t in prompt],
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k", "temperature"],
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def parse_completion(data: dict, seconds: float, speculative: bool) -> Generation:
    """A Generation from /completion's JSON answer and the request's wall time.

    llama.cpp's timings give prompt_ms (prefill) and predicted_ms (the rest); with a draft, draft_n
    (drafted) and draft_n_accepted. The first token comes from the prefill and each target step emits
    1 + its accepted drafts, so steps = tokens - 1 - accepted.
    """
    tokens = [int(t) for t in data["tokens"]]
    timings = data["timings"]
    accepted = int(timings.get("draft_n_accepted", 0)) if speculative else 0
    return Generation(
        [tokens],
        seconds,
        num_steps=max(1, len(tokens) - 1 - accepted),
        num_accepted=accepted,
        num_drafted=int(timings.get("draft_n", 0)) if speculative else None,
        prefill_seconds=timings["prompt_ms"] / 1e3,
        decode_seconds=timings["predicted_ms"] / 1e3,
    )


def _client() -> httpx.Client:
    import httpx

    return httpx.Client(timeout=600.0)


@dataclass
class LlamaCppMethod(Method):
    """A method run by a llama-server: one /completion request per call, timed from send to answer
    (the table's figure, prefill included); the server's own prefill / decode split rides along."""

    server: ServerProcess | None = None
    client: httpx.Client = field(default_factory=_client)
    gguf: Path | None = None  # the target's GGUF file the server runs

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Generation:
        if len(prompts) != 1:
            raise ValueError(f"llama.cpp methods take batch 1 (max_batch=1); got {len(prompts)} prompts")
        body = request_body(prompts[0], max_tokens)
        start = time.perf_counter()
        response = self.client.post(f"{self.server.url}/completion", json=body)
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"llama-server answered {response.status_code}: {response.text[:1000]}")
        return parse_completion(response.json(), seconds, self.drafter is not None)


@dataclass
class LlamaCppSetup:
    """What the llama.cpp methods need: the checkout and build folder, the pair (local folders) and their
    dtypes (the bench's), k, threads per server, the context, and where the GGUF files are cached;
    `quantization` ("int8", "int4", "w8a8", "w4a8" or None) picks the GGUF type (gguf_cache.QUANT_TYPES) and
    `target_gguf` a ready target GGUF of that type (else the target is converted like the draft)."""

    checkout: str
    build: str
    target: str
    draft: str | None
    dtype: str
    draft_dtype: str
    k: int
    threads: int
    context: int
    cache_dir: str | Path = DEFAULT_CACHE
    quantization: str | None = None
    target_gguf: str | None = None

    def gguf(self, model: str, dtype: str) -> Path:
        """The GGUF file of `model` (a local folder) that the servers run: converted in `dtype`, or when
        the run is quantized, quantized from its f32 conversion (gguf_cache.quantized_gguf_file)."""
        if self.quantization is None:
            return gguf_file(self.checkout, model, dtype, self.cache_dir)
        return quantized_gguf_file(
            self.checkout, self.build, model, self.quantization, self.cache_dir, self.threads
        )

    def target_file(self) -> Path:
        """The target's GGUF: `target_gguf` checked against the run's type (a ValueError naming
        --llama-cpp-target-gguf otherwise), or made from the target's folder."""
        if self.target_gguf is not None:
            expected = expected_gguf_type(self.dtype, self.quantization)
            return check_gguf_type(self.target_gguf, expected, checkout=self.checkout)
        return self.gguf(self.target, self.dtype)


def llama_cpp_methods(
    setup: LlamaCppSetup, stack: ExitStack, selects: Callable[[str], bool] = lambda name: True
) -> tuple[list[Method], dict[str, dict]]:
    """The llama.cpp methods that `selects` (a method's name -> whether it runs) keeps, with their
    servers started (each registered on `stack`, which stops it), and those skipped (with why): the
    draft methods without a draft, the defaults method when llama.cpp's default draft length is k."""
    binary = server_binary(setup.checkout, setup.build)
    target = setup.target_file()

    def method(name: str, label: str, draft: Path | None, k: int | None, spec_k: int) -> LlamaCppMethod:
        port = free_port()
        args = server_args(
            target,
            draft,
            k,
            setup.threads,
            setup.context,
            port,
            (OUTTYPES[setup.dtype], OUTTYPES[setup.draft_dtype]),
        )
        server = stack.enter_context(ServerProcess([str(binary), *args], port, "llama-server"))
        m = LlamaCppMethod(
            name,
            label,
            "llama.cpp",
            "draft_model" if draft else None,
            spec_k,
            max_batch=1,
            server=server,
            gguf=target,
        )
        stack.callback(m.client.close)
        return m

    methods = [method("llamacpp", NAMES["llamacpp"], None, None, 0)]
    if setup.draft is None:
        return methods, skipped_entries(
            "no --draft-model given", ["llamacpp_draft", "llamacpp_draft_default"]
        )
    if not selects("llamacpp_draft") and not selects("llamacpp_draft_default"):
        return methods, {}
    draft = setup.gguf(setup.draft, setup.draft_dtype)
    if selects("llamacpp_draft"):
        methods.append(method("llamacpp_draft", f"llama.cpp draft k={setup.k}", draft, setup.k, setup.k))
    if not selects("llamacpp_draft_default"):
        return methods, {}
    default = default_draft_max(binary)
    if default is None:
        return methods, skipped_entries(
            "llama-server --help gives no default --spec-draft-n-max", ["llamacpp_draft_default"]
        )
    if default == setup.k:
        return methods, skipped_entries(
            f"llama.cpp's default draft length is k={default}, as llama.cpp draft k={setup.k}",
            ["llamacpp_draft_default"],
        )
    methods.append(
        method("llamacpp_draft_default", f"llama.cpp draft, defaults (k={default})", draft, None, default)
    )
    return methods, {}
