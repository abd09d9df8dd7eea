"""Adaptive k under tensor parallelism: rank 0 chooses, every rank drafts that k."""

from __future__ import annotations

import torch
import torch.distributed as dist

from speculative.engine.draft_length import DraftLength


class RankZeroDraftLength(DraftLength):
    """DraftLength (adaptive) whose every choice is rank 0's, broadcast to the other ranks: each rank
    measures its own step times, which differ, but all must draft and verify the same k. One broadcast
    of an integer per step (on `device`: NCCL's tensors live on the GPU)."""

    def __init__(self, max_k: int, device: torch.device, disable_by_batch_size: int | None = None) -> None:
        super().__init__(max_k, adaptive=True, disable_by_batch_size=disable_by_batch_size)
        self.device = device

    def choose(self, batch_size: int, backlog: int | None = None) -> int:
        k = torch.tensor([super().choose(batch_size, backlog)], device=self.device)
        dist.broadcast(k, src=0)
        return int(k.item())
