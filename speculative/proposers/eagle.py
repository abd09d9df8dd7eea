"""An EAGLE head as proposer: a chain of k drafts from the target's hidden states (models/eagle.py).

The head drafts from features the target computes anyway: the engine runs the target's forward with
`hidden_layers=proposer.hidden_layers` and hands the proposer that forward's features (`observe`)
before committing the step. Head position p (token x_{p+1}, feature of position p) can be fed once
the target's feature of p is known, that is for p <= n - 2 in a context of n tokens.

State between steps: the head's cache holds its positions [0, c_b) of row b, each computed from the
target's own features, and `features` [B, W, F] holds the target's features of positions c_b + j,
j < n_b - 1 - c_b, not fed yet (right-padded). A proposal feeds those (at least one per row: the
target's feature of the context's second-to-last token is always new), drafts its first token from
the last, then k - 1 tokens more, each from the head's own hidden state. After the step the cache
is rolled back to the positions fed from the target's features (drafted positions were fed the head's
guesses), and the verification forward's features [B, k + 1, F], of positions n_b - 1 .. n_b + k - 1,
become `features`: the kept ones are exactly those the next proposal needs. A plain step (no
proposal) adds its one feature behind the others.

New rows get their features from the engine's prefill of their prompts (or, resumed, its forward
over their contexts but the last token), handed over (`observe`) before `add_rows`, which feeds the
head every position of theirs but the root at once: in `features` they then stand as the rows a step
left behind, one feature each, however long their prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from speculative.kv_cache import KVCache
from speculative.models.base import decode_steps
from speculative.models.compiled import CompiledCausalLM
from speculative.models.eagle import EagleHead
from speculative.models.prefill import prefill_groups
from speculative.proposers.base import Proposal
from speculative.sampling import SampleStrategy


class EagleProposer:
    """Proposes a chain of k tokens sampled from an EAGLE head with each row's own sampling parameters
    (module docstring). hidden_layers: what the target's forward must return for `observe`.

    compiled: the head wrapped in a CompiledCausalLM (or None): a greedy batch without grammars then
    feeds the target's features and drafts its k tokens in one compiled call (head_greedy_decode),
    and the head's cache is the wrapper's."""

    def __init__(self, head: EagleHead, compiled: CompiledCausalLM | None = None) -> None:
        self.head, self.compiled = head, compiled
        self.hidden_layers = head.target_layers
        self.cache = None
        self.features: Tensor | None = None  # [B, W, F], module docstring
        self._observed: Tensor | None = None  # [B, q, F], the step's target features
        self._roots: Tensor | None = None  # [B] the cache lengths of a proposal's target-fed positions
        self._proposed = 0

    def observe(self, features: Tensor) -> None:
        """The features [B, q, F] of the target's forward: a step's (its q query tokens: the context's
        last token, then the drafts, or a tree's accepted path), before the step is committed; or, before
        `add_rows`, the new rows' prefill's (their contexts but the last token, right-padded)."""
        self._observed = features

    def add_rows(self, tokens: Tensor, lengths: Tensor) -> None:
        features, self._observed = self._observed, None
        cache, features = self._feed_new_rows(tokens, lengths, features)
        if self.cache is None or self.cache.batch_size == 0:
            self.cache, self.features = cache, features
        else:
            self.cache.append_rows(cache)
            width = max(self.features.shape[1], features.shape[1])
            self.features = torch.cat([_pad(self.features, width), _pad(features, width)])

    def _feed_new_rows(self, tokens: Tensor, lengths: Tensor, features: Tensor) -> tuple[KVCache, Tensor]:
        """A cache for new rows (tokens [B, L], lengths [B], their prefill's features [B, W, F]) fed every
        position but the root (the context's second-to-last token), and the roots' features [B, 1, F].
        Fed here rather than by the next proposal, the new rows do not widen the batch's `features`:
        a long prompt that joins running rows is not fed padded beside them, each of them padded to
        its length. On a CPU, rows of different lengths go in forwards of similar lengths
        (`prefill_groups`)."""
        model = self.compiled or self.head
        fed = lengths - 2  # [B] positions 0 .. n - 3, those before the root
        widths = fed.tolist()
        groups = prefill_groups(widths) if tokens.device.type == "cpu" else [list(range(len(widths)))]
        cache = None
        for group in groups:  # the cache's rows: the groups' rows one after the other
            part = model.new_cache(len(group), tokens.shape[1])
            width = max(widths[i] for i in group)
            if width:
                index = torch.tensor(group, device=tokens.device)
                first = torch.zeros(len(group), 1, dtype=torch.long, device=tokens.device)
                self.head.forward(
                    tokens[index, 1 : width + 1], features[index, :width], part, fed[index], first
                )
            if cache is None:
                cache = part
            else:
                cache.append_rows(part)
        order = torch.tensor([row for group in groups for row in group], device=tokens.device)
        cache.select_rows(torch.argsort(order))  # back in the rows' order
        return cache, features.gather(1, fed[:, None, None].expand(-1, 1, features.shape[2]))

    def propose(self, tokens: Tensor, lengths: Tensor, num_tokens: int, strategy: SampleStrategy) -> Proposal:
        self._proposed = num_tokens
        if self.compiled is not None and strategy.all_greedy and not strategy.any_guided:
            query, features, need = self._unfed(tokens, lengths)
            token_ids, _ = self.compiled.head_greedy_decode(query, features, self.cache, num_tokens, need)
            return Proposal(token_ids, None)
        logits, hidden = self._feed_features(tokens, lengths)
        last = [hidden]  # the head's hidden state at the position fed last

        def step(ids: Tensor, i: int) -> Tensor:
            if i == 0:  # the root's logits, computed above (ids, the query, are not read)
                return logits
            out, hidden = self.head.forward(ids, last.pop(), self.cache)
            last.append(hidden)
            return out

        token_ids, all_logits = decode_steps(step, num_tokens, tokens[:, :1], strategy.next_tokens)
        return Proposal(token_ids, strategy.draft_probs(all_logits))

    def _unfed(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The positions whose target features the head lacks (at least one per row, the last at the
        context's second-to-last token: the root): their tokens [B, W] (x_{p+1} at position p), features
        [B, W, F] and number per row [B] (right padding after); they leave `features`."""
        need = lengths - 1 - self.cache.lengths  # [B] >= 1
        index = (self.cache.lengths + 1)[:, None] + torch.arange(self.features.shape[1], device=tokens.device)
        query = tokens.gather(1, index.clamp(max=tokens.shape[1] - 1))
        features, self._roots, self.features = self.features, lengths - 1, None
        return query, features, need

    def _feed_features(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Feed the head the positions `_unfed` names. Returns the root's logits [B, 1, V] and hidden
        state [B, 1, H]."""
        query, features, need = self._unfed(tokens, lengths)
        return self.head.forward(
            query, features, self.cache, num_tokens=need, logits_indices=(need - 1)[:, None]
        )

    def on_commit(self, lengths: Tensor, max_length: int, most_kept: int) -> None:
        observed, self._observed = self._observed, None
        if self._proposed:
            self.cache.rollback(self._roots, max_length)  # max_length: a bound of the roots
            self.features = observed
        else:  # a plain step: its one feature, of position n_b - 2 (n_b the new length), goes behind
            offset = lengths - 2 - self.cache.lengths  # [B]
            features = F.pad(self.features, (0, 0, 0, 1))
            index = offset[:, None, None].expand(-1, 1, features.shape[2])
            self.features = features.scatter(1, index, observed)
        self._proposed = 0

    def on_finish(self, tokens: Tensor, lengths: Tensor, rows: Tensor) -> None:
        pass

    def select_rows(self, rows: Tensor) -> None:
        if not rows.numel():  # the batch emptied: the cache's buffers go with it, as the target's do,
            self.cache = self.features = None  # and a step it ended is never committed
            self._proposed = 0
        if self.cache is not None:
            self.cache.select_rows(rows)
        for name in ("features", "_observed", "_roots"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[rows])


def _pad(features: Tensor, width: int) -> Tensor:
    """[B, w, F] -> [B, width, F], zero padded on the right."""
    return F.pad(features, (0, 0, 0, width - features.shape[1]))
