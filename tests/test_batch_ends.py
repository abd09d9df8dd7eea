"""A batch that ends in a drafting step: every row finishes in it, so the step's commit never reaches the
proposer (rows that finish leave first), and the next batch may start with plain steps (adaptive k at
0, or disable_by_batch_size). Whatever each proposer kept of the ended step must not meet the new rows:
a server's adaptive k once failed every running request there."""

from __future__ import annotations

import itertools

import pytest
from conftest import tiny_model
from exactness import hf_greedy
from test_dflash import saved
from test_eagle import write_head

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.methods import DraftModelConfig

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 2], [20, 21], [5, 6, 7, 5, 6]]
LENGTHS = [14, 9, 17, 12]
K = 3


def _llm(tmp_path, target, method: str) -> LLM:
    """`target` with a random drafter of `method` (a name; "+lookup": prompt lookup first, "+tree": a
    dynamic tree of width 2)."""
    name, _, variant = method.partition("+")
    tree = dict(tree="dynamic", tree_width=2, tree_nodes=6) if variant == "tree" else {}
    options = DraftModelConfig(prompt_lookup_min=1) if variant == "lookup" else None
    config = SpeculativeConfig(method=name, num_speculative_tokens=K, options=options, **tree)
    if name == "draft_model":
        draft = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=1, seed=7)
    elif name == "dflash":
        draft = saved(tmp_path, target)
    elif name == "self_draft":  # the target's own quantized copy
        draft = None
    else:
        draft = write_head(tmp_path / name, name)
    return LLM(target, draft_model=draft, speculative_config=config)


METHODS = [
    "draft_model",
    "draft_model+lookup",
    "draft_model+tree",
    "eagle",
    "eagle3+tree",
    "dflash",
    "dflash+tree",
    "self_draft",
]


@pytest.mark.parametrize("method", METHODS)
def test_plain_steps_after_a_batch_that_ended_in_a_drafting_step(tmp_path, monkeypatch, method) -> None:
    target = tiny_model("llama", vocab_size=96, hidden_size=64, num_layers=4, seed=3)
    llm = _llm(tmp_path, target, method)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with llm.engine.recording_steps() as steps:
        llm.generate(PROMPTS[:1], greedy)  # one row: the step that finishes it ends the batch
    assert steps[-1].num_query_tokens > 1  # ... and drafted
    chosen = itertools.chain([0, 0, 0], itertools.repeat(K))  # plain steps first, then drafting again
    monkeypatch.setattr(llm.engine.draft_length, "choose", lambda batch_size, backlog=None: next(chosen))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    for prompt, output, n in zip(PROMPTS, llm.generate(PROMPTS, params), LENGTHS):
        assert output.outputs[0].token_ids == hf_greedy(target, prompt, n, None)
