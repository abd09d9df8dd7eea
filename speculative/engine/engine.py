"""The speculative step loop over a batch of sequences.

One step, for all active rows at once (B rows, k draft tokens, V vocabulary):
  1. the proposer drafts x_1..x_k after each row's context ([B, k], -1 where it has nothing);
  2. the target scores [last token, x_1..x_k] in one forward: logits [B, k+1, V], processed at each
     position with that position's own context (prompt + output + the drafts before it);
  3. the acceptance rule keeps a prefix of the drafts and adds one token of the target's own
     (recovered or bonus): [B, k+1] with -1 padding;
  4. EOS, stop tokens and max_tokens cut each row's block; the blocks are appended to the context;
  5. both KV caches are rolled back to the kept context (a length change), and finished rows leave
     the batch so that they stop costing compute.
The one host-device synchronisation of a step is the read of the blocks (and drafts) in (4), where
the cut is then worked out on the host (rows with a grammar or user logits processors add one to
read the drafts).
Cache invariant between steps: the target's cache holds the context minus its last token.
With no proposer the same loop is plain autoregressive decoding (k = 0): the baseline.
The prefill runs once per prompt; a prompt's n / best_of sequences then copy its cache rows.

Continuous batching: `add` prefills new sequences into caches of their own and then appends their
rows to the running batch (and its caches), `step` advances every running row, `abort` drops rows;
a server's scheduler calls these between steps. `generate` is the same loop for one fixed batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from speculative.acceptance import TypicalAcceptanceSampler, greedy_accept, rejection_sample
from speculative.engine import logprobs as L
from speculative.engine.batch import Batch, prefill_groups
from speculative.engine.draft_length import DraftLength
from speculative.engine.request import Request, StopStrings
from speculative.kv_cache import KVCache
from speculative.models.base import LanguageModel
from speculative.proposers.base import Proposer
from speculative.sampling_params import SamplingParams


class Engine:
    """Runs batches of sequences through prefill and speculative (or plain) steps.

    target: the model whose distribution the output follows.
    proposer: the drafter, or None for plain autoregressive decoding.
    num_speculative_tokens: k per step (ignored without a proposer).
    eos_token_ids: tokens that finish a row unless its params say ignore_eos.
    generator: the generator of rows without one of their own.
    typical: a TypicalAcceptanceSampler to use instead of the lossless rejection rule.
    adaptive: choose k per step in [0, num_speculative_tokens] (`draft_length.DraftLength`).
    decode: (token ids, SamplingParams or None) -> text, for stop strings and log-probability
        tokens; None when there is no tokenizer.
    """

    def __init__(self, target: LanguageModel, proposer: Proposer | None, num_speculative_tokens: int,
                 eos_token_ids: Sequence[int], generator: torch.Generator,
                 typical: TypicalAcceptanceSampler | None = None,
                 decode: Callable[[list[int], SamplingParams | None], str] | None = None,
                 adaptive: bool = False) -> None:
        self.target = target
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        self.typical = typical
        self.eos_token_ids = list(eos_token_ids)
        self.generator = generator
        self.decode = decode
        self.draft_length = DraftLength(self.k, adaptive)
        self.batch: Batch | None = None
        self.cache: KVCache | None = None
        self.stop_strings: dict[int, StopStrings] = {}
        self.num_top, self.want_logprobs = 0, False

    @property
    def requests(self) -> list[Request]:
        """The sequences in the running batch."""
        return self.batch.requests if self.batch is not None else []

    def run(self, requests: list[Request]) -> None:
        """Generate every sequence to completion, filling in its outputs and metrics."""
        for _ in self.generate(requests):
            pass

    def generate(self, requests: list[Request], chunk_steps: int | None = None,
                 eos_token_ids: Sequence[int] | None = None) -> Iterator[list[Request]]:
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
            self.add([r for r in requests if not r.finished], eos_token_ids)
            steps = 1
            while self.batch is not None:
                if chunk_steps is not None and steps % chunk_steps == 0:
                    yield requests
                self.step()
                steps += 1
            yield requests
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget the running batch and its caches."""
        self.batch, self.cache = None, None
        self.stop_strings = {}
        if self.proposer is not None:
            self.proposer.select_rows(torch.empty(0, dtype=torch.long, device=self.target.device))

    @torch.inference_mode()
    def add(self, requests: list[Request], eos_token_ids: Sequence[int] | None = None) -> list[Request]:
        """Admit sequences to the running batch (continuous batching): prefill new ones, each
        sampling its first token, or rebuild the caches of resumed ones from their tokens.

        The running rows are untouched until the new ones are ready, so when this raises only the
        new sequences are lost. Returns the new sequences that already finished (one token was
        enough, or they failed).
        """
        if not requests:
            return []
        start = time.perf_counter()
        for r in requests:
            r.start_time = start
        eos = list(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        batch = Batch(requests, eos, self.k, self.target.vocab_size, self.target.device, self.generator)
        for r in requests:
            if r.params.stop:
                self.stop_strings[id(r)] = StopStrings(r, lambda ids, p=r.params: self.decode(ids, p))
        self._want_logprobs(self.requests + requests)
        if any(r.output_token_ids for r in requests):
            cache = self._rebuild_cache(batch)
            finished = []
        else:
            cache, finished = self._prefill(batch)
        if not batch.requests:
            return finished
        if self.proposer is not None:
            if self.batch is not None:
                self.proposer.catch_up(self.batch.tokens, self.batch.lengths)
            self.proposer.add_rows(batch.tokens, batch.lengths)
        if self.batch is None:
            self.batch, self.cache = batch, cache
        else:
            self.batch.append(batch)
            self.cache.append_rows(cache)
        return finished

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One speculative (or plain) step of every running row; returns the sequences it finished."""
        if self.batch is None:
            return []
        finished = self._step(self.batch)
        if not self.batch.requests:
            self.reset()
        return finished

    def abort(self, requests: list[Request], reason: str = "abort") -> None:
        """Drop these sequences from the running batch, marking them finished with `reason`."""
        gone = {id(r) for r in requests}
        for r in requests:
            if not r.finished:
                r.finish_reason = reason
            self.stop_strings.pop(id(r), None)
        if self.batch is None:
            return
        keep = [i for i, r in enumerate(self.batch.requests) if id(r) not in gone]
        if len(keep) < len(self.batch.requests):
            self.batch.select(keep, [self.cache], self.proposer)
            if not self.batch.requests:
                self.reset()

    def _want_logprobs(self, requests: list[Request]) -> None:
        self.num_top = max([r.params.logprobs or 0 for r in requests])
        self.want_logprobs = any(r.params.logprobs is not None or r.params.sampled_sequences > r.params.n
                                 for r in requests)

    def _rebuild_cache(self, batch: Batch) -> KVCache:
        """Resume: the target's cache computed again from the tokens (all but the last), sampling
        nothing."""
        lengths = batch.lengths
        cache = self.target.new_cache(len(batch.requests), batch.capacity)
        self.target.forward(batch.tokens[:, : max(batch.host_lengths) - 1], cache, num_tokens=lengths - 1,
                            logits_indices=torch.zeros_like(lengths)[:, None])
        return cache

    def _prefill(self, batch: Batch) -> tuple[KVCache, list[Request]]:
        """The target's prefill of each prompt; its sequences copy the cache; each samples a first
        token. Returns the new cache and the sequences that finished with that token.

        On a CPU, prompts of different lengths are prefilled in a few forwards of similar lengths
        (`prefill_groups`), not all padded to the longest; elsewhere, and when prompt log-probabilities
        are wanted, in one forward."""
        requests = batch.requests
        heads, expand = [], []  # the first row of each prompt; row -> its prompt's index in heads
        for row, r in enumerate(requests):
            if row == 0 or r.prompt_index != requests[row - 1].prompt_index:
                heads.append(row)
            expand.append(len(heads) - 1)
        all_logits = any(r.params.prompt_logprobs is not None for r in requests)
        prompt_lengths = [batch.host_lengths[h] for h in heads]
        groups = (prefill_groups(prompt_lengths) if self.target.device.type == "cpu" and not all_logits
                  else [list(range(len(heads)))])
        cache, parts = None, []
        for group in groups:  # the cache's rows: the groups' rows one after the other
            index = torch.tensor([heads[i] for i in group], dtype=torch.long, device=batch.tokens.device)
            lengths = batch.lengths[index]
            part = self.target.new_cache(len(group), batch.capacity)
            width = max(prompt_lengths[i] for i in group)
            parts.append(self.target.forward(batch.tokens[index, :width], part, num_tokens=lengths,
                                             logits_indices=None if all_logits else (lengths - 1)[:, None]))
            if cache is None:
                cache = part
            else:
                cache.append_rows(part)
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        cache_row = {prompt: row for row, prompt in enumerate(i for group in groups for i in group)}
        expand = [cache_row[i] for i in expand]  # row -> its prompt's row in the cache
        if all_logits:
            index = torch.tensor(heads, dtype=torch.long, device=batch.tokens.device)
            last = (batch.lengths[index] - 1)[:, None]
            for row, head in enumerate(heads):
                r = requests[head]
                if r.params.prompt_logprobs is not None:
                    found = L.prompt_logprobs(logits[row], r.prompt_token_ids, r.params.prompt_logprobs,
                                              self._decode_token)
                    for other in requests[head: head + expand.count(row)]:
                        other.prompt_logprobs = found
            logits = logits.gather(1, last[:, :, None].expand(-1, -1, logits.shape[-1]))
        if expand != list(range(len(expand))):
            rows = torch.tensor(expand, dtype=torch.long, device=batch.tokens.device)
            cache.select_rows(rows)
            logits = logits[rows]
        first = batch.strategy.next_tokens(logits[:, 0], batch.context())[:, None]  # [B, 1]
        return cache, self._commit(batch, cache, None, first, logits, None)

    def _step(self, batch: Batch) -> list[Request]:
        start, rows = time.perf_counter(), len(batch.requests)
        k = self.draft_length.choose(rows) if self.proposer is not None else 0
        finished, k = self._speculate(batch, k) if k else (self._plain(batch), 0)
        if self.proposer is not None:
            self.draft_length.observe(rows, k, time.perf_counter() - start, *self.step_counts)
        return finished

    def _plain(self, batch: Batch) -> list[Request]:
        """One token per row from the target alone (k = 0)."""
        last = batch.tokens.gather(1, batch.lengths[:, None] - 1)  # [B, 1]
        logits = self.target.forward(last, self.cache)  # [B, 1, V]
        tokens = batch.strategy.next_tokens(logits[:, 0], batch.context())[:, None]
        return self._commit(batch, self.cache, self.proposer, tokens, logits, None, counted=True)

    def _speculate(self, batch: Batch, k: int) -> tuple[list[Request], int]:
        """Draft k tokens per row, verify them in one target forward, keep a prefix and one more.
        Returns the finished sequences and the number of drafts verified per row.

        A proposal narrower than k (no row had more) is verified as it is when the batch is greedy,
        and a plain step is taken when it is empty. A sampled batch pads it back to k: its random
        draws are made per position of k, so a seeded row's output does not depend on its neighbours.
        """
        strategy = batch.strategy
        greedy = self.typical is None and strategy.all_greedy
        last = batch.tokens.gather(1, batch.lengths[:, None] - 1)  # [B, 1]
        proposal = self.proposer.propose(batch.tokens, batch.lengths, k, strategy)
        draft_ids = proposal.token_ids  # [B, j], j <= k, -1 = nothing proposed
        if greedy:
            if draft_ids.shape[1] == 0:
                return self._plain(batch), 0
            k = draft_ids.shape[1]
        elif draft_ids.shape[1] < k:
            draft_ids = F.pad(draft_ids, (0, k - draft_ids.shape[1]), value=-1)
            if proposal.probs is not None:
                proposal = proposal._replace(probs=F.pad(proposal.probs, (0, 0, 0, k - proposal.probs.shape[1])))
        query = torch.cat([last, draft_ids.clamp(min=0)], dim=1)  # [B, k + 1]
        logits = self.target.forward(query, self.cache)  # [B, k + 1, V]
        context = batch.context(draft_ids)
        if greedy:
            out = greedy_accept(strategy.argmax(logits, context), draft_ids)
        else:
            target_probs = strategy.probs(logits, context)  # [B, k + 1, V]
            bonus = strategy.sample(target_probs[:, -1])[:, None]  # [B, 1]
            if self.typical is not None:
                out = self.typical(target_probs, bonus, proposal.probs, draft_ids)
            else:
                out = rejection_sample(target_probs[:, :k], bonus, proposal.probs, draft_ids,
                                       strategy.random.uniform(k), strategy.random.exponential(logits.shape[-1]))
        return self._commit(batch, self.cache, self.proposer, out, logits, draft_ids, counted=True), k

    def _commit(self, batch: Batch, cache: KVCache, proposer: Proposer | None, emitted: Tensor, logits: Tensor,
                draft_ids: Tensor | None, counted: bool = False) -> list[Request]:
        """Cut each row's block at its stop token or max_tokens, append it, roll the caches back,
        drop the rows that finished (returned).

        emitted: [B, m] tokens of this step, -1 padded; logits: [B, m, V] the target's raw logits
        they were chosen from; draft_ids: [B, k], or None for a step without drafts; counted: a
        step of the metrics (the prefill's first token is not one). A row whose own host-side work
        (stop strings, grammar, log-probability tokens) raises fails alone: finish_reason "error".
        The blocks (and drafts) come to the host in the step's one sync; the cut is worked out there,
        row by row, where a handful of tokens costs less than the tensor ops that would do it.
        """
        width = emitted.shape[1]
        host = (emitted if draft_ids is None else torch.cat([emitted, draft_ids], dim=1)).tolist()  # the sync
        cuts = [self._cut(batch, row, values[:width]) for row, values in enumerate(host)]
        kept = torch.tensor([n for n, _ in cuts], dtype=torch.long, device=emitted.device)  # [B]
        positions = torch.arange(width, device=emitted.device)
        batch.tokens.scatter_(1, batch.lengths[:, None] + positions, emitted.clamp(min=0))
        batch.lengths += kept
        accepted = [sum(t >= 0 for t in values[:width]) - 1 for values in host]
        drafted = [sum(t >= 0 for t in values[width:]) for values in host]
        self.step_counts = (accepted, drafted)
        scores = [t.tolist() for t in L.token_logprobs(logits, emitted, self.num_top)] if self.want_logprobs else None
        now = time.perf_counter()
        failures = batch.strategy.take_failures()  # {row: error} from per-row processing this step
        finished = []
        for row, (request, values, (n, stop)) in enumerate(zip(batch.requests, host, cuts)):
            batch.host_lengths[row] += n
            try:
                if row in failures:
                    raise failures[row]
                self._record(request, values[:n], stop, accepted[row], drafted[row], batch.eos_token_ids,
                             [s[row][:n] for s in scores] if scores is not None else None, counted)
            except Exception as error:  # noqa: BLE001 - the row's own work failed: it fails alone
                request.finish_reason, request.error = "error", f"{type(error).__name__}: {error}"
            if not counted:  # the prefill's token: the first
                request.metrics.first_token_s = now - request.start_time
            if request.finished:
                request.metrics.elapsed_s = now - request.start_time
                self.stop_strings.pop(id(request), None)
                finished.append(request)
        if finished:
            gone = {id(r) for r in finished}
            batch.select([i for i, r in enumerate(batch.requests) if id(r) not in gone], [cache], proposer)
        if batch.requests:
            max_length = max(batch.host_lengths)
            cache.rollback(batch.lengths - 1, max_length - 1)
            if proposer is not None:  # whether some row kept its whole block
                proposer.accept(batch.lengths, max_length, any(n == width for n, _ in cuts))
        return finished

    @staticmethod
    def _cut(batch: Batch, row: int, block: list[int]) -> tuple[int, bool]:
        """How many tokens of a row's block (-1 padded) it keeps: up to and including its first stop
        token, and no more than its max_tokens leaves; and whether a stop token ended it."""
        request, stops = batch.requests[row], batch.host_stop_ids[row]
        room = request.max_tokens - (batch.host_lengths[row] - len(request.prompt_token_ids))
        emitted = sum(t >= 0 for t in block)
        first_stop = next((i for i, t in enumerate(block[:emitted]) if t in stops), emitted)
        kept = min(emitted, first_stop + 1, room)
        return kept, first_stop < kept

    def _record(self, request: Request, new: list[int], stop: bool, accepted: int, drafted: int,
                eos_token_ids: list[int], scores: list[list] | None, counted: bool) -> None:
        """One row's share of a commit, on the host: its new tokens, figures and finish."""
        n = len(new)
        request.output_token_ids.extend(new)
        if scores is not None:
            self._add_logprobs(request, new, scores)
        if request.guide is not None:
            request.guide.accept(new)
        m = request.metrics
        m.num_generated += n
        if counted:
            m.num_steps += 1
            m.num_drafted += drafted
            m.num_accepted += accepted
            for i in range(drafted):
                m.drafted_per_position[i] += 1
            for i in range(accepted):
                m.accepted_per_position[i] += 1
        checker = self.stop_strings.get(id(request))
        if checker is not None and checker.extend(n):
            request.finish_reason, request.text = "stop", checker.text
            m.num_generated = len(request.output_token_ids)
        elif stop:
            last = request.output_token_ids[-1]
            request.finish_reason = "stop"
            request.stop_reason = None if last in eos_token_ids else last
        elif m.num_generated >= request.max_tokens:
            request.finish_reason = "length"

    def _add_logprobs(self, request: Request, new: list[int], scores: list[list]) -> None:
        chosen = scores[0]
        request.cumulative_logprob = (request.cumulative_logprob or 0.0) + sum(chosen)
        if request.params.logprobs is not None:
            entries = L.as_dicts(new, *scores, request.params.logprobs, self._decode_token)
            request.logprobs = (request.logprobs or []) + entries

    def _decode_token(self, token: int) -> str | None:
        return self.decode([token], None) if self.decode is not None else None
