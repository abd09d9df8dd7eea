"""What `LLM.generate` returns: vLLM's RequestOutput shape, with speculation figures per request."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SpeculationMetrics:
    """Speculation figures of one request (vLLM v1's meanings).

    num_steps: target forward passes after the prefill (speculative or plain steps).
    num_drafted: draft tokens proposed; num_accepted: draft tokens kept.
    accepted_per_position / drafted_per_position: the same counts at each draft position 1..k.
    acceptance_histogram: steps that drafted, by how many drafts they accepted: [j] = steps that
        accepted exactly j (j in [0, the longest proposal]); acceptance_by_draft_length: the same per
        proposal length, {d: [steps of d drafts that accepted j, j in [0, d]]} (k varies under
        adaptive k, and where a proposer comes up short).
    num_generated: tokens emitted; elapsed_s: wall time from the engine's admission of the request
        (its prefill's start) to its last token; first_token_s: to its first token (the prefill and
        the first sampling: the time to first token). For a prompt with several sequences (n,
        best_of) the figures add up over all of them, the times being the longest.
    """

    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_generated: int = 0
    elapsed_s: float = 0.0
    first_token_s: float = 0.0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)
    acceptance_by_draft_length: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:  # from JSON (SampleState), the lengths come back as strings
        self.acceptance_by_draft_length = {int(d): c for d, c in self.acceptance_by_draft_length.items()}

    def record_step(self, drafted: int, accepted: int) -> None:
        """Count a target step after the first token that verified `drafted` drafts (0: a plain step)
        and kept `accepted` of them."""
        self.num_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        if drafted:
            _add_at(self.acceptance_histogram, accepted, 1)
            _add_at(self.acceptance_by_draft_length.setdefault(drafted, [0] * (drafted + 1)), accepted, 1)

    def merge(self, other: SpeculationMetrics) -> None:
        """Add another sequence's figures to these."""
        for name in ("num_steps", "num_drafted", "num_accepted", "num_generated"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.elapsed_s = max(self.elapsed_s, other.elapsed_s)
        self.first_token_s = max(self.first_token_s, other.first_token_s)
        self.drafted_per_position = [
            a + b for a, b in zip(self.drafted_per_position, other.drafted_per_position)
        ]
        self.accepted_per_position = [
            a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)
        ]
        for j, count in enumerate(other.acceptance_histogram):
            _add_at(self.acceptance_histogram, j, count)
        for d, counts in other.acceptance_by_draft_length.items():
            mine = self.acceptance_by_draft_length.setdefault(d, [0] * (d + 1))
            self.acceptance_by_draft_length[d] = [a + b for a, b in zip(mine, counts)]

    @classmethod
    def total(cls, metrics: Iterable[SpeculationMetrics]) -> SpeculationMetrics:
        """A new record adding up `metrics` (the sequences or prompts of one request)."""
        metrics = list(metrics)
        width = max((len(m.drafted_per_position) for m in metrics), default=0)
        total = cls(drafted_per_position=[0] * width, accepted_per_position=[0] * width)
        for m in metrics:
            total.merge(m)
        return total

    @property
    def num_drafts(self) -> int:
        """Steps that verified at least one draft."""
        return sum(self.acceptance_histogram)

    def vllm_fields(self) -> dict:
        """The request's speculation figures in vLLM's names (its spec-decode metrics, per request):
        mean_acceptance_length (1 + accepted / steps), draft_acceptance_rate, num_drafts,
        num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos, acceptance_histogram and
        acceptance_histogram_by_draft_length (keys as strings, for JSON)."""
        return {
            "mean_acceptance_length": self.mean_accepted_length,
            "draft_acceptance_rate": self.acceptance_rate,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_drafted,
            "num_accepted_tokens": self.num_accepted,
            "num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "acceptance_histogram": list(self.acceptance_histogram),
            "acceptance_histogram_by_draft_length": {
                str(d): list(counts) for d, counts in sorted(self.acceptance_by_draft_length.items())
            },
        }

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Acceptance rate at each draft position: accepted_i / drafted_i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target step: 1 + accepted / steps."""
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / elapsed wall time (the prefill included)."""
        return self.num_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first / the time after the first token: the decoding speed alone."""
        decoding = self.elapsed_s - self.first_token_s
        return (self.num_generated - 1) / decoding if self.num_generated > 1 and decoding > 0 else 0.0


@dataclass
class Logprob:
    """The target's log-probability of a token (raw logits, before any sampling processor), its rank
    among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence.

    finish_reason: "stop" (EOS, a stop token or a stop string) or "length" (max_tokens).
    stop_reason: the stop token id or stop string that ended it; None for EOS or length.
    cumulative_logprob: sum of the chosen tokens' log-probabilities (when logprobs or best_of ask).
    logprobs: per output token, {token id: Logprob} for the chosen token and the top `logprobs`.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The result of one prompt. num_cached_tokens: its prompt's tokens that the prefix cache held
    (their prefill skipped; 0 without prefix caching)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = True
    metrics: SpeculationMetrics = field(default_factory=SpeculationMetrics)
    num_cached_tokens: int = 0


def _add_at(counts: list[int], index: int, amount: int) -> None:
    """counts[index] += amount, the list grown with zeros as needed."""
    counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += amount
