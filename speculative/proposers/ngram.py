"""N-gram prompt lookup (Saxena 2023; HF `prompt_lookup_num_tokens`, vLLM's ngram method).

No model: the last n tokens of the context are looked up earlier in the same context, longest n
first (prompt_lookup_max down to prompt_lookup_min), the most recent match winning, and the tokens
that followed the match are proposed. The proposer is deterministic, so its draft distribution is
one-hot and the rejection rule accepts a token x with probability q(x). On CPU a proposal is only as
wide as its longest row's (none at all when no row has a match), so that no position is verified for
nothing (see Engine._propose); on an accelerator it keeps all k columns, since reading the width
back would add a host sync to the step.

As a tree (`tree_nodes`): every match of the longest n that has one (the most recent first, at
most `MAX_MATCHES`) proposes its continuation, and the continuations are merged into a trie of at
most `tree_nodes` drafts, so that repeated prefixes are verified once and diverging continuations
side by side. The trie is built on the host (one more host sync per step on an accelerator). A
greedy batch gets a tree as wide as its largest row's; a sampled batch always `tree_nodes`, so a
seeded row's random draws do not depend on its neighbours. Tries shrink with a greedy batch as the
other proposers' trees do (tree.py's `batch_tree`, its breadth bounded by its nodes alone): a batch
of B rows merges at most `tree_nodes // B` nodes a row, and proposes the chain where that leaves no
more than the chain holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.proposers.base import Proposal
from speculative.sampling import SampleStrategy
from speculative.tree import batch_tree

MAX_MATCHES = 8  # matches a tree merges at most, the most recent first


class NgramProposer:
    """Prompt-lookup proposer over the context tokens, vectorized over rows; a chain of the most
    recent match's continuation, or (tree_nodes given) a trie of every match's."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, tree_nodes: int | None = None) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.tree_nodes = tree_nodes

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        pass

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        matches, n = self._matches(tokens, lengths)  # [batch, starts] bool, [batch] n of each row
        if self.tree_nodes is not None:
            width, nodes = batch_tree(self.tree_nodes, self.tree_nodes, strategy.tree_rows, num_tokens)
            if width > 1:
                return self._trie(tokens, lengths, matches, n, num_tokens, strategy, nodes)
            num_tokens = min(num_tokens, nodes)  # the greedy batch's trees shrank to chains
        last = (
            torch.where(matches, torch.arange(matches.shape[1], device=tokens.device), -1).max(dim=1).values
        )
        found = torch.where(last >= 0, last + n, -1)  # [batch] continuation start, -1 if none
        token_ids, usable = self._continuations(tokens, lengths, found[:, None], num_tokens)
        token_ids = token_ids[:, 0]
        if tokens.device.type != "cpu":  # reading the width would be a second host sync in the step
            return Proposal(token_ids, None)
        width = int(usable[:, 0].sum(dim=1).max())  # the longest row's proposal: no wider verification
        return Proposal(token_ids[:, :width], None)

    def _matches(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Where each row's suffix occurs earlier: [batch, starts] bool over window starts, for the
        longest n in [min_n, max_n] with a match (all False if none), and that n [batch]."""
        batch, capacity = tokens.shape
        device = tokens.device
        starts = capacity - self.min_n + 1
        best = torch.zeros(batch, max(starts, 1), dtype=torch.bool, device=device)
        best_n = torch.zeros(batch, dtype=torch.long, device=device)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= capacity:
                continue
            offsets = torch.arange(n, device=device)
            suffix = tokens.gather(1, (lengths[:, None] - n + offsets).clamp(min=0))  # [batch, n]
            windows = tokens.unfold(1, n, 1)  # [batch, capacity - n + 1, n]
            index = torch.arange(windows.shape[1], device=device)
            # A match must end before the suffix itself and leave at least one token after it.
            match = (windows == suffix[:, None, :]).all(dim=-1) & (index <= (lengths - n - 1)[:, None])
            match &= (lengths >= n + 1)[:, None]
            first = (best_n == 0) & match.any(dim=1)  # rows whose longest match is this n
            best[:, : match.shape[1]] |= match & first[:, None]
            best_n = torch.where(first, n, best_n)
        return best, best_n

    @staticmethod
    def _continuations(
        tokens: Tensor, lengths: Tensor, found: Tensor, num_tokens: int
    ) -> tuple[Tensor, Tensor]:
        """The tokens after each match: found [batch, m] continuation starts (-1: none) -> token ids
        [batch, m, num_tokens] (-1 past the context's end or with no match) and where usable."""
        capacity = tokens.shape[1]
        positions = found[:, :, None] + torch.arange(num_tokens, device=tokens.device)  # [batch, m, k]
        usable = (found[:, :, None] >= 0) & (positions < lengths[:, None, None])  # a prefix of each
        values = tokens.gather(1, positions.clamp(0, capacity - 1).flatten(1)).view(positions.shape)
        return torch.where(usable, values, -1), usable

    def _trie(
        self,
        tokens: Tensor,
        lengths: Tensor,
        matches: Tensor,
        n: Tensor,
        num_tokens: int,
        strategy: SampleStrategy,
        nodes: int,
    ) -> Proposal:
        """Every match's continuation merged into a trie of at most `nodes` per row (module docstring)."""
        index = torch.arange(matches.shape[1], device=tokens.device)
        recent = (
            torch.where(matches, index, -1).topk(min(MAX_MATCHES, matches.shape[1]), dim=1).values
        )  # [B, m]
        found = torch.where(recent >= 0, recent + n[:, None], -1)
        continuations = self._continuations(tokens, lengths, found, num_tokens)[0].tolist()  # the sync
        rows = [_merge(row, nodes) for row in continuations]  # [(tokens, parents)] per row
        width = nodes if not strategy.all_greedy else max(len(t) for t, _ in rows)
        token_ids = torch.tensor([t + [-1] * (width - len(t)) for t, _ in rows], dtype=torch.long)
        parents = torch.tensor([[-1, *p] + [-1] * (width - len(p)) for _, p in rows], dtype=torch.long)
        if width == 0:
            return Proposal(token_ids.to(tokens.device), None)
        return Proposal(token_ids.to(tokens.device), None, parents.to(tokens.device))

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        pass

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        pass

    def select_rows(self, rows: Tensor) -> None:
        pass


def _merge(continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """A trie of token sequences (-1 ends one), in the order given, of at most max_nodes nodes:
    (node tokens, node parents) with node 0 the root (not listed) and nodes numbered from 1."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for sequence in continuations:
        node = 0
        for token in sequence:
            if token < 0:
                break
            child = children.get((node, token))
            if child is None:
                if len(tokens) == max_nodes:
                    break
                tokens.append(token)
                parents.append(node)
                child = children[(node, token)] = len(tokens)
            node = child
    return tokens, parents
