"""SampleStrategy: how each row of a batch turns logits into a distribution and a token.

The processed distribution of a row is, in this order:
  1. temperature (rows with temperature 0 are greedy: their distribution is one-hot at the argmax),
  2. top-k, 3. top-p (on the tempered distribution),
then sampling by exponential race, `argmax(probs / E)` with E ~ Exp(1) drawn from the row's own
generator, which is an exact draw from `probs`.
The same processing is applied to the target's logits at every verified position, so the rejection
rule compares the draft with exactly the distribution the target alone would have sampled from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from speculative.sampling.processors import apply_temperature, apply_top_k_top_p
from speculative.sampling.random import RowRandom
from speculative.sampling_params import SamplingParams


class SampleStrategy:
    """Per-row sampling parameters of a batch as tensors, with per-row random generators."""

    def __init__(self, params: Sequence[SamplingParams], vocab_size: int, device: torch.device,
                 default_generator: torch.Generator | None = None) -> None:
        self.params = list(params)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        if default_generator is None:
            default_generator = torch.Generator(device=self.device)
            default_generator.seed()
        generators = [_generator(p.seed, self.device) for p in self.params]
        self.random = RowRandom(generators, default_generator, self.device)
        self._build()

    @classmethod
    def greedy(cls, batch_size: int, vocab_size: int, device: torch.device | str = "cpu") -> SampleStrategy:
        """All rows greedy: argmax decoding."""
        return cls([SamplingParams(temperature=0.0)] * batch_size, vocab_size, torch.device(device))

    def _build(self) -> None:
        ps, dev = self.params, self.device
        self.greedy_rows = torch.tensor([p.greedy for p in ps], dtype=torch.bool, device=dev)  # [batch]
        self.temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in ps],
                                        dtype=torch.float32, device=dev)  # [batch]
        self.top_k = torch.tensor([self.vocab_size if p.top_k == -1 else min(p.top_k, self.vocab_size)
                                   for p in ps], dtype=torch.long, device=dev)  # [batch]
        self.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)  # [batch]
        self.all_greedy = all(p.greedy for p in ps)
        self.any_greedy = any(p.greedy for p in ps)
        self._use_top_k = any(p.top_k != -1 and p.top_k < self.vocab_size for p in ps)
        self._use_top_p = any(p.top_p < 1.0 for p in ps)

    @property
    def batch_size(self) -> int:
        return len(self.params)

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (host indices into the batch), in that order."""
        self.params = [self.params[i] for i in rows]
        self.random.select_rows(rows)
        self._build()

    def probs(self, logits: Tensor) -> Tensor:
        """Processed distributions: logits [batch, q, vocab] -> probs [batch, q, vocab] float32."""
        logits = logits.float()
        if self.all_greedy:
            return _one_hot_argmax(logits)
        processed = apply_temperature(logits, self.temperature)
        if self._use_top_k or self._use_top_p:
            processed = apply_top_k_top_p(processed, self.top_k, self.top_p if self._use_top_p else None)
        probs = processed.softmax(dim=-1)
        if self.any_greedy:
            probs = torch.where(self.greedy_rows[:, None, None], _one_hot_argmax(logits), probs)
        return probs

    def sample(self, probs: Tensor) -> Tensor:
        """One token per row from probs [batch, vocab] by exponential race: [batch] int64."""
        noise = self.random.exponential(probs.shape[-1])  # [batch, vocab]
        return (probs / noise).argmax(dim=-1)

    def next_tokens(self, logits: Tensor) -> Tensor:
        """Sample one token per row from logits [batch, vocab] (argmax when all rows are greedy)."""
        if self.all_greedy:
            return logits.argmax(dim=-1)
        return self.sample(self.probs(logits[:, None])[:, 0])


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """[..., vocab] logits -> float32 one-hot at the argmax."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
