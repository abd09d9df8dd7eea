"""Loading a model by hub id or local path (or taking a model object) behind the model protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from speculative.models import llama
from speculative.models.base import LanguageModel
from speculative.models.hf import HFCausalLM

ModelImpl = Literal["auto", "native", "transformers"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for the engine, with what the engine needs to know about it."""

    model: LanguageModel
    tokenizer: PreTrainedTokenizerBase | None
    eos_token_ids: list[int]
    name: str


def load_model(model: str | PreTrainedModel | LanguageModel, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", model_impl: ModelImpl = "auto",
               tokenizer: PreTrainedTokenizerBase | str | None = None) -> LoadedModel:
    """Load `model` (hub id, local path, a transformers model, or a LanguageModel as it is).

    dtype: "auto" (the checkpoint's dtype, float32 if it names none), "float32", "bfloat16",
        "float16" or a torch.dtype.
    model_impl: "auto" uses the native forward for Llama, Mistral, Qwen2 and Qwen3 and transformers'
        forward otherwise; "native" requires the native one; "transformers" forces transformers'.
    """
    if model_impl not in ("auto", "native", "transformers"):
        raise ValueError(f'model_impl must be "auto", "native" or "transformers"; got {model_impl!r}')
    if isinstance(model, str):
        name = model
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=_dtype(dtype, None))
        if tokenizer is None:
            tokenizer = _try_tokenizer(model)
    elif isinstance(model, PreTrainedModel):
        name, hf = getattr(model, "name_or_path", "") or type(model).__name__, model
        if dtype != "auto":
            hf = hf.to(_dtype(dtype, None))
    elif isinstance(model, LanguageModel):
        return LoadedModel(model, _tokenizer(tokenizer), [], type(model).__name__)
    else:
        raise TypeError(f"model must be a hub id or path, a transformers PreTrainedModel or a "
                        f"LanguageModel; got {type(model).__name__}")
    hf = hf.to(device).eval()
    native = model_impl != "transformers" and llama.supports(hf.config)
    if model_impl == "native" and not native:
        raise ValueError(f"model_impl='native' supports model types {sorted(llama.SUPPORTED_MODEL_TYPES)}; "
                         f"{name} is {hf.config.model_type!r}")
    wrapped = llama.NativeCausalLM.from_hf(hf) if native else HFCausalLM(hf)
    return LoadedModel(wrapped, _tokenizer(tokenizer), _eos_token_ids(hf, wrapped.vocab_size), name)


def check_dtype(dtype: str | torch.dtype, name: str = "dtype") -> None:
    """ValueError naming the parameter `name` unless dtype is "auto", a known dtype name or a torch.dtype."""
    if not isinstance(dtype, torch.dtype) and dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"{name} must be 'auto', {', '.join(map(repr, _DTYPES))} or a torch.dtype; got {dtype!r}")


def _dtype(dtype: str | torch.dtype, default: torch.dtype | None) -> torch.dtype | str:
    check_dtype(dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return default if default is not None else "auto"
    return _DTYPES[dtype]


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
