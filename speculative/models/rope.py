"""Rotary position embeddings (RoPE) at per-row positions: the frequencies as Hugging Face computes
them, cos / sin tables built once up to a length, and their application to queries and keys at once.

Tables are indexed by absolute position, so each row of a batch (and each node of a token tree, at
its root's position + its depth) gets its own rotation.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# RoPE types whose frequencies HF recomputes from the batch's longest sequence: not per-row safe.
UNSUPPORTED_ROPE_TYPES = frozenset({"longrope"})


def rope_type(config: PretrainedConfig) -> str:
    """The config's RoPE type ("default" where it names none)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_type", "default")


def attention_head_dim(config: PretrainedConfig) -> int:
    """The attention heads' width: the config's head_dim, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_init(config: PretrainedConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling), as the HF rotary embedding computes them.

    "dynamic" RoPE is taken at its initial (unscaled) frequencies, which is what HF uses for every
    sequence of at most max_position_embeddings tokens. NotImplementedError for UNSUPPORTED_ROPE_TYPES.
    """
    kind = rope_type(config)
    if kind in UNSUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"RoPE type {kind!r} is not supported by NativeCausalLM")
    with torch.device("cpu"):  # also under an enclosing meta-device context (from_hf)
        if kind != "default":
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
            return inv_freq.float(), scaling
        dim = attention_head_dim(config)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** exponents), 1.0


def rope_tables(inv_freq: Tensor, scaling: float, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [length, head_dim] in `dtype` for positions 0 .. length - 1, computed in float32 as HF
    does (inv_freq [head_dim // 2], scaling: rope_init's); sin's first half is negated, so that
    rotate_half(x) * sin == x.roll(head_dim // 2, -1) * (signed sin) (apply_rope)."""
    positions = torch.arange(length, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq.float()[None]  # [length, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    sin = torch.cat((-sin[:, : freqs.shape[1]], sin[:, freqs.shape[1] :]), dim=-1)
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x rotated: x [..., heads, head_dim] (queries and keys side by side: one op for both), cos / sin
    rope_tables' rows at x's positions, broadcast over the heads ([..., 1, head_dim])."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
