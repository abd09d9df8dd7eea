"""The speculative step loop over a batch of sequences.

One step (`Engine.step`), for all active rows at once (B rows, k draft tokens, V vocabulary):
  1. the proposer drafts x_1..x_k after each row's context ([B, k], -1 where it has nothing), or a
     token tree of depth <= k (Proposal.parents; speculative/tree.py); guided rows draft under their
     grammar (speculative/proposers/grammar.py);
  2. the target scores [last token, x_1..x_k] in one forward: logits [B, k+1, V] (a tree: every node
     in one forward_tree, whose accepted path the cache then keeps as a chain, keep_path); for a
     proposer with `hidden_layers` (an EAGLE head) the forward also returns those layers' hidden
     states, which the proposer is handed (`observe`) before the commit;
  3. the acceptance rule keeps a prefix of the drafts and adds one token of the target's own
     (recovered or bonus): [B, k+1] with -1 padding (acceptance/base.py); with no drafts the target
     samples its one token;
  4. EOS, stop tokens and max_tokens cut each row's block; the blocks are appended to the context;
  5. finished rows leave the batch, so that they stop costing compute, and both KV caches are rolled
     back to the kept context (a length change).
The one host-device synchronisation of a step is the read of the blocks (and drafts) in (4), where
the cut is then worked out on the host (rows with a grammar or user logits processors add one to
read the drafts).

Cache invariant between steps: the target's cache holds each row's context minus its last token, so
that the next step's query starts with that token. Rolling back to `lengths - 1` after a commit keeps
it: the cache then holds the context before the step, plus the verified tokens that were kept but the
last; rejected drafts' entries are beyond the new length and are overwritten by the next step.

With no proposer the same loop is plain autoregressive decoding (k = 0): the baseline. The prefill
runs once per prompt; a prompt's n / best_of sequences then copy its cache rows.

Continuous batching: `add` prefills new sequences into caches of their own and then appends their
rows to the running batch (and its caches), `step` advances every running row, `abort` drops rows;
a server's scheduler calls these between steps. A long prompt can instead be prefilled a chunk at a
time between steps (`begin_prefill`, then `prefill_chunk` until it joins), so that the running rows
wait for one chunk at a time rather than the whole prompt. With a prefix cache (prefix_cache.py) a
prompt's prefill starts after the blocks of it the cache holds (their K/V copied into its row), and
each prompt's and each finished row's K/V go into the cache (a draft model keeps its own K/V there
too: PrefixCachingProposer). `generate` is the same loop for one fixed batch.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from speculative.acceptance import AcceptanceRule, RejectionSampler
from speculative.engine import logprobs as L
from speculative.engine.batch import Batch
from speculative.engine.context_features import ContextFeatures
from speculative.engine.draft_length import DraftLength
from speculative.engine.sequence import NoTokenAllowed, Sequence, StopStrings
from speculative.engine.stats import StepClock, StepStats
from speculative.kv_cache import KVCache
from speculative.models.base import LanguageModel
from speculative.models.compiled import graphs_compiled
from speculative.models.prefill import prefill_groups
from speculative.prefix_cache import PrefixCache, PrefixMatch, tokens_after
from speculative.proposers.base import (
    FeatureProposer,
    IntakeTimingProposer,
    LearningProposer,
    PrefixCachingProposer,
    Proposal,
    Proposer,
    TargetCacheProposer,
)
from speculative.proposers.grammar import cut_to_grammar
from speculative.sampling_params import SamplingParams
from speculative.transfer import to_device
from speculative.tree import tree_depths


class Commit(NamedTuple):
    """What one commit did: the sequences it finished; per row, the drafts it kept and the drafts it
    was given; the most tokens a row kept (the proposer's cue, see Proposer.on_commit)."""

    finished: list[Sequence]
    accepted: list[int]
    drafted: list[int]
    most_kept: int


@dataclass
class PartialPrefill:
    """One prompt's sequences being prefilled a chunk at a time (Engine.begin_prefill): their batch,
    the target's cache of the prompt's tokens prefilled so far (one row) and, for a proposer that reads
    them, those tokens' hidden states (one [1, chunk, F] tensor per chunk)."""

    batch: Batch
    cache: KVCache
    done: int = 0
    features: list[Tensor] = field(default_factory=list)

    @property
    def tokens_left(self) -> int:
        """The prompt's tokens not prefilled yet."""
        return self.batch.host_lengths[0] - self.done


class Engine:
    """Runs batches of sequences through prefill and speculative (or plain) steps.

    target: the model whose distribution the output follows.
    proposer: the drafter, or None for plain autoregressive decoding.
    num_speculative_tokens: k per step (ignored without a proposer).
    eos_token_ids: tokens that finish a row unless its params say ignore_eos.
    generator: the generator of rows without one of their own.
    rule: the acceptance rule (default: lossless rejection sampling, greedy acceptance on greedy rows).
    decode: (token ids, SamplingParams or None) -> text, for stop strings and log-probability
        tokens; None when there is no tokenizer.
    adaptive: choose k per step in [0, num_speculative_tokens] (`draft_length.DraftLength`).
    disable_by_batch_size: a step of at least this many rows decodes plainly (None: no such step).
    room: the most tokens a proposal's forwards add to a cache beyond the context (a tree's nodes,
        or what a drafter feeds while it grows one); default k.
    prefix_cache: K/V of earlier prompts' and finished rows' prefixes (prefix_cache.py), which a new
        prompt's prefill starts from (None: every prompt prefilled whole). The target's caches must
        be StaticKVCaches.
    """

    def __init__(
        self,
        target: LanguageModel,
        proposer: Proposer | None,
        num_speculative_tokens: int,
        eos_token_ids: Seq[int],
        generator: torch.Generator,
        rule: AcceptanceRule | None = None,
        decode: Callable[[list[int], SamplingParams | None], str] | None = None,
        adaptive: bool = False,
        disable_by_batch_size: int | None = None,
        room: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        self.rule = rule if rule is not None else RejectionSampler()
        self.eos_token_ids = list(eos_token_ids)
        self.generator = generator
        self.decode = decode
        self.draft_length = DraftLength(self.k, adaptive, disable_by_batch_size)
        self.room = self.k if room is None or proposer is None else room
        # what a proposer that reads the target's hidden states wants of its forward (EagleProposer)
        self.hidden_layers = proposer.hidden_layers if isinstance(proposer, FeatureProposer) else None
        self._timed_intake = isinstance(proposer, IntakeTimingProposer)  # its prefill of joined rows
        self._shares_cache = isinstance(proposer, TargetCacheProposer)  # it drafts on the target's cache
        self.use_prefix_cache(prefix_cache)
        self.batch: Batch | None = None
        self.cache: KVCache | None = None
        self.prefilling: PartialPrefill | None = None  # a prompt prefilled a chunk at a time
        self.stop_strings: dict[int, StopStrings] = {}
        self.num_top, self.want_logprobs = 0, False
        self.step_stats: list[StepStats] | None = None  # collected while `recording_steps` is open
        self._unobserved: tuple | None = None  # the last step's figures for draft_length (_close_period)
        self._admitting = 0.0  # seconds `add` took since the last step started (not that step's cost)
        self._joined = 0  # rows that joined the running batch since the last step started

    def use_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Prefill new prompts from `cache` and keep what they compute there (None: prefill every prompt
        whole and keep nothing), and so does a proposer that can keep its own K/V there. For a
        proposer that reads hidden states, the rows that start from now on keep their contexts'
        (context_features.py) for the blocks of their answers."""
        self.prefix_cache = cache
        self.context_features = (
            ContextFeatures(cache.block_size) if cache is not None and self.hidden_layers else None
        )
        if isinstance(self.proposer, PrefixCachingProposer):
            self.proposer.use_prefix_cache(cache)

    @property
    def sequences(self) -> list[Sequence]:
        """The sequences in the running batch."""
        return self.batch.sequences if self.batch is not None else []

    def run(self, sequences: list[Sequence]) -> None:
        """Generate every sequence to completion, filling in its outputs and metrics."""
        for _ in self.generate(sequences):
            pass

    def generate(
        self, sequences: list[Sequence], chunk_steps: int | None = None, eos_token_ids: Seq[int] | None = None
    ) -> Iterator[list[Sequence]]:
        """Generate the sequences, yielding them all after every `chunk_steps` target steps (the
        prefill included) and once more when every one has finished.

        The engine is this generator's alone while it runs: it starts from an empty batch, and
        closing it early drops the sequences still running (their records stay as they are).
        Sequences that already have output tokens are resumed: their caches are rebuilt from their
        tokens and their generators must hold the state they had. The sequences of one prompt (same
        prompt_index) must be adjacent. eos_token_ids overrides the model's EOS for this generation.
        """
        self.reset()
        try:
            self.add([s for s in sequences if not s.finished], eos_token_ids)
            steps = 1
            while self.batch is not None:
                if chunk_steps is not None and steps % chunk_steps == 0:
                    yield sequences
                self.step()
                steps += 1
            yield sequences
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget the running batch, its caches and a chunked prefill under way."""
        self.prefilling = None
        self.drop_batch()

    def drop_batch(self) -> None:
        """Forget the running batch and its caches, whatever state a step that raised left them in (its
        sequences are the caller's to mark); a chunked prefill under way goes on."""
        self._close_period(None)
        self.batch, self.cache, self._joined = None, None, 0
        waiting = {id(s) for s in self.prefilling.batch.sequences} if self.prefilling is not None else set()
        self.stop_strings = {key: value for key, value in self.stop_strings.items() if key in waiting}
        if self.context_features is not None:
            self.context_features.clear()
        if self.proposer is not None:
            self.proposer.select_rows(torch.empty(0, dtype=torch.long, device=self.target.device))

    def clear_proposer_cache(self) -> None:
        """Forget what earlier generations taught the proposer (suffix decoding's cache of past
        responses): a benchmark's new pass over prompts it has answered."""
        if isinstance(self.proposer, LearningProposer):
            self.proposer.clear_cache()

    @contextmanager
    def recording_steps(self) -> Iterator[list[StepStats]]:
        """Within the block, every step appends its StepStats to the yielded list (prefills are not
        steps). Recording adds no host-device synchronisation (see stats.py)."""
        self.step_stats = recorded = []
        try:
            yield recorded
        finally:
            self.step_stats = None

    @torch.inference_mode()
    def add(self, sequences: list[Sequence], eos_token_ids: Seq[int] | None = None) -> list[Sequence]:
        """Admit sequences to the running batch (continuous batching): prefill new ones, each
        sampling its first token, or rebuild the caches of resumed ones from their tokens.

        The running rows are untouched until the new ones are ready, so when this raises only the
        new sequences are lost. Returns the new sequences that already finished (one token was
        enough, or they failed).
        """
        if not sequences:
            return []
        with self._admitting_time() as start:
            batch = self._new_batch(sequences, start, eos_token_ids)
            self._want_logprobs(self.sequences + sequences)
            if any(s.output_token_ids for s in sequences):
                (cache, features), finished = self._rebuild_cache(batch), []
                if self.context_features is not None and features is not None:
                    self.context_features.begin(sequences, features, [n - 1 for n in batch.host_lengths])
            else:
                cache, features, finished = self._prefill(batch)
            return self._join(batch, cache, features, finished)

    def begin_prefill(self, sequences: list[Sequence], eos_token_ids: Seq[int] | None = None) -> None:
        """Start admitting the sequences of one new prompt (the same prompt_index, no output tokens,
        no prompt_logprobs) with their prompt prefilled a chunk at a time: `prefill_chunk` runs the
        chunks, between steps, and the last one admits them as `add` does. One such prefill at a time;
        `abort` and `reset` end it. Raises ValueError for sequences it cannot take so."""
        if self.prefilling is not None:
            raise RuntimeError("a chunked prefill is under way: prefill_chunk until it ends first")
        if len({s.prompt_index for s in sequences}) != 1 or any(
            s.output_token_ids or s.params.prompt_logprobs is not None for s in sequences
        ):
            raise ValueError(
                "a chunked prefill takes the new sequences of one prompt (the same prompt_index, no "
                "output tokens yet) that want no prompt_logprobs"
            )
        batch = self._new_batch(sequences, time.perf_counter(), eos_token_ids)
        partial = PartialPrefill(batch, self.target.new_cache(1, batch.capacity))
        match = self._prefix_matches(batch, [0])[0]
        if match is not None and match.num_tokens:  # the prefill starts after the prefix held
            (partial.done,) = self.prefix_cache.load_rows(partial.cache, [match])
            if self.hidden_layers:
                partial.features.append(match.features()[None])
        self.prefilling = partial

    @torch.inference_mode()
    def prefill_chunk(self, max_tokens: int | None = None) -> list[Sequence] | None:
        """The next `max_tokens` (None: all the rest) of the chunked prefill's prompt (begin_prefill).
        Until its last chunk, returns None and the running batch is untouched; the last chunk samples
        each sequence's first token and appends them to the running batch, returning those that
        already finished, as `add` does. When this raises, the chunked prefill's sequences are lost
        (the prefill ends), and only they."""
        partial = self.prefilling
        if partial is None:
            raise RuntimeError("no chunked prefill is under way (begin_prefill)")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None; got {max_tokens}")
        with self._admitting_time():
            try:
                return self._prefill_chunk(partial, max_tokens)
            except BaseException:
                self.prefilling = None
                raise

    def _prefill_chunk(self, partial: PartialPrefill, max_tokens: int | None) -> list[Sequence] | None:
        """`prefill_chunk`'s work (its docstring)."""
        batch = partial.batch
        size = partial.tokens_left if max_tokens is None else min(max_tokens, partial.tokens_left)
        extra = {"hidden_layers": self.hidden_layers} if self.hidden_layers else {}
        out = self.target.forward(
            batch.tokens[:1, partial.done : partial.done + size],
            partial.cache,
            logits_indices=torch.full((1, 1), size - 1, dtype=torch.long, device=batch.tokens.device),
            **extra,
        )
        if self.hidden_layers:
            out, hidden = out
            partial.features.append(hidden)
        partial.done += size
        if partial.tokens_left:
            return None
        self.prefilling = None
        self._want_logprobs(self.sequences + batch.sequences)
        features = torch.cat(partial.features, dim=1) if partial.features else None
        if self.prefix_cache is not None:
            own = None if features is None else features[0]
            self.prefix_cache.store(batch.sequences[0].prompt_token_ids, partial.cache, 0, partial.done, own)
        cache, features, finished = self._first_tokens(batch, [0], [0], out, features, partial.cache)
        return self._join(batch, cache, features, finished)

    @contextmanager
    def _admitting_time(self) -> Iterator[float]:
        """Yields the time now; the block's duration counts as admitting rows (not the step's cost:
        _close_period) where a step's figures wait for draft_length."""
        start = time.perf_counter()
        try:
            yield start
        finally:
            if self._unobserved is not None:
                self._admitting += time.perf_counter() - start

    def _new_batch(self, sequences: list[Sequence], start: float, eos_token_ids: Seq[int] | None) -> Batch:
        """The batch of sequences that join at `start`, their stop strings watched."""
        for s in sequences:
            s.start_time = start
            if s.params.stop:
                self.stop_strings[id(s)] = StopStrings(s, lambda ids, p=s.params: self.decode(ids, p))
        eos = list(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        return Batch(
            sequences, eos, self.k, self.target.vocab_size, self.target.device, self.generator, self.room
        )

    def _join(
        self, batch: Batch, cache: KVCache, features: Tensor | None, finished: list[Sequence]
    ) -> list[Sequence]:
        """Append a prefilled batch's rows that stay (and their cache and `features`, the hidden states
        a proposer reads of them) to the running batch; returns `finished`."""
        if not batch.sequences:
            return finished
        if self.proposer is not None:
            if features is not None:  # the new rows' hidden states, for a proposer that reads them
                self.proposer.observe(features)
            self.proposer.add_rows(batch.tokens, batch.lengths)
        if self.batch is None:
            self.batch, self.cache = batch, cache
        else:
            self._joined += len(batch.sequences)
            self.batch.append(batch)
            self.cache.append_rows(cache)
        return finished

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One speculative (or plain) step of every running row (module docstring, 1-5); returns the
        sequences it finished."""
        batch = self.batch
        if batch is None:
            return []
        start, rows, clock = time.perf_counter(), len(batch.sequences), StepClock(self.target.device)
        joined, self._joined = self._joined, 0  # the rows a drafting step's proposer takes in
        self._close_period(start)
        graphs = graphs_compiled()
        k = self.draft_length.choose(rows, batch.backlog()) if self.proposer is not None else 0
        draft_ids, draft_probs, parents = self._propose(batch, k)  # [B, j] (-1: none), [B, j, V], tree
        intake = self.proposer.intake_seconds if k and self._timed_intake else 0.0
        clock.mark()
        last = batch.tokens.gather(1, batch.lengths[:, None] - 1)  # [B, 1]
        query = torch.cat([last, draft_ids.clamp(min=0)], dim=1)  # [B, j+1]
        root_slots = self.cache.lengths.clone() if parents is not None else None  # [B]
        logits, features = self._score(query, parents)  # [B, j+1, V], [B, j+1, F] or None
        clock.mark()
        if parents is not None:
            emitted, logits, path = self._verify_tree(
                batch, logits, last, draft_ids, draft_probs, parents, root_slots
            )
            if features is not None:  # along the accepted path, as the cache keeps it
                features = features.gather(1, path.clamp(min=0)[:, :, None].expand(-1, -1, features.shape[2]))
            drafted = tree_depths(parents).max(dim=1).values  # [B]: a tree drafts as deep as a chain
        elif draft_ids.shape[1]:
            emitted = self.rule.verify(
                logits, draft_ids, draft_probs, batch.strategy, batch.context(draft_ids)
            )
            drafted = (draft_ids >= 0).sum(dim=1)  # [B]
        else:  # plain step: the target's own token
            emitted = batch.strategy.next_tokens(logits[:, 0], batch.context())[:, None]  # [B, 1]
            drafted = torch.zeros_like(batch.lengths)
        if features is not None:
            self.proposer.observe(features)
        before = list(batch.host_lengths) if self.context_features is not None else None
        commit = self._commit(batch, emitted, logits, drafted, first_token=False)  # the step's sync
        if before is not None:  # the hidden states of the tokens each row kept
            kept = [after - was for after, was in zip(batch.host_lengths, before)]
            self.context_features.extend(batch.sequences, features, kept)
        if self.prefix_cache is not None and commit.finished:
            self._store_finished(batch, commit.finished)
        self._settle(batch, self.cache, self.proposer, commit)
        if k:  # the proposer has taken in every row's context (but the tokens it feeds each proposal)
            batch.host_drafted = list(batch.host_lengths)
        seconds = time.perf_counter() - start
        if self.proposer is not None:
            timed = graphs_compiled() == graphs  # a step that compiled a graph is no measure of its k
            self._unobserved = (
                rows,
                k,
                draft_ids.shape[1],
                start,
                seconds if timed else None,
                intake,
                joined,
                commit.accepted,
                commit.drafted,
            )
        if self.step_stats is not None:
            propose_s, verify_s = clock.intervals()
            self.step_stats.append(
                StepStats(
                    rows,
                    k,
                    1 + draft_ids.shape[1],
                    sum(commit.drafted),
                    sum(commit.accepted),
                    propose_s,
                    verify_s,
                    seconds,
                )
            )
        if not batch.sequences:
            self.drop_batch()
        return commit.finished

    def _close_period(self, now: float | None) -> None:
        """Hand draft_length the last step's figures, its time taken from its start to `now`, the next
        step's start (what the host did in between, such as publishing its tokens, is part of its
        cost; admitting rows, the target's prefill of their prompts, is not: it costs the same whatever
        k the step had, and in a server it would make one step of many look several times as slow), or
        with None (no next step: the batch ended) its own duration; no time (None) for a step that
        compiled a graph."""
        if self._unobserved is not None:
            rows, chosen, width, start, seconds, intake, joined, accepted, drafted = self._unobserved
            admitting, self._unobserved, self._admitting = self._admitting, None, 0.0
            period = seconds if now is None or seconds is None else now - start - admitting
            self.draft_length.observe(
                rows, width, period, accepted, drafted, chosen=chosen, intake=intake, joined=joined
            )

    def _score(self, query: Tensor, parents: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The target's forward over the step's query [B, q] (a chain, or the tree `parents`): its
        logits [B, q, V] and, for a proposer with `hidden_layers`, those layers' hidden states [B, q,
        F] (None otherwise)."""
        if parents is None:
            if self.hidden_layers:
                return self.target.forward(query, self.cache, hidden_layers=self.hidden_layers)
            return self.target.forward(query, self.cache), None
        if self.hidden_layers:
            return self.target.forward_tree(query, self.cache, parents, hidden_layers=self.hidden_layers)
        return self.target.forward_tree(query, self.cache, parents), None

    def _propose(self, batch: Batch, k: int) -> Proposal:
        """The step's drafts: token ids [B, j] (-1 where a row has nothing), the distributions they
        were drawn from ([B, j, V], or None for a deterministic proposer) and their tree (None for a
        chain); j = 0 for a plain step.

        A deterministic proposal is cut where a guided row's grammar forbids a draft (`cut_to_grammar`;
        a draft model draws guided rows under their grammar itself). A chain narrower than k (no row
        had more) is verified as it is when a lossless rule meets a greedy batch, which draws no
        randomness (an empty one is then a plain step). Otherwise it is padded back to k: random draws
        are made per position of k, so a seeded row's output does not depend on its neighbours. (A tree
        proposer keeps its width fixed unless the batch is greedy.)
        """
        if k == 0:
            return Proposal(batch.tokens.new_empty((len(batch.sequences), 0)), None)
        if self._shares_cache:
            self.proposer.use_target_cache(self.cache)
        proposal = self.proposer.propose(batch.tokens, batch.lengths, k, batch.strategy)
        if proposal.probs is None and batch.strategy.any_guided:
            proposal = cut_to_grammar(proposal, batch.strategy.guides)
        draft_ids, draft_probs, parents = proposal
        j = draft_ids.shape[1]
        if parents is None and j < k and not (self.rule.lossless and batch.strategy.all_greedy):
            draft_ids = F.pad(draft_ids, (0, k - j), value=-1)
            if draft_probs is not None:
                draft_probs = F.pad(draft_probs, (0, 0, 0, k - j))
            return Proposal(draft_ids, draft_probs)
        return proposal

    def _verify_tree(
        self,
        batch: Batch,
        logits: Tensor,
        last: Tensor,
        draft_ids: Tensor,
        draft_probs: Tensor | None,
        parents: Tensor,
        root_slots: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """The rule over each row's tree (logits [B, M, V] at its nodes; last [B, 1] the roots' tokens;
        draft_ids [B, M - 1]; draft_probs [B, M - 1, V] or None; parents [B, M]); the accepted path's
        K/V are moved to the cache as a chain from `root_slots` [B] on. Returns the emitted tokens [B,
        M] (-1 padded), the logits each was chosen from [B, M, V] (the path's nodes) and the path [B,
        M] (its nodes, -1 padded)."""
        tokens = torch.cat([last, draft_ids], dim=1)  # [B, M], the nodes' tokens
        probs = None if draft_probs is None else F.pad(draft_probs, (0, 0, 1, 0))  # [B, M, V]
        context = batch.context(draft_ids, parents)
        emitted, path = self.rule.verify_tree(logits, tokens, parents, probs, batch.strategy, context)
        self.cache.keep_path(root_slots, path)
        along = path.clamp(min=0)[:, :, None].expand(-1, -1, logits.shape[-1])  # [B, M, V]
        return emitted, logits.gather(1, along), path

    def _commit(
        self, batch: Batch, emitted: Tensor, logits: Tensor, drafted: Tensor | None, first_token: bool
    ) -> Commit:
        """Cut each row's block at its stop token or max_tokens and append it: to the batch's tokens
        and to each sequence's record (tokens, log-probabilities, figures, finish).

        emitted: [B, m] tokens of this step, -1 padded; logits: [B, m, V] the target's raw logits
        they were chosen from; drafted: [B] int64 the drafts each row was given (a tree's: its
        depth), or None for the prefill's first token (not a step of the metrics). A row whose own
        host-side work (stop strings, grammar, log-probability tokens) raises fails alone:
        finish_reason "error". The blocks (and draft counts) come to the host in the step's one
        sync; the cut is worked out there, row by row, where a handful of tokens costs less than the
        tensor ops that would do it.
        """
        width = emitted.shape[1]
        host = (
            emitted if drafted is None else torch.cat([emitted, drafted[:, None]], dim=1)
        ).tolist()  # sync
        cuts = [self._cut(batch, row, values[:width]) for row, values in enumerate(host)]
        kept = to_device([n for n, _ in cuts], torch.long, emitted.device)  # [B]
        positions = torch.arange(width, device=emitted.device)
        batch.tokens.scatter_(1, batch.lengths[:, None] + positions, emitted.clamp(min=0))
        batch.lengths += kept
        accepted = [sum(t >= 0 for t in values[:width]) - 1 for values in host]
        drafted = [values[width] if len(values) > width else 0 for values in host]
        scores = (
            [t.tolist() for t in L.token_logprobs(logits, emitted, self.num_top)]
            if self.want_logprobs
            else None
        )
        now = time.perf_counter()
        failures = batch.strategy.take_failures()  # {row: error} from per-row processing this step
        finished = []
        for row, (s, values, (n, stop)) in enumerate(zip(batch.sequences, host, cuts)):
            batch.host_lengths[row] += n
            try:
                if row in failures:
                    raise failures[row]
                self._record(
                    s,
                    values[:n],
                    stop,
                    accepted[row],
                    drafted[row],
                    batch.eos_token_ids,
                    [t[row][:n] for t in scores] if scores is not None else None,
                    first_token,
                )
            except NoTokenAllowed as error:
                s.finish_reason, s.error = "error", str(error)
            except Exception as error:
                s.finish_reason, s.error = "error", f"{type(error).__name__}: {error}"
            if first_token:
                s.metrics.first_token_s = now - s.start_time
            if s.finished:
                s.metrics.elapsed_s = now - s.start_time
                self.stop_strings.pop(id(s), None)
                finished.append(s)
        return Commit(finished, accepted, drafted, max(n for n, _ in cuts))

    def _store_finished(self, batch: Batch, finished: list[Sequence]) -> None:
        """Give the prefix cache the K/V of the rows that finished (before they leave the cache): each
        holds its context but the last token, so that a next turn, which repeats this one's prompt
        and answer, starts from them."""
        gone = {id(s) for s in finished}
        for row, s in enumerate(batch.sequences):
            if id(s) in gone:
                context = s.prompt_token_ids + s.output_token_ids  # a stop string may have cut the tail
                length = min(len(context), batch.host_lengths[row] - 1)
                kept = self.context_features.take(s) if self.context_features is not None else None
                start, features = kept if kept is not None else (0, None)
                self.prefix_cache.store(context, self.cache, row, length, features, start)

    @staticmethod
    def _settle(batch: Batch, cache: KVCache, proposer: Proposer | None, commit: Commit) -> list[int] | None:
        """After a commit: finished rows leave the batch, the cache and the proposer (told their final
        contexts first, on_finish); the cache is rolled back to the invariant (module docstring) and the
        proposer told what was kept. Returns the rows that stay, in their new order (_fill_holes), or
        None when none left."""
        kept = None
        if commit.finished:
            gone = {id(s) for s in commit.finished}
            if proposer is not None:
                rows = [i for i, s in enumerate(batch.sequences) if id(s) in gone]
                proposer.on_finish(
                    batch.tokens, batch.lengths, to_device(rows, torch.long, batch.tokens.device)
                )
            kept = _fill_holes([id(s) not in gone for s in batch.sequences])
            batch.select(kept, [cache], proposer)
        if batch.sequences:
            max_length = max(batch.host_lengths)
            cache.rollback(batch.lengths - 1, max_length - 1)
            if proposer is not None:
                proposer.on_commit(batch.lengths, max_length, commit.most_kept)
        return kept

    @staticmethod
    def _cut(batch: Batch, row: int, block: list[int]) -> tuple[int, bool]:
        """How many tokens of a row's block (-1 padded) it keeps: up to and including its first stop
        token, and no more than its max_tokens leaves; and whether a stop token ended it."""
        s, stops = batch.sequences[row], batch.host_stop_ids[row]
        room = s.max_tokens - (batch.host_lengths[row] - len(s.prompt_token_ids))
        emitted = sum(t >= 0 for t in block)
        first_stop = next((i for i, t in enumerate(block[:emitted]) if t in stops), emitted)
        kept = min(emitted, first_stop + 1, room)
        return kept, first_stop < kept

    def _record(
        self,
        s: Sequence,
        new: list[int],
        stop: bool,
        accepted: int,
        drafted: int,
        eos_token_ids: list[int],
        scores: list[list] | None,
        first_token: bool,
    ) -> None:
        """One row's share of a commit, on the host: its new tokens, figures and finish. Raises
        NoTokenAllowed when a new token is one that its constraints forbid: it was drawn at a position
        where they left no token allowed."""
        n = len(new)
        allowed = s.allowed_token_set
        if allowed is not None and any(t not in allowed for t in new):
            raise NoTokenAllowed(s)
        if s.guide is not None:
            try:
                s.guide.accept(new)
            except ValueError:
                raise NoTokenAllowed(s) from None
        before = len(s.output_token_ids)
        s.output_token_ids.extend(new)
        checker = self.stop_strings.get(id(s))
        stopped_by_string = checker is not None and checker.extend(n)  # cuts the tokens after it
        kept = len(s.output_token_ids) - before
        if scores is not None:  # log-probabilities of the kept tokens only
            self._add_logprobs(s, new[:kept], [t[:kept] for t in scores])
        m = s.metrics
        m.num_generated += kept
        if not first_token:
            m.record_step(drafted, accepted)
        if stopped_by_string:
            s.finish_reason, s.text = "stop", checker.text
        elif stop:
            last = s.output_token_ids[-1]
            s.finish_reason = "stop"
            s.stop_reason = None if last in eos_token_ids else last
        elif m.num_generated >= s.max_tokens:
            s.finish_reason = "length"

    def _add_logprobs(self, s: Sequence, new: list[int], scores: list[list]) -> None:
        chosen = scores[0]
        s.cumulative_logprob = (s.cumulative_logprob or 0.0) + sum(chosen)
        if s.params.logprobs is not None:
            entries = L.as_dicts(new, *scores, s.params.logprobs, self._decode_token)
            s.logprobs = (s.logprobs or []) + entries

    def abort(self, sequences: list[Sequence], reason: str = "abort") -> None:
        """Drop these sequences from the running batch or the chunked prefill, marking them finished
        with `reason`."""
        gone = {id(s) for s in sequences}
        for s in sequences:
            if not s.finished:
                s.finish_reason = reason
            self.stop_strings.pop(id(s), None)
        if self.context_features is not None:
            self.context_features.drop(sequences)
        if self.prefilling is not None:
            partial = self.prefilling.batch
            keep = [i for i, s in enumerate(partial.sequences) if id(s) not in gone]
            if not keep:
                self.prefilling = None
            elif len(keep) < len(partial.sequences):
                partial.select(keep, [], None)
        if self.batch is None:
            return
        keep = [i for i, s in enumerate(self.batch.sequences) if id(s) not in gone]
        if len(keep) < len(self.batch.sequences):
            self.batch.select(keep, [self.cache], self.proposer)
            if not self.batch.sequences:
                self.drop_batch()

    def _want_logprobs(self, sequences: list[Sequence]) -> None:
        self.num_top = max([s.params.logprobs or 0 for s in sequences])
        self.want_logprobs = any(
            s.params.logprobs is not None or s.params.sampled_sequences > s.params.n for s in sequences
        )

    def _rebuild_cache(self, batch: Batch) -> tuple[KVCache, Tensor | None]:
        """Resume: the target's cache computed again from the tokens (all but the last), sampling
        nothing; and the hidden states [B, width, F] of those tokens a proposer reads (None: none)."""
        lengths = batch.lengths
        cache = self.target.new_cache(len(batch.sequences), batch.capacity)
        extra = {"hidden_layers": self.hidden_layers} if self.hidden_layers else {}
        out = self.target.forward(
            batch.tokens[:, : max(batch.host_lengths) - 1],
            cache,
            num_tokens=lengths - 1,
            logits_indices=torch.zeros_like(lengths)[:, None],
            **extra,
        )
        return cache, out[1] if self.hidden_layers else None

    def _prefill(self, batch: Batch) -> tuple[KVCache, Tensor | None, list[Sequence]]:
        """The target's prefill of each prompt (its first sequence's row), then `_first_tokens`."""
        sequences = batch.sequences
        heads = [
            row
            for row, s in enumerate(sequences)
            if row == 0 or s.prompt_index != sequences[row - 1].prompt_index
        ]
        all_logits = any(s.params.prompt_logprobs is not None for s in sequences)
        logits, features, cache, order = self._prefill_prompts(batch, heads, all_logits)  # [P, 1 or width, V]
        if all_logits:
            logits = self._prompt_logprobs(batch, heads, order, logits)
        return self._first_tokens(batch, heads, order, logits, features, cache)

    def _first_tokens(
        self,
        batch: Batch,
        heads: list[int],
        order: list[int],
        logits: Tensor,
        features: Tensor | None,
        cache: KVCache,
    ) -> tuple[KVCache, Tensor | None, list[Sequence]]:
        """After the prefill of the prompts whose first sequences are the batch rows `heads` (logits
        [P, 1, V] at each prompt's last token, features [P, width, F] or None, the cache's row of
        prompt p `order[p]`): each prompt's other sequences copy its cache row, and every sequence
        samples its first token. Returns the new cache, the hidden states of the prompts of the rows
        that stay ([B, width, F], None if the proposer reads none) and the sequences that finished
        with that token."""
        sequences = batch.sequences
        rows = [order[bisect.bisect_right(heads, row) - 1] for row in range(len(sequences))]  # -> cache row
        if rows != list(range(len(rows))):
            index = to_device(rows, torch.long, batch.tokens.device)
            cache.select_rows(index)
            logits = logits[index]
            features = None if features is None else features[index]
        first = batch.strategy.next_tokens(logits[:, 0], batch.context())[:, None]  # [B, 1]
        commit = self._commit(batch, first, logits, None, first_token=True)
        if self.context_features is not None and features is not None:
            self.context_features.begin(sequences, features, [len(s.prompt_token_ids) for s in sequences])
        kept = self._settle(batch, cache, None, commit)
        if features is not None and kept is not None:
            features = features[kept]
        return cache, features, commit.finished

    def _prefill_prompts(
        self, batch: Batch, heads: list[int], all_logits: bool
    ) -> tuple[Tensor, Tensor | None, KVCache, list[int]]:
        """The target on each prompt (batch rows `heads`). Returns its logits ([P, 1, V] at each prompt's
        last token; [P, width, V] with all_logits), the hidden states a proposer reads ([P, width, F]
        at every prompt position, right-padded; None if it reads none), its cache and, per prompt, its
        row in them.

        On a CPU, prompts of different lengths are prefilled in a few forwards of similar lengths
        (`prefill_groups`), not all padded to the longest; elsewhere, and when every position's logits
        are wanted, in one forward."""
        prompt_lengths = [batch.host_lengths[h] for h in heads]
        matches = self._prefix_matches(batch, heads) if not all_logits else [None] * len(heads)
        cached = [m.num_tokens if m is not None else 0 for m in matches]
        fed = [n - c for n, c in zip(prompt_lengths, cached)]
        # a target that rounds its activations (w8a8, w4a8) must prefill each prompt as it would alone
        exact = getattr(self.target, "rounds_activations", False)
        groups = (
            prefill_groups(fed, exact)
            if self.target.device.type == "cpu" and not all_logits
            else [list(range(len(heads)))]
        )
        cache, parts, features = None, [], []
        extra = {"hidden_layers": self.hidden_layers} if self.hidden_layers else {}
        longest = max(prompt_lengths)
        for group in groups:  # the cache's rows: the groups' rows one after the other
            index = to_device([heads[i] for i in group], torch.long, batch.tokens.device)
            lengths = batch.lengths[index]
            part = self.target.new_cache(len(group), batch.capacity)
            width = max(fed[i] for i in group)
            starts = [0] * len(group)
            if self.prefix_cache is not None:
                starts = self.prefix_cache.load_rows(part, [matches[i] for i in group])
            start = to_device(starts, torch.long, batch.tokens.device) if any(starts) else 0
            out = self.target.forward(
                tokens_after(batch.tokens[index], starts, width),
                part,
                num_tokens=lengths - start,
                logits_indices=None if all_logits else (lengths - start - 1)[:, None],
                **extra,
            )
            hidden = None
            if self.hidden_layers:
                out, hidden = out
                hidden = _with_cached_features(hidden, [matches[i] for i in group], [fed[i] for i in group])
                features.append(F.pad(hidden, (0, 0, 0, longest - hidden.shape[1])))
            if self.prefix_cache is not None:
                for row, i in enumerate(group):
                    prompt = batch.sequences[heads[i]].prompt_token_ids
                    own = None if hidden is None else hidden[row]
                    self.prefix_cache.store(prompt, part, row, prompt_lengths[i], own)
            parts.append(out)
            if cache is None:
                cache = part
            else:
                cache.append_rows(part)
        order = [0] * len(heads)
        for row, prompt in enumerate(i for group in groups for i in group):
            order[prompt] = row
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        return logits, (torch.cat(features) if features else None), cache, order

    def _prefix_matches(self, batch: Batch, heads: list[int]) -> list[PrefixMatch | None]:
        """Per prompt (batch rows `heads`), the prefix cache's blocks it begins with (None without a
        prefix cache); each of the prompt's sequences records how many tokens they hold."""
        if self.prefix_cache is None:
            return [None] * len(heads)
        matches = []
        ends = heads[1:] + [len(batch.sequences)]
        for head, end in zip(heads, ends):
            prompt = batch.sequences[head].prompt_token_ids
            match = self.prefix_cache.match(prompt, with_features=self.hidden_layers is not None)
            for s in batch.sequences[head:end]:
                s.num_cached_tokens = match.num_tokens
            matches.append(match)
        return matches

    def cached_prefix(self, prompt: list[int]) -> int:
        """How many of the prompt's tokens the prefix cache holds now (0 without one): what its
        prefill would skip."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.peek(prompt, with_features=self.hidden_layers is not None)

    def _prompt_logprobs(self, batch: Batch, heads: list[int], order: list[int], logits: Tensor) -> Tensor:
        """Fill in prompt_logprobs of the sequences that asked, from every prompt position's logits
        ([P, width, V], one forward: `order` is the identity); returns the last position's [P, 1, V]."""
        ends = heads[1:] + [len(batch.sequences)]
        for prompt, (head, end) in enumerate(zip(heads, ends)):
            first = batch.sequences[head]
            if first.params.prompt_logprobs is not None:
                found = L.prompt_logprobs(
                    logits[order[prompt]],
                    first.prompt_token_ids,
                    first.params.prompt_logprobs,
                    self._decode_token,
                )
                for s in batch.sequences[head:end]:
                    s.prompt_logprobs = found
        index = to_device(heads, torch.long, batch.tokens.device)
        last = (batch.lengths[index] - 1)[:, None, None].expand(-1, 1, logits.shape[-1])  # [P, 1, V]
        return logits.gather(1, last)

    def _decode_token(self, token: int) -> str | None:
        return self.decode([token], None) if self.decode is not None else None


def _fill_holes(kept: list[bool]) -> list[int]:
    """The rows that stay (kept[i]: row i does), in their new order: the place of each row that left
    goes to a row that stays from past the new end, the others keep theirs. A cache then copies one
    row's K/V (every layer's, its whole capacity) for each row that left, where keeping the order
    moved every row after the first that left (docs/internals.md#measured-choices)."""
    stay = [i for i, k in enumerate(kept) if k]
    tail = [i for i in stay if i >= len(stay)][::-1]  # the rows past the new end fill the holes
    return [i if kept[i] else tail.pop() for i in range(len(stay))]


def _with_cached_features(hidden: Tensor, matches: list[PrefixMatch | None], fed: list[int]) -> Tensor:
    """The hidden states of a prefill's rows at every prompt position: each row's matched prefix's
    (held in its blocks) before the `fed` positions its forward computed (hidden [rows, width, F]).
    Returns [rows, longest prompt, F], right-padded; `hidden` itself where no row had a prefix."""
    if all(m is None or not m.num_tokens for m in matches):
        return hidden
    rows = []
    for row, (match, n) in enumerate(zip(matches, fed)):
        own = hidden[row, :n]
        rows.append(
            own if match is None or not match.num_tokens else torch.cat([match.features().to(own), own])
        )
    longest = max(r.shape[0] for r in rows)
    return torch.stack([F.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows])
