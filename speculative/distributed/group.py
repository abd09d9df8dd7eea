"""This process's place among the ranks of a tensor-parallel LLM, and how it gets there.

`connect(size, device)` joins, in this order of precedence: the ranks this process already spawned
(speculative/distributed/ranks.py), torch.distributed's default group where it is already initialized
(a spawned rank, or a program that set it up itself), a group described by the environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: torchrun), and otherwise spawns size - 1 ranks of its own.
Backends: gloo on CPU, NCCL on CUDA; every group has a timeout (TIMEOUT), so that a collective whose
peers never come ends in an error, not a hang (speculative/distributed/backend.py).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from speculative.distributed import ranks
from speculative.distributed.backend import TIMEOUT, backend
from speculative.distributed.ranks import Ranks


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks one tensor-parallel model is split over, seen from one of them.

    rank / size: this process's rank and the number of ranks (torch.distributed's default group).
    local_rank: its rank on this machine (its GPU's index on CUDA).
    ranks: on rank 0 of ranks this process spawned, those ranks (it sends them every engine call);
        None under torchrun and on the spawned ranks themselves, whose calls are their own program's.
    """

    rank: int
    size: int
    local_rank: int
    ranks: Ranks | None = None

    def device(self, device: str | torch.device) -> torch.device:
        """This rank's device for `device`: CUDA's GPU number local_rank; the CPU as it is."""
        device = torch.device(device)
        if device.type != "cuda":
            return device
        torch.cuda.set_device(self.local_rank)
        return torch.device("cuda", self.local_rank)


def connect(size: int, device: torch.device) -> TensorParallelGroup:
    """This process's place among `size` ranks (see the module docstring). ValueError where a group
    already exists with another number of ranks."""
    spawned = ranks.current()
    if spawned is not None and spawned.size == size and spawned.failure is None:
        return TensorParallelGroup(0, size, 0, spawned)
    if spawned is None and not dist.is_initialized() and {"RANK", "WORLD_SIZE"} <= os.environ.keys():
        dist.init_process_group(backend(device.type), timeout=TIMEOUT)
        # ended before the interpreter's own teardown: a torchrun rank once aborted at exit ("terminate
        # called without an active exception") with the group left to be torn down with the process
        atexit.register(_destroy)
    if spawned is None and dist.is_initialized():
        if dist.get_world_size() != size:
            raise ValueError(
                f"tensor_parallel_size={size}, but this process is one of {dist.get_world_size()} ranks "
                f"(torch.distributed's group, e.g. torchrun's --nproc-per-node): they must be equal"
            )
        rank = dist.get_rank()
        return TensorParallelGroup(rank, size, int(os.environ.get("LOCAL_RANK", rank)))
    return TensorParallelGroup(0, size, 0, ranks.start(size, device.type))


def _destroy() -> None:
    """Destroy the default group this process initialized, if it is still there."""
    if dist.is_initialized():
        dist.destroy_process_group()
