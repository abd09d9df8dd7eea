"""Synthetic pairs (bench/synthetic.py) and HF's static-cache baseline (bench/methods.py)."""

from __future__ import annotations

import pytest
import torch

from speculative import LLM, SamplingParams
from speculative.bench.methods import HFMethod, hf_static
from speculative.bench.synthetic import SIZES, build_pair
from speculative.cli import main
from speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def pair():
    return build_pair("tiny", dtype=torch.float32, acceptance=0.8)


def test_the_draft_is_the_targets_first_layers(pair) -> None:
    target, draft = pair.target, pair.draft
    assert len(draft.model.layers) == SIZES["tiny"].draft_layers < len(target.model.layers)
    shared = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in shared for p in draft.parameters())  # no copies
    assert draft.lm_head is target.lm_head and draft.model.norm is target.model.norm


def test_damping_calibrates_the_agreement(pair) -> None:
    assert 0.0 < pair.damping < 1.0
    assert pair.agreement == pytest.approx(0.8, abs=0.1)
    assert "synthetic" in pair.describe() and "means nothing" in pair.describe()
    undamped = build_pair("tiny", dtype=torch.float32, acceptance=0.3)
    assert undamped.damping > pair.damping and undamped.agreement == pytest.approx(0.3, abs=0.1)


def test_speculation_on_a_synthetic_pair_is_exact_and_accepts_near_the_calibration(pair) -> None:
    prompts = [{"prompt_token_ids": torch.randint(0, 8192, (n,)).tolist()} for n in (7, 19, 33, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    alone = LLM(pair.target).generate(prompts, params)
    llm = LLM(pair.target, draft_model=pair.draft, speculative_config=SpeculativeConfig("draft_model", 4))
    drafted = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in alone]
    metrics = [o.metrics for o in drafted]
    tokens_per_step = 1 + sum(m.num_accepted for m in metrics) / sum(m.num_steps for m in metrics)
    assert tokens_per_step > 2.0  # about 3.4 at a per-token acceptance of 0.8, 1.3 undamped


def test_bad_synthetic_arguments_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="synthetic must be one of"):
        build_pair("13b")
    with pytest.raises(ValueError, match="acceptance must be in"):
        build_pair("tiny", acceptance=1.0)
    assert main(["bench", "--synthetic", "tiny", "--model", "models/demo/target"]) == 2


@pytest.mark.slow
def test_hf_static_is_hf_generate_compiled_once(pair) -> None:
    static = hf_static(pair.target, 0, cache_length=96)
    plain = HFMethod("hf_generate", "HF generate", "hf", model=pair.target, pad_token_id=0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for n in (10, 40, 25, 60):  # prompts of every length share the one cache: one compile
        prompt = torch.randint(0, 8192, (n,)).tolist()
        assert static.generate([prompt], 24).token_ids == plain.generate([prompt], 24).token_ids
    # transformers' own static cache, sized per call, compiles a second, dynamic graph for a longer one
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
