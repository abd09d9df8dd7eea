"""quantization="w8a8" and "w4a8": int8 or Q4_1 (4-bit) weights times activations quantized per blocks
of 32 (models/int8_activations.py). Each kernel computes the block-wise integer arithmetic it states,
each row's results are bitwise those of a one-row call (what keeps speculation exact), Q4_1 weights
dequantized to float are quantized back to themselves (the demo's GGUF), greedy speculative output is
the quantized target's own (eager and compiled), layers of other widths stay int8, and a kernel that
cannot be built is a clear error. Tiny in-process models; the kernels are built once per machine
(about a minute)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import noisy_copy, tiny_model
from torch import Tensor
from torch.utils import cpp_extension

from speculative import LLM, SamplingParams, SpeculativeConfig, engine_args
from speculative.cli import main
from speculative.models import cpu_kernels, few_rows
from speculative.models import int8_activations as activations
from speculative.models import quantization as q
from speculative.models.attention import QueryByQueryAttention
from speculative.models.llama import NativeCausalLM

PROMPTS = [[5, 6, 7], [9, 10, 11, 12] * 3, [3, 4, 5] * 6 + [8]]
BLOCK = activations.BLOCK


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    activations.load()


def quantized_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels' quantization of x [rows, in], in float64: per block of 32 (d = absmax / 127, round
    half to even) -> (xq [rows, blocks, 32] integers, d [rows, blocks])."""
    rows, in_features = x.shape
    blocks = x.double().reshape(rows, in_features // BLOCK, BLOCK)
    absmax = blocks.abs().amax(-1)
    inverse = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    return torch.round(blocks * inverse[..., None]), absmax / 127


def q4_values(qweight: Tensor) -> Tensor:
    """quantize_q4_1's packed qweight [out, in / 2] -> its levels [out, blocks, 32] (int64)."""
    out_features = qweight.shape[0]
    packed = qweight.reshape(out_features, -1, BLOCK // 2).long()
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def q4_dequantized(qweight: Tensor, scales_and_mins: Tensor) -> Tensor:
    """The float weight [out, in] a Q4_1 weight stands for: level * scale + minimum, block by block."""
    scales, minimums = scales_and_mins.float().unbind(1)  # [out, blocks] each
    weights = q4_values(qweight) * scales[..., None] + minimums[..., None]
    return weights.reshape(qweight.shape[0], -1)


def reference(quantization: str, x: Tensor, weights: tuple[Tensor, Tensor]) -> Tensor:
    """The arithmetic int8_activations.cpp states, in float64: exact integer dot products per block,
    scaled by d and the weight row's scale (w8a8), or by d and the block's scale, plus the block's
    minimum times d times the sum of its int8 activations (w4a8)."""
    xq, d = quantized_activations(x)
    if quantization == "w8a8":
        qweight, scales = weights
        levels = qweight.reshape(qweight.shape[0], -1, BLOCK).double()
        sums = torch.einsum("rbi,obi->rob", xq, levels)  # exact: integers below 2**53
        return (sums * d[:, None, :]).sum(-1) * scales.double()
    qweight, scales_and_mins = weights
    scales, minimums = scales_and_mins.double().unbind(1)  # [out, blocks]
    sums = torch.einsum("rbi,obi->rob", xq, q4_values(qweight).double())
    block_sums = d * xq.sum(-1)  # [rows, blocks]
    return (sums * scales[None] * d[:, None, :]).sum(-1) + block_sums @ minimums.T


def quantized(quantization: str, weight: Tensor) -> tuple[Tensor, Tensor]:
    if quantization == "w8a8":
        qweight, scales = q.quantize_int8(weight)
        return qweight, scales.float()
    return q.quantize_q4_1(weight)


def linear(quantization: str, x: Tensor, weights: tuple[Tensor, Tensor], *extra) -> Tensor:
    return {"w8a8": activations.w8a8_linear, "w4a8": activations.w4a8_linear}[quantization](
        x, *weights, *extra
    )


def float_weight(quantization: str, weights: tuple[Tensor, Tensor]) -> Tensor:
    if quantization == "w8a8":
        return weights[0].float() * weights[1][:, None]
    return q4_dequantized(*weights)


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 300), (5, 576, 97), (9, 96, 16)])
def test_the_kernel_computes_its_block_wise_integer_arithmetic(quantization, rows, in_features, out_features):
    generator = torch.Generator().manual_seed(rows)
    weights = quantized(quantization, torch.randn(out_features, in_features, generator=generator))
    x = torch.randn(rows, in_features, generator=generator)
    x[0, :32] = 0  # a block of zeros: scale 0, no NaN
    bias = torch.randn(out_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator)
    got = linear(quantization, x, weights, bias, residual)
    want = reference(quantization, x, weights) + bias.double() + residual.double()
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # and near the float matmul: activations of 8 bits per block of 32 (a broken block scale is not)
    exact = x @ float_weight(quantization, weights).T + bias + residual
    assert (got - exact).norm() <= 0.02 * exact.norm()


def test_q4_1_packs_two_levels_a_byte_as_llama_cpp_does() -> None:
    """Byte j of a block holds its weight j in the low four bits and its weight j + 16 in the high
    four; a block's scale is (max - min) / 15 and its minimum the least weight."""
    weight = torch.arange(32.0)[None] * 0.5 - 3  # levels 0..31 / 2: scale 31 / 30, minimum -3
    packed, scales_and_mins = q.quantize_q4_1(weight)
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8
    assert scales_and_mins.shape == (1, 2, 1) and scales_and_mins.dtype == torch.float16
    assert scales_and_mins[0, :, 0].tolist() == [torch.tensor(15.5 / 15).half().item(), -3.0]
    levels = q4_values(packed)[0, 0]
    assert levels[0] == 0 and levels[31] == 15 and torch.equal(packed[0] & 15, levels[:16].to(torch.uint8))
    assert torch.equal(packed[0] >> 4, levels[16:].to(torch.uint8))


def test_q4_1_weights_dequantized_to_float_are_quantized_back_to_themselves() -> None:
    """The demo target is dequantized from a Q4_1 GGUF: w4a8 must run that file's own weights again."""
    generator = torch.Generator().manual_seed(3)
    out_features, blocks = 24, 6
    levels = torch.randint(0, 16, (out_features, blocks, BLOCK), generator=generator)
    levels[..., 0], levels[..., 7] = 0, 15  # Q4_1 of any block spans the levels 0 to 15
    scales = (torch.rand(out_features, blocks, generator=generator) * 0.01 + 1e-4).half()
    minimums = (-torch.rand(out_features, blocks, generator=generator) * 0.1).half()
    packed = (levels[..., :16] | (levels[..., 16:] << 4)).to(torch.uint8).reshape(out_features, -1)
    original = (packed, torch.stack([scales, minimums], dim=1))
    again = q.quantize_q4_1(q4_dequantized(*original))
    assert torch.equal(again[0], original[0]) and torch.equal(again[1], original[1])


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_each_rows_result_is_bitwise_its_one_row_call_at_any_thread_count(quantization: str) -> None:
    """A verification of k + 1 rows must give each row what a one-row decoding step gives it, or
    greedy speculative decoding would not be the target's own (a per-tensor activation scale, as
    torch's dynamic quantized linear uses, fails this)."""
    generator = torch.Generator().manual_seed(0)
    weights = quantized(quantization, torch.randn(203, 160, generator=generator))
    x = torch.randn(11, 160, generator=generator) * torch.logspace(-2, 2, 11)[:, None]
    together = linear(quantization, x, weights)
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:
            torch.set_num_threads(count)
            for row in range(11):
                assert torch.equal(linear(quantization, x[row : row + 1], weights)[0], together[row])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_bfloat16_calls_compute_in_float32(quantization: str) -> None:
    generator = torch.Generator().manual_seed(1)
    weights = quantized(quantization, torch.randn(40, 64, generator=generator))
    x = torch.randn(3, 64, generator=generator).bfloat16()
    bias = torch.randn(40, generator=generator).bfloat16()
    got = linear(quantization, x, weights, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, linear(quantization, x.float(), weights, bias.float()).bfloat16())


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_speculative_greedy_output_is_the_quantized_targets_own(family: str, quantization: str) -> None:
    target = tiny_model(family)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(target, dtype="float32", quantization=quantization)
    speculative = LLM(
        target,
        draft_model=noisy_copy(target, 0.02),
        dtype="float32",
        quantization=quantization,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    outputs = speculative.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_accepted for o in outputs) > 0
    assert plain.target.model.quantization == speculative.draft.model.quantization == quantization


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_a_quantized_copy_of_the_target_drafts_for_the_float_target(quantization: str) -> None:
    """LLM(draft_model=the target, draft_quantization=...): the draft is the target's own weights
    quantized, the target stays float; the output is the float target's own. The w8a8 copy keeps over
    80% of its drafts (4-bit weights keep fewer of this tiny random model's, whose logits are nearly
    flat)."""
    target = tiny_model("llama", hidden_size=128, num_layers=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    config = SpeculativeConfig(num_speculative_tokens=4)
    own = LLM(
        target,
        draft_model=target,
        dtype="float32",
        draft_quantization=quantization,
        speculative_config=config,
    )
    outputs = own.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert own.target.model.quantization is None and own.draft.model.quantization == quantization
    rate = sum(o.metrics.num_accepted for o in outputs) / sum(o.metrics.num_drafted for o in outputs)
    assert rate > 0.8 or quantization == "w4a8"


def test_draft_quantization_is_checked_and_needs_a_draft_model() -> None:
    target = tiny_model("llama")
    with pytest.raises(ValueError, match=r"draft_quantization must be None, 'int8'.*; got 'fp8'"):
        LLM(target, draft_model=target, draft_quantization="fp8")
    with pytest.raises(
        ValueError, match="draft_quantization is the draft model's quantization: give it with"
    ):
        LLM(target, draft_quantization="w8a8")
    with pytest.raises(ValueError, match="draft_quantization is the draft model's quantization"):
        LLM(target, speculative_config=SpeculativeConfig("ngram"), draft_quantization="w8a8")


def test_cli_draft_quantization_flag(model_dirs, capsys) -> None:
    """--draft-quantization quantizes the draft alone, and the load line says so."""
    args = ["generate", "--model", model_dirs["target"], "--draft-model", model_dirs["target"]]
    args += ["--dtype", "float32", "--draft-quantization", "w8a8", "--max-tokens", "4", "--prompt", "ab"]
    assert main(args) == 0
    assert re.search(
        r"target in float32 \([^)]*\); draft in float32 \([^)]*\), w8a8 weights\n", capsys.readouterr().err
    )
    assert engine_args.QUANTIZATIONS == q.QUANTIZATIONS


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_layers_whose_width_is_not_a_multiple_of_32_are_int8(quantization: str) -> None:
    native = NativeCausalLM.from_hf(tiny_model("llama", hidden_size=48))  # MLP 96: down_proj in 96
    native.quantize(quantization)
    layer = native._layers[0]
    assert (layer.qkv.quantization, layer.gate_up.quantization, layer.down.quantization) == (
        "int8",
        "int8",
        quantization,
    )
    assert native.quantization == quantization


def test_w4a8_keeps_the_lm_head_at_8_bits() -> None:
    native = NativeCausalLM.from_hf(tiny_model("llama"))
    native.quantize("w4a8")
    assert native._layers[0].qkv.quantization == "w4a8" and native._lm_head.quantization == "w8a8"


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_a_kernel_that_cannot_be_built_is_a_clear_error(monkeypatch, quantization: str) -> None:
    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'speculative_cpu_kernels'")

    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(few_rows, "_usable", None)  # float32 layers try the kernel first, then warn
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.raises(
        RuntimeError, match=rf"quantization='{quantization}' builds a C\+\+ kernel.*pip install ninja"
    ):
        LLM(tiny_model("llama"), dtype="float32", quantization=quantization)


@pytest.mark.parametrize(
    ("vendor", "prefetch"), [("GenuineIntel", True), ("AuthenticAMD", False), ("", False)]
)
def test_the_kernels_prefetch_weights_where_that_was_measured_to_pay(monkeypatch, vendor, prefetch):
    """A build flag (the extension is built per machine, and rebuilt where its flags change)."""
    monkeypatch.setattr(cpu_kernels, "_vendor", lambda: vendor)
    flags = [flag for flag in cpu_kernels._flags() if flag.startswith("-DSPECULATIVE_PREFETCH=")]
    assert flags == (["-DSPECULATIVE_PREFETCH=8192"] if prefetch else [])


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_compiled_greedy_output_is_the_eager_quantized_targets_own(quantization: str) -> None:
    """Compiled graphs call the kernels as opaque ops, one-token steps and verifications alike."""
    target = tiny_model("llama", hidden_size=64, num_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [[3, 4, 5] * 6 + [8]]
    eager = LLM(target, dtype="float32", quantization=quantization)
    want = eager.generate(prompt, params)[0].outputs[0].token_ids
    compiled = LLM(
        target,
        dtype="float32",
        quantization=quantization,
        compile=True,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    output = compiled.generate(prompt, params)[0]
    assert output.outputs[0].token_ids == want
    assert 0 < output.metrics.num_drafted < 3 * output.metrics.num_steps  # verifications and plain steps


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_a_verifications_logits_are_bitwise_the_one_token_steps(quantization: str) -> None:
    """With quantized activations an ulp of difference in a query's attention moves values across a
    rounding step, so a verification must give each of its tokens bitwise what plain decoding's
    one-token steps give (QueryByQueryAttention); SDPA over the 5 queries at once does not."""
    native = NativeCausalLM.from_hf(tiny_model("llama", hidden_size=128, num_layers=3))
    native.quantize(quantization)
    assert isinstance(native.attention_backend, QueryByQueryAttention)
    prompt, new = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], [20, 21, 22, 23, 24]
    with torch.inference_mode():
        steps_cache = native.new_cache(1, 32)
        native.forward(torch.tensor(prompt), steps_cache)
        steps = torch.cat([native.forward(torch.tensor([[token]]), steps_cache)[:, -1] for token in new])
        block_cache = native.new_cache(1, 32)
        native.forward(torch.tensor(prompt), block_cache)
        block = native.forward(torch.tensor([new]), block_cache)[0]
    assert torch.equal(steps, block)


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_a_prompt_decodes_bitwise_as_alone_in_a_batch_of_other_lengths(quantization: str) -> None:
    """Prompts of several lengths prefilled and decoded together: each one's log-probabilities are
    bitwise its own alone (prefilled beside prompts of its own length only, then attending query by
    query), speculative or not."""
    target = tiny_model("llama", hidden_size=128, num_layers=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[3, 4, 5] * 6 + [8], [9, 10, 11, 12] * 3, [5, 6, 7, 30, 31], [40, 41] * 8]
    for draft in (None, noisy_copy(target, 0.02)):
        config = None if draft is None else SpeculativeConfig(num_speculative_tokens=3)
        llm = LLM(
            target, draft_model=draft, dtype="float32", quantization=quantization, speculative_config=config
        )
        alone = [llm.generate([p], params)[0].outputs[0] for p in prompts]
        together = [o.outputs[0] for o in llm.generate(prompts, params)]
        for a, t in zip(alone, together):
            assert a.token_ids == t.token_ids and a.logprobs == t.logprobs
