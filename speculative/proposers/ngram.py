"""N-gram prompt lookup (Saxena 2023; HF `prompt_lookup_num_tokens`, vLLM's ngram method).

No model: the last n tokens of the context are looked up earlier in the same context, longest n
first (prompt_lookup_max down to prompt_lookup_min), the most recent match winning, and the tokens
that followed the match are proposed. The proposer is deterministic, so its draft distribution is
one-hot and the rejection rule accepts a token x with probability q(x). On CPU a proposal is only as
wide as its longest row's (none at all when no row has a match), so that no position is verified for
nothing (see Engine._speculate); on an accelerator it keeps all k columns, since reading the width
back would add a host sync to the step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculative.proposers.base import Proposal
from speculative.sampling import SampleStrategy


class NgramProposer:
    """Prompt-lookup proposer over the context tokens, vectorized over rows."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        pass

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        batch, capacity = tokens.shape
        device = tokens.device
        found = torch.full((batch,), -1, dtype=torch.long, device=device)  # [batch] continuation start
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= capacity:
                continue
            offsets = torch.arange(n, device=device)
            suffix = tokens.gather(1, (lengths[:, None] - n + offsets).clamp(min=0))  # [batch, n]
            windows = tokens.unfold(1, n, 1)  # [batch, capacity - n + 1, n]
            starts = torch.arange(windows.shape[1], device=device)
            # A match must end before the suffix itself and leave at least one token after it.
            match = (windows == suffix[:, None, :]).all(dim=-1) & (starts <= (lengths - n - 1)[:, None])
            match &= (lengths >= n + 1)[:, None]
            last = torch.where(match, starts, -1).max(dim=1).values  # [batch], -1 if none
            found = torch.where((found < 0) & (last >= 0), last + n, found)
        positions = found[:, None] + torch.arange(num_tokens, device=device)  # [batch, k]
        usable = (found[:, None] >= 0) & (positions < lengths[:, None])  # a prefix of each row
        token_ids = torch.where(usable, tokens.gather(1, positions.clamp(0, capacity - 1)), -1)
        if device.type != "cpu":  # reading the width would be a second host sync in the step
            return Proposal(token_ids, None)
        width = int(usable.sum(dim=1).max())  # the longest row's proposal: no wider verification
        return Proposal(token_ids[:, :width], None)

    def on_commit(self, lengths: Tensor, max_length: int, whole_block_kept: bool = True) -> None:
        pass

    def catch_up(self, tokens: Tensor, lengths: Tensor) -> None:
        pass

    def select_rows(self, rows: Tensor) -> None:
        pass
