"""Tensor parallelism: one LLM over N processes (ranks), each holding 1/N of the target.

SPMD: every rank builds the same engine from the same arguments and runs the same schedule (the same
batch, the same steps), its share of the target's forward meeting the others' in collectives
(models/tensor_parallel.py: two all-reduces per layer). The draft model runs whole on every rank by
default (ParallelConfig.draft_tensor_parallel_size = 1), and n-gram lookup or suffix decoding needs no
split: every rank drafts the same tokens from the same context.

Acceptance is decided identically on every rank, by identical seeded generators over identical logits,
not by rank 0 deciding and broadcasting the tokens it accepted: the logits are bit-identical on every
rank (an all-reduce or an all-gather hands each rank the same result, and all that follows runs
replicated on identical inputs, with the same kernels and thread counts), every sequence's generator
(and the shared one of unseeded rows) starts from the same seed and is consumed the same way, and the
host-side work that decides what a step keeps (stop tokens and strings, max_tokens, grammars) is
replicated anyway, since each rank's caches and batch must follow the same tokens. A broadcast of the
accepted tokens would add a collective and a host sync to every step for nothing. The one choice made
from measurements, adaptive k (from step times, which differ between ranks), is rank 0's, broadcast
(draft_length.py).

Two ways to start the ranks (group.py):
  spawned  `LLM(..., tensor_parallel_size=N)` in a plain process: it becomes rank 0, spawns ranks
           1 .. N-1 (ranks.py; each runs speculative/rank_worker.py), and sends them every engine call it
           makes (mirror.py); results come back to the caller on rank 0. The ranks stay up for the
           process's next tensor-parallel LLM of that size; `shutdown()` ends them.
  torchrun with RANK / WORLD_SIZE in the environment (or torch.distributed already initialized) the LLM
           joins that group, and every rank runs the caller's program: make the same calls on every
           rank (each gets the same results).
"""

from speculative.distributed.ranks import shutdown

__all__ = ["shutdown"]
