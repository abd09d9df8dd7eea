"""GGUF checkpoints (llama.cpp's one-file format) as a model source.

A GGUF file is read by transformers' own GGUF reader (`from_pretrained(folder, gguf_file=name)`) and
its tensors dequantized to a dtype at load: the result is a plain transformers model, with no
`quantization_config`, that runs on the native forward like any other checkpoint of its architecture.
Only local files: a `.gguf` file, or a folder holding one `.gguf` and no `config.json`.

Reading one needs the gguf extra (`pip install 'speculative[gguf]'`): the `gguf` package, which
transformers' reader of most architectures uses, and accelerate, which transformers requires to load
any GGUF file.
"""

from __future__ import annotations

import importlib
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from speculative.extras import EXTRAS, needs_extra

if TYPE_CHECKING:
    from transformers.integrations.gguf import GgufHeader

_FILE_SPELLING = {
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gpt_oss": "gpt-oss",
    "minimax_m2": "minimax-m2",
}
"""transformers' legacy GGUF reader lists these architectures in its own spelling; a file's
`general.architecture` spells them as llama.cpp does (load_gguf_checkpoint renames them)."""


QUANTIZED_DTYPE = torch.bfloat16
"""The float type a file of quantized blocks is dequantized to where nothing else is asked: the demo's
conversion, and LLM's dtype "auto" where the device computes it natively (float32 elsewhere). Rounded
to bfloat16 (8 significant bits), a dequantized weight moves by at most 1/256 of itself: a block's
largest weight no more than Q8_0 already rounded it by (half its step, 1/254 of that weight), smaller
weights less, and a small fraction of a 4-bit format's step; and a decoding step streams half the
bytes of float32."""


def gguf_source(path: str) -> tuple[str, str] | None:
    """(folder, file name) of the GGUF file `path` names: `path` itself when it is a file whose name
    ends in `.gguf`, or the one `.gguf` in the folder `path` when that folder has no `config.json`.
    None for anything else (a Hugging Face folder, another file, a hub id). A FileNotFoundError when a
    `.gguf` path does not exist; a ValueError naming them when the folder holds several `.gguf` files
    and no `config.json`."""
    where = Path(path)
    if where.is_file():
        return (str(where.parent), where.name) if where.name.lower().endswith(".gguf") else None
    if where.is_dir():
        if (where / "config.json").is_file():
            return None
        files = sorted(f.name for f in where.iterdir() if f.is_file() and f.name.lower().endswith(".gguf"))
        if len(files) > 1:
            raise ValueError(
                f"{path} holds {len(files)} GGUF files ({', '.join(files)}) and no config.json: "
                f"pass one file's path"
            )
        return (str(where), files[0]) if files else None
    if where.name.lower().endswith(".gguf"):
        raise FileNotFoundError(f"no GGUF file at {path}")
    return None


def check_not_split(model: object, name: str, size: int) -> None:
    """A ValueError naming `name` (a tensor-parallel keyword, given as `size` > 1) when `model` is a path
    naming a GGUF file (gguf_source's): a GGUF model is not split over ranks. Anything else passes."""
    if isinstance(model, str) and gguf_source(model) is not None:
        raise ValueError(
            f"{name}={size} does not split a GGUF file ({model}): give {name}=1, or the folder "
            f"speculative.models.gguf.save_checkpoint converts it into"
        )


def supported_architectures() -> list[str]:
    """The `general.architecture` values transformers' GGUF readers build a config and weights for, in
    the file's spelling, sorted: the legacy reader's (GGUF_SUPPORTED_ARCHITECTURES, less the metadata
    sections "general" and "tokenizer") and the newer one's (integrations/gguf: GGUF_ARCHS)."""
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    legacy = {_FILE_SPELLING.get(name, name) for name in GGUF_SUPPORTED_ARCHITECTURES}
    return sorted((legacy - {"general", "tokenizer"}) | set(GGUF_ARCHS))


def gguf_dtype(path: str) -> torch.dtype | None:
    """The float type the GGUF file at `path` (a file or a folder, as gguf_source takes) stores its
    weights in (its half type where it holds F32 norms beside F16 or BF16 weights), or None where it
    holds quantized blocks. Raises as load_gguf does for a missing extra or an unsupported
    architecture."""
    return _header(_file(path)).dtype


def load_gguf(
    path: str, dtype: torch.dtype, tokenizer: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """The model in the GGUF file at `path` (a `.gguf` file, or a folder as gguf_source takes), read by
    transformers and dequantized to `dtype`: a plain `*ForCausalLM` (no quantization_config; it saves
    with save_pretrained) in eval mode on the CPU, whose generation_config holds the file's BOS, EOS and
    padding ids; and, with `tokenizer`, the tokenizer the file describes (with its chat template where
    it has one), else None.

    Raises ModuleNotFoundError naming the gguf extra where its modules are missing, and ValueError
    naming the architecture, the path and the supported architectures where transformers cannot read
    the file's architecture."""
    file = _file(path)
    _header(file)
    folder, name = os.path.split(file)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    )
    text = AutoTokenizer.from_pretrained(folder, gguf_file=name) if tokenizer else None
    return model.eval(), text


def save_checkpoint(gguf_path: str, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> None:
    """Convert the GGUF file at `gguf_path` (as load_gguf takes) into a Hugging Face folder `out_dir`
    that plain `from_pretrained(out_dir)` loads: safetensors weights in `dtype`, config.json (no
    quantization_config), generation_config.json and the tokenizer's files (chat template included).

    The folder is written beside `out_dir` under a hidden temporary name and renamed into place when
    complete, so an interrupted conversion never leaves a folder at `out_dir`: an exception removes the
    temporary folder, a killed process leaves it as `.<name>.<hex>.partial` beside `out_dir`. `out_dir`
    must not exist, or be an empty folder: a FileExistsError otherwise, before anything is read."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out_dir {out} exists and is not an empty folder")
    model, tokenizer = load_gguf(gguf_path, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.{uuid.uuid4().hex}.partial"
    partial.mkdir()
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if out.is_dir():
            out.rmdir()  # empty, as checked
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _file(path: str) -> str:
    """The GGUF file `path` names (gguf_source's); a ValueError naming `path` if it names none."""
    source = gguf_source(path)
    if source is None:
        raise ValueError(f"path must be a .gguf file or a folder holding one and no config.json; got {path}")
    return os.path.join(*source)


def _header(file: str) -> GgufHeader:
    """The GGUF file's header (transformers' GgufHeader: architecture, tensor types, dtype), once the
    gguf extra's modules import and transformers reads the file's architecture."""
    with needs_extra("gguf", "loading a GGUF file"):
        for module in EXTRAS["gguf"]:
            importlib.import_module(module)
    from transformers.integrations.gguf import GgufHeader

    header = GgufHeader.from_file(file)
    if header.architecture not in supported_architectures():
        raise ValueError(
            f"transformers cannot read GGUF architecture {header.architecture!r} ({file}); it reads "
            f"{', '.join(supported_architectures())}"
        )
    return header
