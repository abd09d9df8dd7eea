"""The decoding methods under test, each behind one call: `generate(prompts, max_tokens) -> Generation`.

All decode greedily for exactly `max_tokens` tokens: ours with `ignore_eos=True`, Hugging Face's with
`eos_token_id=None` (its `min_new_tokens` would instead mask EOS out of the logits and change the greedy
text wherever EOS is the argmax; ignoring EOS keeps the target's own greedy text).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, StaticCache

from speculative.bench.clock import CallTimes, hf_recording
from speculative.bench.timing import synchronize
from speculative.llm import LLM
from speculative.sampling_params import SamplingParams


@dataclass
class Generation:
    """What one call produced and cost.

    token_ids: the generated tokens of each prompt. seconds: wall time of the call.
    num_steps: target forward passes: after the prefill (ours, vLLM v1's meaning), every call (HF).
    num_accepted: draft tokens kept; num_drafted: draft tokens proposed (None where unknown: HF).
    accepted_per_position / drafted_per_position: the same at draft positions 1..k (ours only).
    calls: the times of the call's decoding forwards and draftings (clock.py; None for other engines).
    prefill_seconds / decode_seconds: the engine's own split of the call, where it reports one
    (llama.cpp: prompt_ms / predicted_ms; ours: the call's time outside its decoding steps, the prefill
    and LLM.generate's own work, / its steps' time); None otherwise.
    """

    token_ids: list[list[int]]
    seconds: float
    num_steps: int = 0
    num_accepted: int = 0
    num_drafted: int | None = None
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    calls: CallTimes | None = None
    prefill_seconds: float | None = None
    decode_seconds: float | None = None


@dataclass
class Method:
    """A named decoding method. engine: "hf", "ours", "ours_compiled", "vllm" or "llama.cpp"; drafter: a
    registered speculative method ("draft_model", "ngram", "suffix", "eagle", ...) or None (plain
    decoding); k: drafts per step (0 without a drafter); max_batch: the largest batch it takes (None: any)."""

    name: str
    label: str
    engine: str
    drafter: str | None = None
    k: int = 0
    max_batch: int | None = None

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Generation:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget what earlier calls taught the method (suffix decoding's cache of past responses), so
        that no prompt is drafted from its own earlier, identical, greedy response."""


@dataclass
class OursMethod(Method):
    """Our engine through the public API: `LLM.generate` with greedy SamplingParams. adaptive: the LLM
    chooses k per step (up to `k`); tree: the shape of its token trees ("static" or "dynamic", k
    deep), None for chains; ragged: its chains come in several lengths up to k (a draft's own chain
    shorter than a lookup's), so that T_v is over all its verifications."""

    llm: LLM | None = None
    adaptive: bool = False
    tree: str | None = None
    ragged: bool = False

    def reset(self) -> None:
        self.llm.engine.clear_proposer_cache()

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Generation:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        with self.llm.engine.recording_steps() as steps:
            synchronize(self.llm.device)
            start = time.perf_counter()
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
            synchronize(self.llm.device)
            seconds = time.perf_counter() - start
        metrics = [o.metrics for o in outputs]
        decode = sum(step.step_s for step in steps)
        return Generation(
            [o.outputs[0].token_ids for o in outputs],
            seconds,
            sum(m.num_steps for m in metrics),
            sum(m.num_accepted for m in metrics),
            sum(m.num_drafted for m in metrics),
            [sum(c) for c in zip(*(m.accepted_per_position for m in metrics))] if self.k else [],
            [sum(c) for c in zip(*(m.drafted_per_position for m in metrics))] if self.k else [],
            CallTimes.from_steps(steps),
            prefill_seconds=seconds - decode,
            decode_seconds=decode,
        )


@dataclass
class HFMethod(Method):
    """Hugging Face `generate`, greedy, with `options` (assistant_model, prompt_lookup_num_tokens, ...).

    Counts the target's forward calls with a hook: each call of assisted generation or prompt lookup
    verifies a block and emits 1 + (accepted drafts) tokens, so accepted = tokens - calls. Batches are
    left-padded. Forward hooks also time the calls (clock.py), unless `hooked` is False (a compiled
    forward would trace them).
    """

    model: torch.nn.Module | None = None
    pad_token_id: int = 0
    options: dict = field(default_factory=dict)
    hooked: bool = True

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Generation:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        calls, times = [], None
        with ExitStack() as stack:
            if self.hooked:
                stack.callback(self.model.register_forward_hook(lambda *_: calls.append(1)).remove)
                times = stack.enter_context(hf_recording(self.model, self.options.get("assistant_model")))
            synchronize(self.model.device)
            start = time.perf_counter()
            out = self.model.generate(
                ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad_token_id,
                **self.call_options(),
            )
            synchronize(self.model.device)
            seconds = time.perf_counter() - start
        tokens = out[:, width:].tolist()
        num_calls = len(calls) if self.hooked else len(tokens[0])  # unhooked: plain decoding
        accepted = len(tokens[0]) - num_calls if self.k else 0  # speculative HF methods take batch 1
        return Generation(tokens, seconds, num_calls, accepted, calls=times)

    def call_options(self) -> dict:
        """`generate`'s options for the next call."""
        return self.options


@dataclass
class HFStaticMethod(HFMethod):
    """HF `generate` with a static KV cache, which transformers compiles (torch.compile of the decoding
    forward, with CUDA graphs on CUDA): Hugging Face's fastest path, batch 1. One StaticCache of
    `cache_length` positions (the longest prompt and max_tokens), reset before each call, so that no
    later call compiles again for a longer cache; the first call (the benchmark's warm-up) compiles.
    Not hooked: its calls are not clocked, so it has no step times (and needs none: it has no drafts)."""

    hooked: bool = False
    cache_length: int = 0
    cache: StaticCache | None = None

    def call_options(self) -> dict:
        if self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.cache_length)
        else:
            self.cache.reset()
        return {**self.options, "past_key_values": self.cache}


def hf_static(model: torch.nn.Module, pad_token_id: int, cache_length: int) -> HFStaticMethod:
    """HF `generate` on a static cache, compiled as transformers compiles it: on CUDA by default (mode
    "reduce-overhead"); on a CPU only when asked (CompileConfig's `_compile_all_devices`), as here."""
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    return HFStaticMethod(
        "hf_static",
        "HF generate, static cache, compiled",
        "hf",
        max_batch=1,
        model=model,
        pad_token_id=pad_token_id,
        options={"compile_config": compile_config},
        cache_length=cache_length,
    )


def hf_assistant(draft: torch.nn.Module, k: int) -> torch.nn.Module:
    """Configure a draft for HF assisted generation with exactly k drafts per step, like ours (HF's
    defaults adapt the count with a heuristic schedule and stop drafting below a confidence)."""
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


@dataclass
class VLLMMethod(Method):
    """vLLM's offline `LLM.generate` with a draft model (on a GPU, where vLLM is installed)."""

    llm: object = None

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Generation:
        from vllm import SamplingParams as VLLMSamplingParams

        params = VLLMSamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return Generation([list(o.outputs[0].token_ids) for o in outputs], seconds)


def vllm_unavailable(device: torch.device) -> str | None:
    """Why vLLM cannot run here (a note for the results), or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    if device.type != "cuda":
        return f"vLLM needs a CUDA GPU; this run is on {device.type} (--device cuda)"
    return None


def vllm_method(target: str, draft: str, k: int, dtype: str) -> VLLMMethod:
    """vLLM with the same pair and k (draft-model speculation, vLLM >= 0.11's speculative_config)."""
    import vllm

    llm = vllm.LLM(
        model=target,
        dtype=dtype,
        seed=0,
        gpu_memory_utilization=0.3,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k},
    )
    return VLLMMethod("vllm_draft", f"vLLM draft k={k}", "vllm", "draft_model", k, llm=llm)
