"""quantization="w8a8": int8 weights times activations quantized per blocks of 32 (models/w8a8.py).
The kernel computes the block-wise integer arithmetic it states, each row's results are bitwise those
of a one-row call (what keeps speculation exact), greedy speculative output is the w8a8 target's own
(eager and compiled), layers of other widths stay int8, and a kernel that cannot be built is a clear
error. Tiny in-process models; the kernel is built once per machine (about a minute)."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model
from torch import Tensor
from torch.utils import cpp_extension

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models import quantization as q
from speculative.models import w8a8
from speculative.models.llama import NativeCausalLM

PROMPTS = [[5, 6, 7], [9, 10, 11, 12] * 3, [3, 4, 5] * 6 + [8]]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    w8a8.load()


def reference(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor, residual: Tensor) -> Tensor:
    """The arithmetic w8a8.cpp states, in float64: x's rows quantized per block of 32 (d = absmax /
    127, round half to even), exact integer dot products per block, scaled by d and the row's scale."""
    rows, in_features = x.shape
    blocks = x.reshape(rows, in_features // w8a8.BLOCK, w8a8.BLOCK)
    absmax = blocks.abs().amax(-1)
    inverse = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    xq = torch.round(blocks * inverse[..., None])
    weights = qweight.reshape(qweight.shape[0], -1, w8a8.BLOCK).double()
    sums = torch.einsum("rbi,obi->rob", xq.double(), weights)  # exact: integers below 2**53
    d = (absmax / 127).double()
    return (sums * d[:, None, :]).sum(-1) * scales.double() + bias.double() + residual.double()


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 300), (5, 576, 97), (9, 96, 16)])
def test_the_kernel_computes_block_wise_int8_arithmetic(rows, in_features, out_features) -> None:
    generator = torch.Generator().manual_seed(rows)
    qweight, scales = q.quantize_int8(torch.randn(out_features, in_features, generator=generator))
    x = torch.randn(rows, in_features, generator=generator)
    x[0, :32] = 0  # a block of zeros: scale 0, no NaN
    bias = torch.randn(out_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    got = w8a8.linear(x, qweight, scales, bias, residual)
    want = reference(x, qweight, scales, bias, residual)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # and near the float matmul: activations of 8 bits per block of 32 (a broken block scale is not)
    exact = x @ (qweight.float() * scales[:, None]).T + bias + residual
    assert (got - exact).norm() <= 0.02 * exact.norm()


def test_each_rows_result_is_bitwise_its_one_row_call_at_any_thread_count() -> None:
    """A verification of k + 1 rows must give each row what a one-row decoding step gives it, or
    greedy speculative decoding would not be the target's own (a per-tensor activation scale, as
    torch's dynamic quantized linear uses, fails this)."""
    generator = torch.Generator().manual_seed(0)
    qweight, scales = q.quantize_int8(torch.randn(203, 160, generator=generator))
    x = torch.randn(7, 160, generator=generator) * torch.logspace(-2, 2, 7)[:, None]
    together = w8a8.linear(x, qweight, scales)
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:
            torch.set_num_threads(count)
            for row in range(7):
                assert torch.equal(w8a8.linear(x[row : row + 1], qweight, scales)[0], together[row])
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_calls_compute_in_float32() -> None:
    generator = torch.Generator().manual_seed(1)
    qweight, scales = q.quantize_int8(torch.randn(40, 64, generator=generator))
    x = torch.randn(3, 64, generator=generator).bfloat16()
    bias = torch.randn(40, generator=generator).bfloat16()
    got = w8a8.linear(x, qweight, scales, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, w8a8.linear(x.float(), qweight, scales, bias.float()).bfloat16())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_speculative_greedy_output_is_the_w8a8_targets_own(family: str) -> None:
    target = tiny_model(family)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(target, dtype="float32", quantization="w8a8")
    speculative = LLM(
        target,
        draft_model=noisy_copy(target, 0.02),
        dtype="float32",
        quantization="w8a8",
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    outputs = speculative.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_accepted for o in outputs) > 0
    assert plain.target.model.quantization == speculative.draft.model.quantization == "w8a8"


def test_layers_whose_width_is_not_a_multiple_of_32_are_int8() -> None:
    native = NativeCausalLM.from_hf(tiny_model("llama", hidden_size=48))  # MLP 96: down_proj in 96
    native.quantize("w8a8")
    layer = native._layers[0]
    assert (layer.qkv.quantization, layer.gate_up.quantization, layer.down.quantization) == (
        "int8",
        "int8",
        "w8a8",
    )
    assert native.quantization == "w8a8"


def test_a_kernel_that_cannot_be_built_is_a_clear_error(monkeypatch) -> None:
    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'speculative_w8a8'")

    monkeypatch.setattr(w8a8, "_loaded", False)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.raises(RuntimeError, match=r"quantization='w8a8' builds a C\+\+ kernel.*pip install ninja"):
        LLM(tiny_model("llama"), dtype="float32", quantization="w8a8")


@pytest.mark.slow
def test_compiled_w8a8_greedy_output_is_the_eager_targets_own() -> None:
    """Compiled graphs call the kernel as an opaque op, one-token steps and verifications alike."""
    target = tiny_model("llama", hidden_size=64, num_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [[3, 4, 5] * 6 + [8]]
    want = LLM(target, dtype="float32", quantization="w8a8").generate(prompt, params)[0].outputs[0].token_ids
    compiled = LLM(
        target,
        dtype="float32",
        quantization="w8a8",
        compile=True,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    output = compiled.generate(prompt, params)[0]
    assert output.outputs[0].token_ids == want
    assert 0 < output.metrics.num_drafted < 3 * output.metrics.num_steps  # verifications and plain steps
