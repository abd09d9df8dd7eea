"""A draft model that proposes a token tree: at each depth it expands its best nodes by their top
candidates, and the target verifies the whole tree in one forward.

Growth (per row, vectorised over rows): the root (the context's last token) is fed with the tokens
the cache lacks; then, for depth 1..k, every node of the frontier gets its `width` likeliest tokens
as candidate children, and the `width` best candidates become the next frontier, fed to the draft
in one `forward_tree` call (all but at the last depth). Of all candidates, the `num_nodes` best form
the proposal. What "best" means is the tree's shape:
  - "dynamic" (EAGLE-2, Li et al. 2024, arXiv:2406.16858): a node's score is its path's draft
    log-probability; the frontier and the final tree follow the draft's confidence, so the tree is
    deep where the draft is sure and bushy where it is not;
  - "static": a node's score is minus the sum of its path's candidate ranks (0 for the likeliest
    child); the topology is fixed (the draft's top path, then its runners-up branching off it, as
    Medusa's and EAGLE-1's hand-made trees do), only the tokens change.
Ties go to the shallower node, so a node is never kept without its parent. The drafts are the
draft's top candidates, chosen deterministically from the context: the proposal carries no
distributions (one-hot), and the rule's sibling-by-sibling rejection keeps the output exact. A guided
row's candidates are the top ones among the tokens its grammar allows after the node's path
(grammar.py's `allowed_after`); where fewer are allowed than the tree is wide, the forbidden ones
are cut from the proposal by the engine.

Compiled (the drafter a CompiledCausalLM, no guided row), a proposal is one call: the query, then
every level, the candidates chosen and the masks built in the graph (compiled_tree).

Trees shrink with a greedy batch (tree.py's `batch_tree`: width // B and num_nodes // B for B rows).
At width 1 the tree is the draft's top path, which the proposer hands over as a chain (no guided
row): the engine verifies it as one, without tree masks or a path to move in the cache.

Cache: a proposal first feeds each row the context tokens its draft cache lacks (the row's own
number, right-padded to the most any row can lack: `missing` + `behind`), the root last; the tree's
expanded nodes follow the root in the cache, in the order they were fed. After the step the cache
is rolled back to the context before the step (all that was fed as a chain), so the next proposal
feeds what the step added; plain steps (no proposal) add one token each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from speculative.kv_cache import StaticKVCache
from speculative.models.base import CompiledDrafting, LanguageModel, decode_steps
from speculative.models.llama import NativeCausalLM
from speculative.proposers.base import Proposal
from speculative.proposers.draft_model import DraftModelProposer
from speculative.proposers.grammar import allowed_after
from speculative.sampling import SampleStrategy
from speculative.sampling.processors import apply_allowed
from speculative.tree import batch_tree, tree_ancestors, tree_query

TreeShape = Literal["static", "dynamic"]
# The log-probability score of a candidate its grammar forbids (-inf): below every allowed one, yet
# finite, so that a parent still scores higher than its children.
FORBIDDEN = -1e9


class DraftTreeProposer(DraftModelProposer):
    """Proposes a tree of `num_nodes` drafts, at most `num_tokens` deep, from a draft model whose
    forward takes trees (`forward_tree`: the native forward, compiled or not).

    shape: "dynamic" or "static" (module docstring); width: candidates per expanded node and nodes
    expanded per depth (>= 1); num_nodes: drafts per tree (>= 1)."""

    def __init__(self, model: LanguageModel, shape: TreeShape, width: int, num_nodes: int) -> None:
        super().__init__(model)
        self.compiled_drafting = isinstance(model, CompiledDrafting)  # a whole tree in one compiled call
        self.shape, self.width, self.num_nodes = shape, width, num_nodes

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        need = lengths - self.cache.lengths  # [B] >= 1: what each row's draft cache lacks
        fed = self.missing + self.behind  # the most any row can lack (a host bound: no sync)
        index = (lengths - need)[:, None] + torch.arange(fed, device=tokens.device)  # [B, fed], right-padded
        query = tokens.gather(1, index)
        self.behind, self._proposed, self._roots = 0, num_tokens, lengths.clone()
        width, num_nodes = batch_tree(self.width, self.num_nodes, strategy.tree_rows, num_tokens)
        if width == 1 and not strategy.any_guided:
            return self._chain(query, need, min(num_tokens, num_nodes))
        tree = self.shape, width, num_nodes
        if self.compiled_drafting and not strategy.any_guided:  # one compiled call
            token_ids, parents = compiled_tree(self.model, query, self.cache, need, num_tokens, *tree)
            return Proposal(token_ids, None, parents)
        logits = self.model.forward(query, self.cache, num_tokens=need, logits_indices=(need - 1)[:, None])
        root = tokens.gather(1, lengths[:, None] - 1)  # [B, 1]

        def expand(nodes: Tensor, cached: Tensor) -> Tensor:
            return self.model.forward_tree(nodes, self.cache, cached)

        return grow_tree(logits, root, expand, num_tokens, *tree, row_guides(strategy))

    def _chain(self, query: Tensor, need: Tensor, num_tokens: int) -> Proposal:
        """The draft's top path, `num_tokens` deep, as a chain: the query (query [B, fed], `need` [B]
        real tokens a row), then the drafts but the last, fed one at a time (the cache rolls back to
        the roots after the step all the same)."""
        first = (need - 1)[:, None]

        def step(ids: Tensor, i: int) -> Tensor:
            if i == 0:
                return self.model.forward(ids, self.cache, num_tokens=need, logits_indices=first)
            return self.model.forward(ids, self.cache)

        token_ids, _ = decode_steps(step, num_tokens, query)
        return Proposal(token_ids, None)

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        cache, _ = self._prefill(tokens, lengths)  # each row lacks its last token, as `need` allows
        if self.cache is None or self.cache.batch_size == 0:
            self.cache, self.behind, self.missing = cache, 0, 1
        else:
            self.cache.append_rows(cache)

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        if self._proposed:  # back to the context before the step, which was fed as a chain
            self.missing, self._bound = most_kept, max_length  # max_length: a bound of the roots' lengths
            self.cache.rollback(self._roots, max_length)
        else:  # a plain step: every row gained one token that the cache has not seen
            self.behind += 1
            self._tighten(max_length)
        self._proposed = 0


def grow_tree(
    logits: Tensor,
    root: Tensor,
    expand: Callable[[Tensor, Tensor], Tensor],
    num_tokens: int,
    shape: TreeShape,
    width: int,
    num_nodes: int,
    guides: list | None = None,
) -> Proposal:
    """The module docstring's growth, for any drafter: `logits` [B, 1, V] the draft's after the root
    (the context's last token, root [B, 1]); `expand(nodes [B, f], cached [B, C])` feeds the frontier's
    tokens as a tree whose nodes in feeding order (the root first) have parents `cached` (the new
    nodes last, so their parents' feeding-order indices are cached[:, -f:]) and returns their logits
    [B, f, V]. guides: each row's grammar state or None (SampleStrategy.guides), or None where no row
    has one; a guided row takes its candidates among what its grammar allows. Returns the proposal:
    a tree of `num_nodes` drafts, at most `num_tokens` deep (`width` nodes fed at each depth but the
    last); tensor operations of static shapes only, unless guided (what tree_run compiles)."""
    batch, device = root.shape[0], root.device
    # the pool of candidates, index 0 the root: token, pool parent, score, depth
    pool_tokens, pool_parents = root, torch.full_like(root, -1)
    pool_scores = torch.zeros(batch, 1, dtype=torch.float64, device=device)
    pool_depths = [0]
    frontier = torch.zeros_like(root)  # [B, f] pool indices of the nodes to expand
    cached = torch.full_like(root, -1)  # [B, C] the fed tree's parents (cache order), root first
    cache_index = torch.zeros_like(root)  # [B, P] each pool node's index in the fed tree, -1 if none
    for depth in range(1, num_tokens + 1):
        f = frontier.shape[1]
        if guides is not None:
            allowed = _allowed_at(guides, pool_tokens, pool_parents, frontier, logits.shape[-1])
            logits = apply_allowed(logits, allowed.to(device))
        top = logits.float().log_softmax(dim=-1).topk(width, dim=-1)  # [B, f, w]
        if shape == "dynamic":
            gain = top.values.double().clamp(min=FORBIDDEN)
        else:
            gain = -torch.arange(width, device=device, dtype=torch.float64).expand(batch, f, -1)
        scores = (pool_scores.gather(1, frontier)[:, :, None] + gain).flatten(1)  # [B, f * w]
        base = pool_tokens.shape[1]
        pool_tokens = torch.cat([pool_tokens, top.indices.flatten(1)], dim=1)
        pool_parents = torch.cat([pool_parents, frontier.repeat_interleave(width, dim=1)], dim=1)
        pool_scores = torch.cat([pool_scores, scores], dim=1)
        pool_depths += [depth] * scores.shape[1]
        cache_index = torch.cat([cache_index, torch.full_like(scores, -1, dtype=torch.long)], dim=1)
        if depth == num_tokens:
            break
        frontier = base + scores.topk(min(width, scores.shape[1]), dim=1).indices  # [B, f']
        fed_index = cached.shape[1] + torch.arange(frontier.shape[1], device=device).expand_as(frontier)
        cache_index.scatter_(1, frontier, fed_index)
        cached = torch.cat([cached, cache_index.gather(1, pool_parents.gather(1, frontier))], dim=1)
        logits = expand(pool_tokens.gather(1, frontier), cached)
    return select_tree(pool_tokens, pool_parents, pool_scores, pool_depths, num_nodes)


def compiled_tree(
    compiled: CompiledDrafting,
    query: Tensor,
    cache: StaticKVCache,
    need: Tensor,
    num_tokens: int,
    shape: TreeShape,
    width: int,
    num_nodes: int,
    features: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A tree proposal (no guided rows) in one compiled call of `compiled` (its draft_with, over
    tree_run): the query [B, q] with `need` [B] real tokens a row (and an EAGLE head's `features`
    [B, q, F]) fed first, then the tree grown from each row's last. Returns token_ids [B, n] and
    parents [B, 1 + n]."""
    tree = (num_tokens, shape, width, num_nodes)
    grow = tree_run(compiled.model, *tree)
    return compiled.draft_with(tree, grow, query, cache, need, width * (num_tokens - 1), features)


def tree_run(
    model: NativeCausalLM, num_tokens: int, shape: TreeShape, width: int, num_nodes: int
) -> Callable[..., tuple[Tensor, Tensor]]:
    """grow_tree over `model` as one function of tensors, what CompiledCausalLM.draft_with compiles:
    `grow(input_ids [B, q], positions [B, q], last [B, 1], keys, values, key_positions, features)`
    feeds the query (NativeCausalLM.run's arguments; with `features` [B, q, F], `model` is an EagleHead
    and they are its features there), the root each row's query token at `last`, then grows the
    tree from it, each level a tree forward of the nodes fed so far (the root at its query slot; an
    EAGLE head's nodes read the head's hidden states at their parents). Returns the proposal's
    token_ids [B, n] and parents [B, 1 + n]. No guided rows."""
    windows = model.attention_windows

    def grow(
        input_ids: Tensor,
        positions: Tensor,
        last: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        key_positions: Tensor,
        features: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        start = positions.gather(1, last)  # [B, 1]: the root's cache slot (a query token's position)
        if features is None:
            logits = model.run(input_ids, positions, keys, values, key_positions, last)
        else:
            logits, hidden = model.run_head(input_ids, features, positions, keys, values, key_positions, last)
            states = [hidden]  # the head's hidden states at the nodes fed, in feeding order

        def expand(nodes: Tensor, cached: Tensor) -> Tensor:
            ancestors = tree_ancestors(cached)
            depths = ancestors.sum(-1) - 1
            at, slots, masks = tree_query(ancestors, depths, nodes.shape[1], start, key_positions, windows)
            if features is None:
                return model.run(nodes, at, keys, values, key_positions, None, slots, masks)
            fed = torch.cat(states, dim=1)  # [B, C - f, H]
            parents = cached[:, -nodes.shape[1] :, None].expand(-1, -1, fed.shape[2])
            out, hidden = model.run_head(
                nodes, fed.gather(1, parents), at, keys, values, key_positions, None, slots, masks
            )
            states.append(hidden)
            return out

        root = input_ids.gather(1, last)
        proposal = grow_tree(logits, root, expand, num_tokens, shape, width, num_nodes)
        return proposal.token_ids, proposal.parents

    return grow


def select_tree(
    tokens: Tensor, parents: Tensor, scores: Tensor, depths: list[int], num_nodes: int
) -> Proposal:
    """The best `num_nodes` candidates of the pool ([B, P], index 0 the root), as a tree in pool
    order (parents come first there): Proposal(tokens [B, n], None, parents [B, 1 + n])."""
    n = min(num_nodes, tokens.shape[1] - 1)
    depth = torch.tensor(depths[1:], dtype=torch.float64, device=tokens.device)
    key = scores[:, 1:] - 1e-9 * depth  # a parent scores at least as high as its child: ties to it
    chosen = 1 + key.topk(n, dim=1).indices.sort(dim=1).values  # [B, n] pool indices, in pool order
    node = torch.full_like(tokens, -1)  # pool index -> tree node
    node[:, 0] = 0
    node.scatter_(1, chosen, 1 + torch.arange(n, device=tokens.device).expand_as(chosen))
    tree_parents = node.gather(1, parents.gather(1, chosen))  # [B, n]
    root = torch.full_like(tree_parents[:, :1], -1)
    return Proposal(tokens.gather(1, chosen), None, torch.cat([root, tree_parents], dim=1))


def row_guides(strategy: SampleStrategy) -> list | None:
    """grow_tree's `guides`: the strategy's, where a row is guided."""
    return strategy.guides if strategy.any_guided else None


def _allowed_at(guides: list, tokens: Tensor, parents: Tensor, frontier: Tensor, vocab_size: int) -> Tensor:
    """[B, f, V] bool: what each guided row's grammar allows after each frontier node's path (all True
    for rows without a grammar). tokens / parents: [B, P] the pool's (index 0 the root); frontier: [B, f]
    pool indices. One host read of the pool, one `allowed_after` per frontier column."""
    tokens, parents = tokens.tolist(), parents.tolist()

    def path(row: int, node: int) -> list[int]:  # the node's drafts from depth 1 (none: no grammar)
        drafts = []
        while node > 0 and guides[row] is not None:
            drafts.append(tokens[row][node])
            node = parents[row][node]
        return drafts[::-1]

    columns = zip(*frontier.tolist())  # f tuples of B pool indices
    return torch.stack(
        [allowed_after(guides, [path(row, node) for row, node in enumerate(c)], vocab_size) for c in columns],
        dim=1,
    )
