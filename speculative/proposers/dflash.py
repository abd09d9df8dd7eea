"""A DFlash block drafter as proposer: a chain of k drafts from one forward (models/dflash.py).

The drafter reads the target's hidden states, which the engine hands over (`observe`): the engine runs
the target's forward with `hidden_layers=proposer.hidden_layers` and passes the proposer that forward's
features before the step is committed, and the prefill's (or a resumed row's rebuild's) before
`add_rows`.

State between steps: the drafter's cache holds, for row b with a context of n_b tokens, the context
K/V of positions [0, n_b - 1), every one computed from the target's own features of committed tokens
(the last token's features come with the next verification). `add_rows` fills it from the prefill's
features (positions 0 .. n_b - 2). A proposal drafts one block per row over it: the context's last
token and block_size - 1 masks at positions n_b - 1 .., whose first k outputs are the chain (the
block's K/V are written past the row's length and never counted). After the step, `on_commit` feeds
the verification's features [B, q, F] (positions n_b - 1 .. n_b - 1 + q - 1 of the context before the
step) for the positions the step kept: new length - 1 - cached, the rest (rejected drafts' positions)
written past the length and so rolled back, as the target's own cache is; a plain step's one feature
the same way. So after every commit the cache holds exactly positions [0, new length - 1).

Greedy rows propose each block position's argmax. Sampled rows draw each position from its
distribution processed with the row's SamplingParams (temperature, min_p, top-k, top-p) and the
proposal carries those distributions: a block's positions are drawn independently given the context,
which is a draft distribution like any other for the rejection rule (draft i's distribution does not
depend on drafts before it), so the output stays exact as long as `probs` are the distributions the
drafts were drawn from, which they are.

Trees (`shape` "dynamic" or "static"): the same block, grown as draft_tree.py grows a draft model's
tree (`grow_tree`), where every node at depth d has the same candidates, position d's top tokens,
since the block drafts each position given the context alone; a node's score is its path's
log-probability ("dynamic") or minus its candidates' ranks ("static"). So one forward drafts a whole
tree: the alternatives at a position the chain would bet on one token for. The drafts are the top
candidates, chosen deterministically (one-hot, as every tree here: the rule's sibling-by-sibling
rejection keeps a sampled row exact). Trees shrink with a greedy batch (tree.py's `batch_tree`); at
width 1 the proposal is the chain above. The verification's features come along the accepted path,
so `on_commit` is the chain's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.models.dflash import DFlashDrafter
from speculative.proposers.base import Proposal
from speculative.proposers.draft_tree import TreeShape, grow_tree, row_guides
from speculative.sampling import SampleStrategy
from speculative.tree import batch_tree


class DFlashProposer:
    """Proposes a chain of k <= block_size - 1 tokens, or a tree at most k deep, from one block of a
    DFlash drafter (module docstring). shape: None (chains), "dynamic" or "static"; width and num_nodes:
    as DraftTreeProposer's. hidden_layers: what the target's forward must return for `observe`."""

    def __init__(
        self, drafter: DFlashDrafter, shape: TreeShape | None = None, width: int = 2, num_nodes: int = 8
    ) -> None:
        self.drafter = drafter
        self.shape, self.width, self.num_nodes = shape, width, num_nodes
        self.hidden_layers = drafter.hidden_layers
        self.cache = None  # the drafter's StaticKVCache of context K/V, [0, n_b - 1) per row
        self._observed: Tensor | None = None  # [B, q, F], the features not fed yet

    def observe(self, features: Tensor) -> None:
        """The features [B, q, F] of the target's forward: a step's (its q query tokens: the context's
        last token, then the drafts, or a tree's accepted path), before the step is committed; or, before
        `add_rows`, the new rows' prefill's (their contexts but the last token, right-padded)."""
        self._observed = features

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        features, self._observed = self._observed, None
        if features is None:
            raise RuntimeError("DFlashProposer.add_rows needs the prefill's features first (observe)")
        # room for a block past the longest context the batch can hold
        cache = self.drafter.new_cache(tokens.shape[0], tokens.shape[1] + self.drafter.block_size)
        self.drafter.extend_context(features, cache, num_tokens=lengths - 1)
        if self.cache is None or self.cache.batch_size == 0:
            self.cache = cache
        else:
            self.cache.append_rows(cache)

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        size = self.drafter.block_size
        if num_tokens > size - 1:
            raise ValueError(
                f"a DFlash drafter of block_size {size} drafts at most {size - 1} tokens; "
                f"{num_tokens} were asked for (num_speculative_tokens)"
            )
        last = tokens.gather(1, (lengths - 1)[:, None])[:, 0]  # [B], at position cache.lengths
        logits = self.drafter.draft(last, self.cache, count=num_tokens)  # [B, k, V] float32
        if self.shape is not None:
            width, num_nodes = batch_tree(self.width, self.num_nodes, strategy.tree_rows, num_tokens)
            if width > 1 or strategy.any_guided:
                return self._tree(logits, last, width, num_nodes, strategy)
        if strategy.all_greedy:
            return Proposal(logits.max(dim=-1).indices, None)
        probs = strategy.probs(logits)  # [B, k, V]: what each draft is drawn from
        token_ids = torch.stack([strategy.sample(probs[:, i]) for i in range(num_tokens)], dim=1)
        return Proposal(token_ids, probs)

    def _tree(
        self, logits: Tensor, last: Tensor, width: int, num_nodes: int, strategy: SampleStrategy
    ) -> Proposal:
        """The tree of the block's logits [B, k, V] over the roots `last` [B] (module docstring)."""
        positions = iter(range(1, logits.shape[1]))

        def expand(nodes: Tensor, cached: Tensor) -> Tensor:  # the next depth's candidates, any parent
            i = next(positions)
            return logits[:, i : i + 1].expand(-1, nodes.shape[1], -1)

        tree = self.shape, width, num_nodes
        return grow_tree(logits[:, :1], last[:, None], expand, logits.shape[1], *tree, row_guides(strategy))

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        observed, self._observed = self._observed, None
        if observed is None:
            raise RuntimeError("DFlashProposer.on_commit needs the step's features first (observe)")
        kept = lengths - 1 - self.cache.lengths  # [B] positions whose features are now committed
        self.drafter.extend_context(observed, self.cache, num_tokens=kept)
        self.cache.rollback(lengths - 1, max_length - 1)  # the lengths as they are; the host bound tight

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        pass

    def select_rows(self, rows: Tensor) -> None:
        if not rows.numel():  # the batch emptied: the cache's buffers go with it, as the target's do
            self.cache = self._observed = None
        if self.cache is not None:
            self.cache.select_rows(rows)
        if self._observed is not None:
            self._observed = self._observed[rows]
