"""Per-row random draws: a seeded row draws from its own generator, the rest share one.

A row with its own `torch.Generator` consumes the same amount of randomness at every step whatever
else is in the batch, so a seeded request gives the same text alone and inside any batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from speculative.transfer import to_device

_TINY = torch.finfo(torch.float32).tiny


class RowRandom:
    """Draws [batch, *shape] tensors row by row from per-row generators.

    generators: one entry per row, None for rows without a seed of their own.
    default: the generator shared (in one batched draw) by the rows without a seed.
    """

    def __init__(
        self, generators: Sequence[torch.Generator | None], default: torch.Generator, device: torch.device
    ) -> None:
        self.generators = list(generators)
        self.default = default
        self.device = device
        self._index()

    def _index(self) -> None:
        self._seeded = [(i, g) for i, g in enumerate(self.generators) if g is not None]
        unseeded = [i for i, g in enumerate(self.generators) if g is None]
        self._unseeded = to_device(unseeded, torch.long, self.device)
        self._all_unseeded = len(unseeded) == len(self.generators)

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (host indices), in that order."""
        self.generators = [self.generators[i] for i in rows]
        self._index()

    def append(self, other: RowRandom) -> None:
        """Add `other`'s rows after these (the default generator stays this one's)."""
        self.generators += other.generators
        self._index()

    def _draw(self, shape: tuple[int, ...], fill: Callable[[Tensor, torch.Generator], Tensor]) -> Tensor:
        out = torch.empty((len(self.generators), *shape), dtype=torch.float32, device=self.device)
        if self._all_unseeded:
            return fill(out, self.default)
        if self._unseeded.numel():
            out[self._unseeded] = fill(out.new_empty((self._unseeded.numel(), *shape)), self.default)
        for i, g in self._seeded:
            fill(out[i], g)
        return out

    def uniform(self, *shape: int) -> Tensor:
        """Uniform samples in (0, 1], never 0: [batch, *shape] float32."""
        return self._draw(shape, lambda t, g: t.uniform_(generator=g).neg_().add_(1.0))

    def exponential(self, *shape: int) -> Tensor:
        """Exp(1) samples, clamped away from 0: [batch, *shape] float32."""
        return self._draw(shape, lambda t, g: t.exponential_(generator=g).clamp_(min=_TINY))
