"""SamplingParams: how one request is sampled, with vLLM's names and meanings.

Follows the OpenAI completions API and vLLM (seed 004). Every field is validated at construction,
and a bad value raises a ValueError that names the field and its allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling parameters for one request.

    temperature: randomness of sampling; 0 means greedy. Range [0, inf).
    top_p: cumulative probability of the top tokens to keep. Range (0, 1]; 1 keeps all.
    top_k: number of top tokens to keep; -1 keeps all. -1 or >= 1.
    seed: the request's own random seed: the same seed gives the same text whatever else is in
        the batch. None draws from the engine's generator.
    max_tokens: maximum number of tokens to generate. >= 1.
    ignore_eos: keep generating after the EOS token.
    stop_token_ids: token ids that end the generation; they are kept in the output token ids.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(_is_number(self.temperature) and 0.0 <= self.temperature < float("inf"),
               "temperature", self.temperature, "a finite number >= 0")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
               "top_k", self.top_k, "-1 (disabled) or an integer >= 1")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an integer or None")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "an integer >= 1")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of integers >= 0")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """True when the request samples greedily (temperature 0)."""
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {allowed}; got {value!r}")
