"""Tensor parallelism on CPU (gloo): at tensor_parallel_size=2 the output is token-identical to one
process's, greedy and seeded sampling alike, for each native family's particulars (GQA, attention
biases, q/k norms), with a draft model and with n-gram lookup; a rank holds about half the weights; a
bad size or `compile` is a ValueError; a rank that dies ends the LLM with an error, not a hang;
torchrun's ranks give the same output. Models on transformers' forward: test_tensor_parallel_transformers.py.

The spawned ranks of this module's LLMs are one child process, started once (about 7 s on 2 cores)
and shared by every LLM here, then ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import noisy_copy, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.distributed import ranks, shutdown
from speculative.distributed.group import TensorParallelGroup
from speculative.models.tensor_parallel import TensorParallelCausalLM

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16], [20, 21, 22]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = [  # seeded rows, and one drawing from the LLM's own generator
    SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, ignore_eos=True, repetition_penalty=1.2),
    SamplingParams(temperature=0.7, seed=11, max_tokens=11, ignore_eos=True),
]
SETUPS = {  # family, drafter, SpeculativeConfig options
    "llama (GQA), draft model": ("llama", "draft_model", {}),
    "llama (GQA), n-gram": ("llama", "ngram", {}),
    "qwen2 (attention biases), draft model": ("qwen2", "draft_model", {}),
    "qwen2 (attention biases), n-gram": ("qwen2", "ngram", {}),
    "qwen3 (q/k norms), draft model": ("qwen3", "draft_model", {}),
    "qwen3 (q/k norms), n-gram": ("qwen3", "ngram", {}),
    "llama, draft model, adaptive k": ("llama", "draft_model", {"adaptive": True}),
    "llama, draft model split too, tree": ("llama", "draft_model", {"tree": "dynamic", "split_draft": True}),
}


@pytest.fixture(scope="module", autouse=True)
def _end_ranks():
    yield
    shutdown()


_LLMS: dict[tuple[str, int], LLM] = {}


def _pair(setup: str, tensor_parallel_size: int) -> LLM:
    """The setup's LLM, built once."""
    key = (setup, tensor_parallel_size)
    if key not in _LLMS:
        family, drafter, options = SETUPS[setup]
        options = dict(options)
        split_draft = options.pop("split_draft", False)
        target = tiny_model(family, num_layers=2)
        draft = noisy_copy(target, 0.03) if drafter == "draft_model" else None
        _LLMS[key] = LLM(
            target,
            draft_model=draft,
            speculative_config=SpeculativeConfig.from_dict(
                dict(method=drafter, num_speculative_tokens=3, **options)
            ),
            seed=5,
            tensor_parallel_size=tensor_parallel_size,
            draft_tensor_parallel_size=tensor_parallel_size if split_draft else 1,
        )
    return _LLMS[key]


def _tokens(llm: LLM, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_output_at_tensor_parallel_2_is_that_of_one_process(setup: str) -> None:
    assert _tokens(_pair(setup, 2), GREEDY) == _tokens(_pair(setup, 1), GREEDY)


@pytest.mark.parametrize("setup", ["llama (GQA), draft model", "qwen2 (attention biases), n-gram"])
def test_seeded_sampling_at_tensor_parallel_2_is_that_of_one_process(setup: str) -> None:
    assert _tokens(_pair(setup, 2), SAMPLED) == _tokens(_pair(setup, 1), SAMPLED)


def test_rows_joining_a_running_batch_give_their_output_alone() -> None:
    """The engine's continuous batching (the server's calls) at tensor_parallel_size=2."""
    llm, one = _pair("llama (GQA), draft model", 2), _pair("llama (GQA), draft model", 1)
    alone = [[c.token_ids for c in one.generate([q], p)[0].outputs] for q, p in zip(PROMPTS, SAMPLED)]
    sequences = [llm.make_sequences(prompt, p, i) for i, (prompt, p) in enumerate(zip(PROMPTS, SAMPLED))]
    engine = llm.engine
    engine.add(sequences[0])
    engine.step()
    engine.add(sequences[1] + sequences[2])
    engine.step()
    engine.abort(sequences[2])
    engine.add(sequences[3])
    while engine.sequences:
        engine.step()
    for i in (0, 1, 3):
        assert [s.output_token_ids for s in sequences[i]] == alone[i], f"prompt {i}"


def test_a_rank_holds_half_the_weights() -> None:
    hf = tiny_model("qwen2", num_layers=2, vocab_size=97, tie_word_embeddings=False)
    whole = sum(p.numel() * p.element_size() for p in hf.parameters())
    shards = [TensorParallelCausalLM.from_hf(hf, TensorParallelGroup(r, 2, r)) for r in range(2)]
    sizes = [sum(p.numel() * p.element_size() for p in shard.parameters()) for shard in shards]
    # replicated: the norms and rank 0's biases of the row-parallel layers; the vocabulary padded to 98
    assert all(0.5 <= size / whole <= 0.51 for size in sizes), (sizes, whole)
    q = [shard.model.layers[0].self_attn.q_proj.weight for shard in shards]
    assert torch.equal(torch.cat(q), hf.model.layers[0].self_attn.q_proj.weight)
    down = [shard.model.layers[1].mlp.down_proj.weight for shard in shards]
    assert torch.equal(torch.cat(down, dim=1), hf.model.layers[1].mlp.down_proj.weight)


def test_a_size_that_does_not_divide_the_heads_is_a_value_error_naming_the_allowed_sizes() -> None:
    target = tiny_model("llama", num_layers=1)  # 4 heads, 2 key/value heads, 128 MLP columns
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide .* allowed: 1, 2$"):
        LLM(target, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1 or tensor_parallel_size"):
        LLM(target, draft_model=noisy_copy(target, 0.1), tensor_parallel_size=2, draft_tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(target, tensor_parallel_size=0)


def test_compile_is_refused() -> None:
    target = tiny_model("llama", num_layers=1)
    with pytest.raises(ValueError, match="compile=True does not run with tensor_parallel_size > 1"):
        LLM(target, compile=True, tensor_parallel_size=2)


def test_a_rank_that_dies_ends_the_llm_with_an_error_not_a_hang() -> None:
    llm = _pair("llama (GQA), n-gram", 2)
    child = ranks.current().children[0]
    os.kill(child.process.pid, signal.SIGKILL)
    start = time.monotonic()
    stopped = "the tensor-parallel ranks were stopped: rank 1 exited with code -9"
    with pytest.raises(RuntimeError, match=stopped):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 10
    for key in [key for key in _LLMS if key[1] > 1]:  # their ranks are gone
        del _LLMS[key]


@pytest.mark.slow
def test_torchrun_ranks_join_their_group(tmp_path) -> None:
    """Every rank of `torchrun --nproc-per-node 2` runs the program; rank 0's output is one process's."""
    script = tmp_path / "program.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from conftest import noisy_copy, tiny_model
            from speculative import LLM, SamplingParams

            target = tiny_model("qwen3", num_layers=2)
            llm = LLM(target, draft_model=noisy_copy(target, 0.03), seed=5, tensor_parallel_size=2)
            params = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)
            tokens = [out.outputs[0].token_ids for out in llm.generate({PROMPTS!r}, params)]
            if llm.tensor_parallel.rank == 0:
                print(json.dumps(tokens))
            """
        )
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    target = tiny_model("qwen3", num_layers=2)
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)
    one = LLM(target, draft_model=noisy_copy(target, 0.03), seed=5)
    expected = [out.outputs[0].token_ids for out in one.generate(PROMPTS, params)]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
