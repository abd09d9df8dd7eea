"""float32 matmuls of a few rows by the project's own kernel (models/few_rows.py): it computes x @ W.T
(+ bias) (+ residual), each row's result is bitwise that of a one-row call on any number of threads
(a verification's rows are a decoding step's), PackedLinear gives it exactly the calls it is for (float32,
at most ROWS_MAX rows, AVX2-only CPUs and Intel ones with AVX-512), and a kernel that cannot be built
leaves oneDNN, with a warning.
The kernel is built once per machine (about a minute)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from torch.utils import cpp_extension

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models import cpu_kernels, few_rows
from speculative.models.packed import PackedLinear


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    cpu_kernels.load("the tests")


@pytest.mark.parametrize("in_features", [32, 96, 576])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13])
def test_the_kernel_computes_the_linear_layer(rows: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(37, in_features, generator=generator)
    bias, residual = torch.randn(37, generator=generator), torch.randn(rows, 37, generator=generator)
    want = x.double() @ weight.double().T
    scale = (x.double().abs() @ weight.double().abs().T).max()
    assert (few_rows.linear(x, weight) - want).abs().max() < 1e-6 * scale
    got = few_rows.linear(x, weight, bias, residual)
    assert (got - (want + bias.double() + residual.double())).abs().max() < 1e-6 * scale


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_is_bitwise_a_one_row_calls(threads: int) -> None:
    """Whatever the rows beside it (groups of 6 and what is left) and the threads."""
    x, weight, bias = torch.randn(13, 576), torch.randn(300, 576), torch.randn(300)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([few_rows.linear(x[r : r + 1], weight, bias) for r in range(13)])
        for rows in (2, 5, 6, 7, 13):
            assert torch.equal(few_rows.linear(x[:rows], weight, bias), alone[:rows])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(few_rows.linear(x, weight, bias), alone)


def test_a_wrong_operand_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 32"):
        few_rows.linear(torch.randn(1, 40), torch.randn(8, 40))
    with pytest.raises(RuntimeError, match="weight must be float32"):
        few_rows.linear(torch.randn(1, 32), torch.randn(8, 32, dtype=torch.bfloat16))


def _counting(monkeypatch) -> list[int]:
    """The rows of every few_rows.linear call from now on."""
    calls: list[int] = []
    linear = few_rows.linear
    monkeypatch.setattr(few_rows, "linear", lambda x, *args: calls.append(x.shape[0]) or linear(x, *args))
    return calls


def test_packed_linear_gives_the_kernel_the_float32_calls_of_a_few_rows(monkeypatch) -> None:
    layer = PackedLinear([torch.nn.Linear(64, 96), torch.nn.Linear(64, 32)])
    if not layer.few_rows:
        pytest.skip("the kernel serves AVX2-only CPUs and Intel ones, not this one")
    calls = _counting(monkeypatch)
    with torch.inference_mode():
        for rows in (1, 5, few_rows.ROWS_MAX, few_rows.ROWS_MAX + 1, 40):
            x, residual = torch.randn(rows, 64), torch.randn(rows, 128)
            want = x @ layer.weight.T + layer.bias
            assert torch.allclose(layer(x), want, atol=1e-5)
            assert torch.allclose(layer(x, residual), want + residual, atol=1e-5)
    assert calls == [rows for rows in (1, 5, few_rows.ROWS_MAX) for _ in range(2)]
    assert not PackedLinear([torch.nn.Linear(64, 96).bfloat16()]).few_rows
    assert not PackedLinear([torch.nn.Linear(48, 96)]).few_rows  # in_features not a multiple of 32
    assert not few_rows.usable(torch.randn(64, 96).T)  # not contiguous: each call would copy it
    layer.quantize("int8")
    assert not layer.few_rows


def test_greedy_speculative_output_is_plain_decodings_through_the_kernel(monkeypatch) -> None:
    """Decoding steps and verifications of a float32 target and its draft take the kernel."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", hidden_size=64, num_layers=1, seed=1)
    plain = LLM(target, dtype="float32")
    if not plain.target.model._lm_head.few_rows:
        pytest.skip("the kernel serves AVX2-only CPUs and Intel ones, not this one")
    calls = _counting(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12] * 3]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=4)
    llm = LLM(target, draft_model=draft, speculative_config=config, dtype="float32")
    assert [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts] == want
    assert {1, 2, 5} <= set(calls)  # steps of two rows and one, verifications of 5 tokens


@pytest.mark.parametrize(
    ("capability", "prefetches", "served"),
    [
        ("AVX2", False, True),  # AMD or Intel
        ("AVX2", True, True),
        ("AVX512", True, True),  # an Intel CPU: built with the weights' prefetch, measured faster
        ("AVX512", False, False),  # an AMD one: oneDNN's, the kernel unmeasured against it
        ("DEFAULT", True, False),  # no AVX2: scalar code
    ],
)
def test_the_cpus_the_kernel_serves(capability, prefetches, served) -> None:
    assert few_rows.serves(capability, prefetches) is served


def test_a_kernel_that_cannot_be_built_leaves_onednn_with_a_warning(monkeypatch) -> None:
    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'speculative_cpu_kernels'")

    monkeypatch.setattr(few_rows, "_SERVES_THIS_CPU", True)
    monkeypatch.setattr(few_rows, "_usable", None)
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.warns(UserWarning, match=r"C\+\+ compiler.*float32 matmuls of a few rows stay oneDNN's"):
        layer = PackedLinear([torch.nn.Linear(64, 96)])
    assert not layer.few_rows and not PackedLinear([torch.nn.Linear(64, 32)]).few_rows  # one warning
    x = torch.randn(1, 64)
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-5)
