"""The speculative step loop over a static batch of requests.

One step, for all active rows at once (B rows, k draft tokens, V vocabulary):
  1. the proposer drafts x_1..x_k after each row's context ([B, k], -1 where it has nothing);
  2. the target scores [last token, x_1..x_k] in one forward: logits [B, k+1, V];
  3. the acceptance rule keeps a prefix of the drafts and adds one token of the target's own
     (recovered or bonus): [B, k+1] with -1 padding;
  4. EOS, stop tokens and max_tokens cut each row's block; the blocks are appended to the context;
  5. both KV caches are rolled back to the kept context (a length change), and finished rows leave
     the batch so that they stop costing compute.
The only host-device synchronisation of a step is the read of the kept tokens and counts in (4).
Cache invariant between steps: the target's cache holds the context minus its last token.
With no proposer the same loop is plain autoregressive decoding (k = 0): the baseline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from speculative.acceptance import TypicalAcceptanceSampler, greedy_accept, rejection_sample
from speculative.engine.outputs import SpeculationMetrics
from speculative.inference import ModelInferencer
from speculative.models.base import LanguageModel
from speculative.proposers.base import Proposer
from speculative.sampling import SampleStrategy
from speculative.sampling_params import SamplingParams


@dataclass
class Request:
    """Host-side record of one sequence being generated."""

    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    metrics: SpeculationMetrics = field(default_factory=SpeculationMetrics)


class Engine:
    """Runs batches of requests through prefill and speculative (or plain) steps.

    target: the model whose distribution the output follows.
    proposer: the drafter, or None for plain autoregressive decoding.
    num_speculative_tokens: k per step (ignored without a proposer).
    typical: a TypicalAcceptanceSampler to use instead of the lossless rejection rule.
    eos_token_ids: tokens that finish a row unless its params say ignore_eos.
    generator: the generator of rows without a seed of their own.
    """

    def __init__(self, target: LanguageModel, proposer: Proposer | None, num_speculative_tokens: int,
                 eos_token_ids: Sequence[int], generator: torch.Generator,
                 typical: TypicalAcceptanceSampler | None = None) -> None:
        self.target = target
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        self.typical = typical
        self.eos_token_ids = list(eos_token_ids)
        self.generator = generator
        self.inferencer = ModelInferencer(target)

    @torch.inference_mode()
    def run(self, requests: list[Request]) -> None:
        """Generate every request to completion, filling in its outputs and metrics."""
        start_time = time.perf_counter()
        device, k = self.target.device, self.k
        batch = _Batch(requests, self.eos_token_ids, k, self.target.vocab_size, device, self.generator)
        self.cache = self.target.new_cache(len(requests), batch.capacity)
        width = max(batch.host_lengths)
        first = self.inferencer.prefill(batch.tokens[:, :width], self.cache, batch.strategy,
                                        num_tokens=batch.lengths, all_logits=False)
        if self.proposer is not None:
            self.proposer.start(batch.tokens, batch.lengths)
        self._commit(batch, first.token_ids, None, start_time, count_step=False)
        while batch.requests:
            self._step(batch, start_time)

    def _step(self, batch: _Batch, start_time: float) -> None:
        k, strategy = self.k, batch.strategy
        last = batch.tokens.gather(1, batch.lengths[:, None] - 1)  # [B, 1]
        if self.proposer is None:
            logits = self.target.forward(last, self.cache)  # [B, 1, V]
            self._commit(batch, strategy.next_tokens(logits[:, 0])[:, None], None, start_time)
            return
        proposal = self.proposer.propose(batch.tokens, batch.lengths, k, strategy)
        draft_ids = proposal.token_ids  # [B, k], -1 = nothing proposed
        query = torch.cat([last, draft_ids.clamp(min=0)], dim=1)  # [B, k + 1]
        logits = self.target.forward(query, self.cache)  # [B, k + 1, V]
        if self.typical is None and strategy.all_greedy:
            out = greedy_accept(logits.argmax(dim=-1), draft_ids)
        else:
            target_probs = strategy.probs(logits)  # [B, k + 1, V]
            bonus = strategy.sample(target_probs[:, -1])[:, None]  # [B, 1]
            if self.typical is not None:
                out = self.typical(target_probs, bonus, proposal.probs, draft_ids)
            else:
                out = rejection_sample(target_probs[:, :k], bonus, proposal.probs, draft_ids,
                                       strategy.random.uniform(k), strategy.random.exponential(logits.shape[-1]))
        self._commit(batch, out, draft_ids, start_time)

    def _commit(self, batch: _Batch, emitted: Tensor, draft_ids: Tensor | None, start_time: float,
                count_step: bool = True) -> None:
        """Cut each row's block at its stop token or max_tokens, append it, roll caches back.

        emitted: [B, m] tokens of this step, -1 padded; draft_ids: [B, k] or None (prefill, plain).
        """
        width = emitted.shape[1]
        positions = torch.arange(width, device=emitted.device)
        num_emitted = (emitted >= 0).sum(dim=1)  # [B]
        is_stop = (emitted[:, :, None] == batch.stop_ids[:, None, :]).any(dim=-1) & (emitted >= 0)
        first_stop = torch.where(is_stop, positions, width).min(dim=1).values  # [B], width = none
        remaining = batch.max_tokens - batch.num_generated  # [B]
        kept = torch.minimum(torch.minimum(num_emitted, first_stop + 1), remaining)  # [B]
        stopped = first_stop < kept
        batch.tokens.scatter_(1, batch.lengths[:, None] + positions, emitted.clamp(min=0))
        batch.lengths += kept
        batch.num_generated += kept
        num_drafted = (draft_ids >= 0).sum(dim=1) if draft_ids is not None else torch.zeros_like(kept)
        columns = [emitted, kept[:, None], stopped[:, None], (num_emitted - 1)[:, None], num_drafted[:, None]]
        host = torch.cat(columns, dim=1).tolist()  # the step's one host sync
        now = time.perf_counter()
        finished = []
        for row, (request, values) in enumerate(zip(batch.requests, host)):
            n, stop, accepted, drafted = values[width:]
            request.output_token_ids.extend(values[:n])
            batch.host_lengths[row] += n
            m = request.metrics
            m.num_generated += n
            if count_step:
                m.num_steps += 1
                m.num_drafted += drafted
                m.num_accepted += accepted
                for i in range(drafted):
                    m.drafted_per_position[i] += 1
                for i in range(accepted):
                    m.accepted_per_position[i] += 1
            if stop or m.num_generated >= request.params.max_tokens:
                last = request.output_token_ids[-1]
                request.finish_reason = "stop" if stop else "length"
                request.stop_reason = last if stop and last not in self.eos_token_ids else None
                m.elapsed_s = now - start_time
                finished.append(row)
        if finished:
            batch.drop(finished, self.cache, self.proposer)
        if batch.requests:
            max_length = max(batch.host_lengths)
            self.cache.rollback(batch.lengths - 1, max_length - 1)
            if self.proposer is not None:
                self.proposer.accept(batch.lengths, max_length)


class _Batch:
    """Device-side state of the active rows, and their host-side records.

    tokens: [B, capacity + k + 1] contexts (prompt + output), lengths: [B] context lengths,
    stop_ids: [B, s] tokens that finish each row (-1 padded), max_tokens / num_generated: [B].
    """

    def __init__(self, requests: list[Request], eos_token_ids: list[int], k: int, vocab_size: int,
                 device: torch.device, generator: torch.Generator) -> None:
        self.requests = list(requests)
        for r in requests:
            r.metrics.drafted_per_position = [0] * k
            r.metrics.accepted_per_position = [0] * k
        self.host_lengths = [len(r.prompt_token_ids) for r in requests]
        self.capacity = max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests) + k + 1
        self.tokens = torch.zeros(len(requests), self.capacity + k + 1, dtype=torch.long, device=device)
        for row, r in enumerate(requests):
            self.tokens[row, : len(r.prompt_token_ids)] = torch.tensor(r.prompt_token_ids)
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=device)
        stops = [sorted(set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(eos_token_ids)))
                 for r in requests]
        width = max(1, max(len(s) for s in stops))
        self.stop_ids = torch.tensor([s + [-1] * (width - len(s)) for s in stops], dtype=torch.long, device=device)
        self.max_tokens = torch.tensor([r.params.max_tokens for r in requests], dtype=torch.long, device=device)
        self.num_generated = torch.zeros_like(self.max_tokens)
        self.strategy = SampleStrategy([r.params for r in requests], vocab_size, device, generator)

    def drop(self, rows: list[int], cache, proposer: Proposer | None) -> None:
        """Remove finished `rows` from every per-row structure."""
        gone = set(rows)
        keep = [i for i in range(len(self.requests)) if i not in gone]
        self.requests = [self.requests[i] for i in keep]
        self.host_lengths = [self.host_lengths[i] for i in keep]
        self.strategy.select_rows(keep)
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        for name in ("tokens", "lengths", "stop_ids", "max_tokens", "num_generated"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        cache.select_rows(index)
        if proposer is not None:
            proposer.select_rows(index)
