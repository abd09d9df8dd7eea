"""Engine configuration dataclasses, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class SpeculativeConfig:
    """How the engine speculates (vLLM's `speculative_config`).

    method: "draft_model" (a small model, `LLM(draft_model=...)`) or "ngram" (prompt lookup).
    num_speculative_tokens: k, tokens proposed per step. 1 <= k <= 32.
    acceptance: "rejection" (lossless: the output follows the target's distribution exactly) or
        "typical" (Medusa's typical acceptance: faster at temperature > 0, NOT lossless).
    posterior_threshold: typical acceptance's upper bound on the acceptance threshold. [0, 1].
    posterior_alpha: typical acceptance's entropy scale: threshold = min(posterior_threshold,
        posterior_alpha * exp(-entropy)). >= 0.
    prompt_lookup_min / prompt_lookup_max: n-gram sizes tried by the "ngram" method, longest first.
        1 <= min <= max.
    """

    method: Literal["draft_model", "ngram"] = "draft_model"
    num_speculative_tokens: int = 4
    acceptance: Literal["rejection", "typical"] = "rejection"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    def __post_init__(self) -> None:
        _check(self.method in ("draft_model", "ngram"), "method", self.method, '"draft_model" or "ngram"')
        k = self.num_speculative_tokens
        _check(_is_int(k) and 1 <= k <= 32, "num_speculative_tokens", k, "an integer in [1, 32]")
        _check(self.acceptance in ("rejection", "typical"), "acceptance", self.acceptance,
               '"rejection" or "typical"')
        _check(isinstance(self.posterior_threshold, (int, float)) and 0 <= self.posterior_threshold <= 1,
               "posterior_threshold", self.posterior_threshold, "in [0, 1]")
        _check(isinstance(self.posterior_alpha, (int, float)) and self.posterior_alpha >= 0,
               "posterior_alpha", self.posterior_alpha, ">= 0")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, "prompt_lookup_min",
               self.prompt_lookup_min, "an integer >= 1")
        _check(_is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "prompt_lookup_max", self.prompt_lookup_max, f"an integer >= prompt_lookup_min "
               f"({self.prompt_lookup_min})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SpeculativeConfig.{name} must be {allowed}; got {value!r}")
