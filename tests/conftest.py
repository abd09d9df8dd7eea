"""Tiny in-process models and tokenizers: no downloads."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

import speculative
from speculative.demo.train_dflash import dflash_drafter
from speculative.demo.train_eagle import eagle_head
from speculative.models.dflash_checkpoint import save_dflash
from speculative.models.eagle_checkpoint import save_eagle_head

os.environ["SPECULATIVE_DEMO"] = "toy"  # the command line runs the bundled toy pair: tests never download

FAMILIES = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "gemma": dict(model_type="gemma", head_dim=16),  # on transformers' forward (not a native family)
}


def tiny_model(
    family: str = "llama",
    vocab_size: int = 96,
    num_layers: int = 2,
    seed: int = 0,
    hidden_size: int = 64,
    **overrides,
) -> torch.nn.Module:
    """A random causal LM of the given family, in fp32 and eval mode."""
    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    config = AutoConfig.for_model(model_type, **{**settings, **spec, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # sharper, less uniform distributions than the default init
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """The model with Gaussian noise added to every weight: a draft that mostly agrees."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return noisy


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens plus <|endoftext|> (id 256). Vocabulary 257."""
    return _byte_level(sorted(pre_tokenizers.ByteLevel.alphabet()))


def char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of a few printable ASCII characters (ids in the given order) plus
    <|endoftext|> (id len(chars)): texts of other characters cannot be encoded."""
    return _byte_level(list(chars))


def _byte_level(tokens: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges over these tokens (byte-level alphabet characters), then
    <|endoftext|>."""
    vocab = {ch: i for i, ch in enumerate(tokens)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """A saved tiny target and draft (Llama, byte tokenizer) loadable by path, as a user's would be, and
    an untrained EAGLE-1 head ("eagle") and DFlash drafter ("dflash") for the target."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = byte_tokenizer()
    eos = tokenizer.eos_token_id
    target = tiny_model("llama", vocab_size=257, num_layers=2, eos_token_id=eos, bos_token_id=eos)
    draft = noisy_copy(target, 0.02)
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    paths["eagle"] = save_eagle_head_for(target, root / "eagle")
    paths["dflash"] = str(root / "dflash")  # an untrained DFlash block drafter, blocks of 5
    save_dflash(dflash_drafter(target, {"intermediate_size": 128}, block=5), root / "dflash")
    return paths


CHATML = (  # SmolLM2-Instruct's chat format
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    """A tiny chat target saved as a Hugging Face folder (byte tokenizer, ChatML template) and its own
    greedy answers collected as train_draft collects them (self_distilled: first.jsonl, second.jsonl)."""
    from speculative.demo.self_distill import self_distilled

    root = tmp_path_factory.mktemp("chat-target")
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHATML
    eos = tokenizer.eos_token_id
    model = tiny_model(
        "llama", vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos
    )
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    self_distilled(speculative.LLM(str(root / "target"), dtype="float32"), root / "data", 40, 3, 24, 16)
    return root


def save_eagle_head_for(target: torch.nn.Module, path) -> str:
    """An untrained EAGLE-1 head for `target` (the demo recipe's, 4 heads) saved at `path`; its path."""
    sizes = {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    save_eagle_head(eagle_head(target, sizes, "eagle"), path)
    return str(path)


@pytest.fixture
def hide_module(monkeypatch):
    """hide(missing, *reloaded): make module `missing` and its submodules unimportable (an extra left
    out), and drop the cached `reloaded` modules and their submodules so that they import again; all put
    back afterwards."""

    def hide(missing: str, *reloaded: str) -> None:
        for name in [missing, *(n for n in sys.modules if n.startswith(missing + "."))]:
            monkeypatch.setitem(sys.modules, name, None)
        for name in [n for n in sys.modules if n.startswith(reloaded)]:
            monkeypatch.delitem(sys.modules, name)

    return hide
