"""EAGLE drafting heads: one Llama decoder layer that drafts from the target's hidden states.

Head position p reads the token x_{p+1} and a feature of position p, and its logits predict x_{p+2}.
The feature is the target's hidden state at p (a context token) or, while drafting past the context,
the head's own output hidden state at p (its guess of the target's). Two published layouts:

  "eagle" (EAGLE-1, Li et al. 2024, arXiv:2401.15077): the feature is the target's last hidden
      state (after its final norm, what its lm_head reads); hidden = fc([embed(x) ; feature]) (2H -> H,
      bias optional), then the decoder layer without its first RMSNorm (the attention reads `hidden`
      as it is); the layer's output is the head's hidden state, and the target's lm_head (no norm)
      gives the logits.
  "eagle3" (EAGLE-3, arXiv:2503.01840): the target's feature is three of its layers' hidden states
      concatenated (3H, low, middle and high: the residual streams entering those layers), which
      `fc` (no bias) maps to H; the head's own feature (H) is taken as it is. The attention reads
      [input_layernorm(embed(x)) ; hidden_norm(hidden)] (2H: its q/k/v projections take 2H), the
      residual stream is `hidden` (hidden_norm(hidden) with `norm_before_residual`, the speculators
      library's option); the layer's output is the head's hidden state (its `norm`'s output with
      `norm_output`, the library's EAGLE 3.1 option), and its own `norm` and `lm_head` give logits
      over a draft vocabulary, whose token i is target token i + d2t[i].

Draft vocabulary: an "eagle3" head's lm_head may cover only part of the target's vocabulary (its
`d2t` says which tokens), and so may an "eagle" head's: its lm_head is then the target's rows of the
`d2t` tokens (FR-Spec, Zhao et al. 2025, arXiv:2502.14856: the shared lm_head cut to the most
frequent tokens). Each drafted token then reads that many rows instead of the whole vocabulary's;
the head never drafts a token outside it, and the output stays exact (the logits outside are -inf,
so a sampled draft's distribution q is the head's renormalized over the draft vocabulary).

The head is a NativeCausalLM of one layer (its RoPE, KV cache, fused projections and layer code),
with the embedding (and for "eagle" the lm_head) shared with the target (models/eagle_checkpoint.py
loads one).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from speculative.kv_cache import StaticKVCache
from speculative.models.llama import DecoderLayer, NativeCausalLM
from speculative.models.norms import RMSNorm, rms_norm
from speculative.models.packed import PackedLinear, hold

EagleLayout = Literal["eagle", "eagle3"]


class EagleHead(NativeCausalLM):
    """An EAGLE head (module docstring) in `layout`.

    config: a llama config of one layer, vocab_size the target's; feature_size: the width of the
    target's feature (H for "eagle", 3H for "eagle3"); target_layers: the target's layers it reads
    (NativeCausalLM.forward's `hidden_layers`); draft_vocab_size: the lm_head's rows (module
    docstring; None: the whole vocabulary); fc_bias ("eagle"): whether fc has a bias. Parameter names
    are NativeCausalLM's (`model.layers.0.*`, `model.norm`, `lm_head`) plus `fc`,
    `model.layers.0.hidden_norm` ("eagle3") and the buffer `d2t` ("eagle3", or a draft vocabulary).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        layout: EagleLayout,
        feature_size: int,
        target_layers: tuple[int, ...],
        draft_vocab_size: int | None = None,
        fc_bias: bool = False,
    ) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.layout, self.target_layers = layout, target_layers
        self.norm_before_residual = False  # "eagle3": the residual stream is hidden_norm(hidden) when set
        self.norm_output = False  # "eagle3": the head's hidden state is its norm's output when set
        if layout == "eagle3":
            layer = self.model.layers[0] = DecoderLayer(config, 0, input_size=2 * hidden)
            layer.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
            self.fc = nn.Linear(feature_size, hidden, bias=False)
        else:
            self.fc = nn.Linear(feature_size + hidden, hidden, bias=fc_bias)
        if layout == "eagle3" or draft_vocab_size not in (None, config.vocab_size):
            self.lm_head = nn.Linear(hidden, draft_vocab_size or config.vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.lm_head.out_features, dtype=torch.long))
        self.pack_weights()

    def pack_weights(self) -> None:
        """NativeCausalLM.pack_weights, and `fc` as a PackedLinear too: on CPU a oneDNN prepacked copy,
        faster than F.linear at a verification's few rows (docs/internals.md#measured-choices)."""
        super().pack_weights()
        if hasattr(self, "fc"):  # NativeCausalLM.__init__ packs before fc exists
            hold(self, "_fc", PackedLinear([self.fc]))
            if self._fc.prepacked is not None:
                self._prepacked.append(self._fc)
                self._note_versions()

    def packed_linears(self) -> list[PackedLinear]:
        """NativeCausalLM.packed_linears, then `fc`: quantize() quantizes it with the layer's."""
        return [*super().packed_linears(), self._fc]

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [batch, q], x_{p+1} at head position p
        features: Tensor,  # [batch, q, feature_size or hidden_size], the feature of each position
        cache: StaticKVCache,
        num_tokens: Tensor | None = None,  # [batch] int64, real tokens per row (right padding after)
        logits_indices: Tensor | None = None,  # [batch, n] int64
    ) -> tuple[Tensor, Tensor]:  # logits [batch, n, vocab_size] float32, hidden [batch, n, hidden_size]
        """Append head positions to `cache` (as NativeCausalLM.forward appends tokens) and return the
        logits over the target's vocabulary (-inf outside an "eagle3" draft vocabulary) and the head's
        hidden states at `logits_indices` (default all q): the features of the next positions."""

        def run(ids: Tensor, positions: Tensor, keys, values, key_positions: Tensor, indices) -> tuple:
            return self.run_head(ids, features, positions, keys, values, key_positions, indices)

        return self.forward_with(run, input_ids, cache, num_tokens, logits_indices)

    def score(self, input_ids: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """Whole sequences at positions 0 .. q - 1 from an empty cache: input_ids [batch, q], features
        [batch, q, feature_size] -> logits [batch, q, vocab_size], hidden [batch, q, hidden_size];
        differentiable with respect to the head's parameters where gradients are enabled (training)."""
        batch, q = input_ids.shape
        cache = self.new_cache(batch, q)
        self.prepare(q)
        positions = self._arange[:q].expand(batch, q)
        return self.run_head(input_ids, features, positions, cache.keys, cache.values, self._arange[:q], None)

    @torch.no_grad()
    def forward_tree(
        self,
        input_ids: Tensor,  # [batch, q], the tokens of the tree's last q nodes
        features: Tensor,  # [batch, q, hidden_size], the head's hidden states at their parents
        cache: StaticKVCache,
        parents: Tensor,  # [batch, M] int64, the whole tree (NativeCausalLM.forward_tree)
    ) -> tuple[Tensor, Tensor]:  # logits [batch, q, vocab_size], hidden [batch, q, hidden_size]
        """`forward` over the nodes of trees grown a level at a time (NativeCausalLM.forward_tree)."""

        def run(ids, positions, keys, values, key_positions, indices, slots, tree_masks) -> tuple:
            return self.run_head(
                ids, features, positions, keys, values, key_positions, indices, slots, tree_masks
            )

        return super().forward_tree(input_ids, cache, parents, body=run)

    def run_head(
        self,
        input_ids: Tensor,
        features: Tensor,
        positions: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        key_positions: Tensor,
        logits_indices: Tensor | None,
        slots: Tensor | None = None,
        tree_masks: dict[int | None, Tensor] | None = None,
        with_logits: bool = True,
    ) -> tuple[Tensor | None, Tensor]:
        """`forward` as a function of tensors (NativeCausalLM.run's arguments, and the features); the
        logits are None where not `with_logits` (training takes head_logits of the positions it
        counts)."""
        batch, q = input_ids.shape
        hidden_size, eps = self.config.hidden_size, self._eps
        embeds = self.embed(input_ids.reshape(batch * q))  # [rows, H]
        features = features.reshape(batch * q, -1).to(embeds.dtype)
        if self.layout == "eagle":
            hidden = first = self._fc(torch.cat([embeds, features], dim=-1))
        else:
            hidden = features if features.shape[-1] == hidden_size else self._fc(features)
            layer = self.model.layers[0]
            normed = rms_norm(hidden, layer.hidden_norm.weight, eps)
            first = torch.cat([rms_norm(embeds, layer.input_layernorm.weight, eps), normed], dim=-1)
            if self.norm_before_residual:
                hidden = normed
        hidden, _ = self.run_layers(
            hidden, first, batch, positions, keys, values, key_positions, slots, tree_masks
        )
        hidden = hidden.view(batch, q, -1)
        if logits_indices is not None:
            hidden = hidden.gather(1, logits_indices[..., None].expand(-1, -1, hidden_size))
        if self.norm_output:  # the speculators library's EAGLE 3.1 option: the normed state is fed back
            hidden = rms_norm(hidden, self.model.norm.weight, eps)
        return (self.head_logits(hidden) if with_logits else None), hidden

    def head_logits(self, hidden: Tensor, full_vocabulary: bool = True) -> Tensor:
        """The logits of the head's hidden states [batch, n, hidden_size] (run_head's second output):
        [batch, n, vocab_size] float32, -inf outside a draft vocabulary, or where not
        `full_vocabulary` [batch, n, draft vocab] (NativeCausalLM.logits)."""
        norm = None if self.layout == "eagle" or self.norm_output else self.model.norm.weight
        return self.logits(hidden, None, norm, full_vocabulary)
