"""Tensor parallelism through transformers' own (models/hf_tensor_parallel.py), on CPU (gloo): at
tensor_parallel_size=2 a model type we do not run natively (Gemma), and a Llama forced onto
transformers' forward, give one process's output, greedy and seeded sampling alike, with a draft model
(whole, or split too) and with n-gram lookup, given as a model object or by path; a rank holds about
half the parameter bytes; a model type transformers has no plan for, or a device it does not place
shards on, is a ValueError.

The spawned ranks of this module's LLMs are one child process, started once and shared by every LLM
here, then ended."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.distributed import shutdown
from speculative.models.hf import HFCausalLM
from speculative.models.hf_tensor_parallel import mesh_device_type

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SAMPLED = [
    SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True),  # the LLM's generator
]
ON_CPU = pytest.mark.skipif(
    mesh_device_type() != "cpu", reason="transformers splits models on the machine's accelerator, not the CPU"
)
SETUPS = {  # family, drafter, LLM options
    "gemma, draft model": ("gemma", "draft_model", {}),
    "gemma, draft model split too": ("gemma", "draft_model", {"split_draft": True}),
    "gemma, n-gram": ("gemma", "ngram", {}),
    "llama on transformers' forward, n-gram": ("llama", "ngram", {"model_impl": "transformers"}),
}


@pytest.fixture(scope="module", autouse=True)
def _end_ranks():
    yield
    shutdown()


_LLMS: dict[tuple[str, int], LLM] = {}


def _llm(setup: str, tensor_parallel_size: int) -> LLM:
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
            speculative_config=SpeculativeConfig(method=drafter, num_speculative_tokens=3),
            seed=5,
            tensor_parallel_size=tensor_parallel_size,
            draft_tensor_parallel_size=tensor_parallel_size if split_draft else 1,
            **options,
        )
    return _LLMS[key]


def _tokens(llm: LLM, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


@ON_CPU
@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_output_at_tensor_parallel_2_is_that_of_one_process(setup: str) -> None:
    llm = _llm(setup, 2)
    assert isinstance(llm.target.model, HFCausalLM)  # transformers' forward, split by transformers
    assert _tokens(llm, GREEDY) == _tokens(_llm(setup, 1), GREEDY)


@ON_CPU
def test_seeded_sampling_at_tensor_parallel_2_is_that_of_one_process() -> None:
    setup = "gemma, draft model"
    assert _tokens(_llm(setup, 2), SAMPLED) == _tokens(_llm(setup, 1), SAMPLED)


def _parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of the storages of the parameters this process holds (a DTensor's: its local shard's),
    each storage once: a shard that is a view of the whole model's tensor counts the whole."""
    storages = {}
    for p in model.parameters():
        storage = (p.to_local() if isinstance(p, DTensor) else p).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@ON_CPU
def test_a_rank_holds_half_the_parameter_bytes() -> None:
    split = _llm("gemma, draft model split too", 2)
    whole = _llm("gemma, draft model split too", 1)
    for role in ("target", "draft"):
        ours, one = (getattr(llm, role).model.model for llm in (split, whole))
        # replicated: the norms; the vocabulary (96) and every split splits evenly in two
        assert 0.5 <= _parameter_bytes(ours) / _parameter_bytes(one) <= 0.51, role


@ON_CPU
def test_a_checkpoint_given_by_path_is_split_as_each_rank_loads_it(tmp_path) -> None:
    """Each rank reads its own shard of the checkpoint (transformers' from_pretrained, by path)."""
    tiny_model("gemma", num_layers=2).save_pretrained(tmp_path)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    split, one = (LLM(str(tmp_path), speculative_config=config, tensor_parallel_size=n) for n in (2, 1))
    assert _tokens(split, GREEDY) == _tokens(one, GREEDY)
    ratio = _parameter_bytes(split.target.model.model) / _parameter_bytes(one.target.model.model)
    assert 0.5 <= ratio <= 0.51


def test_a_model_type_without_a_plan_is_a_value_error() -> None:
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=64)
    gpt2 = AutoModelForCausalLM.from_config(config)
    refused = r"tensor_parallel_size=2 cannot split the target: it is 'gpt2'.*no tensor-parallel plan"
    with pytest.raises(ValueError, match=refused):
        LLM(gpt2, tensor_parallel_size=2)
    target = tiny_model("gemma", num_layers=1)
    refused = "draft_tensor_parallel_size=2 cannot split the draft model: it is 'gpt2'"
    with pytest.raises(ValueError, match=refused):
        LLM(target, draft_model=gpt2, tensor_parallel_size=2, draft_tensor_parallel_size=2)


def test_a_device_transformers_does_not_place_shards_on_is_a_value_error() -> None:
    machine = mesh_device_type()
    other = "cuda" if machine == "cpu" else "cpu"
    with pytest.raises(ValueError, match=f"on this machine's {machine} .*device='{other}' is not it"):
        LLM(tiny_model("gemma", num_layers=1), device=other, tensor_parallel_size=2)


@ON_CPU
def test_a_size_that_does_not_divide_the_heads_is_a_value_error() -> None:
    target = tiny_model("gemma", num_layers=1)  # 4 heads, 2 key/value heads, 128 MLP columns
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide .* allowed: 1, 2$"):
        LLM(target, tensor_parallel_size=4)


def test_without_accelerate_it_names_the_extra(hide_module) -> None:
    hide_module("accelerate")
    with pytest.raises(ModuleNotFoundError, match=r"needs the transformers-tp extra: pip install"):
        LLM(tiny_model("gemma", num_layers=1), tensor_parallel_size=2)
