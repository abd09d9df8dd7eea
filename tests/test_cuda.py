"""On a CUDA GPU (skipped elsewhere): compiled, graph-replayed decoding gives the eager and Hugging Face
greedy text, rows joining and leaving a graphed batch give their solo outputs, and a speculative step
synchronizes the host with the device a bounded number of times."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import DEMO_DIR

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[15, 2005, 77, 1024, 9], [300, 41], [12, 13, 14, 15, 16, 17, 18, 19, 20], [512, 8, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _llm(compile: bool) -> LLM:
    return LLM(
        str(DEMO_DIR / "target"),
        draft_model=str(DEMO_DIR / "draft"),
        speculative_config=SpeculativeConfig("draft_model", 4),
        dtype="float32",
        device="cuda",
        compile=compile,
    )


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@torch.no_grad()
def test_graph_replayed_greedy_is_eager_and_hf() -> None:
    hf = AutoModelForCausalLM.from_pretrained(str(DEMO_DIR / "target"), dtype=torch.float32).cuda().eval()
    expected = [
        hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert _tokens(_llm(compile=False).generate(prompts, GREEDY)) == expected
    compiled = _llm(compile=True)
    for _ in range(2):  # the second run replays the graphs the first one recorded
        assert _tokens(compiled.generate(prompts, GREEDY)) == expected


def test_rows_joining_and_leaving_a_graphed_batch_give_their_solo_outputs() -> None:
    llm = _llm(compile=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 30, 7, 20)]
    alone = [
        llm.generate([{"prompt_token_ids": p}], q)[0].outputs[0].token_ids for p, q in zip(PROMPTS, params)
    ]
    engine = llm.engine
    sequences = [llm.make_sequences(p, q, i) for i, (p, q) in enumerate(zip(PROMPTS, params))]
    engine.add(sequences[0])
    engine.step()
    engine.add(sequences[1] + sequences[2])
    engine.step()
    engine.add(sequences[3])
    while engine.sequences:
        engine.step()
    assert [group[0].output_token_ids for group in sequences] == alone


def test_host_syncs_per_speculative_step() -> None:
    """At most one host-device synchronization per step (the acceptance's read-back), counted by
    torch's sync debug mode, beyond the prefill's."""
    llm = _llm(compile=True)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    llm.generate(prompt, GREEDY)  # graphs recorded
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output = llm.generate(prompt, GREEDY)[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    steps = output.metrics.num_steps
    assert syncs <= steps + 2, f"{syncs} host syncs over {steps} steps"
