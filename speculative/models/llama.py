"""Native Llama-family causal LM (llama, mistral, qwen2, qwen3) speaking the LanguageModel protocol.

Parameter names equal those of the Hugging Face `*ForCausalLM` state_dict, so
`NativeCausalLM(config).load_state_dict(hf_model.state_dict())` works. The per-family differences
follow transformers' modeling files exactly:

  family   q/k/v bias       o bias           mlp bias   q/k RMSNorm   sliding window
  llama    attention_bias   attention_bias   mlp_bias   no            never
  mistral  no               no               no         no            every layer, if sliding_window
  qwen2    yes              no               no         no            layers whose layer_types[i] is
  qwen3    attention_bias   attention_bias   no         yes           "sliding_attention"

Attention runs against a StaticKVCache with per-row lengths: row b's q tokens sit at positions
`cache.lengths[b] + arange(q)`, and RoPE, the K/V writes and the causal mask all use those per-row
positions, so rows of one batch may hold contexts of different lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from speculative.kv_cache import StaticKVCache

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# RoPE types whose frequencies HF recomputes from the batch's longest sequence: not per-row safe.
_UNSUPPORTED_ROPE_TYPES = frozenset({"longrope"})


def _rope_type(config: PretrainedConfig) -> str:
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_type", "default")


def supports(config: PretrainedConfig) -> bool:
    """Whether NativeCausalLM can run a model of this config."""
    return config.model_type in SUPPORTED_MODEL_TYPES and _rope_type(config) not in _UNSUPPORTED_ROPE_TYPES


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_init(config: PretrainedConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling), as the HF rotary embedding computes them.

    "dynamic" RoPE is taken at its initial (unscaled) frequencies, which is what HF uses for every
    sequence of at most max_position_embeddings tokens.
    """
    rope_type = _rope_type(config)
    if rope_type in _UNSUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"RoPE type {rope_type!r} is not supported by NativeCausalLM")
    with torch.device("cpu"):  # also under an enclosing meta-device context (from_hf)
        if rope_type != "default":
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
            return inv_freq.float(), scaling
        dim = _head_dim(config)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** exponents), 1.0


def attention_mask(positions: Tensor, span: int, window: int | None) -> Tensor:
    """Boolean mask [batch, 1, q, span]: key j is visible to query i of row b iff
    j <= positions[b, i] and, with a sliding window W, positions[b, i] - j < W.

    positions: [batch, q] absolute positions of the query tokens.
    """
    keys = torch.arange(span, device=positions.device)  # [span]
    distance = positions[:, None, :, None] - keys  # [batch, 1, q, span]
    mask = distance >= 0
    if window is not None:
        mask &= distance < window
    return mask


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 like HF's LlamaRMSNorm."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., size]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, config: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:  # [batch, q, hidden]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """GQA self-attention with RoPE at per-row positions, reading and writing a StaticKVCache."""

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        family = config.model_type
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.scaling = self.head_dim**-0.5
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = {"llama": attention_bias, "mistral": False, "qwen2": True, "qwen3": attention_bias}[family]
        o_bias = {"llama": attention_bias, "qwen3": attention_bias}.get(family, False)
        hidden = config.hidden_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_out, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_out, bias=qkv_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=o_bias)
        self.qk_norm = family == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        if family == "mistral":
            self.sliding_window = getattr(config, "sliding_window", None)
        elif family in ("qwen2", "qwen3") and config.layer_types[layer_idx] == "sliding_attention":
            self.sliding_window = config.sliding_window
        else:
            self.sliding_window = None

    def forward(
        self,
        x: Tensor,  # [batch, q, hidden]
        cos: Tensor,  # [batch, 1, q, head_dim]
        sin: Tensor,  # [batch, 1, q, head_dim]
        positions: Tensor,  # [batch, q]
        cache: StaticKVCache,
        masks: dict[int | None, Tensor],  # window -> [batch, 1, q, span], shared by the layers
    ) -> Tensor:  # [batch, q, hidden]
        batch, q, _ = x.shape
        query = self.q_proj(x).view(batch, q, self.num_heads, self.head_dim)
        key = self.k_proj(x).view(batch, q, self.num_kv_heads, self.head_dim)
        value = self.v_proj(x).view(batch, q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # [batch, heads, q, head_dim]
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin

        keys, values = cache.write(self.layer_idx, key, value, positions)  # [batch, kv_heads, span, head_dim]
        mask = masks.get(self.sliding_window)
        if mask is None:
            mask = masks[self.sliding_window] = attention_mask(positions, keys.shape[2], self.sliding_window)
        gqa = self.num_heads != self.num_kv_heads
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=gqa
        )  # [batch, heads, q, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config, bias=config.model_type == "llama" and getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,  # [batch, q, hidden]
        cos: Tensor,  # [batch, 1, q, head_dim]
        sin: Tensor,  # [batch, 1, q, head_dim]
        positions: Tensor,  # [batch, q]
        cache: StaticKVCache,
        masks: dict[int | None, Tensor],
    ) -> Tensor:  # [batch, q, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, masks)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Holds the `model.*` parameters: embed_tokens, layers, norm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class NativeCausalLM(nn.Module):
    """A llama/mistral/qwen2/qwen3 causal LM implementing the LanguageModel protocol."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} not in {sorted(SUPPORTED_MODEL_TYPES)}")
        self.config = config
        self.vocab_size: int = config.vocab_size
        self.max_length: int = config.max_position_embeddings
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.attention_scaling = _rope_init(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2]

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> NativeCausalLM:
        """Build from a HF `*ForCausalLM`, on its device and dtype, sharing (not copying) its weights."""
        with torch.device("meta"):
            native = cls(hf_model.config)
        native.load_state_dict(hf_model.state_dict(), strict=True, assign=True)
        if getattr(hf_model.config, "tie_word_embeddings", False):
            native.lm_head.weight = native.model.embed_tokens.weight
        weight = hf_model.get_input_embeddings().weight
        native.inv_freq = hf_model.model.rotary_emb.inv_freq.to(weight.device, torch.float32)
        return native.eval()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_length: int) -> StaticKVCache:
        """An empty StaticKVCache of `batch_size` rows and `max_length` positions, in the model's dtype."""
        attn = self.model.layers[0].self_attn
        return StaticKVCache(
            num_layers=len(self.model.layers),
            batch_size=batch_size,
            num_kv_heads=attn.num_kv_heads,
            max_length=max_length,
            head_dim=attn.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [batch, 1, q, head_dim] at `positions` [batch, q], computed in float32."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [batch, q, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [batch, q]
        cache: StaticKVCache,
        num_tokens: Tensor | None = None,  # [batch] int64, real tokens per row (right padding after)
        logits_indices: Tensor | None = None,  # [batch, n] int64, query indices whose logits are wanted
    ) -> Tensor:  # [batch, n, vocab] float32 (n = q without logits_indices)
        """Append `input_ids` at each row's cache positions and return float32 logits.

        Row b's tokens go to positions cache.lengths[b] .. cache.lengths[b] + q - 1; afterwards the
        cache's lengths advance by `num_tokens` (default q). Padding tokens are written too, past the
        row's new length, where attention ignores them and later writes overwrite them.
        Raises ValueError if the cache has no room for q more tokens.
        """
        q = input_ids.shape[1]
        cache.check_room(q)
        positions = cache.positions(q)  # [batch, q]
        hidden = self.model.embed_tokens(input_ids)  # [batch, q, hidden]
        cos, sin = self._rope(positions, hidden.dtype)
        masks: dict[int | None, Tensor] = {}
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, positions, cache, masks)
        cache.advance(q if num_tokens is None else num_tokens, q)
        if logits_indices is not None:
            index = logits_indices[..., None].expand(-1, -1, hidden.shape[-1])  # [batch, n, hidden]
            hidden = hidden.gather(1, index)
        return self.lm_head(self.model.norm(hidden)).float()
