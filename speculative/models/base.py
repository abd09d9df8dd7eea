"""The one protocol every model of the engine speaks, native or Hugging Face, and the capabilities a
model may have beyond it.

Capabilities are `runtime_checkable` protocols, and a model has one exactly when it has its members:
`isinstance(model, TreeForward)` is the whole check, made once where a model is built or taken
(`require` raises the ValueError that names the parameter asking for it), never probed per call. A
wrapper (CompiledCausalLM, BucketedModel) defines a capability's methods only when it provides them:
BucketedModel is made of the class whose methods its inner model's capabilities allow.

  TreeForward       forward_tree(input_ids, cache, parents): token trees scored in one forward
                    (NativeCausalLM, compiled or bucketed; not transformers' models)
  HiddenStates      forward(..., hidden_layers=) and forward_tree(..., hidden_layers=) also return
                    layers' hidden states (EAGLE heads read them); check_hidden_layers(indices)
  GreedyDecoding    greedy_decode(input_ids, cache, steps): several greedy steps in one call
                    (CompiledCausalLM, and a BucketedModel of one)
  CompiledDrafting  draft_with(key, grow, ...): a drafter's whole proposal as one compiled call over
                    `model`, the NativeCausalLM (or EAGLE head) it compiles (CompiledCausalLM)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from speculative.kv_cache import KVCache


@runtime_checkable
class LanguageModel(Protocol):
    """A causal LM that appends tokens to a per-row KV cache and returns logits.

    Contract of `forward(input_ids, cache, num_tokens=None, logits_indices=None)`:
      input_ids:      [batch, q] token ids; row b's tokens go to positions
                      cache.lengths[b] .. cache.lengths[b] + q - 1.
      num_tokens:     [batch] int64, how many of the q tokens of each row are real (right padding
                      after them); default q for every row. The cache's lengths advance by it.
      logits_indices: [batch, n] int64 indices into the q query positions whose logits are wanted;
                      default all q.
      returns:        logits [batch, n, vocab_size], float32 or the model's dtype.
    """

    vocab_size: int
    max_length: int  # the longest context the model accepts (max_position_embeddings)
    device: torch.device
    dtype: torch.dtype

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty cache for `batch_size` rows of at most `max_length` tokens each."""
        ...

    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache,
        num_tokens: Tensor | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor: ...


@runtime_checkable
class TreeForward(Protocol):
    """Scores token trees (speculative/tree.py's convention) in one forward; see
    NativeCausalLM.forward_tree: input_ids [batch, q] (the tree's last q nodes), parents [batch, M]
    -> logits [batch, q, vocab] float32; the cache's lengths advance by q."""

    def forward_tree(self, input_ids: Tensor, cache: KVCache, parents: Tensor) -> Tensor: ...


@runtime_checkable
class HiddenStates(Protocol):
    """Returns hidden states with the logits: `forward(..., hidden_layers=(i, ...))` and
    `forward_tree(..., hidden_layers=...)` give (logits, hidden [batch, q, len(hidden_layers) *
    hidden_size]) (NativeCausalLM.forward says which layers the indices name);
    `check_hidden_layers(indices)` raises the ValueError a forward would for indices it cannot give."""

    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache,
        num_tokens: Tensor | None = None,
        logits_indices: Tensor | None = None,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]: ...

    def forward_tree(
        self, input_ids: Tensor, cache: KVCache, parents: Tensor, hidden_layers: tuple[int, ...] | None = None
    ) -> Tensor | tuple[Tensor, Tensor]: ...

    def check_hidden_layers(self, hidden_layers: tuple[int, ...]) -> None: ...


@runtime_checkable
class GreedyDecoding(Protocol):
    """`greedy_decode(input_ids [batch, q], cache, steps)` -> (tokens [batch, steps], float32 logits
    [batch, steps, vocab]): what `decode(model, input_ids, cache, steps)` returns, in one call."""

    def greedy_decode(self, input_ids: Tensor, cache: KVCache, steps: int) -> tuple[Tensor, Tensor]: ...


@runtime_checkable
class CompiledDrafting(Protocol):
    """A drafter's whole proposal as one compiled call: `draft_with(key, grow, input_ids, cache,
    num_tokens, nodes, features=None)` runs `grow`, a function of tensors over `model` (the
    NativeCausalLM, or EAGLE head, it compiles), as CompiledCausalLM.draft_with says."""

    model: Any

    def draft_with(
        self,
        key: tuple,
        grow: Callable[..., tuple[Tensor, Tensor]],
        input_ids: Tensor,
        cache: KVCache,
        num_tokens: Tensor,
        nodes: int,
        features: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...


# What `require` says a model without the capability lacks: (what it needs, what the model does instead)
_NATIVE = (
    "the native forward for the {which} (model types llama, mistral, qwen2, qwen3; "
    "model_impl 'native' or 'auto')"
)
_MISSING: dict[type, tuple[str, str]] = {
    TreeForward: (_NATIVE, "verifies chains only"),
    HiddenStates: (_NATIVE, "returns no hidden states"),
    GreedyDecoding: ("a compiled {which} (compile=True)", "decodes a step a call"),
    CompiledDrafting: ("a compiled {which} (compile=True)", "drafts a forward a call"),
}


def require(model: object, capability: type, parameter: str, which: str = "model") -> None:
    """A ValueError naming `parameter` (what asked for it, e.g. "SpeculativeConfig.tree") unless `model`
    (the `which`: "model", "draft model", ...) has `capability`, one of this module's protocols."""
    if not isinstance(model, capability):
        needs, instead = _MISSING[capability]
        raise ValueError(f"{parameter} needs {needs.format(which=which)}; {type(model).__name__} {instead}")


def first_argmax(logits: Tensor) -> Tensor:  # [batch, vocab] -> [batch]
    """The first maximal index of each row (greedy decoding's choice)."""
    return logits.max(dim=-1).indices


def decode_steps(
    step: Callable[[Tensor, int], Tensor],
    steps: int,
    input_ids: Tensor,
    choose: Callable[[Tensor], Tensor] = first_argmax,
    until: Callable[[Tensor], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """Up to `steps` autoregressive steps from input_ids [batch, q]: `step(ids, i)` feeds step i's ids
    (the query at i = 0, then the token chosen last) and returns logits [batch, n, vocab] whose last
    position `choose` ([batch, vocab] -> [batch]) picks the next token from; `until(tokens [batch])`,
    if given, ends the loop early when it returns True. Returns the tokens [batch, n_steps] and the
    logits [batch, n_steps, vocab] each was chosen from."""
    tokens, logits, current = [], [], input_ids
    for i in range(steps):
        out = step(current, i)[:, -1]
        current = choose(out)[:, None]
        tokens.append(current)
        logits.append(out)
        if until is not None and until(current[:, 0]):
            break
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def decode(
    model: LanguageModel,
    input_ids: Tensor,
    cache: KVCache,
    steps: int,
    choose: Callable[[Tensor], Tensor] = first_argmax,
    until: Callable[[Tensor], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """`decode_steps` through `model.forward`: the query input_ids [batch, q] first (logits at its last
    token only), then one token a step. The cache gains the query and every token but the last."""
    batch, q = input_ids.shape
    last = torch.full((batch, 1), q - 1, device=input_ids.device) if q > 1 else None

    def step(ids: Tensor, i: int) -> Tensor:
        return model.forward(ids, cache, logits_indices=last if i == 0 else None)

    return decode_steps(step, steps, input_ids, choose, until)
