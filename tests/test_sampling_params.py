"""Every SamplingParams validation error, with its message (vLLM's rules)."""

from __future__ import annotations

import pytest

from speculative import SamplingParams

CASES = [
    (dict(n=0), "n must be an integer >= 1; got 0"),
    (dict(n=2, best_of=1), r"best_of must be None or an integer >= n \(2\); got 1"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]; got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]; got -3"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0; got 0.0"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0; got -0.1"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]; got 0.0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), r"top_k must be -1 \(disabled\) or an integer >= 1; got 0"),
    (dict(top_k=-2), r"top_k must be -1 \(disabled\) or an integer >= 1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]; got 1.5"),
    (dict(seed="7"), "seed must be an integer or None; got '7'"),
    (dict(stop=[""]), "stop must be non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of integers >= 0"),
    (dict(bad_words=[""]), "bad_words must be a list of non-empty strings"),
    (dict(ignore_eos=1), "ignore_eos must be a bool; got 1"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be a bool"),
    (dict(max_tokens=0), "max_tokens must be None or an integer >= 1; got 0"),
    (dict(max_tokens=4, min_tokens=5), r"min_tokens must be an integer in \[0, max_tokens \(4\)\]; got 5"),
    (dict(min_tokens=-1), "min_tokens must be an integer in"),
    (dict(logprobs=-1), "logprobs must be None or an integer >= 0; got -1"),
    (dict(prompt_logprobs=-2), "prompt_logprobs must be None or an integer >= 0"),
    (dict(logits_processors=[3]), "logits_processors must be a list of callables"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be None or an integer >= 1; got 0"),
    (dict(guided_decoding="json"), "guided_decoding must be a GuidedDecodingParams or None"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias must be a dict of token id \(>= 0\) -> finite bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias must be a dict"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be None or a non-empty list of integers >= 0"),
    (dict(stop=["x"], detokenize=False), "stop must be empty when detokenize is False"),
    (dict(temperature=0.0, n=2), r"n must be 1 with greedy sampling \(temperature 0\)"),
    (dict(temperature=0.0, best_of=3), "best_of must be 1 with greedy sampling"),
]


@pytest.mark.parametrize(
    "kwargs,message", CASES, ids=[next(iter(c[0])) + str(i) for i, c in enumerate(CASES)]
)
def test_validation_error(kwargs, message) -> None:
    with pytest.raises(ValueError, match="SamplingParams." + message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams(stop="END", logit_bias={3: 250.0, 4: -1e9})
    assert p.stop == ["END"] and p.stop_token_ids == [] and p.bad_words == []
    assert p.logit_bias == {3: 100.0, 4: -100.0}  # clamped as vLLM does
    assert p.sampled_sequences == 1 and SamplingParams(n=2, best_of=5).sampled_sequences == 5
    assert SamplingParams(temperature=0).greedy


def test_token_ids_checked_against_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"allowed_token_ids must be token ids in \[0, 10\); got \[12\]"):
        SamplingParams(allowed_token_ids=[3, 12]).token_ids_in_vocabulary(10)
    with pytest.raises(ValueError, match=r"logit_bias must be token ids in \[0, 10\)"):
        SamplingParams(logit_bias={10: 1.0}).token_ids_in_vocabulary(10)
