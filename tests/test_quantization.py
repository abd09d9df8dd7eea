"""Weight-only int8 / int4 quantization of the native forward: logits as the dequantized weights give
them, greedy output exactly the quantized target's own (eager and compiled), memory that drops, and
clear errors. Tiny in-process models; nothing here depends on the CPU's vector width."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import noisy_copy, tiny_model
from torch import Tensor
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.cli import main
from speculative.models import packed as packed_module
from speculative.models import quantization as q
from speculative.models.gemv import GEMV_PASS
from speculative.models.llama import QUANTIZE_LM_HEAD, NativeCausalLM
from speculative.models.packed import PackedLinear

PROMPTS = [[5, 6, 7], [9, 10, 11, 12] * 3, [3, 4, 5] * 6 + [8]]


# The inverses of the quantizers: what the kernels compute with (the references of these tests).
def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    """q [out, in] int8, scales [out] -> the float weight [out, in] (float32) the kernels compute with."""
    return q.float() * scales.float()[:, None]


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """quantize_int4's output -> the float weight [out, in] (float32) the kernel computes with."""
    out_features, in_features = q.shape
    groups = scales.shape[1]
    w = (q.float().reshape(out_features, groups, -1) - 8) * scales.float()[..., None] + zeros.float()[
        ..., None
    ]
    return w.reshape(out_features, in_features)


def _dequantized(hf: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """A copy of an HF model whose projection weights are their quantize-dequantize round trip, as
    NativeCausalLM.quantize computes them (per output row, or per group of a row: the same whether
    the projections are fused or not)."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if not isinstance(module, torch.nn.Linear) or (name == "lm_head" and not QUANTIZE_LM_HEAD):
                continue
            weight = module.weight
            group = q.int4_group_size(*weight.shape) if quantization == "int4" else None
            if group is None:
                dequantized = dequantize_int8(*q.quantize_int8(weight))
            else:
                dequantized = dequantize_int4(*q.quantize_int4(weight, group))
            module.weight.copy_(dequantized.to(weight.dtype))
    return hf


def _logits(model: NativeCausalLM, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of every position: a prefill of `split` tokens, then one-token steps (the one-row
    kernels), for each row of ids [batch, length]."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    out = [model(ids[:, :split], cache)]
    out += [model(ids[:, i : i + 1], cache) for i in range(split, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    ("quantization", "dtype"), [("int8", torch.float32), ("int8", torch.bfloat16), ("int4", torch.bfloat16)]
)
def test_logits_are_the_dequantized_weights_logits(
    family: str, quantization: str, dtype: torch.dtype
) -> None:
    hf = tiny_model(family, vocab_size=112).to(dtype)
    ids = torch.randint(0, 112, (2, 9), generator=torch.Generator().manual_seed(0))
    quantized = NativeCausalLM.from_hf(hf)
    quantized.quantize(quantization)
    got = _logits(quantized, ids, 5)
    reference = _logits(NativeCausalLM.from_hf(_dequantized(hf, quantization)), ids, 5)
    unquantized = _logits(NativeCausalLM.from_hf(hf), ids, 5)
    scale = unquantized.abs().max()
    # float32: rounding only; bfloat16: the kernels round activations and outputs to bfloat16
    tight = 1e-5 if dtype == torch.float32 else 0.03
    assert (got - reference).abs().max() <= tight * scale
    # and near the float model's: these random weights have no structure that int4's 16 levels keep
    # (measured: int8 within 2.6-5.9% of the largest logit, the same argmax at 89-100% of positions;
    # int4 35-60%, and 33-56%, against 1% by chance)
    near, same = (0.1, 0.8) if quantization == "int8" else (0.8, 0.25)
    assert (got - unquantized).abs().max() <= near * scale
    assert (got.argmax(-1) == unquantized.argmax(-1)).float().mean() >= same


def test_int4_falls_back_to_int8_where_the_kernel_takes_no_shape() -> None:
    hf = tiny_model("llama", vocab_size=100).to(torch.bfloat16)  # lm_head [100, 64]: 100 % 16 != 0
    native = NativeCausalLM.from_hf(hf)
    native.quantize("int4")
    assert native._layers[0].gate_up.quantization == "int4" and native._layers[0].gate_up.group_size == 64
    if QUANTIZE_LM_HEAD:
        assert native._lm_head.quantization == "int8"
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = _logits(NativeCausalLM.from_hf(_dequantized(hf, "int4")), ids, 3)
    assert (_logits(native, ids, 3) - reference).abs().max() <= 0.03 * reference.abs().max()


def test_bfloat16_int8_kernel_takes_unaligned_and_strided_rows() -> None:
    """torch's vectorized bfloat16 int8 kernel loads x aligned and reads rows in[i] apart: PackedLinear
    copies x where it must (a view at an odd offset, a column slice)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    packed = PackedLinear([linear])
    weight, bias = dequantize_int8(*q.quantize_int8(linear.weight)), linear.bias.float()
    packed.quantize("int8")
    big = torch.randn(4, 80, dtype=torch.bfloat16)
    for x in (big.flatten()[3:67].view(1, 64), big[:, 5:69], big[:, :64].contiguous()):
        expected = torch.nn.functional.linear(x.float(), weight, bias)
        assert (packed(x).float() - expected).abs().max() <= 0.05 * expected.abs().max()


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 10])  # the whole weight, 15 rows, 1 row at a time
def test_float32_int8_matmul_dequantizes_in_chunks(monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(packed_module, "DEQUANTIZE_CHUNK", chunk)
    monkeypatch.setattr(packed_module, "_scratch", threading.local())
    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, out) for out in (200, 100)]
    packed = PackedLinear(linears)
    weight = dequantize_int8(*q.quantize_int8(torch.cat([lin.weight for lin in linears])))
    bias = torch.cat([lin.bias for lin in linears]).detach()
    packed.quantize("int8")
    for rows in (1, 5):
        x, residual = torch.randn(rows, 64), torch.randn(rows, 300)
        expected = torch.nn.functional.linear(x, weight, bias) + residual
        got = packed(x, residual)
        assert got.shape == (rows, 300) and got.is_contiguous()
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_memory_drops_and_the_float_weights_are_gone() -> None:
    hf = tiny_model("qwen2", hidden_size=128)  # q/k/v biases stay in float
    native = NativeCausalLM.from_hf(copy.deepcopy(hf))
    before = q.tensor_bytes(native)
    native.quantize("int8")
    after = q.tensor_bytes(native)
    projections = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("proj.weight"))
    # the fp32 projections (4 bytes a weight, plus their oneDNN copies) became int8: 1 byte a weight
    assert before - after >= 3 * projections
    attn = native.model.layers[0].self_attn
    assert attn.q_proj.weight is None and attn.q_proj.bias is not None
    assert native._layers[0].qkv.weight is None and native._layers[0].qkv.qweight.dtype == torch.int8
    assert not any(p.stale() for p in native.packed_linears())
    with pytest.raises(RuntimeError, match="quantized"):
        native.state_dict()
    with pytest.raises(RuntimeError, match="quantized"):
        native.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="quantized"):
        native._layers[0].qkv.pack()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculative_greedy_output_is_the_quantized_targets_own(family: str) -> None:
    target = tiny_model(family)
    draft = noisy_copy(target, 0.02)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(target, dtype="float32", quantization="int8")
    speculative = LLM(
        target,
        draft_model=draft,
        dtype="float32",
        quantization="int8",
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    outputs = speculative.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_accepted for o in outputs) > 0
    assert speculative.draft.model.quantization == "int8"


@pytest.mark.slow
@pytest.mark.parametrize("words", [False, True])
def test_compiled_quantized_greedy_output_is_the_eager_quantized_targets_own(monkeypatch, words) -> None:
    """Compiled, a plain step's graph reads the int8 weights in inductor's loop (as int32 words with
    packed.INT8_WORDS, forced here on any CPU, as is a batch-1 verification's) and a verification's
    calls torch's kernel as an op otherwise: speculating (n-gram drafts, so that the target's graphs
    are all that compiles) gives the eager quantized target's own tokens."""
    monkeypatch.setattr(packed_module, "INT8_WORDS", words)
    target = tiny_model("llama", hidden_size=32, num_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [[3, 4, 5] * 6 + [8]]
    want = LLM(target, dtype="float32", quantization="int8").generate(prompt, params)[0].outputs[0].token_ids
    compiled = LLM(
        target,
        dtype="float32",
        quantization="int8",
        compile=True,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    output = compiled.generate(prompt, params)[0]
    assert output.outputs[0].token_ids == want
    assert 0 < output.metrics.num_drafted < 3 * output.metrics.num_steps  # verifications and plain steps


@pytest.mark.parametrize(
    ("words", "rows", "kind"),
    [
        (False, 1, "gemv"),
        (False, 5, "static_rows"),
        (False, packed_module.STATIC_ROWS_MAX + 1, "rows"),
        (True, 1, "words"),
        (True, packed_module.STATIC_ROWS_MAX, "words"),
        (True, packed_module.STATIC_ROWS_MAX + 1, "rows"),
    ],
)
def test_compiled_int8_matmul_is_a_reduction_over_the_int8_weight(monkeypatch, words, rows, kind) -> None:
    """gemv.py rewrites F.linear(x, q.float()) (q int8) into a reduction that reads q as it is: one row
    as any one-row matmul, several rows as a few-row float32 matmul is (test_gemv.py); with
    packed.INT8_WORDS (AVX2 CPUs; forced here on any), up to STATIC_ROWS_MAX static rows read q as
    int32 words."""
    monkeypatch.setattr(packed_module, "INT8_WORDS", words)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 72, generator=generator)  # [out, in]: sizes off any vector width
    qweight, scales = q.quantize_int8(weight)
    x = torch.randn(rows, 72, generator=generator)
    want = torch.nn.functional.linear(torch.nn.functional.silu(x), dequantize_int8(qweight, scales))
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):  # a cached graph would skip the pass
        counters.clear()
        compiled = torch.compile(
            lambda x: torch.nn.functional.linear(torch.nn.functional.silu(x), qweight.float()) * scales,
            dynamic=False,
            options={"post_grad_custom_post_pass": GEMV_PASS},
        )
        got = compiled(x)
        assert dict(counters["speculative"]) == {kind: 1}
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_bad_values_are_clear_errors() -> None:
    target = tiny_model("llama")
    allowed = r"None, 'int8', 'int4', 'w8a8' or 'w4a8'"
    with pytest.raises(ValueError, match=rf"quantization must be {allowed}; got 'fp8'"):
        LLM(target, quantization="fp8")
    with pytest.raises(ValueError, match="quantization='int8' needs the native forward"):
        LLM(target, quantization="int8", model_impl="transformers")
    gpt2 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=64)
    )
    with pytest.raises(ValueError, match=r"needs the native forward.*HFCausalLM"):
        LLM(gpt2, quantization="int8")
    with pytest.raises(ValueError, match=r"int4.*bfloat16 target \(dtype='bfloat16'\)"):
        LLM(target, dtype="float32", quantization="int4")
    with pytest.raises(ValueError, match=r"int4.*bfloat16 draft model \(draft_dtype='bfloat16'\)"):
        LLM(
            target,
            draft_model=noisy_copy(target, 0.02),
            dtype="bfloat16",
            draft_dtype="float32",
            quantization="int4",
        )
    native = NativeCausalLM.from_hf(target)
    native.quantize("int8")
    with pytest.raises(RuntimeError, match=r"already quantized|quantizing it again"):
        native.quantize("int4")


def test_cli_quantization_flag(model_dirs, capsys) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                model_dirs["target"],
                "--draft-model",
                model_dirs["draft"],
                "--dtype",
                "float32",
                "--quantization",
                "int8",
                "--max-tokens",
                "4",
                "--prompt",
                "ab",
            ]
        )
        == 0
    )
    assert "int8 weights" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--quantization", "fp8"])
    assert exit_info.value.code == 2
    assert "--quantization" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--model",
                model_dirs["target"],
                "--model-impl",
                "transformers",
                "--quantization",
                "int8",
                "--prompt",
                "ab",
            ]
        )
        == 2
    )
    assert "native forward" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("dtypes", "words", "rewritten"),
    [((torch.float32,), False, {"gemv": 1}), ((torch.float32,), True, {"words": 1}), ((), False, {})],
)
def test_compiled_int8_call_is_the_reduction_only_where_the_vector_isa_takes_it(
    monkeypatch, dtypes: tuple, words: bool, rewritten: dict
) -> None:
    """A compiled one-row float32 call of an int8 PackedLinear is inductor's reduction where
    INT8_REDUCTION_DTYPES holds float32, converting int8 in its loop (AVX-512) or reading the weight
    as int32 words (INT8_WORDS: AVX2), and the eager dequantization as an opaque op where it is
    empty: the same values either way."""
    monkeypatch.setattr(packed_module, "INT8_REDUCTION_DTYPES", dtypes)
    monkeypatch.setattr(packed_module, "INT8_WORDS", words)
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(48, 80).requires_grad_(False)
    layer = PackedLinear([linear])
    layer.quantize("int8")
    x = torch.randn(1, 48, generator=generator)
    with torch.inference_mode():
        want = layer(x)
        with inductor_config.patch(force_disable_caches=True):
            counters.clear()
            torch._dynamo.reset()
            got = torch.compile(layer.__call__, options={"post_grad_custom_post_pass": GEMV_PASS})(x)
    assert dict(counters["speculative"]) == rewritten
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
