"""SampleStrategy: how each row of a batch turns logits into a distribution and a token.

The target's processed distribution of a row is, in this order (vLLM's semantics for each):
  1. allowed tokens (allowed_token_ids, and the guided-decoding grammar's mask),
  2. bad words,
  3. min_tokens (EOS and stop tokens banned while too few tokens exist) and logit_bias,
  4. the user's logits_processors,
  5. penalties (repetition, frequency, presence),
  6. temperature (temperature 0: one-hot at the argmax of the logits after steps 1-5),
  7. min_p, 8. top-k, then top-p,
then sampling by exponential race, `argmax(probs / E)` with E ~ Exp(1) from the row's own generator:
an exact draw from `probs`. Steps 1-5 depend on the context; they get each position's real context
through a `TokenContext`, so the rejection rule compares each draft with exactly the distribution the
target alone would have sampled from there. Draft models sample with steps 6-8 only (`context=None`),
guided rows after their grammar's mask (speculative/proposers/grammar.py): any draft distribution
keeps the output exact, as long as it is the one the draft was drawn from.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor

from speculative.sampling import processors as P
from speculative.sampling.context import TokenContext
from speculative.sampling.random import RowRandom
from speculative.sampling_params import SamplingParams
from speculative.transfer import to_device


class SampleStrategy:
    """Per-row sampling parameters of a batch as tensors, with per-row random generators.

    params: one SamplingParams per row. generators: per-row generators (None: the default one).
    stop_ids: [B, s] each row's EOS and stop tokens, -1 padded (for min_tokens).
    bad_words: per row, the token ids of each bad word (the tokenizer's work, done by the caller).
    guides: per row, a guided-decoding state (speculative.sampling.guided.GuideState) or None.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        default_generator: torch.Generator | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        stop_ids: Tensor | None = None,
        bad_words: Sequence[list[list[int]]] | None = None,
        guides: Sequence | None = None,
    ) -> None:
        self.params = list(params)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        if default_generator is None:
            default_generator = torch.Generator(device=self.device)
            default_generator.seed()
        if generators is None:
            generators = [_generator(p.seed, self.device) for p in self.params]
        self.random = RowRandom(generators, default_generator, self.device)
        batch = len(self.params)
        self.stop_ids = stop_ids if stop_ids is not None else torch.full((batch, 1), -1, device=self.device)
        self.bad_words = list(bad_words) if bad_words is not None else [[] for _ in range(batch)]
        self.guides = list(guides) if guides is not None else [None] * batch
        self._build()

    @classmethod
    def greedy(cls, batch_size: int, vocab_size: int, device: torch.device | str = "cpu") -> SampleStrategy:
        """All rows greedy: argmax decoding."""
        return cls([SamplingParams(temperature=0.0)] * batch_size, vocab_size, device)

    def _build(self) -> None:
        ps, dev, vocab = self.params, self.device, self.vocab_size

        def column(values, dtype=torch.float32) -> Tensor:
            return to_device(values, dtype, dev)

        self.greedy_rows = column([p.greedy for p in ps], torch.bool)  # [B]
        self.temperature = column([1.0 if p.greedy else p.temperature for p in ps])  # [B]
        self.top_k = column([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in ps], torch.long)
        self.top_p = column([p.top_p for p in ps])
        self.min_p = column([p.min_p for p in ps])
        self.all_greedy = all(p.greedy for p in ps)
        self.any_greedy = any(p.greedy for p in ps)
        self._use_top_k = any(p.top_k != -1 and p.top_k < vocab for p in ps)
        self._use_top_p = any(p.top_p < 1.0 for p in ps)
        self._use_min_p = any(p.min_p > 0 for p in ps)
        self._allowed = None
        if any(p.allowed_token_ids for p in ps):
            allowed = torch.ones(len(ps), vocab, dtype=torch.bool)
            for row, p in enumerate(ps):
                if p.allowed_token_ids:
                    allowed[row] = False
                    allowed[row, p.allowed_token_ids] = True
            self._allowed = allowed.to(dev)
        self._bias = None
        if any(p.logit_bias for p in ps):
            bias = torch.zeros(len(ps), vocab)
            for row, p in enumerate(ps):
                for token, value in (p.logit_bias or {}).items():
                    bias[row, token] = value
            self._bias = bias.to(dev)
        words: dict[tuple[int, ...], list[int]] = {}
        for row, row_words in enumerate(self.bad_words):
            for ids in row_words:
                words.setdefault(tuple(ids), []).append(row)
        self._bad_words = [(column(rows, torch.long), list(ids)) for ids, rows in words.items()]
        self.min_tokens = column([p.min_tokens for p in ps], torch.long)
        self._use_min_tokens = any(p.min_tokens > 0 for p in ps)
        self.presence = column([p.presence_penalty for p in ps])
        self.frequency = column([p.frequency_penalty for p in ps])
        self.repetition = column([p.repetition_penalty for p in ps])
        self._use_penalties = any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps
        )
        self._user = [
            (row, [(_arity(f), f) for f in p.logits_processors])
            for row, p in enumerate(ps)
            if p.logits_processors
        ]
        self._guided = [(row, g) for row, g in enumerate(self.guides) if g is not None]
        self.any_guided = bool(self._guided)
        self._failures: dict[int, Exception] = {}
        self.needs_context = bool(
            self._allowed is not None
            or self._bad_words
            or self._use_min_tokens
            or self._bias is not None
            or self._user
            or self._use_penalties
            or self._guided
        )

    @property
    def batch_size(self) -> int:
        return len(self.params)

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (host indices into the batch, repeats allowed), in that order."""
        self.params = [self.params[i] for i in rows]
        self.random.select_rows(rows)
        self.stop_ids = self.stop_ids[to_device(rows, torch.long, self.stop_ids.device)]
        self.bad_words = [self.bad_words[i] for i in rows]
        self.guides = [self.guides[i] for i in rows]
        self._build()

    def append(self, other: SampleStrategy) -> None:
        """Add `other`'s rows (same vocabulary and device) after these."""
        self.params += other.params
        self.random.append(other.random)
        self.stop_ids = _cat_padded(self.stop_ids, other.stop_ids)
        self.bad_words += other.bad_words
        self.guides += other.guides
        self._build()

    def take_failures(self) -> dict[int, Exception]:
        """The rows whose grammar or logits processors raised since the last call ({row: error});
        their positions were left unprocessed by the failing step, so the caller must drop them."""
        failures, self._failures = self._failures, {}
        return failures

    def process(self, logits: Tensor, context: TokenContext | None) -> Tensor:
        """Steps 1-5 (everything before temperature): [B, q, V] -> float32 [B, q, V].

        With context None (draft sampling) nothing is applied."""
        logits = logits.float()
        if context is None or not self.needs_context:
            return logits
        if self._allowed is not None:
            logits = P.apply_allowed(logits, self._allowed)
        if self._guided:
            logits = P.apply_allowed(logits, self._guide_masks(context))
        if self._bad_words:
            logits = P.apply_bad_words(logits, context, self._bad_words)
        if self._use_min_tokens:
            logits = P.apply_min_tokens(logits, context, self.min_tokens, self.stop_ids)
        if self._bias is not None:
            logits = logits + self._bias[:, None, :]
        if self._user:
            logits = self._apply_user(logits, context)
        if self._use_penalties:
            logits = P.apply_penalties(logits, context, self.presence, self.frequency, self.repetition)
        return logits

    @property
    def tree_rows(self) -> int:
        """The rows that share a tree budget (tree.batch_tree's `batch`): all of them in an all-greedy
        batch, else 1, since a sampled row's draws, and so a seeded row's output, must not depend on
        its neighbours."""
        return len(self.params) if self.all_greedy else 1

    def draft_probs(self, logits: Tensor) -> Tensor | None:
        """A sampling drafter's Proposal.probs from its logits [B, j, V]: the distributions its drafts
        were drawn from (probs), or None for an all-greedy batch, whose drafts are argmaxes (one-hot)."""
        return None if self.all_greedy else self.probs(logits)

    def probs(self, logits: Tensor, context: TokenContext | None = None) -> Tensor:
        """Processed distributions: logits [B, q, V] -> probs [B, q, V] float32 (steps 1-8)."""
        logits = self.process(logits, context)
        if self.all_greedy:
            return _one_hot_argmax(logits)
        warped = P.apply_temperature(logits, self.temperature)
        if self._use_min_p:
            warped = P.apply_min_p(warped, self.min_p)
        if self._use_top_k or self._use_top_p:
            warped = P.apply_top_k_top_p(warped, self.top_k, self.top_p if self._use_top_p else None)
        probs = warped.softmax(dim=-1)
        if self.any_greedy:
            probs = torch.where(self.greedy_rows[:, None, None], _one_hot_argmax(logits), probs)
        return probs

    def argmax(self, logits: Tensor, context: TokenContext | None = None) -> Tensor:
        """Greedy tokens after steps 1-5: logits [B, q, V] -> [B, q] int64.

        `max(dim).indices` here and below: the first maximal index, as `argmax` gives it, at a third of
        its cost on CPU (docs/internals.md#measured-choices)."""
        return self.process(logits, context).max(dim=-1).indices

    def sample(self, probs: Tensor) -> Tensor:
        """One token per row from probs [B, V] by exponential race: [B] int64."""
        noise = self.random.exponential(probs.shape[-1])  # [B, V]
        return (probs / noise).max(dim=-1).indices

    def next_tokens(self, logits: Tensor, context: TokenContext | None = None) -> Tensor:
        """One token per row from logits [B, V] (after the context's last token): [B] int64."""
        if self.all_greedy:
            return self.argmax(logits[:, None], context)[:, 0]
        return self.sample(self.probs(logits[:, None], context)[:, 0])

    def _guide_masks(self, context: TokenContext) -> Tensor:
        """[B, q, V] bool: each guided row's grammar mask at each position (all True elsewhere).

        For a tree context, the mask at each real node is the grammar's after that node's path: one
        `allowed_for_block` call per leaf, its rows scattered to the root and the path's nodes (a node
        on several leaves' paths gets the same row from each: it depends on its own path only)."""
        if context.parents is not None:
            return self._tree_guide_masks(context)
        q = context.num_positions
        masks = torch.ones(self.batch_size, q, self.vocab_size, dtype=torch.bool)
        block = context.block.tolist()
        for row, guide in self._guided:
            drafts = block[row]
            drafts = drafts[: drafts.index(-1)] if -1 in drafts else drafts
            try:
                masks[row, : len(drafts) + 1] = guide.allowed_for_block(drafts)
            except Exception as error:
                self._failures[row] = error
        return masks.to(self.device)

    def _tree_guide_masks(self, context: TokenContext) -> Tensor:
        """_guide_masks of a tree context (padding nodes all True)."""
        masks = torch.ones(self.batch_size, context.num_positions, self.vocab_size, dtype=torch.bool)
        block = context.block.tolist()
        for row, guide in self._guided:
            try:
                for leaf in context.leaves(row):
                    nodes = context.path_nodes(row, leaf)
                    masks[row, [0, *nodes]] = guide.allowed_for_block([block[row][i - 1] for i in nodes])
            except Exception as error:
                self._failures[row] = error
        return masks.to(self.device)

    def _apply_user(self, logits: Tensor, context: TokenContext) -> Tensor:
        """The rows' user logits processors, called at each used position with its own context (for a
        tree: at each real node, with its path's context; padding nodes are left as they are)."""
        logits = logits.clone()
        block = context.block.tolist()
        for row, functions in self._user:
            if context.parents is not None:
                used = context.real_nodes(row)
            else:  # positions after a missing draft are never used
                used = range(block[row].index(-1) + 1 if -1 in block[row] else context.num_positions)
            try:
                for position in used:
                    prompt, output = context.row_context(row, position)
                    for arity, fn in functions:
                        row_logits = logits[row, position]
                        logits[row, position] = (
                            fn(output, row_logits) if arity == 2 else fn(prompt, output, row_logits)
                        )
            except Exception as error:
                self._failures[row] = error
        return logits


def _arity(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 2


def _cat_padded(a: Tensor, b: Tensor) -> Tensor:
    """Rows of [n, s] and [m, t] id tables, the narrower padded with -1: [n + m, max(s, t)]."""
    width = max(a.shape[1], b.shape[1])
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in (a, b)])


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """[..., V] logits -> float32 one-hot at the argmax."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.max(dim=-1, keepdim=True).indices, 1.0)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
