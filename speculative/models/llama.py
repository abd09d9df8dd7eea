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

This module assembles a model from its layers: RoPE (models/rope.py), RMSNorm (models/norms.py), the
projections as PackedLinears (models/packed.py: float, int8 or int4 weights behind one call), and
attention through the model's AttentionBackend (models/attention.py: the K/V writes, the masks and
attention itself; `attention_backend`, FusedAttention by default). The threads of small forwards are
models/cpu_tuning.py's.

The forward is one function of tensors (`NativeCausalLM.run`, which torch.compile can compile:
models/compiled.py), written for few ops per layer, since a decode step on a CPU is the weights'
streaming plus per-op overhead: q/k/v and gate/up as single matmuls, residual adds fused into the
matmuls, RoPE of queries and keys at once from tables built once, one mask per window per forward,
the K/V written with one index_put per cache. The modules below only hold the parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from speculative.kv_cache import StaticKVCache
from speculative.models.attention import (
    CAUSAL_SPLIT_MIN_QUERY,
    AttentionBackend,
    CausalAfter,
    FusedAttention,
    QueryByQueryAttention,
)
from speculative.models.cpu_tuning import SMALL_CALL_ROWS, small_call_threads
from speculative.models.norms import RMSNorm, rms_norm
from speculative.models.packed import PackedLinear, hold
from speculative.models.quantization import check_quantization
from speculative.models.rope import (
    UNSUPPORTED_ROPE_TYPES,
    apply_rope,
    attention_head_dim,
    rope_init,
    rope_tables,
    rope_type,
)
from speculative.tree import tree_ancestors, tree_query

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# NativeCausalLM.quantize's default: quantize the lm_head too (see the README's Quantization section).
QUANTIZE_LM_HEAD = True
# The lm_head's quantization under a model's, where they differ: llama.cpp's 4-bit types keep the
# output matrix at 8 bits or more (the demo's shipped Q4_1 GGUF: its tied embedding is Q8_0), as the
# next token's choice is the most sensitive matmul of all.
LM_HEAD_QUANTIZATION = {"w4a8": "w8a8"}
# Quantizations that round the matmuls' activations, which makes a query's attention need to be bitwise
# the same whatever the queries beside it (QueryByQueryAttention).
ACTIVATION_QUANTIZATIONS = ("w8a8", "w4a8")
# Attention spans are rounded up to a multiple of this (the causal mask hides the positions past each
# row's length) where a new span costs: a compiled forward (CompiledCausalLM; a CUDA graph per shape)
# and an eager one on CUDA, where SDPA's cuDNN backend makes a plan for each new shape: without the
# rounding, a plan a token.
SPAN_MULTIPLE = 64


def supports(config: PretrainedConfig) -> bool:
    """Whether NativeCausalLM can run a model of this config."""
    return config.model_type in SUPPORTED_MODEL_TYPES and rope_type(config) not in UNSUPPORTED_ROPE_TYPES


def runs_natively(config: PretrainedConfig, model_impl: str) -> bool:
    """Whether a model of this config runs on NativeCausalLM under `model_impl` ("auto", "native" or
    "transformers"; "native" where it cannot is the loader's error)."""
    return model_impl != "transformers" and supports(config)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)). Parameters only: NativeCausalLM runs it fused."""

    def __init__(self, config: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]


class Attention(nn.Module):
    """GQA self-attention's parameters and settings. NativeCausalLM runs it (RoPE at per-row
    positions, a StaticKVCache written at those positions) with q/k/v as one fused projection.
    input_size: the q/k/v projections' in_features (default hidden_size; EAGLE-3's layer reads 2x)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, input_size: int | None = None) -> None:
        super().__init__()
        family = config.model_type
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attention_head_dim(config)
        self.scaling = self.head_dim**-0.5
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = {"llama": attention_bias, "mistral": False, "qwen2": True, "qwen3": attention_bias}[family]
        o_bias = {"llama": attention_bias, "qwen3": attention_bias}.get(family, False)
        hidden = config.hidden_size
        inputs = input_size or hidden
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(inputs, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(inputs, kv_out, bias=qkv_bias)
        self.v_proj = nn.Linear(inputs, kv_out, bias=qkv_bias)
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


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). input_size: see Attention."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, input_size: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, input_size)
        self.mlp = MLP(config, bias=config.model_type == "llama" and getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    """Holds the `model.*` parameters: embed_tokens, layers, norm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class FusedLayer(nn.Module):
    """One decoder layer as the forward runs it: its modules (read at every call) and fused projections
    (qkv: q_proj, k_proj, v_proj; gate_up: gate_proj, up_proj). act None is SiLU. An nn.Module, like
    PackedLinear, so that a compiled forward's guards over an unchanged layer are skipped after one
    dict-tag check (models/compiled.py); models hold their list of them with `hold`, outside their
    state_dict."""

    def __init__(
        self,
        attn: nn.Module,
        input_norm: RMSNorm,
        post_norm: RMSNorm,
        act: nn.Module | None,
        qkv: PackedLinear,
        o: PackedLinear,
        gate_up: PackedLinear,
        down: PackedLinear,
    ) -> None:
        super().__init__()
        self.attn, self.input_norm, self.post_norm, self.act = attn, input_norm, post_norm, act
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down

    def projections(self) -> tuple[PackedLinear, PackedLinear, PackedLinear, PackedLinear]:
        """qkv, o, gate_up, down."""
        return self.qkv, self.o, self.gate_up, self.down


class NativeCausalLM(nn.Module):
    """A llama/mistral/qwen2/qwen3 causal LM implementing the LanguageModel protocol.

    The projections run as PackedLinears (models/packed.py): each layer's q/k/v and gate/up fused
    into one matmul, laid out for the fastest kernel; the nn.Linear parameters are views into that
    layout, so state_dict() and load_state_dict() see the HF names and shapes. Loading a state dict
    or moving the model (`.to`) lays the weights out again; so does a forward after an in-place
    change of a weight.
    `quantize("int8" | "int4" | "w8a8" | "w4a8")` quantizes the projections in place (CPU); see there.
    """

    quantization: str | None = None  # None, "int8", "int4", "w8a8" or "w4a8": what quantize() was given

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
        inv_freq, self.attention_scaling = rope_init(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2]
        attn = self.model.layers[0].self_attn
        self._num_heads, self._num_kv_heads, self._head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self._inner, self._eps = config.intermediate_size, config.rms_norm_eps
        self.small_call_threads = small_call_threads()  # None: torch's setting throughout (cpu_tuning)
        self.attention_backend: AttentionBackend = FusedAttention()
        self.pack_weights()
        self.register_load_state_dict_post_hook(lambda module, _: module.pack_weights())

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> NativeCausalLM:
        """Build from a HF `*ForCausalLM`, on its device and dtype. It shares the HF model's weights,
        except the fused q/k/v and gate/up projections, which are copies (see PackedLinear)."""
        with torch.device("meta"):
            native = cls(hf_model.config)
        return native._take_weights(hf_model, hf_model.state_dict())

    def _take_weights(self, hf_model: nn.Module, state_dict: dict[str, Tensor]) -> NativeCausalLM:
        """Take `state_dict` (the HF model's, or this model's share of it) as this model's parameters
        (built on the meta device), tie the lm_head as the config says, take the HF model's RoPE
        frequencies, lay the weights out; returns the model in eval mode."""
        self.load_state_dict(state_dict, strict=True, assign=True)
        if getattr(hf_model.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        weight = hf_model.get_input_embeddings().weight
        self.inv_freq = hf_model.model.rotary_emb.inv_freq.to(weight.device, torch.float32)
        self.pack_weights()
        return self.eval()

    def pack_weights(self) -> None:
        """Lay the projection weights out for the matmul kernels (PackedLinear), from the parameters."""
        self._check_not_quantized("laying the weights out again")
        silu = self.config.hidden_act == "silu"
        layers = [
            FusedLayer(
                a,
                layer.input_layernorm,
                layer.post_attention_layernorm,
                None if silu else m.act_fn,
                PackedLinear([a.q_proj, a.k_proj, a.v_proj]),
                self._row_linear(a.o_proj),
                PackedLinear([m.gate_proj, m.up_proj]),
                self._row_linear(m.down_proj),
            )
            for layer, a, m in ((layer, layer.self_attn, layer.mlp) for layer in self.model.layers)
        ]
        hold(self, "_layers", nn.ModuleList(layers))
        hold(self, "_lm_head", self._head_linear())
        packed = [p for layer in self._layers for p in layer.projections()]
        # only a prepacked copy can go stale: every other layout is the parameters' own storage
        self._prepacked = [p for p in (*packed, self._lm_head) if p.prepacked is not None]
        self._note_versions()
        self._rope_cos = self._rope_sin = self._arange = torch.empty(0)

    def _row_linear(self, linear: nn.Linear) -> PackedLinear:
        """The layer that runs o_proj or down_proj (row-parallel in models/tensor_parallel.py)."""
        return PackedLinear([linear])

    def _head_linear(self) -> PackedLinear:
        """The layer that runs the lm_head (split by vocabulary in models/tensor_parallel.py)."""
        return PackedLinear([self.lm_head])

    def embed(self, token_ids: Tensor) -> Tensor:  # [rows] -> [rows, hidden]
        """The token embeddings (gathered from the ranks' vocabulary shards in models/tensor_parallel.py)."""
        return F.embedding(token_ids, self.model.embed_tokens.weight)

    def _apply(self, fn, recurse=True):  # .to(), .float(), ...: the parameters got new tensors
        self._check_not_quantized("moving or casting it (.to(), .float(), ...)")
        super()._apply(fn, recurse)
        self.pack_weights()
        return self

    def quantize(self, quantization: str, lm_head: bool | None = None) -> None:
        """Quantize the projection weights in place (models/quantization.py): every layer's q/k/v, o,
        gate/up and down, and the lm_head when `lm_head` (default QUANTIZE_LM_HEAD); the embeddings,
        norms and biases stay as they are. "int8": weight-only, per output channel, symmetric;
        "int4": weight-only, group-wise asymmetric (groups of 64 along in_features, or 32), bfloat16
        models only in practice (torch's int4 CPU kernel is vectorized for bfloat16 alone); "w8a8":
        int8's weights, the matmuls' activations quantized to int8 per blocks of 32; "w4a8": the same
        activations, 4-bit weights in llama.cpp's Q4_1 scheme (models/int8_activations.py), its lm_head
        w8a8 (LM_HEAD_QUANTIZATION).
        The float weights are freed (their nn.Linear `weight` parameters become None), so memory
        drops; an lm_head tied to the embeddings keeps the embedding, so quantizing it adds its int8
        copy. CPU only.

        A quantized model is final: state_dict(), load_state_dict() and .to() / .float() / ... raise a
        RuntimeError (the float weights are gone; save the float checkpoint, and move or cast the
        model before quantizing)."""
        check_quantization(quantization)
        self._check_not_quantized("quantizing it again")
        if self.device.type != "cpu":
            raise ValueError(f"quantization runs on CPU only; the model is on {self.device}")
        lm_head = QUANTIZE_LM_HEAD if lm_head is None else lm_head
        for packed in self.packed_linears():
            if packed is not self._lm_head:
                packed.quantize(quantization)
            elif lm_head:
                packed.quantize(LM_HEAD_QUANTIZATION.get(quantization, quantization))
        self._prepacked = [p for p in self._prepacked if p.quantization is None]
        self._note_versions()
        self.quantization = quantization
        if quantization in ACTIVATION_QUANTIZATIONS:  # exact speculation needs it (see there)
            self.attention_backend = QueryByQueryAttention()

    def quantized_copy(self, quantization: str) -> NativeCausalLM:
        """A second model of this float model's weights with its projections quantized (`quantize`),
        this one left as it is. The copy shares the tensors it does not quantize (embeddings, norms,
        biases, RoPE frequencies): it adds its quantized weights, after a peak of one more float copy
        of the fused q/k/v and gate/up projections while it is laid out. CPU only; a RuntimeError for a
        model that is quantized already (its float weights are gone)."""
        self._check_not_quantized("copying it")
        with torch.device("meta"):
            copy = type(self)(self.config)
        copy.load_state_dict(self.state_dict(), strict=True, assign=True)  # the same tensors, not copies
        if getattr(self.config, "tie_word_embeddings", False):
            copy.lm_head.weight = copy.model.embed_tokens.weight
        copy.inv_freq = self.inv_freq
        copy.pack_weights()
        copy.quantize(quantization)
        return copy.eval()

    @property
    def rounds_activations(self) -> bool:
        """Whether its matmuls quantize their activations (w8a8, w4a8): a row's result must then be
        bitwise what it would be alone, whatever the rows and queries beside it, or the activations'
        rounding turns the difference into other tokens. Its decoding steps and verifications attend
        query by query (QueryByQueryAttention), and the engine prefills its prompts only beside prompts
        of their own length (prefill_groups' `exact`)."""
        return self.quantization in ACTIVATION_QUANTIZATIONS

    @property
    def draft_vocabulary(self) -> Tensor | None:
        """[draft vocab] int64: the token of each lm_head row (arange + d2t) where the lm_head covers
        only part of the vocabulary (restrict_vocabulary); None where it covers the whole of it."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t

    def restrict_vocabulary(self, token_ids: Tensor) -> None:
        """Make the lm_head a copy of its rows of `token_ids` ([n] int64, distinct, in [0, vocab_size)):
        a draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv:2502.14856). Each forward then reads n
        rows instead of the whole vocabulary's, and its logits are -inf outside those tokens, so a
        drafter never proposes another one and a sampled draft's distribution is the model's
        renormalised over them: speculation stays exact. The buffer `d2t` (token_ids - arange(n),
        EAGLE-3's convention) records it in state_dict(). ValueError for a bad `token_ids`."""
        self._check_not_quantized("restricting its vocabulary")
        token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if (
            token_ids.dim() != 1
            or not token_ids.numel()
            or token_ids.min() < 0
            or token_ids.max() >= self.vocab_size
            or token_ids.unique().numel() != token_ids.numel()
        ):
            raise ValueError(
                f"a draft vocabulary must be distinct token ids in [0, {self.vocab_size}); got "
                f"{token_ids.numel()} ids"
            )
        rows = self.lm_head.weight.detach()[token_ids].clone()
        self.lm_head = nn.Linear(
            rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype
        )
        self.lm_head.weight = nn.Parameter(rows, requires_grad=False)
        self.register_buffer("d2t", token_ids - torch.arange(token_ids.numel(), device=self.device))
        self.pack_weights()

    def packed_linears(self) -> list[PackedLinear]:
        """Every PackedLinear of the forward: each layer's q/k/v, o, gate/up and down, then the lm_head."""
        return [
            *(p for layer in self._layers for p in layer.projections()),
            self._lm_head,
        ]

    def _check_not_quantized(self, what: str) -> None:
        if self.quantization is not None:
            raise RuntimeError(
                f"this NativeCausalLM is quantized ({self.quantization}) and its float weights were "
                f"freed: {what} is not supported; quantize after loading and moving the model"
            )

    def state_dict(self, *args, **kwargs):
        """The HF-named state dict (see the class docstring); a RuntimeError once quantized."""
        self._check_not_quantized("state_dict()")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        """Load an HF-named state dict and lay it out; a RuntimeError once quantized."""
        self._check_not_quantized("load_state_dict()")
        return super().load_state_dict(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_length: int) -> StaticKVCache:
        """An empty StaticKVCache of `batch_size` rows and `max_length` positions, in the model's dtype."""
        return StaticKVCache(
            num_layers=len(self.model.layers),
            batch_size=batch_size,
            num_kv_heads=self._num_kv_heads,
            max_length=max_length,
            head_dim=self._head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def prepare(self, span: int) -> None:
        """Make what a forward attending over `span` positions needs, outside of any compiled code: the
        RoPE tables and key positions up to `span`, and the packed weights after an in-place change."""
        if span > self._rope_cos.shape[0]:
            length = max(span, 2 * self._rope_cos.shape[0])
            self._rope_cos, self._rope_sin = rope_tables(
                self.inv_freq, self.attention_scaling, length, self.dtype
            )
            self._arange = torch.arange(length, device=self.inv_freq.device)
        if sum(t._version for t in self._versioned) != self._version:  # one sum: this runs every call
            if self.quantization is None:
                self.pack_weights()
            else:  # only float layers have a prepacked copy: lay those out again, one by one
                for p in self._prepacked:
                    if p.stale():
                        p.pack()
                self._note_versions()
            self.prepare(span)

    def _note_versions(self) -> None:
        """Remember the version counters of the weights behind the prepacked copies (prepare)."""
        self._versioned = [t for p in self._prepacked for t in p.versioned]
        self._version = sum(t._version for t in self._versioned)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [batch, q]
        cache: StaticKVCache,
        num_tokens: Tensor | None = None,  # [batch] int64, real tokens per row (right padding after)
        logits_indices: Tensor | None = None,  # [batch, n] int64, query indices whose logits are wanted
        hidden_layers: tuple[int, ...] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:  # [batch, n, vocab] float32 (n = q without logits_indices)
        """Append `input_ids` at each row's cache positions and return float32 logits.

        Row b's tokens go to positions cache.lengths[b] .. cache.lengths[b] + q - 1; afterwards the
        cache's lengths advance by `num_tokens` (default q). Padding tokens are written too, past the
        row's new length, where attention ignores them and later writes overwrite them.
        hidden_layers: also return the hidden states of these layers at every query position, for
        drafters that read them (EAGLE heads): (logits, hidden [batch, q, len(hidden_layers) *
        hidden_size]), concatenated in the order given. Index i < num_hidden_layers is the residual
        stream entering layer i (0: the embeddings; vLLM's aux-layer ids), i = num_hidden_layers the
        final norm's output (what the lm_head reads). None (default): logits alone, at no extra cost.
        Raises ValueError if the cache has no room for q more tokens.
        """
        if hidden_layers is not None:
            self.check_hidden_layers(hidden_layers)
        cached = cache.host_max_length
        uniform = cached == 0 or (
            input_ids.shape[1] >= max(CAUSAL_SPLIT_MIN_QUERY, cached)
            and bool((cache.lengths == cached).all())
        )
        run = functools.partial(
            self.run, hidden_layers=hidden_layers, causal_from=cached if uniform else None
        )
        return self.forward_with(run, input_ids, cache, num_tokens, logits_indices)

    def check_hidden_layers(self, hidden_layers: tuple[int, ...]) -> None:
        """A ValueError unless every index is in [0, num_hidden_layers] (see forward)."""
        top = len(self._layers)
        if not hidden_layers or any(not 0 <= i <= top for i in hidden_layers):
            raise ValueError(f"hidden_layers {tuple(hidden_layers)} must be indices in [0, {top}]")

    @torch.no_grad()
    def forward_tree(
        self,
        input_ids: Tensor,  # [batch, q] the tokens of the tree's last q nodes; a padding node's -1 fed as 0
        cache: StaticKVCache,
        parents: Tensor,  # [batch, M] int64, the whole tree (speculative/tree.py's convention), M >= q
        hidden_layers: tuple[int, ...] | None = None,
        body: Callable[..., Any] | None = None,
        span_multiple: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:  # [batch, q, vocab] float32
        """Score the nodes of token trees: each query node's logits predict the token after the path
        from the root (node 0, the row's last context token) to that node.

        The tree's first M - q nodes are already in the cache (an earlier forward_tree of the same
        trees wrote them: a drafter grows its tree a level at a time); with q = M the whole tree is
        fed (a verification). With the root at cache slot S_b (row b), node i's K/V go to slot S_b + i
        at RoPE position S_b + depth[i], and node i attends to the context [0, S_b) and to the slots
        of its ancestors-or-self (a padding node to itself only: its logits are garbage). The cache's
        lengths advance by q, as after a chain; `cache.keep_path(start, path)`, with start = S, keeps
        one root-to-node path as if it had been fed as a chain. A chain tree (parents [-1, 0, ...,
        M - 2]) gives forward's logits and cache. Raises ValueError if the cache has no room for q
        more tokens.
        hidden_layers: as forward's (then (logits, hidden [batch, q, ...]) at the query nodes).
        body: the function of tensors to run over the nodes, with `run`'s arguments (default `run`;
        an EAGLE head's binds its features, a compiled model's is compiled); what it returns is
        returned. span_multiple: forward_with's.
        """
        batch, m = parents.shape
        q = input_ids.shape[1]
        if input_ids.shape[0] != batch or not 0 < q <= m:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} must be [batch, q <= M] for parents [{batch}, {m}]"
            )
        if hidden_layers is not None:
            self.check_hidden_layers(hidden_layers)
        ancestors = tree_ancestors(parents)  # [batch, M, M]
        depths = ancestors.sum(-1) - 1  # [batch, M]

        def run(
            input_ids: Tensor,
            slots: Tensor,
            keys: list[Tensor],
            values: list[Tensor],
            key_positions: Tensor,
            logits_indices: None,
        ) -> Tensor:
            start = slots[:, :1] - (m - q)  # [batch, 1]: the root's slot
            positions, slots, masks = tree_query(
                ancestors, depths, q, start, key_positions, self.attention_windows
            )
            if body is not None:
                return body(input_ids, positions, keys, values, key_positions, None, slots, masks)
            return self.run(
                input_ids, positions, keys, values, key_positions, None, slots, masks, hidden_layers
            )

        return self.forward_with(run, input_ids.clamp(min=0), cache, span_multiple=span_multiple)

    @property
    def attention_windows(self) -> set[int | None]:
        """The sliding windows of the layers' attention (None: a layer without one)."""
        return {layer.attn.sliding_window for layer in self._layers}

    def forward_with(
        self,
        run: Callable[..., Any],
        input_ids: Tensor,
        cache: StaticKVCache,
        num_tokens: Tensor | None = None,
        logits_indices: Tensor | None = None,
        span_multiple: int | None = None,
        written: int | None = None,
    ) -> Any:
        """`forward` with `run` (this model's, or a compiled one) computing the logits; returns what
        `run` returns.

        span_multiple: attend over the cache's first `span` positions rounded up to a multiple of
        this (capped at the cache's length), so that a compiled `run` sees few distinct spans; None:
        SPAN_MULTIPLE on CUDA (there an eager attention call plans its kernel per shape), 1
        elsewhere.
        written: the positions `run` writes per row (default q); a `run` of several decoding steps
        writes one per step, at positions + step.
        """
        q = input_ids.shape[1]
        written = q if written is None else written
        cache.check_room(written)
        span = cache.host_max_length + written
        if span_multiple is None:
            span_multiple = SPAN_MULTIPLE if input_ids.device.type == "cuda" else 1
        span = min(-(-span // span_multiple) * span_multiple, cache.max_length)
        self.prepare(span)
        threads, previous = self.small_call_threads, torch.get_num_threads()
        limit = (
            bool(threads)
            and previous > threads
            and input_ids.numel() <= SMALL_CALL_ROWS
            and input_ids.device.type == "cpu"
        )
        if limit:
            torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                positions, key_positions = cache.positions(q), self._arange[:span]
                logits = run(input_ids, positions, cache.keys, cache.values, key_positions, logits_indices)
        finally:
            if limit:
                torch.set_num_threads(previous)
        cache.advance(written if num_tokens is None else num_tokens, written)
        return logits

    def run(
        self,
        input_ids: Tensor,  # [batch, q]
        positions: Tensor,  # [batch, q] int64, the positions of the tokens
        keys: list[Tensor],  # per layer [batch, kv_heads, max_length, head_dim], written in place
        values: list[Tensor],  # per layer, the same
        key_positions: Tensor,  # [span] = arange(span): attention reads cache positions [0, span)
        logits_indices: Tensor | None = None,  # [batch, n] int64
        slots: Tensor | None = None,  # [batch, q] int64, where the K/V are written; default positions
        tree_masks: dict[int | None, Tensor] | None = None,  # window -> [batch, 1, q, span] bool
        hidden_layers: tuple[int, ...] | None = None,  # see forward
        causal_from: int | None = None,  # every row's queries are positions causal_from.. (no mask made)
    ) -> Tensor | tuple[Tensor, Tensor]:  # [batch, n, vocab] float32 (and [batch, q, h * hidden])
        """The forward as a function of tensors: what torch.compile compiles.

        Writes the K/V of the tokens at `positions` and attends over keys [0, span), masking every
        key after a query's own position (and outside the sliding window, where there is one).
        span must exceed every row's last position; `prepare(span)` must have run.

        A tree (forward_tree): `positions` are the nodes' RoPE positions (root slot + depth), their K/V
        go to `slots`, and `tree_masks[window]` says which keys each node sees (for each window of
        attention_windows). Without them, the ops are those of a chain alone.
        """
        batch, q = input_ids.shape
        hidden = self.embed(input_ids.reshape(batch * q))  # [rows, hidden]
        wanted = hidden_layers or ()
        hidden, taps = self.run_layers(
            hidden,
            None,
            batch,
            positions,
            keys,
            values,
            key_positions,
            slots,
            tree_masks,
            wanted,
            causal_from,
        )
        hidden = hidden.view(batch, q, -1)
        logits = self.logits(hidden, logits_indices, self.model.norm.weight)
        if hidden_layers is None:
            return logits
        if len(self._layers) in wanted:  # the final norm's output, at every position
            taps[len(self._layers)] = rms_norm(hidden, self.model.norm.weight, self._eps)
        return logits, torch.cat([taps[i].view(batch, q, -1) for i in hidden_layers], dim=-1)

    def logits(
        self, hidden: Tensor, logits_indices: Tensor | None, norm: Tensor | None, full_vocabulary: bool = True
    ) -> Tensor:
        """The lm_head over hidden [batch, q, hidden] at `logits_indices` ([batch, n], default all q),
        after the RMSNorm of weight `norm` (None: none): [batch, n, vocab] float32 (-inf outside a
        draft vocabulary, restrict_vocabulary), or where not `full_vocabulary` [batch, n, lm_head rows]
        (a draft vocabulary's own logits, as training reads them)."""
        if logits_indices is not None:
            index = logits_indices[..., None].expand(-1, -1, hidden.shape[-1])  # [batch, n, hidden]
            hidden = hidden.gather(1, index)
        if norm is not None:
            hidden = rms_norm(hidden, norm, self._eps)
        logits = self._lm_head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1).float()
        vocabulary = self.draft_vocabulary  # logits: [batch, n, draft vocab]
        if vocabulary is None or not full_vocabulary:
            return logits
        full = logits.new_full((*logits.shape[:2], self.vocab_size), -torch.inf)
        return full.index_copy_(2, vocabulary, logits)

    def run_layers(
        self,
        hidden: Tensor,  # [rows = batch * q, hidden], the residual stream entering the first layer
        first_input: Tensor | None,  # [rows, in_features] the first attention's input; None: its norm
        batch: int,
        positions: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        key_positions: Tensor,
        slots: Tensor | None,
        tree_masks: dict[int | None, Tensor] | None,
        wanted: tuple[int, ...] = (),  # layers whose input streams are kept
        causal_from: int | None = None,  # run's
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """The decoder layers of `run` (its other arguments) over the residual stream `hidden`. Returns
        the stream after the last layer ([rows, hidden], before the final norm) and, for each i in
        `wanted` below the number of layers, the stream entering layer i ([rows, hidden])."""
        q = positions.shape[1]
        rows, heads, kv_heads, head_dim = batch * q, self._num_heads, self._num_kv_heads, self._head_dim
        eps, span, backend = self._eps, key_positions.shape[0], self.attention_backend
        taps: dict[int, Tensor] = {}
        cos = self._rope_cos[positions][:, :, None]  # [batch, q, 1, head_dim]
        sin = self._rope_sin[positions][:, :, None]
        batch_index = torch.arange(batch, device=positions.device)[:, None]  # [batch, 1]
        write = positions if slots is None else slots
        masks: dict[int | None, Any] = {}  # window -> the backend's mask
        for i, (layer, key_cache, value_cache) in enumerate(zip(self._layers, keys, values)):
            if i in wanted:
                taps[i] = hidden
            attn = layer.attn
            if i == 0 and first_input is not None:
                qkv = layer.qkv(first_input)
            else:
                qkv = layer.qkv(rms_norm(hidden, layer.input_norm.weight, eps))
            qkv = qkv.view(batch, q, heads + 2 * kv_heads, head_dim)  # q, k, v heads side by side
            qk = qkv[:, :, : heads + kv_heads]
            if attn.qk_norm:
                norms = (attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1))
                qk = rms_norm(qk, torch.cat(norms), eps)  # [batch, q, heads + kv_heads, head_dim]
            qk = apply_rope(qk, cos, sin)  # queries and keys at once
            backend.write(
                key_cache, value_cache, batch_index, write, qk[:, :, heads:], qkv[:, :, heads + kv_heads :]
            )
            window = attn.sliding_window
            if window not in masks:
                tree_mask = None if tree_masks is None else tree_masks[window]
                causal = causal_from is not None and tree_mask is None and window is None  # no mask made
                masks[window] = (
                    (None if causal_from == 0 else CausalAfter(causal_from))
                    if causal
                    else backend.mask(positions, key_positions, window, tree_mask, hidden.dtype)
                )
            out = backend.attend(
                qk[:, :, :heads].transpose(1, 2), key_cache, value_cache, span, masks[window], attn.scaling
            )  # [batch, heads, q, head_dim]
            hidden = layer.o(out.transpose(1, 2).reshape(rows, heads * head_dim), hidden)  # + residual
            gate_up = layer.gate_up(rms_norm(hidden, layer.post_norm.weight, eps))  # [rows, 2 * inner]
            gate, up = gate_up[:, : self._inner], gate_up[:, self._inner :]
            gate = F.silu(gate) if layer.act is None else layer.act(gate)
            hidden = layer.down(gate * up, hidden)  # + residual
        return hidden, taps
