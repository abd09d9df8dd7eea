"""GGUF files of a local Hugging Face checkpoint for llama.cpp, made by llama.cpp's own converter and cached.

`gguf_file(checkout, model, dtype, cache_dir)` converts with the `convert_hf_to_gguf.py` of the given
llama.cpp checkout (and the gguf-py beside it), run in a subprocess of this module, once per (model
path, dtype, model files' modification time): a second bench run finds the file and converts nothing.
The subprocess runs this file as a script, so that it imports llama.cpp's modules and not this package.

The converter recognises a byte-level BPE pre-tokenizer only by the hash of its output on a test string,
and refuses one it does not know (the demo pair's). For a tokenizer.json whose pre-tokenizer is plain
`ByteLevel` (GPT-2's regex split, then bytes) this module tells it "gpt-2", which is that pre-tokenizer;
any other unknown one is still refused. llama.cpp's own code is not changed.

Quantized GGUFs (`speculative bench --quantization int8 | int4 | w8a8 | w4a8`): `quantized_gguf_file(checkout,
build, model, quantization, cache_dir)` runs the checkout's own `llama-quantize` (DIR/build/bin) on the f32
conversion (lossless for a float32 or bfloat16 checkpoint, so nothing is rounded twice, whatever the run's
dtype), with llama.cpp's default choices for that type, once per (model path, GGUF type, model files'
modification time), and caches the result beside the conversions. Our weight-only quantizations map to the
llama.cpp types of the same kind (QUANT_TYPES): int8, symmetric absmax per output channel, to Q8_0 (symmetric
absmax, blocks of 32), and so does w8a8 (int8's weights; its activations are quantized as Q8_0's dot products
quantize them); int4, asymmetric (scale and zero) in groups of 64, to Q4_1 (asymmetric, scale and minimum,
blocks of 32), and so does w4a8 (Q4_1's own scheme, with int8 activations as Q4_1's dot products have them),
also the format SmolLM2-135M-Instruct's GGUF ships in: llama-quantize's Q4_1 of a float32 copy dequantized
from that file is that file's tensors again.

`gguf_type(path)` says what a GGUF file holds (its general.file_type: "F32", "BF16", "Q8_0", "Q4_1",
...) and `check_gguf_type` refuses a file given for a run of another precision. They read the file with
the `gguf` package where it is installed, else with the checkout's gguf-py.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}  # the bench's --dtype -> the converter's --outtype
# the bench's --quantization -> llama-quantize's type
QUANT_TYPES = {"int8": "Q8_0", "int4": "Q4_1", "w8a8": "Q8_0", "w4a8": "Q4_1"}
DEFAULT_CACHE = Path.home() / ".cache" / "speculative" / "gguf"


def cache_key(model: str | Path, outtype: str) -> str:
    """The cached file's name: the model folder's name, the outtype, and a digest of its resolved path,
    the outtype and the newest modification time (ns) of the files in it; a retrained model gets a new key."""
    path = Path(model).resolve()
    files = [f for f in path.iterdir() if f.is_file()]
    if not files:
        raise ValueError(f"model {model} is not a local checkpoint folder: llama.cpp needs one to convert")
    mtime = max(f.stat().st_mtime_ns for f in files)
    digest = hashlib.sha256(f"{path}\0{outtype}\0{mtime}".encode()).hexdigest()[:16]
    return f"{path.name}-{outtype}-{digest}.gguf"


def gguf_file(
    checkout: str | Path, model: str | Path, dtype: str, cache_dir: str | Path = DEFAULT_CACHE
) -> Path:
    """The GGUF file of `model` (a local checkpoint folder) in `dtype` ("float32" or "bfloat16"), from
    `cache_dir`, converted there first if it is not there yet. Raises ValueError for another dtype or a
    model that is not a folder, RuntimeError with the converter's output when the conversion fails."""
    if dtype not in OUTTYPES:
        raise ValueError(f"dtype must be one of {sorted(OUTTYPES)} for llama.cpp; got {dtype!r}")
    if not Path(model).is_dir():
        raise ValueError(
            f"model {model!r} is not a local folder: llama.cpp's converter needs a checkpoint folder"
        )
    converter = Path(checkout) / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise ValueError(f"llama.cpp checkout {checkout} has no convert_hf_to_gguf.py")
    out = Path(cache_dir) / cache_key(model, OUTTYPES[dtype])
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.stem + ".partial.gguf")
    command = [
        sys.executable,
        __file__,
        str(checkout),
        str(model),
        OUTTYPES[dtype],
        str(partial),
    ]  # no torch import
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"llama.cpp's convert_hf_to_gguf.py failed on {model} ({dtype}):\n"
            f"{(result.stdout + result.stderr)[-3000:]}"
        )
    partial.replace(out)
    return out


def quantize_binary(checkout: str | Path, build: str = "build") -> Path:
    """DIR/NAME/bin/llama-quantize (NAME may also be an absolute build folder)."""
    return Path(checkout) / build / "bin" / "llama-quantize"


def quantized_cache_key(model: str | Path, quant_type: str) -> str:
    """The quantized file's name: cache_key's for the f32 conversion it is made from, followed by the
    GGUF type ("target-f32-q8_0-<digest>.gguf"): a file per model, type and training."""
    return cache_key(model, f"f32-{quant_type.lower()}")


def quantize_command(binary: str | Path, source: Path, out: Path, quant_type: str, threads: int) -> list[str]:
    """llama-quantize's command line: `source` (a float GGUF) to `out` in `quant_type` with llama.cpp's
    default choices for that type (its per-tensor exceptions included), on `threads` threads."""
    return [str(binary), str(source), str(out), quant_type, str(threads)]


def quantized_gguf_file(
    checkout: str | Path,
    build: str,
    model: str | Path,
    quantization: str,
    cache_dir: str | Path = DEFAULT_CACHE,
    threads: int = 1,
) -> Path:
    """The GGUF file of `model` (a local checkpoint folder) converted to f32 (gguf_file) and quantized
    by the checkout's llama-quantize (build folder `build`, on `threads` threads) to
    QUANT_TYPES[quantization], from `cache_dir`, made there first if it is not there yet. Raises
    ValueError for an unknown quantization or a missing llama-quantize, RuntimeError with
    llama-quantize's output when it fails."""
    if quantization not in QUANT_TYPES:
        raise ValueError(
            f"quantization must be one of {sorted(QUANT_TYPES)} for llama.cpp; got {quantization!r}"
        )
    binary = quantize_binary(checkout, build)
    if not binary.is_file():
        raise ValueError(f"{binary} not found: build llama-quantize there (cmake --target llama-quantize)")
    source = gguf_file(checkout, model, "float32", cache_dir)
    quant_type = QUANT_TYPES[quantization]
    out = Path(cache_dir) / quantized_cache_key(model, quant_type)
    if out.is_file():
        return out
    partial = out.with_name(out.stem + ".partial.gguf")
    command = quantize_command(binary, source, partial, quant_type, threads)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"llama-quantize failed on {source} ({quant_type}):\n{(result.stdout + result.stderr)[-3000:]}"
        )
    partial.replace(out)
    return out


def gguf_module(checkout: str | Path | None = None) -> ModuleType:
    """The `gguf` package: the installed one, else the gguf-py of the llama.cpp `checkout` (put first on
    sys.path). ImportError when neither is there."""
    try:
        return importlib.import_module("gguf")
    except ImportError:
        if checkout is None or not (Path(checkout) / "gguf-py" / "gguf").is_dir():
            raise
    sys.path.insert(0, str(Path(checkout) / "gguf-py"))
    return importlib.import_module("gguf")


def gguf_type(path: str | Path, checkout: str | Path | None = None) -> str:
    """What a GGUF file holds: its general.file_type's name without the prefix ("F32", "BF16", "Q8_0",
    "Q4_1", "Q4_K_M", ...); without that field, the type of most of its matrices' bytes."""
    gguf = gguf_module(checkout)
    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.file_type")
    if field is not None:
        value = int(field.parts[field.data[0]][0])
        try:
            name = gguf.LlamaFileType(value).name
        except ValueError:  # a type newer than this gguf package
            return f"file_type {value}"
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    sizes: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) >= 2:
            sizes[tensor.tensor_type.name] = sizes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    return max(sizes, key=sizes.get)


def expected_gguf_type(dtype: str, quantization: str | None) -> str:
    """The GGUF type of a run: QUANT_TYPES[quantization] when quantized, else the dtype's ("F32", "BF16")."""
    return QUANT_TYPES[quantization] if quantization else OUTTYPES[dtype].upper()


def check_gguf_type(
    path: str | Path, expected: str, flag: str = "--llama-cpp-target-gguf", checkout: str | Path | None = None
) -> Path:
    """`path` if it is a GGUF file of type `expected`; a ValueError naming `flag` otherwise (a missing
    file, or one of another type: llama.cpp would run other weights than ours)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    found = gguf_type(path, checkout)
    if found != expected:
        raise ValueError(
            f"{flag} {path} is a {found} GGUF; this run compares {expected} weights "
            f"(--dtype / --quantization): give a {expected} file or leave {flag} out"
        )
    return path


def byte_level_bpe(model: str | Path) -> bool:
    """Whether the model's tokenizer.json is a BPE with a plain ByteLevel pre-tokenizer (GPT-2's)."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return False
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    pre = tokenizer.get("pre_tokenizer") or {}
    bpe = tokenizer.get("model", {}).get("type") == "BPE"
    return bpe and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def convert(checkout: str, model: str, outtype: str, out: str) -> None:
    """Run the checkout's converter on `model` into `out`, an unknown plain byte-level BPE pre-tokenizer
    taken as GPT-2's. Imports the checkout's modules: call it in a process of its own (`gguf_file` does)."""
    sys.path.insert(0, checkout)
    import convert_hf_to_gguf  # the checkout's; it puts its own gguf-py first on sys.path
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if byte_level_bpe(self.dir_model):
                return "gpt-2"
            raise

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile", out]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    convert(*sys.argv[1:])
