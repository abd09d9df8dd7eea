"""Attention against a StaticKVCache, behind one seam: `AttentionBackend`.

The contract, for one decoder layer of one forward of `batch` rows of `q` query tokens each:

  positions      [batch, q] int64: each query token's absolute position (its RoPE position; in a
                 token tree, its root's slot + its depth)
  key_positions  [span] int64 = arange(span): attention reads cache slots [0, span); span exceeds every
                 row's last written slot
  cache layout   per layer, keys and values [batch, kv_heads, max_length, head_dim] each (slot-major
                 per head); slot s of row b holds the K/V of the token at position s (a tree's nodes:
                 their slots, not their RoPE positions)
  mask           made once per forward for each sliding window (None: none) by `mask`, from either
                 the chain rule (key j visible to query i of row b iff j <= positions[b, i] and, with a
                 window W, positions[b, i] - j < W) or a token tree's boolean mask [batch, 1, q, span]
                 (speculative/tree.py's tree_query: the context before the root, then the node's
                 ancestors-or-self); what it returns is the backend's own and goes only to its attend
  write          the layer's new keys and values [batch, q, kv_heads, head_dim] into the cache at
                 `slots` [batch, q] (default positions), row b's at row b (`rows`: arange(batch)[:, None])
  attend         queries [batch, heads, q, head_dim] (grouped-query: head h reads KV head
                 h // (heads / kv_heads)) against the cache's slots [0, span) -> [batch, heads, q,
                 head_dim] in the queries' dtype: softmax(q k^T * scale, masked) v

                 A forward into an empty cache (every row's queries at positions 0..q-1, no sliding
                 window, no tree) makes none: `attend` then takes None, the causal rule itself, which
                 a kernel applies without a mask in memory (SDPA's is_causal, which also skips the
                 masked half of the scores; docs/internals.md#measured-choices). A forward of q >=
                 CAUSAL_SPLIT_MIN_QUERY tokens into a cache whose rows all hold P tokens, 0 < P <= q
                 (a long prompt prefilled after a short cached prefix) makes none either: `attend`
                 takes CausalAfter(P) and attends in two parts (`causal_after`)

A query always sees at least itself, so no row of a mask is empty. Slots past a row's length hold
stale or padding K/V, which the mask hides (after a right-padded prefill into an empty cache, the
padding queries alone see them: their outputs are never read). Every method runs inside compiled graphs too
(NativeCausalLM.run is what torch.compile compiles), so a backend is plain tensor code; a flash,
paged or FlexAttention backend is one more class with these three methods (a paged one also owns
the cache layout: StaticKVCache is today's only one). A model's backend is its `attention_backend`
attribute (NativeCausalLM), FusedAttention unless set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from speculative.models.packed import STATIC_ROWS_MAX

# A query of q >= this many tokens into a cache whose rows all hold the same P <= q tokens attends in
# two parts (causal_after) rather than under a mask: the causal part skips q^2 / 2 of the q (P + q)
# scores a mask has the kernel compute, which pays where q is not small against P (at q = 256 after
# P = 1,792 the two calls cost more: docs/internals.md#measured-choices); its host check costs a sync,
# nothing beside a prefill-sized forward.
CAUSAL_SPLIT_MIN_QUERY = 32


@dataclass(frozen=True)
class CausalAfter:
    """attend's rule for a forward whose rows all hold `cached` tokens before its queries (at positions
    cached..cached + q - 1; no sliding window, no tree): query i sees slots 0..cached + i."""

    cached: int


class AttentionBackend(Protocol):
    """How a layer writes its keys and values and attends to the cache (module docstring)."""

    def mask(
        self,
        positions: Tensor,
        key_positions: Tensor,
        window: int | None,
        tree_mask: Tensor | None,
        dtype: torch.dtype,
    ) -> Any:
        """The mask `attend` takes for the layers of sliding window `window`: from the chain rule, or
        from `tree_mask` ([batch, 1, q, span] bool, True: visible) when given. dtype: the queries'."""
        ...

    def write(
        self,
        key_cache: Tensor,
        value_cache: Tensor,
        rows: Tensor,
        slots: Tensor,
        keys: Tensor,
        values: Tensor,
    ) -> None:
        """Write keys and values [batch, q, kv_heads, head_dim] at `slots` [batch, q] of each row `rows`
        ([batch, 1]) of the layer's caches ([batch, kv_heads, max_length, head_dim]), in place."""
        ...

    def attend(
        self, query: Tensor, key_cache: Tensor, value_cache: Tensor, span: int, mask: Any, scale: float
    ) -> Tensor:
        """query [batch, heads, q, head_dim] against cache slots [0, span) under `mask` (this backend's
        own, from `mask`; None: query i sees slots 0..i, a forward into an empty cache): [batch,
        heads, q, head_dim] in the query's dtype."""
        ...


def chain_mask(positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """Boolean mask [batch, 1, q, span]: key j is visible to query i of row b iff j <= positions[b, i]
    and, with a sliding window W, positions[b, i] - j < W.

    positions: [batch, q] absolute positions of the query tokens; key_positions: [span] those of the keys.
    """
    distance = positions[:, None, :, None] - key_positions  # [batch, 1, q, span]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def write_slots(
    key_cache: Tensor, value_cache: Tensor, rows: Tensor, slots: Tensor, keys: Tensor, values: Tensor
) -> None:
    """AttentionBackend.write into a StaticKVCache's layout: one index_put_ per cache (not scatter_:
    inductor then writes into the cache in place, not into a copy)."""
    key_cache[rows, :, slots] = keys
    value_cache[rows, :, slots] = values


def _allowed(
    positions: Tensor, key_positions: Tensor, window: int | None, tree_mask: Tensor | None
) -> Tensor:
    return chain_mask(positions, key_positions, window) if tree_mask is None else tree_mask


class FusedAttention:
    """The default backend, on every device: scaled_dot_product_attention (SDPA) with an additive mask
    (0 or -inf, in the queries' dtype), except in a compiled graph on a CPU, where attention is
    written as reductions that inductor fuses into the graph's own loops (in float32): for the few
    query tokens of a decoding call, the flash-attention kernel's fixed cost dominates
    (docs/internals.md#measured-choices); a few query tokens known statically, one after the other
    (packed.STATIC_ROWS_MAX). On CUDA it is SDPA throughout (flash or memory-efficient kernels).
    K/V writes: write_slots."""

    write = staticmethod(write_slots)

    def mask(
        self,
        positions: Tensor,
        key_positions: Tensor,
        window: int | None,
        tree_mask: Tensor | None,
        dtype: torch.dtype,
    ) -> Tensor:
        """Additive [batch, 1, q, span] in `dtype`: 0 where visible, -inf elsewhere."""
        allowed = _allowed(positions, key_positions, window, tree_mask)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, -torch.inf)

    def attend(
        self, query: Tensor, key_cache: Tensor, value_cache: Tensor, span: int, mask: Tensor, scale: float
    ) -> Tensor:
        if isinstance(mask, CausalAfter):
            return causal_after(query, key_cache, value_cache, mask.cached, scale)
        keys, values = key_cache[:, :, :span], value_cache[:, :, :span]
        if mask is None:
            return _causal(query, keys, values, scale)
        # dynamo's tracing (is_compiling() is process-wide: also true beside another thread's compile)
        if not (torch.compiler.is_dynamo_compiling() and query.device.type == "cpu"):
            return F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
            )
        return self.reductions(query, keys, values, mask, scale)

    def reductions(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
        """attend's compiled CPU path: query [batch, heads, q, head_dim], keys and values [batch,
        kv_heads, span, head_dim], mask additive [batch, 1, q, span] -> [batch, heads, q, head_dim]."""
        batch, heads, q, head_dim = query.shape
        kv_heads = keys.shape[1]
        if q != 1 and statically_known_true(
            q <= STATIC_ROWS_MAX
        ):  # static and few: query by query (packed.py)
            return torch.cat(
                [
                    self.reductions(query[:, :, i, None], keys, values, mask[:, :, i, None], scale)
                    for i in range(q)
                ],
                dim=2,
            )
        grouped = query.float().view(batch, kv_heads, heads // kv_heads, q, 1, head_dim)
        keys, values = (
            keys.float()[:, :, None, None],
            values.float()[:, :, None, None],
        )  # [b, kv, 1, 1, span, d]
        scores = (grouped * keys).sum(-1) * scale + mask.float()[
            :, :, None
        ]  # [batch, kv_heads, group, q, span]
        out = (scores.softmax(-1)[..., None] * values).sum(-2)  # [batch, kv_heads, group, q, head_dim]
        return out.view(batch, heads, q, head_dim).to(query.dtype)


class QueryByQueryAttention(FusedAttention):
    """FusedAttention, except that an eager call under a mask (a decoding step, a verification, a
    tree) has each query of each row attend alone, one SDPA call each, to exactly the keys it sees: a
    slice of the cache where they are its first slots (a chain, a row of a padded batch), else gathered
    in slot order (a tree's ancestors, a sliding window). A query's result is then bitwise the same
    whatever the other queries and rows of the call: SDPA's few-row kernel otherwise rounds a query's
    scores differently with the number of queries beside it (logits up to 5e-5 apart on
    SmolLM2-135M-Instruct in float32). That is harmless in float32, but where the matmuls quantize
    their activations (w8a8, w4a8: models/int8_activations.py) such a difference moves values across a
    rounding step, and greedy speculative output then parted from plain decoding within a few tokens.
    Prefills (mask None, CausalAfter) and compiled graphs are FusedAttention's. The model's
    attention_backend once it is quantized so (NativeCausalLM.quantize); a verification of 5 tokens
    makes 5 calls a layer instead of 1."""

    def attend(
        self, query: Tensor, key_cache: Tensor, value_cache: Tensor, span: int, mask: Tensor, scale: float
    ) -> Tensor:
        if mask is None or isinstance(mask, CausalAfter) or torch.compiler.is_dynamo_compiling():
            return super().attend(query, key_cache, value_cache, span, mask, scale)
        gqa = query.shape[1] != key_cache.shape[1]
        plan = self._plan(mask)
        out = None if len(plan) == 1 else torch.empty_like(query)
        for b, i, seen in plan:
            if isinstance(seen, int):  # its first slots: a view
                keys, values = key_cache[b : b + 1, :, :seen], value_cache[b : b + 1, :, :seen]
            else:
                keys, values = key_cache[b : b + 1, :, seen], value_cache[b : b + 1, :, seen]
            one = query if out is None else query[b : b + 1, :, i : i + 1]
            result = F.scaled_dot_product_attention(one, keys, values, scale=scale, enable_gqa=gqa)
            if out is None:  # one row, one query: a decoding step
                return result
            out[b, :, i] = result[0, :, 0]
        return out

    def _plan(self, mask: Tensor) -> list[tuple[int, int, int | Tensor]]:
        """Per (row, query) of the additive mask [batch, 1, q, span]: the number of first slots it sees
        where those are all it sees, else the slots it sees. Made once for the mask, which every layer
        of a forward (of one window size) shares."""
        cached = getattr(self, "_last", None)
        if cached is not None and cached[0] is mask:
            return cached[1]
        visible = (mask[:, 0] == 0).cpu()  # [batch, q, span]
        counts = visible.sum(-1)
        plan: list[tuple[int, int, int | Tensor]] = []
        for b in range(visible.shape[0]):
            for i in range(visible.shape[1]):
                seen = int(counts[b, i])
                prefix = bool(visible[b, i, :seen].all())
                plan.append((b, i, seen if prefix else visible[b, i].nonzero().squeeze(1).to(mask.device)))
        self._last = (mask, plan)
        return plan


class SdpaAttention:
    """scaled_dot_product_attention in every call, compiled CPU graphs too (where FusedAttention writes
    reductions), with a boolean mask (no additive one made). Selectable per model
    (`model.attention_backend = SdpaAttention()`), not the default: on CUDA the default already calls
    SDPA, and on a CPU its fixed cost a call loses to the fused reductions at decoding sizes
    (docs/internals.md#measured-choices); it is the reference the other backends are tested against.
    K/V writes: write_slots."""

    write = staticmethod(write_slots)

    def mask(
        self,
        positions: Tensor,
        key_positions: Tensor,
        window: int | None,
        tree_mask: Tensor | None,
        dtype: torch.dtype,
    ) -> Tensor:
        """Boolean [batch, 1, q, span], True where visible."""
        return _allowed(positions, key_positions, window, tree_mask)

    def attend(
        self, query: Tensor, key_cache: Tensor, value_cache: Tensor, span: int, mask: Tensor, scale: float
    ) -> Tensor:
        if isinstance(mask, CausalAfter):
            return causal_after(query, key_cache, value_cache, mask.cached, scale)
        keys, values = key_cache[:, :, :span], value_cache[:, :, :span]
        if mask is None:
            return _causal(query, keys, values, scale)
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
        )


def _causal(query: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """attend with mask None (a forward into an empty cache): SDPA under its own causal rule, query i
    seeing keys 0..i (the first q of the span's)."""
    return F.scaled_dot_product_attention(
        query, keys, values, is_causal=True, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
    )


def causal_after(query: Tensor, key_cache: Tensor, value_cache: Tensor, cached: int, scale: float) -> Tensor:
    """attend under CausalAfter(cached): query [batch, heads, q, head_dim] at positions cached..cached +
    q - 1 against the layer's cache ([batch, kv_heads, max_length, head_dim]), query i seeing slots
    0..cached + i. On a CPU in two parts, each without a mask: every query against the `cached` slots
    before it, and the queries among themselves under SDPA's causal rule (which skips the masked half
    of their scores), their softmaxes merged by their log-sum-exps; a mask would have the kernel score
    every query against every slot. Elsewhere SDPA under a boolean mask of the rule."""
    q = query.shape[2]
    keys, values = key_cache[:, :, : cached + q], value_cache[:, :, : cached + q]
    if query.device.type != "cpu":
        visible = torch.ones(q, cached + q, dtype=torch.bool, device=query.device).tril(cached)
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
        )
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # before: no mask, so a KV head's query heads go as one longer query (the kernel that returns
    # log-sum-exps has no grouped-query attention; this copies no keys)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * q, head_dim)
    before, lse_before = flash(grouped, keys[:, :, :cached], values[:, :, :cached], 0.0, False, scale=scale)
    before, lse_before = before.reshape(batch, heads, q, head_dim), lse_before.reshape(batch, heads, q)
    among_keys, among_values = keys[:, :, cached:], values[:, :, cached:]
    if heads != kv_heads:  # the causal part's keys: q of them, copied per query head
        among_keys = among_keys.repeat_interleave(heads // kv_heads, dim=1)
        among_values = among_values.repeat_interleave(heads // kv_heads, dim=1)
    among, lse_among = flash(query, among_keys, among_values, 0.0, True, scale=scale)
    top = torch.maximum(lse_before, lse_among)  # [batch, heads, q]
    w_before, w_among = (lse_before - top).exp()[..., None], (lse_among - top).exp()[..., None]
    out = (before.float() * w_before + among.float() * w_among) / (w_before + w_among)
    return out.to(query.dtype)
