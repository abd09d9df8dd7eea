"""Token trees for tree verification: the convention, their depths and ancestors, their attention mask,
and how a batch shrinks them (`batch_tree`).

A batch of trees is `parents` [batch, M] int64, M nodes per row. Node 0 is the root: the last
context token (the token a chain verification feeds first). Nodes 1 .. M-1 are draft tokens: a real
node i has its parent `parents[b, i]` in [0, i) (so a root-to-leaf path has increasing indices); a
padding node has parent -1 (rows with fewer nodes pad at their end; their tokens are fed clamped to
0). `parents[b, 0]` is -1. depth[0] = 0 and depth[i] = depth[parents[i]] + 1; a padding node has depth
0. A chain of k drafts is parents = [-1, 0, 1, ..., k - 1].

A tree forward (NativeCausalLM.forward_tree) writes node i's K/V at cache slot L_b + i, with L_b the
row's cached length, at RoPE position L_b + depth[i]; node i attends to the context [0, L_b) and to the
slots of its ancestors-or-self (a padding node to itself only).
"""

from __future__ import annotations

import torch
from torch import Tensor


def batch_tree(width: int, num_nodes: int, batch: int, depth: int) -> tuple[int, int]:
    """The width and node count of each row's tree in a greedy batch of `batch` rows, for trees of
    `width` and `num_nodes` at batch 1, at most `depth` deep: trees shrink with the batch, so that a
    verification, whose cost grows with its tokens on a CPU, costs about what one row's tree did.
    Nodes: max(min(num_nodes, depth), num_nodes // batch), never more than the batch-1 tree's. Width:
    width // batch, or 1, a chain of min(depth, nodes) drafts, where that leaves at most 1, or where a
    batch leaves a row no more nodes than the chain holds. (A proposer without a width, whose tree's
    breadth is its matches', passes width = num_nodes.)

    Proposers shrink a greedy batch's trees only: a sampled row's draws, and so a seeded row's output,
    must not depend on its neighbours (they pass SampleStrategy.tree_rows). Why trees shrink:
    docs/internals.md#measured-choices.
    """
    nodes = max(min(num_nodes, depth), num_nodes // batch)
    shrunk = width // batch
    return (1 if shrunk <= 1 or (batch > 1 and nodes <= depth) else shrunk), nodes


def check_tree(parents: Tensor) -> None:
    """Raise a ValueError unless `parents` [batch, M] int64 follows the convention of the module
    docstring (a device sync: call it on host-side trees, or once in tests)."""
    if parents.dim() != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents must be [batch, M >= 1]; got shape {tuple(parents.shape)}")
    if parents.dtype != torch.int64:
        raise ValueError(f"parents must be int64; got {parents.dtype}")
    m = parents.shape[1]
    index = torch.arange(m, device=parents.device)
    if not bool((parents[:, 0] == -1).all()):
        raise ValueError("parents[:, 0] must be -1 (node 0 is the root)")
    if not bool(((parents >= -1) & (parents < index)).all()):
        raise ValueError("every parents[b, i] must be -1 (padding) or a node index in [0, i)")
    real = (parents >= 0) | (index == 0)  # [batch, M]
    parent_real = real.gather(1, parents.clamp(min=0))
    if not bool((parent_real | ~real).all()):
        raise ValueError("a real node's parent must be a real node, not a padding node")


def tree_ancestors(parents: Tensor) -> Tensor:
    """[batch, M, M] bool: [b, i, j] iff node j is node i or one of its ancestors in row b's tree (a
    padding node: itself only). Vectorised: the reflexive parent relation squared ceil(log2(M)) times."""
    batch, m = parents.shape
    eye = torch.eye(m, dtype=torch.float32, device=parents.device).expand(batch, m, m)
    # [b, i, parents[b, i]] = 1 for real non-root nodes
    step = torch.zeros(batch, m, m + 1, dtype=torch.float32, device=parents.device)
    step.scatter_(2, torch.where(parents >= 0, parents, m)[..., None], 1.0)
    relation = eye + step[..., :m]  # reach within one step
    reach = 1
    while reach < m - 1:  # paths of up to `reach` steps -> up to 2 * reach
        relation = (relation @ relation).clamp_(max=1.0)
        reach *= 2
    return relation > 0


def tree_depths(parents: Tensor, ancestors: Tensor | None = None) -> Tensor:
    """[batch, M] int64: each node's depth (the root's 0, a padding node's 0). `ancestors`, if given, is
    tree_ancestors(parents), not computed again."""
    ancestors = tree_ancestors(parents) if ancestors is None else ancestors
    return ancestors.sum(-1) - 1


def tree_attention_mask(
    query_ancestors: Tensor, node_positions: Tensor, start: Tensor, keys: Tensor, window: int | None
) -> Tensor:
    """Boolean mask [batch, 1, q, span] of a tree forward whose queries are the tree's last q nodes:
    key slot j is visible to query node i of row b iff j < S_b (the context; S_b = start[b], the
    slot of the root) or j = S_b + a for an ancestor-or-self a of i, and, with a sliding window W,
    i's position minus the key's position (j in the context, node_positions[b, a] in the tree) is
    below W.

    query_ancestors: [batch, q, M] the query nodes' rows of tree_ancestors; node_positions: [batch,
    M] every node's RoPE position (S_b + depth); start: [batch, 1]; keys: [span] = arange(span).
    """
    m = node_positions.shape[1]
    offset = keys - start  # [batch, span]: key j's node index, where in [0, M)
    in_tree = (offset >= 0) & (offset < m)
    node = offset.clamp(0, m - 1)  # [batch, span]
    q = query_ancestors.shape[1]
    visible = query_ancestors.gather(2, node[:, None, :].expand(-1, q, -1)) & in_tree[:, None]
    visible |= (offset < 0)[:, None]  # the context; [batch, q, span]
    if window is not None:
        key_position = torch.where(in_tree, node_positions.gather(1, node), keys)  # [batch, span]
        query_position = node_positions[:, m - q :]  # [batch, q]
        visible &= query_position[:, :, None] - key_position[:, None, :] < window
    return visible[:, None]


def tree_query(
    ancestors: Tensor, depths: Tensor, q: int, start: Tensor, key_positions: Tensor, windows: set[int | None]
) -> tuple[Tensor, Tensor, dict[int | None, Tensor]]:
    """What a forward over a tree's last q nodes needs (NativeCausalLM.run's tree arguments), the
    root at cache slot start [batch, 1]: the nodes' RoPE positions [batch, q] (start + depth), their
    K/V slots [batch, q] (start + node index) and the attention mask of each window in `windows`
    (tree_attention_mask). ancestors / depths: tree_ancestors and tree_depths of the whole tree
    [batch, M]; key_positions: [span] = arange(span)."""
    m = depths.shape[1]
    node_positions = start + depths  # [batch, M]
    slots = start + torch.arange(m - q, m, device=start.device)  # [batch, q]
    masks = {
        window: tree_attention_mask(ancestors[:, m - q :], node_positions, start, key_positions, window)
        for window in windows
    }
    return node_positions[:, m - q :], slots, masks
