"""CUDA graphs' output ownership, imitated on CPU: a graph's outputs live in a shared pool that the next
replay of any graph overwrites. CompiledCausalLM in mode "reduce-overhead" must copy them out, or a
draft's tokens and logits, read after the target's verification replays, are garbage (on a GPU torch
raises "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run")."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model

from speculative import LLM, SamplingParams
from speculative.config import SpeculativeConfig
from speculative.models.compiled import CompiledCausalLM
from speculative.models.llama import NativeCausalLM


class PoolOfGraphs:
    """A stand-in for torch.compile(mode="reduce-overhead"): functions run eagerly, and each call first
    overwrites the outputs of every earlier call (NaN, or -7 for integers), as one CUDA graph pool
    would."""

    def __init__(self) -> None:
        self.live: list[torch.Tensor] = []
        self.calls = 0

    def compile(self, fn, **options):
        assert options.get("mode") == "reduce-overhead"

        def replay(*args):
            self.calls += 1
            for tensor in self.live:
                tensor.fill_(float("nan") if tensor.is_floating_point() else -7)
            self.live.clear()
            out = fn(*args)
            self.live += [out] if isinstance(out, torch.Tensor) else list(out)
            return out

        return replay


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_graph_outputs_are_copied_out(monkeypatch, temperature: float) -> None:
    target = NativeCausalLM.from_hf(tiny_model())
    draft = NativeCausalLM.from_hf(noisy_copy(tiny_model(), 0.02))
    prompts = [{"prompt_token_ids": [5, 9, 2, 7, 11][:n]} for n in (2, 5, 3)]
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=3)
    config = SpeculativeConfig("draft_model", 4)
    eager = LLM(target, draft_model=draft, speculative_config=config).generate(prompts, params)
    pool = PoolOfGraphs()
    monkeypatch.setattr(torch, "compile", pool.compile)
    graphed = [CompiledCausalLM(m, mode="reduce-overhead") for m in (target, draft)]
    outputs = LLM(graphed[0], draft_model=graphed[1], speculative_config=config).generate(prompts, params)
    assert pool.calls > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in eager]
    assert [o.metrics.num_accepted for o in outputs] == [o.metrics.num_accepted for o in eager]
