"""An EAGLE head proposing token trees (EAGLE-2's dynamic trees, or static ones), grown as
draft_tree.py grows a draft model's, and shrinking with the batch as those do (tree.py's `batch_tree`;
a chain, the chain proposer's, at width 1): each expanded node is fed to the head with its token and, as
its feature, the head's hidden state at its parent. The head's cache and features are kept as for
chains (proposers/eagle.py): the engine hands over the target's features along the accepted path."""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.models.compiled import CompiledCausalLM
from speculative.models.eagle import EagleHead
from speculative.proposers.base import Proposal
from speculative.proposers.draft_tree import TreeShape, compiled_tree, grow_tree, row_guides
from speculative.proposers.eagle import EagleProposer
from speculative.sampling import SampleStrategy
from speculative.tree import batch_tree


class EagleTreeProposer(EagleProposer):
    """Proposes a tree of `num_nodes` drafts, at most `num_tokens` deep, from an EAGLE head: the
    head's top candidates (deterministic, one-hot). shape, width, num_nodes: as DraftTreeProposer's;
    compiled: as EagleProposer's, a tree without guided rows then grown in one compiled call
    (draft_tree.py's compiled_tree)."""

    def __init__(
        self,
        head: EagleHead,
        shape: TreeShape,
        width: int,
        num_nodes: int,
        compiled: CompiledCausalLM | None = None,
    ) -> None:
        super().__init__(head, compiled)
        self.shape, self.width, self.num_nodes = shape, width, num_nodes

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        width, num_nodes = batch_tree(self.width, self.num_nodes, strategy.tree_rows, num_tokens)
        if width == 1:  # the batch's trees shrank to chains: the chain proposer's, verified as a chain
            return super().propose(tokens, lengths, min(num_tokens, num_nodes), strategy)
        self._proposed = num_tokens
        tree = self.shape, width, num_nodes
        if self.compiled is not None and not strategy.any_guided:  # one compiled call
            query, features, need = self._unfed(tokens, lengths)
            token_ids, parents = compiled_tree(
                self.compiled, query, self.cache, need, num_tokens, *tree, features
            )
            return Proposal(token_ids, None, parents)
        logits, hidden = self._feed_features(tokens, lengths)
        fed = [hidden]  # the head's hidden states at the nodes fed, in feeding order (the root first)

        def expand(nodes: Tensor, cached: Tensor) -> Tensor:
            hidden = torch.cat(fed, dim=1)  # [B, C - q, H]
            parents = cached[:, -nodes.shape[1] :, None].expand(-1, -1, hidden.shape[2])
            out, hidden = self.head.forward_tree(nodes, hidden.gather(1, parents), self.cache, cached)
            fed.append(hidden)
            return out

        root = tokens.gather(1, lengths[:, None] - 1)
        return grow_tree(logits, root, expand, num_tokens, *tree, row_guides(strategy))
