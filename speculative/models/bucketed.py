"""Prefill buckets of a PreCompileConfig: prompts padded to a few widths, and a warm-up of each shape.

`BucketedModel(model, config)` wraps any LanguageModel. A forward of q > 1 tokens on a cache that no
forward has written yet is a prefill: its input_ids are right-padded to `config.bucket(q)` columns,
the smallest prefill bucket that fits (a ValueError naming the largest when none does), while
num_tokens keeps each row's real length, so that the padding lands past the rows' lengths, where
attention never looks and later writes overwrite it; logits come back for the q real positions only.
Its caches are at least as long as the smallest bucket that holds their length, so that a padded
prefill always fits.

`warm_up(model, config, steps)` runs, for every standalone (batch_size, prefill_length) of the config,
a prefill of that shape and then the decode steps the engine will run, so that each shape is
compiled (when compiling) and warm before the first request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from speculative.kv_cache import KVCache
from speculative.models.base import GreedyDecoding, LanguageModel, TreeForward
from speculative.precompile import PreCompileConfig

WARM_UP_PROMPT = 8  # prompt length of a warm-up without prefill buckets
# ... and of its second prefill: a compiled model on CPU runs a prefill of a few rows and one of a few
# dozen in graphs of their own (models/packed.py's few-row reductions against its matmul kernels), so
# without it a first chat prompt of 17-64 tokens compiled during its request (9-47 s on SmolLM2-135M)
WARM_UP_LONG_PROMPT = 48


class BucketedModel:
    """A LanguageModel whose prefills are padded to the prefill buckets of `config` (module docstring).
    It has `forward_tree` (TreeForward) and `greedy_decode` (GreedyDecoding) where `model` has them."""

    forward_tree: Callable[[Tensor, KVCache, Tensor], Tensor]  # set in __init__ where the model has it
    greedy_decode: Callable[[Tensor, KVCache, int], tuple[Tensor, Tensor]]  # the same

    def __init__(self, model: LanguageModel, config: PreCompileConfig) -> None:
        if not isinstance(config, PreCompileConfig):
            raise TypeError(f"precompile must be a PreCompileConfig; got {type(config).__name__}")
        self.model = model
        self.config = config
        self.buckets = sorted({s.prefill_length for s in config.get_standalones()} - {None})
        self._fresh: weakref.WeakSet = weakref.WeakSet()  # caches no forward has written yet
        # the capabilities (models/base.py) of the wrapped model that a bucketed one keeps, as attributes
        # only where it has them: TreeForward (trees are never padded) and GreedyDecoding (decoding is
        # never padded); not HiddenStates (its forward does not pass hidden_layers)
        if isinstance(model, TreeForward):
            self.forward_tree = self._forward_tree
        if isinstance(model, GreedyDecoding):
            self.greedy_decode = model.greedy_decode

    vocab_size = property(lambda self: self.model.vocab_size)
    max_length = property(lambda self: self.model.max_length)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """The model's cache, `max_length` rounded up to the smallest bucket that holds it (if any)."""
        length = next((b for b in self.buckets if b >= max_length), max_length)
        cache = self.model.new_cache(batch_size, length)
        self._fresh.add(cache)
        return cache

    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache,
        num_tokens: Tensor | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """The model's forward; a prefill (q > 1 on a fresh cache) padded to its bucket."""
        batch, q = input_ids.shape
        fresh = cache in self._fresh
        self._fresh.discard(cache)
        if fresh and q > 1 and self.buckets:
            width = self.config.bucket(q)
            if width > q:
                if num_tokens is None:
                    num_tokens = torch.full((batch,), q, dtype=torch.long, device=input_ids.device)
                if logits_indices is None:
                    logits_indices = torch.arange(q, device=input_ids.device).expand(batch, q)
                input_ids = torch.nn.functional.pad(input_ids, (0, width - q))
        return self.model.forward(input_ids, cache, num_tokens, logits_indices)

    __call__ = forward

    def _forward_tree(self, input_ids: Tensor, cache: KVCache, parents: Tensor) -> Tensor:
        """The wrapped model's `forward_tree` (a tree is never a prefill, never padded)."""
        self._fresh.discard(cache)
        return self.model.forward_tree(input_ids, cache, parents)


@torch.inference_mode()
def warm_up(
    model: LanguageModel,
    config: PreCompileConfig,
    steps: Sequence[tuple[int, bool]],
    greedy: Sequence[tuple[int, int]] = (),
) -> list[tuple[int, int]]:
    """Run every standalone shape of `config` once: a prefill of batch_size rows of prefill_length tokens
    (WARM_UP_PROMPT without buckets; fewer where the model's context leaves no room for the steps, the
    padding of a BucketedModel still making it the bucket's width), then one forward per
    (q, wants_last_logits) of `steps`, then, if the model has GreedyDecoding (CompiledCausalLM),
    one greedy decode per (query tokens, steps) of `greedy`; without buckets, also a prefill of
    WARM_UP_LONG_PROMPT tokens where the context holds it. Returns the (batch_size, prompt length)
    pairs run, the steps' prefill first."""
    done = []
    greedy = [(q, n) for q, n in greedy if n > 0] if isinstance(model, GreedyDecoding) else []
    written = sum(q for q, _ in steps) + sum(q + n - 1 for q, n in greedy)
    room = model.max_length - written
    for standalone in config.get_standalones():
        batch = standalone.batch_size
        length = min(standalone.prefill_length or WARM_UP_PROMPT, room)
        if length < 1:
            raise ValueError(f"the model's context of {model.max_length} tokens has no room for a warm-up")
        capacity = length + written
        ids = (torch.arange(capacity, device=model.device) % model.vocab_size).expand(batch, capacity)
        cache = model.new_cache(batch, capacity)
        last = torch.full((batch, 1), length - 1, dtype=torch.long, device=model.device)
        model.forward(ids[:, :length], cache, torch.full((batch,), length, device=model.device), last)
        start = length
        for q, wants_last in steps:
            indices = torch.full((batch, 1), q - 1, device=model.device) if wants_last else None
            model.forward(ids[:, start : start + q], cache, logits_indices=indices)
            start += q
        for q, n in greedy:
            model.greedy_decode(ids[:, start : start + q], cache, n)
            start += q + n - 1
        done.append((batch, length))
        if standalone.prefill_length is None and WARM_UP_LONG_PROMPT <= model.max_length:
            long = WARM_UP_LONG_PROMPT
            ids = (torch.arange(long, device=model.device) % model.vocab_size).expand(batch, long)
            last = torch.full((batch, 1), long - 1, dtype=torch.long, device=model.device)
            model.forward(
                ids, model.new_cache(batch, long), torch.full((batch,), long, device=model.device), last
            )
            done.append((batch, long))
    return done
