"""The registries of speculative methods and acceptance rules: a new drafter is a proposer and one
registered MethodConfig; the configs validate themselves; vLLM's flat form round-trips."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from conftest import tiny_model
from exactness import assert_greedy_equal, hf_greedy

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.fields import check, is_int
from speculative.methods import (
    METHODS,
    BuildContext,
    Built,
    MethodConfig,
    NgramConfig,
    SuffixConfig,
    register,
)
from speculative.proposers import Proposal

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], [3, 4, 3, 4, 3, 4]]


class RepeatProposer:
    """Proposes the context's last token `times` times (or k, whichever is less): a deterministic
    proposer of the narrowest kind, to show that a drafter needs nothing but the protocol."""

    def __init__(self, times: int) -> None:
        self.times = times

    def add_rows(self, tokens, lengths) -> None:
        pass

    def propose(self, tokens, lengths, num_tokens, strategy) -> Proposal:
        last = tokens.gather(1, (lengths - 1)[:, None])
        return Proposal(last.expand(-1, min(num_tokens, self.times)).contiguous(), None)

    def on_commit(self, lengths, max_length, most_kept) -> None:
        pass

    def on_finish(self, tokens, lengths, rows) -> None:
        pass

    def select_rows(self, rows) -> None:
        pass


@dataclass
class RepeatConfig(MethodConfig):
    """The test's method: `times` >= 1 repeats."""

    times: int = field(default=2, metadata={"help": "repeats of the last token"})

    def __post_init__(self) -> None:
        check(is_int(self.times) and self.times >= 1, "times", self.times, "an integer >= 1", "RepeatConfig")

    def build(self, context: BuildContext) -> Built:
        return Built(RepeatProposer(self.times))


@pytest.fixture
def repeat_method():
    register("repeat")(RepeatConfig)
    yield "repeat"
    del METHODS["repeat"]


def test_a_registered_method_runs_exactly_with_its_options(repeat_method) -> None:
    target = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=16)
    config = SpeculativeConfig.from_dict({"method": repeat_method, "num_speculative_tokens": 4, "times": 3})
    assert config.options == RepeatConfig(times=3)
    llm = LLM(target, speculative_config=config)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        want = hf_greedy(target, prompt, 16, 1)
        assert_greedy_equal(target, prompt, out.outputs[0].token_ids, want)
        assert 0 < out.metrics.num_drafted <= 3 * out.metrics.num_steps  # its option took effect
    with pytest.raises(ValueError, match=r"RepeatConfig.times must be an integer >= 1; got 0"):
        SpeculativeConfig.from_dict({"method": repeat_method, "times": 0})
    with pytest.raises(ValueError, match="uses no draft model"):
        LLM(target, draft_model=target, speculative_config=SpeculativeConfig(method=repeat_method))


def test_registering_a_name_twice_or_a_non_config_is_refused() -> None:
    with pytest.raises(ValueError, match="'ngram' is registered twice"):
        register("ngram")(RepeatConfig)
    with pytest.raises(TypeError, match="must be a dataclass subclassing MethodConfig"):
        register("plain")(RepeatProposer)
    assert "plain" not in METHODS


def test_flat_dicts_route_options_to_the_method_and_name_what_does_not_belong() -> None:
    flat = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 30}
    config = SpeculativeConfig.from_dict(flat)
    assert config.options == SuffixConfig(suffix_decoding_max_tree_depth=30)
    assert SpeculativeConfig.from_dict(config.to_dict()) == config
    with pytest.raises(
        ValueError, match=r"no field\(s\) \['prompt_lookup_max'\].*'suffix' takes the options"
    ):
        SpeculativeConfig.from_dict({"method": "suffix", "prompt_lookup_max": 4})
    with pytest.raises(ValueError, match="options must be a SuffixConfig"):
        SpeculativeConfig(method="suffix", options=NgramConfig())
    with pytest.raises(ValueError, match=r"method must be one of \"dflash\", \"draft_model\", .*; got .medu"):
        SpeculativeConfig(method="medusa")
    llm = LLM(tiny_model("llama"), speculative_config={"method": "ngram", "prompt_lookup_max": 2})
    assert llm.speculative_config.options == NgramConfig(prompt_lookup_max=2)


def test_every_built_in_method_declares_what_it_needs() -> None:
    assert {"draft_model", "ngram", "suffix", "eagle", "eagle3"} <= set(METHODS)
    for name, config in METHODS.items():
        assert dataclasses.is_dataclass(config), name
        for f in dataclasses.fields(config):
            assert f.metadata.get("help"), f"{name}'s option {f.name} has no help for its flag"
    assert METHODS["eagle3"].reads_hidden_states and METHODS["draft_model"].uses_draft_model
    assert METHODS["ngram"].model_free and not METHODS["draft_model"].model_free


def test_acceptance_rules_are_registered_by_name() -> None:
    from speculative.acceptance import RejectionSampler, TypicalAcceptanceSampler
    from speculative.methods.acceptance import acceptance_rule

    assert isinstance(acceptance_rule(SpeculativeConfig(method="ngram")), RejectionSampler)
    typical = acceptance_rule(SpeculativeConfig(method="ngram", acceptance="typical", posterior_alpha=0.5))
    assert isinstance(typical, TypicalAcceptanceSampler) and typical.posterior_alpha == 0.5
    with pytest.raises(ValueError, match='acceptance must be one of "rejection", "typical"'):
        SpeculativeConfig(method="ngram", acceptance="lenient")


def test_the_registries_load_without_torch() -> None:
    code = (
        "import sys, speculative.methods, speculative.config;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_engine_checks_proposer_capabilities_once() -> None:
    from speculative.proposers import FeatureProposer, LearningProposer

    suffix = SuffixConfig().proposer()
    assert isinstance(suffix, LearningProposer) and not isinstance(suffix, FeatureProposer)
    assert not isinstance(RepeatProposer(1), LearningProposer)
    llm = LLM(tiny_model("llama"), speculative_config=SpeculativeConfig(method="suffix"))
    assert llm.engine.hidden_layers is None
    llm.generate([[1, 2, 1, 2, 1]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(llm.engine.proposer.cache) == 1
    llm.engine.clear_proposer_cache()
    assert len(llm.engine.proposer.cache) == 0
