"""PackedLinear under NativeCausalLM: fused layouts that keep the HF parameters, and stay in step with
them."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from speculative.models.llama import NativeCausalLM
from speculative.models.packed import ONEDNN_CHUNK_ROWS, PackedLinear, onednn_rows, round_onednn_rows


def _logits(model: NativeCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, model.new_cache(ids.shape[0], ids.shape[1]))


def test_parameters_keep_their_names_and_values_as_views_of_the_fused_layout() -> None:
    hf = tiny_model("qwen2")  # q/k/v biases
    native = NativeCausalLM.from_hf(hf)
    mine, theirs = native.state_dict(), hf.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    layer = native._layers[0]
    attn = native.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == layer.qkv.weight.untyped_storage().data_ptr()
    assert attn.v_proj.bias.untyped_storage().data_ptr() == layer.qkv.bias.untyped_storage().data_ptr()
    reloaded = NativeCausalLM(hf.config)
    reloaded.load_state_dict(mine)  # the post-load hook lays the loaded weights out
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(reloaded, ids), _logits(native, ids))


def test_in_place_change_and_dtype_change_are_seen() -> None:
    hf = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    native = NativeCausalLM.from_hf(copy.deepcopy(hf)).to(torch.bfloat16)  # .to: laid out again
    assert native._layers[0].gate_up.weight.dtype == torch.bfloat16
    expected = _logits(NativeCausalLM.from_hf(copy.deepcopy(hf).to(torch.bfloat16)), ids)
    assert torch.equal(_logits(native, ids), expected)
    with torch.no_grad():  # prepacked (bf16) copies must follow an in-place change of a parameter
        native.model.layers[1].mlp.up_proj.weight.mul_(2.0)
        hf.model.layers[1].mlp.up_proj.weight.mul_(2.0)
    changed = _logits(native, ids)
    assert torch.equal(changed, _logits(NativeCausalLM.from_hf(hf.to(torch.bfloat16)), ids))
    assert not torch.equal(changed, expected)


def test_packed_linear_kernels_agree() -> None:
    torch.manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
        linears = [torch.nn.Linear(64, out, dtype=dtype) for out in (2048, 128)]
        packed = PackedLinear(linears)
        for rows in (1, 2, 5, 135):
            x = torch.randn(rows, 64, dtype=dtype)
            residual = torch.randn(rows, 2176, dtype=dtype)
            want = torch.cat(
                [
                    torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
                    for lin in linears
                ],
                dim=-1,
            )
            assert (packed(x).float() - want).abs().max() < tolerance * want.abs().max()
            assert (
                packed(x, residual).float() - want - residual.float()
            ).abs().max() < tolerance * want.abs().max()


def test_a_server_has_onednn_meet_few_row_counts() -> None:
    """oneDNN keeps a kernel per shape it is called with: with round_onednn_rows (a server's), calls
    of ever new row counts reach it with few, in chunks of at most ONEDNN_CHUNK_ROWS rows, zero-padded
    (at most 25% more rows up to 128, 12.5% beyond), and their results are unchanged; without it,
    with the rows given."""
    assert [onednn_rows(n) for n in (1, 8, 9, 11, 16, 17, 33, 64, 65, 129, 135, 2000, 2048)] == [
        1, 8, 10, 12, 16, 20, 40, 64, 80, 144, 144, 2048, 2048
    ]  # fmt: skip
    assert len({onednn_rows(n) for n in range(1, ONEDNN_CHUNK_ROWS + 1)}) == 8 + 4 * 4 + 8 * 2
    assert all(n <= onednn_rows(n) <= 1.25 * n for n in range(1, 129))
    assert all(n <= onednn_rows(n) <= 1.125 * n for n in range(129, 8193))
    packed = PackedLinear([torch.nn.Linear(64, 96)])
    if packed.prepacked is None:
        pytest.skip("no oneDNN here")
    packed.few_rows = False  # oneDNN's calls, every row count (few_rows.py's kernel takes a few)
    onednn, counts = packed._onednn, list(range(1, 1200, 7))

    def seen_rows(rounding: bool) -> set[int]:
        seen: set[int] = set()
        packed._onednn = lambda x, residual: seen.add(x.shape[0]) or onednn(x, residual)
        round_onednn_rows(rounding)
        try:
            with torch.inference_mode():
                for rows in counts:
                    x, residual = torch.randn(rows, 64), torch.randn(rows, 96) if rows % 2 else None
                    got = packed(x, residual)
                    assert got.shape == (rows, 96) and torch.allclose(got, onednn(x, residual), atol=1e-5)
        finally:
            round_onednn_rows(False)
        return seen

    chunks = {
        n
        for rows in counts
        for n in (ONEDNN_CHUNK_ROWS,) * (rows // ONEDNN_CHUNK_ROWS) + (rows % ONEDNN_CHUNK_ROWS,)
        if n
    }
    assert seen_rows(True) == {onednn_rows(n) for n in chunks}
    assert seen_rows(False) == set(counts)
