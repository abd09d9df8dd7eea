"""DFlash block drafters: k draft tokens from one forward of a small non-causal drafter.

DFlash (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv:2602.06036)
drafts a whole block at once. With a row's context of n tokens, the block sits at positions
n - 1 .. n - 1 + (size - 1): its input is the context's last token followed by size - 1 mask
tokens, and the drafter's output at block position i >= 1 is its guess of the token at position
n - 1 + i (the same position, as masked-token prediction, not the next one). So one forward drafts
size - 1 tokens, each independently given the context and the block's input.

The drafter never computes the context itself: its context is the TARGET's hidden states.
  features  [batch, c, F]: the target's hidden states at context positions 0 .. c - 1 (c = n - 1: the
      last token's are not known until the target's next forward), F = len(target layers) * H, the
      streams of several target layers concatenated;
  ctx = hidden_norm(fc(features))  [batch, c, H]: one fused context, shared by every draft layer;
  layer l's context keys and values: k_proj_l(ctx) (its k_norm for a Qwen3 layer; RoPE at the
      context's positions) and v_proj_l(ctx): injected as keys / values beside the block's own, so
      the block attends to the context and, bidirectionally, to itself (no causal mask inside it).
The block's tokens are embedded with the target's embedding (a mask position with `mask_embedding`,
a learned vector, or with the target's embedding of `mask_token_id` where the config names one and no
vector is learned), run through pre-norm decoder layers (Llama or Qwen3 parameters, models/llama.py's
DecoderLayer), the final `norm`, and the target's lm_head: the embedding and lm_head are shared, frozen
and not saved. A drafter may instead have an lm_head of its own over a draft vocabulary (`lm_head`
[D, H] and `d2t` [D], target token = i + d2t[i], as vLLM's speculators checkpoints carry it): its logits
are -inf outside those D tokens, so its drafts never leave them and a sampled draft's distribution is
its own renormalised over them.

Context K/V are cached per row across steps (a StaticKVCache of the draft's layers, `new_cache`):
`extend_context` appends the K/V of new context positions (the target's features of the tokens a
step committed), `draft` writes the block's K/V past the row's length, where they are garbage for the
next `extend_context` to overwrite, and never advances the lengths. The cached context is thus the
target's committed positions only; the proposer (proposers/dflash.py) keeps it so.

Target layers follow DFlash's convention: id j is the OUTPUT of the target's layer j (Hugging Face's
hidden_states[j + 1]); in this engine's `hidden_layers` (the stream entering a layer; the final norm's
output at L) that is j + 1 (`DFlashDrafter.hidden_layers`), the last layer's output (j = L - 1) being
the final norm's output in both.

Checkpoints: models/dflash_checkpoint.py (z-lab's layout and vLLM's speculators layout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from speculative.kv_cache import StaticKVCache
from speculative.models.llama import DecoderLayer, FusedLayer, NativeCausalLM
from speculative.models.norms import RMSNorm, rms_norm
from speculative.models.packed import PackedLinear, hold
from speculative.models.rope import apply_rope, rope_init, rope_tables

FAMILIES = ("llama", "qwen3")  # the decoder layers a drafter may have


def default_target_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """DFlash's default choice of `count` target layers (ids in DFlash's convention, module docstring):
    one: the middle layer; more: spread evenly from layer 1 to layer L - 3 (to the last layer, L - 1,
    in a target of 4 layers or fewer)."""
    if count < 1 or num_target_layers < 1:
        raise ValueError(f"count and num_target_layers must be >= 1; got {count}, {num_target_layers}")
    top = num_target_layers - 1
    if count == 1:
        return (min(num_target_layers // 2, top),)
    low = min(1, top)
    high = num_target_layers - 3 if num_target_layers - 3 > low else top  # a small target: up to its last
    return tuple(min(round(low + i * (high - low) / (count - 1)), top) for i in range(count))


class DFlashDrafter(nn.Module):
    """A DFlash drafter (module docstring).

    config: a llama or qwen3 config of the draft layers (num_hidden_layers of them); hidden_size must be
        the target's (the embedding and lm_head are the target's), vocab_size the target's.
    target_layer_ids: the target layers whose outputs form the features (DFlash's convention).
    block_size: the block the drafter was trained on (the last token and block_size - 1 masks): it
        drafts up to block_size - 1 tokens a forward. >= 2.
    mask_token_id: a token whose (target) embedding marks the masked positions; None: a learned
        `mask_embedding` [H] does.
    learned_mask: whether a learned `mask_embedding` marks them even though a mask_token_id is named
        (the id it stands for, as a speculators checkpoint's mask_embedding.pt); default: without one.
    draft_vocab_size: None, the target's lm_head; else the drafter's own `lm_head` of that many rows
        and `d2t` (module docstring).
    Parameters: `layers.*` (DecoderLayer's names), `fc` [H, F], `hidden_norm`, `norm`, `mask_embedding`
        where learned, `lm_head` and the buffer `d2t` where its own. The embedding (and the target's
        lm_head) are attached with `share` (share_native for a NativeCausalLM target).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        target_layer_ids: tuple[int, ...],
        block_size: int,
        mask_token_id: int | None = None,
        learned_mask: bool | None = None,
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if config.model_type not in FAMILIES:
            raise ValueError(
                f"a DFlash drafter's model_type must be one of {FAMILIES}; got {config.model_type!r}"
            )
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2; got {block_size!r}")
        if not target_layer_ids or any(not isinstance(j, int) or j < 0 for j in target_layer_ids):
            raise ValueError(f"target_layer_ids must be non-negative layer ids; got {target_layer_ids!r}")
        if any(t == "sliding_attention" for t in getattr(config, "layer_types", None) or ()):
            raise ValueError("a DFlash drafter's layers attend to the whole context: no sliding_attention")
        hidden = config.hidden_size
        self.config = config
        self.target_layer_ids = tuple(target_layer_ids)
        self.hidden_layers = tuple(j + 1 for j in self.target_layer_ids)  # the engine's convention
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        if mask_token_id is None and learned_mask is False:
            raise ValueError("a DFlash drafter's masks need a mask_token_id or a learned mask embedding")
        if mask_token_id is None or learned_mask:
            self.mask_embedding = nn.Parameter(torch.randn(hidden) * 0.02)
        self.lm_head: nn.Linear | None = None
        if draft_vocab_size is not None:
            if not 1 <= draft_vocab_size <= config.vocab_size:
                raise ValueError(
                    f"draft_vocab_size must be in [1, {config.vocab_size}]; got {draft_vocab_size}"
                )
            self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        inv_freq, self.attention_scaling = rope_init(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        attn = self.layers[0].self_attn
        self._heads, self._kv_heads, self._head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self._inner, self._eps = config.intermediate_size, config.rms_norm_eps
        self._embed: Callable[[Tensor], Tensor] | None = None
        self._lm_head: Callable[[Tensor], Tensor] | None = None
        self.pack_weights()
        self.register_load_state_dict_post_hook(lambda module, _: module.pack_weights())

    # ---- shared pieces, layout -------------------------------------------------------------------

    def share(self, embed: Callable[[Tensor], Tensor], lm_head: Callable[[Tensor], Tensor]) -> None:
        """Attach the target's embedding (token ids [n] int64 -> [n, H]) and lm_head (hidden [batch, q,
        H] -> logits [batch, q, V] float32). They are not parameters of the drafter: not trained, not
        saved. A drafter with an lm_head of its own keeps it."""
        self._embed = embed
        self._lm_head = lm_head if self.lm_head is None else self._own_logits

    def _own_logits(self, hidden: Tensor) -> Tensor:
        """The own lm_head's logits of hidden [batch, q, H]: [batch, q, V] float32, -inf outside the
        draft vocabulary (a head of V rows is the whole vocabulary in order)."""
        logits = self._head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1).float()
        if logits.shape[-1] == self.config.vocab_size:
            return logits
        tokens = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        full = logits.new_full((*logits.shape[:2], self.config.vocab_size), -torch.inf)
        return full.index_copy_(2, tokens, logits)

    def share_native(self, target: NativeCausalLM) -> None:
        """`share` the embedding and lm_head of a NativeCausalLM target."""
        self.share(target.embed, lambda hidden: target.logits(hidden, None, None))

    def share_weights(self, embedding: Tensor, lm_head: Tensor) -> None:
        """`share` an embedding [V, H] and an lm_head weight [V, H] (a Hugging Face target's, training)."""
        self.share(
            lambda ids: F.embedding(ids, embedding.to(self.dtype)),
            lambda hidden: F.linear(hidden, lm_head.to(hidden.dtype)).float(),
        )

    def pack_weights(self) -> None:
        """Lay the projections out as PackedLinears (q/k/v and gate/up fused), from the parameters."""
        silu = self.config.hidden_act == "silu"
        layers = [
            FusedLayer(
                layer.self_attn,
                layer.input_layernorm,
                layer.post_attention_layernorm,
                None if silu else layer.mlp.act_fn,
                PackedLinear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                PackedLinear([layer.self_attn.o_proj]),
                PackedLinear([layer.mlp.gate_proj, layer.mlp.up_proj]),
                PackedLinear([layer.mlp.down_proj]),
            )
            for layer in self.layers
        ]
        hold(self, "_layers", nn.ModuleList(layers))
        hold(self, "_fc", PackedLinear([self.fc]))
        self._packed = [self._fc, *(p for layer in self._layers for p in layer.projections())]
        if self.lm_head is not None:
            hold(self, "_head", PackedLinear([self.lm_head]))
            self._packed.append(self._head)
        self._cos = self._sin = torch.empty(0)

    def _apply(self, fn, recurse=True):  # .to(), .float(), ...: the parameters got new tensors
        super()._apply(fn, recurse)
        inv_freq, _ = rope_init(self.config)  # float32 whatever the weights' dtype, as HF keeps it
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self.pack_weights()
        return self

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, batch_size: int, max_length: int) -> StaticKVCache:
        """An empty cache of the context's K/V for `batch_size` rows of `max_length` positions. Give it
        room for a block beyond the longest context (`draft` writes the block's K/V there)."""
        return StaticKVCache(
            num_layers=len(self.layers),
            batch_size=batch_size,
            num_kv_heads=self._kv_heads,
            max_length=max_length,
            head_dim=self._head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def prepare(self, span: int) -> None:
        """RoPE tables for positions [0, span), and the packed weights laid out again after an in-place
        change of a parameter (an optimizer step)."""
        if any(p.stale() for p in self._packed):
            self.pack_weights()
        if span > self._cos.shape[0]:
            length = max(span, 2 * self._cos.shape[0])
            self._cos, self._sin = rope_tables(self.inv_freq, self.attention_scaling, length, self.dtype)

    # ---- the forward's pieces --------------------------------------------------------------------

    def _shared(self) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
        if self._embed is None or self._lm_head is None:
            raise RuntimeError("the drafter has no embedding and lm_head: call share(...) with the target's")
        return self._embed, self._lm_head

    def block_embeddings(self, first_tokens: Tensor, size: int) -> Tensor:
        """The block's input: first_tokens [n] int64 (the context's last token) -> [n, size, H]: its
        embedding, then size - 1 mask embeddings."""
        embed, _ = self._shared()
        first = embed(first_tokens)  # [n, H]
        if hasattr(self, "mask_embedding"):
            mask = self.mask_embedding.to(first.dtype)
        else:
            mask = embed(torch.tensor([self.mask_token_id], device=first_tokens.device))[0]
        masks = mask.expand(first.shape[0], size - 1, -1)
        return torch.cat([first[:, None], masks], dim=1)

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [batch, q, heads, head_dim] rotated at positions [batch, q]."""
        return apply_rope(x, self._cos[positions][:, :, None], self._sin[positions][:, :, None])

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's context keys (q/k-normed where Qwen3, rotated) and values, [batch, m, kv_heads,
        head_dim] each, of features [batch, m, F] at positions [batch, m]; `prepare` must cover them.
        Differentiable where gradients are enabled."""
        batch, m = positions.shape
        kv, head_dim = self._kv_heads, self._head_dim
        rows = features.reshape(batch * m, -1).to(self.dtype)
        ctx = rms_norm(self._fc(rows), self.hidden_norm.weight, self._eps)  # [batch * m, H]
        out = []
        for layer in self._layers:
            attn = layer.attn
            if torch.is_grad_enabled() and attn.k_proj.weight.requires_grad:
                weight = torch.cat([attn.k_proj.weight, attn.v_proj.weight])
                bias = None if attn.k_proj.bias is None else torch.cat([attn.k_proj.bias, attn.v_proj.bias])
            else:  # k_proj and v_proj are the fused weight's last rows
                q_out = self._heads * head_dim
                weight = layer.qkv.weight[q_out:]
                bias = None if layer.qkv.bias is None else layer.qkv.bias[q_out:]
            keys_values = F.linear(ctx, weight, bias).view(batch, m, 2 * kv, head_dim)
            keys, values = keys_values[:, :, :kv], keys_values[:, :, kv:]
            if attn.qk_norm:
                keys = rms_norm(keys, attn.k_norm.weight, self._eps)
            out.append((self._rope(keys, positions), values))
        return out

    def _run_block(
        self,
        hidden: Tensor,  # [batch, Q, H] the block inputs
        positions: Tensor,  # [batch, Q] int64
        attend: Callable[[int, Tensor, Tensor, Tensor], Tensor],
    ) -> Tensor:  # [batch, Q, H], after the final norm
        """The draft layers over block tokens. attend(layer index, queries [batch, heads, Q, head_dim],
        the block's keys and values [batch, Q, kv_heads, head_dim]) -> [batch, heads, Q, head_dim]:
        attention over the context's keys and the block's, as the caller masks it."""
        batch, q, width = hidden.shape
        heads, kv, head_dim, eps = self._heads, self._kv_heads, self._head_dim, self._eps
        x = hidden.reshape(batch * q, width)
        for i, layer in enumerate(self._layers):
            attn = layer.attn
            qkv = layer.qkv(rms_norm(x, layer.input_norm.weight, eps)).view(
                batch, q, heads + 2 * kv, head_dim
            )
            qk = qkv[:, :, : heads + kv]
            if attn.qk_norm:
                norms = (attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv, -1))
                qk = rms_norm(qk, torch.cat(norms), eps)
            qk = self._rope(qk, positions)
            out = attend(i, qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:], qkv[:, :, heads + kv :])
            x = layer.o(out.transpose(1, 2).reshape(batch * q, heads * head_dim).to(x.dtype), x)
            gate_up = layer.gate_up(rms_norm(x, layer.post_norm.weight, eps))
            gate, up = gate_up[:, : self._inner], gate_up[:, self._inner :]
            gate = F.silu(gate) if layer.act is None else layer.act(gate)
            x = layer.down(gate * up, x)
        return rms_norm(x, self.norm.weight, eps).view(batch, q, width)

    def _sdpa(self, queries: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
        """queries [batch, heads, Q, d] over keys / values [batch, kv_heads, K, d] where visible [batch, 1,
        Q or 1, K] (bool)."""
        return F.scaled_dot_product_attention(
            queries,
            keys.to(queries.dtype),
            values.to(queries.dtype),
            attn_mask=visible,
            scale=self.layers[0].self_attn.scaling,
            enable_gqa=self._heads != self._kv_heads,
        )

    # ---- inference: a cached context, one block per call -----------------------------------------

    @torch.no_grad()
    def extend_context(
        self, features: Tensor, cache: StaticKVCache, num_tokens: Tensor | None = None
    ) -> None:
        """Append context positions to `cache`: features [batch, m, F] are the target's hidden states of
        row b's positions cache.lengths[b] .. + m - 1, of which the first num_tokens[b] ([batch] int64,
        default m) are real (right padding after: written past the row's new length, ignored and
        overwritten later). The lengths advance by num_tokens. ValueError if the cache has no room."""
        batch, m = features.shape[:2]
        cache.check_room(m)
        positions = cache.positions(m)  # [batch, m]
        self.prepare(cache.host_max_length + m)
        rows = torch.arange(batch, device=positions.device)[:, None]
        for i, (keys, values) in enumerate(self.context_kv(features, positions)):
            cache.keys[i][rows, :, positions] = keys
            cache.values[i][rows, :, positions] = values
        cache.advance(m if num_tokens is None else num_tokens, m)

    @torch.no_grad()
    def draft(
        self, first_tokens: Tensor, cache: StaticKVCache, size: int | None = None, count: int | None = None
    ) -> Tensor:
        """One block per row: first_tokens [batch] int64 (each row's last context token, at position
        cache.lengths[b]) and size - 1 masks (default block_size), over the cached context. Returns the
        logits [batch, count, V] float32 of the first `count` drafts (default size - 1; the lm_head reads
        only those) at positions cache.lengths[b] + 1 ..: draft i is the guess of the token i + 1 places
        after first_tokens. The cache's lengths are unchanged (the block's K/V are written past them).
        ValueError if the cache has no room for the block."""
        size = self.block_size if size is None else size
        _, lm_head = self._shared()
        cache.check_room(size)
        span = cache.host_max_length + size
        self.prepare(span)
        positions = cache.positions(size)  # [batch, size]
        batch = positions.shape[0]
        rows = torch.arange(batch, device=positions.device)[:, None]
        ends = cache.lengths + size  # the row's context and its block: [0, end) is visible to the block
        visible = (torch.arange(span, device=positions.device) < ends[:, None])[:, None, None, :]

        def attend(i: int, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
            cache.keys[i][rows, :, positions] = keys
            cache.values[i][rows, :, positions] = values
            return self._sdpa(queries, cache.keys[i][:, :, :span], cache.values[i][:, :, :span], visible)

        hidden = self._run_block(self.block_embeddings(first_tokens, size), positions, attend)
        return lm_head(hidden[:, 1 : size if count is None else 1 + count])

    # ---- training (and reference): the context computed whole ------------------------------------

    def block_logits(self, features: Tensor, first_tokens: Tensor, anchors: Tensor) -> Tensor:
        """Blocks drafted over an uncached context, differentiable where gradients are enabled (training).

        features [batch, S, F]: the target's features of positions 0 .. S - 1; anchors [batch, N] int64
        in [1, S]: block j of row b sits at positions anchors[b, j] .. + block_size - 1, its first token
        first_tokens[b, j] (the token at its anchor) and sees the context positions before its anchor
        and its own block, no other block. Returns logits [batch, N, block_size - 1, V] float32: block j's
        drafts of the tokens at anchors[b, j] + 1 ... With anchors = [[S]] and the context cached from
        the same features, `draft` gives the same logits."""
        _, lm_head = self._shared()
        batch, length = features.shape[:2]
        n, size = anchors.shape[1], self.block_size
        self.prepare(length + size)
        context = self.context_kv(features, torch.arange(length, device=anchors.device).expand(batch, -1))
        positions = (anchors[:, :, None] + torch.arange(size, device=anchors.device)).reshape(batch, n * size)
        block = torch.arange(n, device=anchors.device).repeat_interleave(size)  # [N * size]: each query's
        sees_context = (
            torch.arange(length, device=anchors.device) < anchors.repeat_interleave(size, 1)[..., None]
        )
        sees_block = (block[:, None] == block[None, :]).expand(batch, -1, -1)
        visible = torch.cat([sees_context, sees_block], dim=2)[:, None]  # [batch, 1, N * size, S + N * size]

        def attend(i: int, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
            context_keys, context_values = context[i]
            keys = torch.cat([context_keys.to(keys.dtype), keys], dim=1).transpose(1, 2)
            values = torch.cat([context_values.to(values.dtype), values], dim=1).transpose(1, 2)
            return self._sdpa(queries, keys, values, visible)

        inputs = self.block_embeddings(first_tokens.reshape(-1), size).view(batch, n * size, -1)
        hidden = self._run_block(inputs, positions, attend).view(batch, n, size, -1)[:, :, 1:]
        return lm_head(hidden.reshape(batch, n * (size - 1), -1)).view(batch, n, size - 1, -1)
