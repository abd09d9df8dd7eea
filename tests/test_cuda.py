"""On a CUDA GPU (skipped elsewhere): compiled, graph-replayed decoding gives the eager and Hugging Face
greedy text, rows joining and leaving a graphed batch give their solo outputs, and a decoding step, plain
or speculative, synchronizes the host with the device once."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo import DEMO_DIR
from speculative.transfer import to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[15, 2005, 77, 1024, 9], [300, 41], [12, 13, 14, 15, 16, 17, 18, 19, 20], [512, 8, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _llm(compile: bool, speculative: bool = True) -> LLM:
    return LLM(
        str(DEMO_DIR / "target"),
        draft_model=str(DEMO_DIR / "draft") if speculative else None,
        speculative_config=SpeculativeConfig("draft_model", 4) if speculative else None,
        dtype="float32",
        device="cuda",
        compile=compile,
    )


@pytest.fixture(scope="module")
def compiled() -> LLM:
    """The compiled pair, shared: its graphs compile once for the module (most of its time)."""
    return _llm(compile=True)


@pytest.fixture(scope="module")
def hf_greedy() -> list[list[int]]:
    """HF `generate`'s greedy continuation of each of PROMPTS."""
    hf = AutoModelForCausalLM.from_pretrained(str(DEMO_DIR / "target"), dtype=torch.float32).cuda().eval()
    return [
        hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_graph_replayed_greedy_is_eager_and_hf(compiled: LLM, hf_greedy: list[list[int]]) -> None:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert _tokens(_llm(compile=False).generate(prompts, GREEDY)) == hf_greedy
    with warnings.catch_warnings():  # every graph in CUDA graphs
        warnings.filterwarnings("error", message=".*runs without CUDA graphs")
        for _ in range(2):  # the second run replays the graphs the first one recorded
            assert _tokens(compiled.generate(prompts, GREEDY)) == hf_greedy


def test_rows_joining_and_leaving_a_graphed_batch_give_their_solo_outputs(compiled: LLM) -> None:
    llm = compiled
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


def test_to_device_copies_without_a_host_sync() -> None:
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        rows = to_device([[3, 1], [4, 1]], torch.long, "cuda")
        kept = to_device(torch.tensor([5, 9]), torch.long, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows.device.type == "cuda" and rows.tolist() == [[3, 1], [4, 1]] and kept.tolist() == [5, 9]


def test_eager_attention_spans_come_in_few_shapes(hf_greedy: list[list[int]]) -> None:
    """Eagerly on CUDA, attention spans are rounded up to multiples of the models' SPAN_MULTIPLE (SDPA
    plans a kernel per shape there), and the output stays HF's."""
    llm = _llm(compile=False, speculative=False)
    model = llm.target.model
    spans, prepare = [], model.prepare
    model.prepare = lambda span: (spans.append(span), prepare(span))[1]
    output = llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY)[0].outputs[0].token_ids
    assert output == hf_greedy[2]
    assert len(spans) > 30 and len(set(spans)) <= 2, sorted(set(spans))  # one a token without the rounding


def _syncs_per_step(llm: LLM) -> list[int]:
    """The host syncs of each decoding step of one greedy request (its admission not counted), counted
    by torch's sync debug mode, once the request's graphs are recorded."""
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)  # graphs recorded
    engine = llm.engine
    engine.add(llm.make_sequences(PROMPTS[0], GREEDY, 0))
    counts = []
    while engine.sequences:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return counts


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft"])
def test_a_decoding_step_syncs_the_host_once(speculative: bool, compiled: LLM) -> None:
    """A step's one host-device synchronization is its read of the step's tokens: the tensors it sends
    to the device (tokens kept, row indices) go through pinned memory without one. The last step, in
    which the row finishes and leaves, is allowed 2 more (rows leaving a batch that keeps others
    compact the caches by a data-dependent index; here none is kept, which needs none)."""
    counts = _syncs_per_step(compiled if speculative else _llm(compile=True, speculative=False))
    assert len(counts) > 3 and max(counts[:-1]) == 1, counts
    assert counts[-1] <= 3, counts
