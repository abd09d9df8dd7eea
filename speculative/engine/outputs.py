"""What `LLM.generate` returns: vLLM's RequestOutput shape, with speculation figures per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationMetrics:
    """Speculation figures of one request (vLLM v1's meanings).

    num_steps: target forward passes after the prefill (speculative or plain steps).
    num_drafted: draft tokens proposed; num_accepted: draft tokens kept.
    accepted_per_position / drafted_per_position: the same counts at each draft position 1..k.
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
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = True
    metrics: SpeculationMetrics = field(default_factory=SpeculationMetrics)
