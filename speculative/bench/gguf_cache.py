"""GGUF files of a local Hugging Face checkpoint for llama.cpp, made by llama.cpp's own converter and cached.

`gguf_file(checkout, model, dtype, cache_dir)` converts with the `convert_hf_to_gguf.py` of the given
llama.cpp checkout (and the gguf-py beside it), run in a subprocess of this module, once per (model
path, dtype, model files' modification time): a second bench run finds the file and converts nothing.
The subprocess runs this file as a script, so that it imports llama.cpp's modules and not this package.

The converter recognises a byte-level BPE pre-tokenizer only by the hash of its output on a test string,
and refuses one it does not know (the demo pair's). For a tokenizer.json whose pre-tokenizer is plain
`ByteLevel` (GPT-2's regex split, then bytes) this module tells it "gpt-2", which is that pre-tokenizer;
any other unknown one is still refused. llama.cpp's own code is not changed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}  # the bench's --dtype -> the converter's --outtype
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
