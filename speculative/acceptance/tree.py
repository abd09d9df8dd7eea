"""Acceptance rules over token trees: greedy, lossless multi-candidate speculative sampling, and
Medusa's typical acceptance.

The trees follow speculative.tree's convention: per row M nodes, node 0 the root (the last context
token, never judged), nodes 1 .. M - 1 draft tokens, ``parents[b, i]`` in [0, i) for a real node and -1
for the root and for padding nodes (at the end of a row, token -1). The children of a node are the
real nodes whose parent it is, in increasing index order; a real node whose token is -1 is treated as
no child at all (never accepted). The target's distribution at node i predicts the token after the
path root .. i.

Every rule walks one path down from the root and returns two int64 [B, M] tensors:

* ``emitted``: the accepted drafts' tokens in path order, then one token of the target's own (at the
  node where the walk stopped), then -1 padding: the chain rules' [B, k + 1] layout at width M;
* ``path``: the accepted path's node indices starting with the root, ``[0, n1, n2, ..., -1, ...]``
  (number of accepted drafts + 1 entries, then -1).

Lossless sampling over a tree (`tree_rejection_sample`): at the current node c, with q the target's
distribution there, the children j of c are tried in index order. Child j, whose token x_j was drawn
from p_j, is accepted with probability min(1, q(x_j) / p_j(x_j)); on acceptance the walk moves to j
and q becomes the target's distribution at j; on rejection q becomes norm(max(0, q - p_j)) and the
next sibling is tried. When no child is accepted (or c is a leaf) one token is sampled from q, the
residual left by the rejections, or the target's own distribution after a leaf (the bonus). With p_j
the same distribution p for all siblings drawn i.i.d. from it, this is SpecInfer's multi-step
speculative sampling (Miao et al. 2024, "SpecInfer: Accelerating Large Language Model Serving with
Tree-based Speculative Inference and Verification", arXiv:2305.09781); with p_j the draft's
distribution with the earlier siblings' tokens removed (siblings drawn without replacement) it is
recursive rejection sampling (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM
Inference via Sampling Without Replacement", arXiv:2402.14160). With deterministic candidates (p_j
one-hot at x_j, e.g. a draft's top-k) x_j is accepted with probability q(x_j), else x_j is removed
from q and q renormalised. Each way the emitted tokens are distributed exactly as the target's own
sequential sampling, as long as p_j is the distribution x_j was really drawn from (given the path to
c and the earlier siblings).

All functions are pure tensor code: no host synchronisation, no Python loop over rows (the sampling
walk loops M - 1 times, one candidate node per iteration).
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.tree import tree_ancestors, tree_depths

from .threshold import typical_threshold


def _draft_nodes(tokens: Tensor, parents: Tensor) -> Tensor:
    """[B, M] bool: the nodes that can be accepted (real non-root nodes with a token)."""
    return (parents >= 0) & (tokens >= 0)


def path_from_mask(on_path: Tensor) -> Tensor:
    """A path as node indices from a mask of its nodes: [B, M] bool -> [B, M] int64, the marked
    indices in increasing order (a root-to-node path's order, since a parent's index is below its
    child's), then -1."""
    m = on_path.shape[1]
    index = torch.arange(m, device=on_path.device)
    order = torch.where(on_path, index, m + index).sort(dim=1).values  # the marked ones first, in order
    return torch.where(order < m, order, -1)


def assemble_tree_output(tokens: Tensor, path: Tensor, next_token_ids: Tensor) -> Tensor:
    """The emitted tokens of an accepted path: tokens [B, M] int64 (the nodes' tokens), path [B, M]
    int64 (root first, then the accepted nodes, then -1), next_token_ids [B] int64 (the target's token
    at the path's last node) -> [B, M] int64: the accepted nodes' tokens, the next token, then -1."""
    num_accepted = (path >= 0).sum(dim=1, keepdim=True) - 1  # [B, 1], drafts kept
    after_root = torch.cat([path[:, 1:], path.new_full((path.shape[0], 1), -1)], dim=1)  # [B, M]
    drafts = tokens.gather(1, after_root.clamp(min=0))  # [B, M]: slot t holds the (t + 1)-th node's token
    position = torch.arange(path.shape[1], device=path.device)
    out = torch.where(position < num_accepted, drafts, next_token_ids.to(torch.int64)[:, None])
    return torch.where(position <= num_accepted, out, -1)


def _accepted_subtree(passes: Tensor, ancestors: Tensor) -> Tensor:
    """[B, M] bool: the root and every node that passes, with all its non-root ancestors passing.
    passes: [B, M] bool, False for padding nodes (ignored at the root); ancestors: tree_ancestors."""
    ok = passes.clone()
    ok[:, 0] = True
    failing_ancestor = (ancestors & ~ok[:, None, :]).any(dim=-1)  # [B, M]
    return ~failing_ancestor  # a padding node is its own only ancestor, and fails


def tree_greedy_accept(target_ids: Tensor, tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification of a token tree: exactly greedy decoding of the target.

    target_ids: [B, M] int64, the target's argmax at each node; tokens: [B, M] int64 (tokens[:, 0] the
    root's); parents: [B, M] int64 (module docstring).

    The walk starts at the root; at node c, if a child of c has the token target_ids[c] it moves to
    that child (the lowest-index one when siblings repeat a token), else it stops and emits
    target_ids[c]. Returns (emitted, path), each int64 [B, M]: the accepted drafts' tokens, the target's
    token, then -1; and the path's nodes from the root, then -1.
    """
    m = parents.shape[1]
    index = torch.arange(m, device=parents.device)
    same_token_sibling = (parents[:, :, None] == parents[:, None, :]) & (
        tokens[:, :, None] == tokens[:, None, :]
    )  # [B, i, j]
    repeated = (same_token_sibling & (index[None, :] < index[:, None])).any(dim=-1)  # [B, M]: an earlier twin
    wanted = target_ids.gather(1, parents.clamp(min=0))  # [B, M]: the target's token after the parent
    passes = _draft_nodes(tokens, parents) & (tokens == wanted) & ~repeated  # one child per node at most
    accepted = _accepted_subtree(passes, tree_ancestors(parents))  # a chain from the root
    path = path_from_mask(accepted)
    last = path.max(dim=1).values  # the deepest node of a chain is its largest index
    return assemble_tree_output(tokens, path, target_ids.gather(1, last[:, None])[:, 0]), path


def _residual(q: Tensor, p: Tensor) -> Tensor:
    """norm(max(0, q - p)) over the last dim, or q itself where that is all zero (as rejection_sample
    falls back to q): the target's distribution after rejecting a token drawn from p."""
    residual = (q - p).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(q.dtype).tiny), q)


def tree_rejection_sample(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    tokens: Tensor,
    parents: Tensor,
    uniforms: Tensor,
    noise: Tensor,
) -> tuple[Tensor, Tensor]:
    """Lossless verification of a token tree (module docstring: SpecInfer's multi-step speculative
    sampling, recursive rejection sampling without replacement, deterministic candidates).

    target_probs: [B, M, V] float, the target's distribution at each node (node i's: the token after
        the path root .. i); padding nodes' rows are never read.
    draft_probs: [B, M, V] float, row i the distribution node i's token was drawn from (given the path
        to its parent and its earlier siblings; row 0 and padding rows unused), or None for
        deterministic drafts (one-hot at each token).
    tokens, parents: [B, M] int64, the tree (module docstring).
    uniforms: [B, M] float in (0, 1], node i's acceptance draw (column 0 unused).
    noise: [B, V] float, Exp(1) samples > 0: the final token is argmax(q / noise), a draw from q.

    Node j, a child of the current node with q the current (residual) distribution, is accepted iff
    ``uniforms[j] * p_j(x_j) <= q(x_j)`` (never when q(x_j) = 0). Returns (emitted, path), each int64
    [B, M] (module docstring). For a chain (parents [-1, 0, .., k - 1]) this is rejection_sample with the
    bonus drawn as argmax(target_probs[:, k] / noise).
    """
    b, m = tokens.shape
    device = target_probs.device
    index = torch.arange(m, device=device)
    rows = torch.arange(b, device=device)
    candidates = _draft_nodes(tokens, parents)  # [B, M]
    x_all = tokens.clamp(min=0)
    node = torch.zeros(b, dtype=torch.int64, device=device)  # the walk's current node
    tried = torch.zeros(b, dtype=torch.int64, device=device)  # the last node tried (children come later)
    depth = torch.zeros(b, dtype=torch.int64, device=device)
    path = torch.where(index == 0, 0, torch.full((b, m), -1, dtype=torch.int64, device=device))
    q = target_probs[:, 0]  # [B, V]
    for _ in range(m - 1):  # every iteration tries a node not tried before (or does nothing)
        is_next = candidates & (parents == node[:, None]) & (index > tried[:, None])  # [B, M]
        has_child = is_next.any(dim=1)  # [B]
        j = torch.where(is_next, index, m - 1).min(dim=1).values  # [B]: the first untried child
        x = x_all.gather(1, j[:, None])  # [B, 1]
        if draft_probs is None:
            p = torch.zeros_like(q).scatter_(1, x, 1.0)  # [B, V]
        else:
            p = draft_probs[rows, j]  # [B, V]
        u = uniforms.gather(1, j[:, None])  # [B, 1]
        accept = has_child & (u * p.gather(1, x) <= q.gather(1, x))[:, 0]
        reject = has_child & ~accept
        q = torch.where(
            accept[:, None], target_probs[rows, j], torch.where(reject[:, None], _residual(q, p), q)
        )
        path = torch.where(accept[:, None] & (index == depth[:, None] + 1), j[:, None], path)
        depth = depth + accept.to(torch.int64)
        node = torch.where(accept, j, node)
        tried = torch.where(has_child, j, tried)
    next_ids = (q / noise).max(dim=-1).indices  # [B]: a draw from q (first maximum on ties)
    return assemble_tree_output(tokens, path, next_ids), path


def tree_typical_accept(
    target_probs: Tensor,
    tokens: Tensor,
    parents: Tensor,
    bonus_ids: Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
) -> tuple[Tensor, Tensor]:
    """Medusa's typical acceptance over a token tree (TypicalAcceptanceSampler; NOT lossless).

    target_probs: [B, M, V] the target's distribution at each node; tokens, parents: [B, M] int64 (module
    docstring); bonus_ids: [B, M] int64, a token sampled from target_probs at each node.

    Node i passes iff ``target_probs[parent(i)](tokens[i]) > typical_threshold(target_probs[parent(i)])``;
    a node is accepted iff it and all its non-root ancestors pass. The walk ends at the deepest accepted
    node n (the lowest index among equally deep ones); then, as the chain rule does, argmax
    target_probs[n] follows when n has children (the first of them was rejected), else bonus_ids[n]
    (the whole path to a leaf was kept). Deterministic given bonus_ids. Returns (emitted, path), each
    int64 [B, M] (module docstring).
    """
    b, m, v = target_probs.shape
    rows = torch.arange(b, device=target_probs.device)
    index = torch.arange(m, device=target_probs.device)
    parent = parents.clamp(min=0)
    draft = _draft_nodes(tokens, parents)
    flat = target_probs.reshape(b, m * v)
    q_x = flat.gather(1, parent * v + tokens.clamp(min=0))  # [B, M]: q_parent(x_i)
    threshold = typical_threshold(target_probs, posterior_threshold, posterior_alpha).gather(1, parent)
    ancestors = tree_ancestors(parents)  # [B, M, M]
    accepted = _accepted_subtree(draft & (q_x > threshold), ancestors)  # [B, M]
    depth = tree_depths(parents, ancestors)
    score = torch.where(accepted, depth * m + (m - 1 - index), -1)  # deepest, then lowest index
    last = score.max(dim=1).indices  # [B]
    path = path_from_mask(ancestors[rows, last])
    has_children = (draft & (parents == last[:, None])).any(dim=1)  # [B]
    recovered = target_probs[rows, last].max(dim=-1).indices  # [B], the first argmax
    next_ids = torch.where(has_children, recovered, bonus_ids[rows, last].to(torch.int64))
    return assemble_tree_output(tokens, path, next_ids), path
