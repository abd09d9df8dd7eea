"""Prompts of different lengths prefilled together: which rows share a forward.

On a CPU a prefill costs its padded tokens, so rows of similar lengths share a forward, right-padded to
the longest of them, rather than all padded to the batch's longest (the engine's prefill of new
prompts, a draft model's of the rows that joined). Elsewhere one forward of them all is the cheaper.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

# Prefill groups on a CPU, where a prefill's cost is its padded tokens: a row joins the group of the
# longer rows before it when its padding is at most PREFILL_PADDING tokens or 1/8 of the group's width
# (a forward's own overhead is worth about that many tokens), and there are at most MAX_PREFILL_GROUPS.
PREFILL_PADDING = 16
MAX_PREFILL_GROUPS = 8


def prefill_groups(lengths: Seq[int], exact: bool = False) -> list[list[int]]:
    """The rows (indices into `lengths`, the prompts' lengths) of each prefill forward, longest first:
    rows of similar lengths share a forward, right-padded to the longest of them, so that little
    compute goes to padding (module constants). With `exact`, only rows of the same length do, so
    that each row's prefill is bitwise what it would be alone (attention's kernel rounds a row
    differently with the width it is padded to), whatever the number of forwards."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    groups: list[list[int]] = []
    for row in order:
        width = lengths[groups[-1][0]] if groups else 0
        padding = width - lengths[row]
        if exact:
            if groups and padding == 0:
                groups[-1].append(row)
            else:
                groups.append([row])
        elif groups and (padding <= max(PREFILL_PADDING, width // 8) or len(groups) == MAX_PREFILL_GROUPS):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups
