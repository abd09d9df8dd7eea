"""Drafting under a guided row's grammar: proposers see the mask that the target applies.

Draft model (`GrammarWalk`): each guided row's drafts are drawn from the draft's distribution masked by
the row's grammar and renormalised (then the row's temperature, min_p, top-k, top-p). The mask at each
position is what the grammar allows after the drafts before it (`allowed_after`: the row's own matcher,
a `GuideState`, walks them and is rolled back, so the target's verification finds it where it was). The
proposal carries the masked distributions, the ones the drafts were drawn from, as the rejection rule
needs to stay lossless. A draft model's token tree takes its candidates under the same masks
(draft_tree.py).

Deterministic proposals (n-gram, suffix, a draft model's token tree; one-hot distributions) are cut
where the grammar forbids a draft (`cut_to_grammar`, called by the engine): in a chain, the row's drafts
from its first forbidden one on; in a tree, a forbidden node with its subtree. A cut draft could only
have been rejected (the target's mask gives it probability 0): cutting loses nothing, and the target
verifies fewer positions.

Both read each guided row's drafts on the host (a draft model: one read per drafted position), and the
masks are computed there by llguidance; rows without a grammar are left as they are. A draft model's
mask at draft position i walks the i drafts before it again: O(k^2) token steps of the matcher per row,
but one mask a position (a mask costs far more than a step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from speculative.proposers.base import Proposal
from speculative.sampling.processors import apply_allowed


def allowed_after(guides: Sequence, paths: Sequence[Sequence[int]], vocab_size: int) -> Tensor:
    """[B, V] bool (CPU): the tokens each guided row's grammar allows after its committed tokens and then
    the drafts paths[row]; all True for a row without a grammar (guides[row] None), after a draft the
    grammar forbids, and where the grammar allows nothing (an error state: the target fails that row).
    After a draft EOS the grammar allows only EOS, as in the target's masks (GuideState).

    Each guided row's matcher walks its path and is rolled back: the states end where they started.
    The masks of all rows are computed in one llguidance call.
    """
    from speculative.sampling.guided import allowed_for_blocks  # llguidance only where it is used

    allowed = torch.ones(len(guides), vocab_size, dtype=torch.bool)
    walked = [(row, guide) for row, guide in enumerate(guides) if guide is not None]
    try:
        rows = [row for row, guide in walked if guide.advance(paths[row]) == len(paths[row])]
        if rows:
            masks = torch.cat(allowed_for_blocks([guides[r] for r in rows], [[]] * len(rows)))
            allowed[rows] = masks | ~masks.any(dim=-1, keepdim=True)
    finally:
        for _, guide in walked:
            guide.rollback()
    return allowed


class GrammarWalk:
    """Draws a batch's drafts one position at a time under its guided rows' grammars (module docstring).

    guides: per row of the batch, its GuideState, or None for a row without a grammar. vocab_size: the
    logits' width (the guides' masks' width). `choose` wraps the draft's token choice; `masked` gives
    the distributions the drafts were drawn from.
    """

    def __init__(self, guides: Sequence, vocab_size: int) -> None:
        self.guides = list(guides)
        self.vocab_size = vocab_size
        self.drafts: list[list[int]] = [[] for _ in self.guides]  # each row's drafts so far
        self.masks: list[Tensor] = []  # [B, V] bool per drawn position

    def choose(self, next_tokens: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """`next_tokens` (logits [B, V] -> tokens [B] int64) drawing under the grammars: each call masks
        the logits with what each row's grammar allows after its drafts so far (`allowed_after`), draws,
        and reads the drawn tokens to the host."""

        def choose(logits: Tensor) -> Tensor:
            allowed = allowed_after(self.guides, self.drafts, self.vocab_size).to(logits.device)
            self.masks.append(allowed)
            tokens = next_tokens(apply_allowed(logits[:, None], allowed)[:, 0])
            for drafts, token in zip(self.drafts, tokens.tolist()):
                drafts.append(token)
            return tokens

        return choose

    def masked(self, logits: Tensor) -> Tensor:
        """The logits [B, n, V] of the n positions drawn so far with each position's mask applied (-inf
        where the grammar forbids a token): what the drafts were drawn from, before temperature."""
        return apply_allowed(logits, torch.stack(self.masks, dim=1))


def cut_to_grammar(proposal: Proposal, guides: Sequence) -> Proposal:
    """A deterministic proposal (probs None) cut where each guided row's grammar forbids a draft.

    guides: per row, its GuideState or None (left as it is). A chain [B, j] keeps each guided row's
    drafts up to its first forbidden one (-1 after it) and is narrowed to its longest row's drafts; a
    tree keeps its width, and a forbidden node and every node below it become padding nodes (token -1,
    parent -1). One host read of the proposal.
    """
    token_ids, _, parents = proposal
    host = token_ids.tolist()
    rows = [(row, guide) for row, guide in enumerate(guides) if guide is not None]
    if parents is None:
        for row, guide in rows:
            drafts = host[row]
            given = drafts.index(-1) if -1 in drafts else len(drafts)
            valid = guide.valid_prefix(drafts[:given])
            drafts[valid:] = [-1] * (len(drafts) - valid)
        width = max((sum(t >= 0 for t in drafts) for drafts in host), default=0)
        cut = torch.tensor([drafts[:width] for drafts in host], dtype=torch.long).view(len(host), width)
        return Proposal(cut.to(token_ids.device), None)
    tree = parents.tolist()
    for row, guide in rows:
        _prune(host[row], tree[row], guide)
    return Proposal(
        torch.tensor(host, dtype=torch.long, device=token_ids.device),
        None,
        torch.tensor(tree, dtype=torch.long, device=parents.device),
    )


def _prune(tokens: list[int], parents: list[int], guide) -> None:
    """One row's tree (tokens [M - 1], node i's token tokens[i - 1]; parents [M], speculative/tree.py's
    convention), in place: every node whose path the grammar does not allow becomes a padding node.
    Parents precede their children, so a node's path is its parent's and its own token."""
    paths: dict[int, list[int] | None] = {0: []}  # node -> its path's tokens; None once forbidden
    for node in range(1, len(parents)):
        parent = parents[node]
        if parent < 0:
            continue
        above = paths[parent]
        path = None if above is None else above + [tokens[node - 1]]
        if path is not None and guide.valid_prefix(path) < len(path):
            path = None
        paths[node] = path
        if path is None:
            tokens[node - 1], parents[node] = -1, -1
