"""Loading a model by hub id or local path (or taking a model object) behind the model protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from speculative.models import hf_tensor_parallel, llama
from speculative.models.base import LanguageModel
from speculative.models.dtypes import (
    DtypeChoice,
    check_dtype,
    cpu_computes_natively,
    cpu_features,
    resolve_dtype,
)
from speculative.models.gguf import QUANTIZED_DTYPE, check_not_split, gguf_dtype, gguf_source, load_gguf
from speculative.models.hf import HFCausalLM
from speculative.models.quantization import check_quantization
from speculative.models.tensor_parallel import RankGroup, TensorParallelCausalLM, check_model

ModelImpl = Literal["auto", "native", "transformers"]


@dataclass
class LoadedModel:
    """A model ready for the engine, with what the engine needs to know about it. dtype: the dtype it was
    loaded in and why (None for a LanguageModel taken as it is)."""

    model: LanguageModel
    tokenizer: PreTrainedTokenizerBase | None
    eos_token_ids: list[int]
    name: str
    dtype: DtypeChoice | None = None


def load_model(
    model: str | PreTrainedModel | LanguageModel,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    model_impl: ModelImpl = "auto",
    tokenizer: PreTrainedTokenizerBase | str | None = None,
    dtype_name: str = "dtype",
    tensor_parallel: RankGroup | None = None,
    tensor_parallel_name: str = "tensor_parallel_size",
) -> LoadedModel:
    """Load `model` (hub id, local path, a transformers model, or a LanguageModel as it is).

    A path may name a GGUF file (a `.gguf` file, or a folder holding one and no config.json; see
    models/gguf.py): it is read by transformers, dequantized to the dtype, and then taken as a
    transformers model would be; its tokenizer is the file's unless `tokenizer` is given. The
    LoadedModel's name is the path.
    dtype: "auto", "float32", "bfloat16", "float16" or a torch.dtype (a ValueError naming `dtype_name`
        otherwise). "auto" is the checkpoint's dtype (a model object's own; a GGUF file's float type),
        except on a CPU that does not compute it natively, where it is float32 (models/dtypes.py);
        float32 if it names none. A quantized GGUF file names none: "auto" is bfloat16 for it off the
        CPU and on a CPU that computes bfloat16 natively (_quantized_gguf_dtype), float32 elsewhere.
    model_impl: "auto" uses the native forward for Llama, Mistral, Qwen2 and Qwen3 and transformers'
        forward otherwise; "native" requires the native one; "transformers" forces transformers'.
    tensor_parallel: this rank's group: on the native forward the model is loaded whole, then this
        rank's shard kept (TensorParallelCausalLM); on transformers' forward transformers loads this
        rank's shard (models/hf_tensor_parallel.py). A ValueError naming `tensor_parallel_name` unless
        check_model's conditions hold, and for a GGUF file. None: the whole model.
    """
    if model_impl not in ("auto", "native", "transformers"):
        raise ValueError(f'model_impl must be "auto", "native" or "transformers"; got {model_impl!r}')
    check_dtype(dtype, dtype_name)
    device = torch.device(device)
    if tensor_parallel is not None:
        check_not_split(model, tensor_parallel_name, tensor_parallel.size)
        check_model(model, model_impl, tensor_parallel.size, "model", tensor_parallel_name, device)
    if isinstance(model, str) and gguf_source(model) is not None:
        name, checkpoint = model, gguf_dtype(model)
        choice = resolve_dtype(dtype, checkpoint, device, dtype_name)
        if dtype == "auto" and checkpoint is None:
            choice = _quantized_gguf_dtype(device)
        model, file_tokenizer = load_gguf(name, choice.dtype, tokenizer=tokenizer is None)
        config, tokenizer = model.config, file_tokenizer if tokenizer is None else tokenizer
    elif isinstance(model, str):
        name, config = model, AutoConfig.from_pretrained(model)
        choice = resolve_dtype(dtype, _checkpoint_dtype(config), device, dtype_name)
        if tokenizer is None:
            tokenizer = _try_tokenizer(model)
    elif isinstance(model, PreTrainedModel):
        name, config = getattr(model, "name_or_path", "") or type(model).__name__, model.config
        choice = resolve_dtype(dtype, model.dtype, device, dtype_name)
    elif isinstance(model, LanguageModel):  # no config of its own: EOS is the tokenizer's
        tokenizer = _tokenizer(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) and 0 <= eos < model.vocab_size else []
        return LoadedModel(model, tokenizer, eos_ids, type(model).__name__)
    else:
        raise TypeError(
            f"model must be a hub id or path, a transformers PreTrainedModel or a "
            f"LanguageModel; got {type(model).__name__}"
        )
    native = llama.runs_natively(config, model_impl)
    if model_impl == "native" and not native:
        raise ValueError(
            f"model_impl='native' supports model types {sorted(llama.SUPPORTED_MODEL_TYPES)}; "
            f"{name} is {config.model_type!r}"
        )
    if tensor_parallel is not None and not native:  # split by transformers as it loads
        hf = hf_tensor_parallel.from_pretrained(model, choice.dtype, tensor_parallel.size)
        wrapped = HFCausalLM(hf)
    else:
        hf = _whole(model, choice.dtype, device)
        if tensor_parallel is not None:
            wrapped = TensorParallelCausalLM.from_hf(hf, tensor_parallel)
        else:
            wrapped = llama.NativeCausalLM.from_hf(hf) if native else HFCausalLM(hf)
    return LoadedModel(wrapped, _tokenizer(tokenizer), _eos_token_ids(hf, wrapped.vocab_size), name, choice)


def _quantized_gguf_dtype(device: torch.device) -> DtypeChoice:
    """dtype "auto" for a GGUF file of quantized blocks: gguf.QUANTIZED_DTYPE (bfloat16, which says why)
    off the CPU (as a bfloat16 checkpoint's "auto" is there) and on a CPU that computes it natively
    (AVX512-BF16 or AMX), float32 on other CPUs."""
    name = str(QUANTIZED_DTYPE).removeprefix("torch.")
    if device.type != "cpu":
        return DtypeChoice(QUANTIZED_DTYPE, f"auto: a quantized GGUF file, dequantized to {name}")
    if cpu_computes_natively(QUANTIZED_DTYPE):
        return DtypeChoice(
            QUANTIZED_DTYPE,
            f"auto: a quantized GGUF file, dequantized to {name}, which this CPU ({cpu_features()}) "
            f"computes natively",
        )
    return DtypeChoice(
        torch.float32,
        f"auto: a quantized GGUF file, dequantized to float32: this CPU ({cpu_features()}) has no native "
        f"{name}",
    )


def _whole(model: str | PreTrainedModel, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The whole transformers model (loaded from a hub id or path, or the model given), in `dtype` on
    `device`, in eval mode."""
    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return model.to(dtype).to(device).eval()


def _checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype a transformers config names (`dtype`, or the older `torch_dtype`), or None."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else None


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint: a Hugging Face folder or hub id, or a GGUF file (a `.gguf` file, or
    a folder holding one and no config.json)."""
    source = gguf_source(path)
    if source is not None:
        return AutoTokenizer.from_pretrained(source[0], gguf_file=source[1])
    return AutoTokenizer.from_pretrained(path)


def _try_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def _tokenizer(tokenizer: PreTrainedTokenizerBase | str | None) -> PreTrainedTokenizerBase | None:
    return AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer


def _eos_token_ids(hf: PreTrainedModel, vocab_size: int) -> list[int]:
    """EOS ids from the generation config, else the model config; those inside the vocabulary."""
    eos = getattr(getattr(hf, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(hf.config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return [i for i in ids if 0 <= i < vocab_size]


def quantize_model(model, quantization: str | None, role: str = "model", dtype_name: str = "dtype"):
    """Quantize a loaded model in place (a NativeCausalLM: `NativeCausalLM.quantize`) and return it.

    ValueError for a model that does not run the native forward (model_impl="transformers", GPT-2,
    a LanguageModel of one's own), for a device other than the CPU, and for int4 of a model that is
    not in bfloat16 (the message names `role` and `dtype_name`). None returns the model as it is."""
    check_quantization(quantization)
    if quantization is None:
        return model
    if not isinstance(model, llama.NativeCausalLM):
        raise ValueError(
            f"quantization={quantization!r} needs the native forward (model types llama, mistral, "
            f"qwen2, qwen3 with model_impl 'auto' or 'native'); the {role} runs on "
            f"{type(model).__name__}"
        )
    if model.quantization == quantization:
        return model
    if model.device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on CPU only (its kernels are CPU ones); the {role} "
            f"is on {model.device}"
        )
    if quantization == "int4" and model.dtype != torch.bfloat16:
        raise ValueError(
            f"quantization='int4' needs a bfloat16 {role} ({dtype_name}='bfloat16'): torch's int4 "
            f"CPU kernel is vectorized only for bfloat16; the {role} is {model.dtype}"
        )
    model.quantize(quantization)
    return model
