"""models/ as layers: the attention backends against each other (chains with per-row lengths, sliding
windows, token trees), RoPE, the capability protocols and what wrappers declare, `require`'s error, and
models/ importing neither distributed/ nor proposers/."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import tiny_model

from speculative.distributed.group import TensorParallelGroup
from speculative.models.attention import FusedAttention, SdpaAttention, chain_mask
from speculative.models.base import CompiledDrafting, GreedyDecoding, HiddenStates, TreeForward, require
from speculative.models.bucketed import BucketedModel, warm_up
from speculative.models.compiled import CompiledCausalLM
from speculative.models.hf import HFCausalLM
from speculative.models.llama import NativeCausalLM
from speculative.models.rope import apply_rope, rope_tables
from speculative.models.tensor_parallel import RankGroup
from speculative.precompile import PreCompileConfig
from speculative.tree import tree_ancestors, tree_depths, tree_query

BATCH, HEADS, KV_HEADS, HEAD_DIM, MAX_LENGTH = 2, 4, 2, 16, 40
LENGTHS = torch.tensor([5, 11])  # cached tokens per row before the query
PARENTS = torch.tensor([[-1, 0, 0, 1, 1, -1], [-1, 0, 1, 2, 0, 4]])  # row 0: a padding node last


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _caches(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (BATCH, KV_HEADS, MAX_LENGTH, HEAD_DIM)
    return _random(*shape, seed=seed), _random(*shape, seed=seed + 1)


def _queries() -> list[tuple[str, torch.Tensor, torch.Tensor, dict]]:
    """(name, positions [B, q], slots [B, q], the masks' arguments by window) of a chain at per-row
    lengths, with and without a sliding window, and of a token tree."""
    positions = LENGTHS[:, None] + torch.arange(3)
    cases = [
        ("chain", positions, positions, {None: None}),
        ("window", positions, positions, {4: None}),
    ]
    ancestors, depths = tree_ancestors(PARENTS), tree_depths(PARENTS)
    m = PARENTS.shape[1]
    start = LENGTHS[:, None]
    tree_span = int(LENGTHS.max()) + m
    node_positions, slots, masks = tree_query(ancestors, depths, m, start, torch.arange(tree_span), {None, 4})
    cases.append(("tree", node_positions, slots, masks))
    return cases


@pytest.mark.parametrize("case", ["chain", "window", "tree"])
def test_sdpa_backend_equals_the_fused_one_and_its_reductions(case) -> None:
    """SdpaAttention and FusedAttention write the same cache and attend alike: eagerly (SDPA with a
    boolean mask against SDPA with an additive one) and against the fused reductions that compiled CPU
    graphs run, on grouped-query heads, per-row lengths, a sliding window and a token tree."""
    name, positions, slots, masks = next(c for c in _queries() if c[0] == case)
    q = positions.shape[1]
    span = int(slots.max()) + 1
    key_positions = torch.arange(span)
    query = _random(BATCH, HEADS, q, HEAD_DIM, seed=5)
    new_keys, new_values = (
        _random(BATCH, q, KV_HEADS, HEAD_DIM, seed=6),
        _random(BATCH, q, KV_HEADS, HEAD_DIM, seed=7),
    )
    rows = torch.arange(BATCH)[:, None]
    fused, sdpa = FusedAttention(), SdpaAttention()
    outs = {}
    for backend in (fused, sdpa):
        key_cache, value_cache = _caches(seed=1)
        backend.write(key_cache, value_cache, rows, slots, new_keys, new_values)
        assert torch.equal(key_cache[0, :, slots[0]], new_keys[0].transpose(0, 1))
        for window, tree_mask in masks.items():
            if tree_mask is not None:
                tree_mask = tree_mask[..., :span]
            mask = backend.mask(positions, key_positions, window, tree_mask, query.dtype)
            outs[backend, window] = backend.attend(query, key_cache, value_cache, span, mask, 0.3)
            if backend is fused:
                reduced = fused.reductions(query, key_cache[:, :, :span], value_cache[:, :, :span], mask, 0.3)
                torch.testing.assert_close(reduced, outs[backend, window], atol=1e-5, rtol=1e-5)
    for window in masks:
        torch.testing.assert_close(outs[sdpa, window], outs[fused, window], atol=1e-5, rtol=1e-5)
    if name == "window":  # the window hides keys: the output differs from the chain's
        chain = chain_mask(positions, key_positions, None)
        assert not torch.equal(chain, chain_mask(positions, key_positions, 4))


def test_the_backend_is_a_model_setting_with_the_same_logits() -> None:
    """A NativeCausalLM with SdpaAttention gives the default backend's logits, in a chain forward (rows
    of different lengths) and a tree forward."""
    model = NativeCausalLM.from_hf(tiny_model("qwen3", vocab_size=96))
    ids = torch.randint(2, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = {}
    for backend in (FusedAttention(), SdpaAttention()):
        model.attention_backend = backend
        cache = model.new_cache(2, 32)
        model.forward(ids[:, :4], cache, num_tokens=torch.tensor([4, 2]))
        chain = model.forward(ids[:, 4:], cache)
        tree = model.forward_tree(ids[:, :6], cache, PARENTS)
        logits[type(backend)] = chain, tree
    for fused, sdpa in zip(logits[FusedAttention], logits[SdpaAttention]):
        torch.testing.assert_close(sdpa, fused, atol=1e-5, rtol=1e-5)


def test_rope_rotates_as_hugging_face_does() -> None:
    """apply_rope with rope_tables' signed sin equals HF's x * cos + rotate_half(x) * sin."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos, sin = rope_tables(inv_freq, 1.0, 12, torch.float32)
    x = _random(3, 12, 2, HEAD_DIM, seed=9)  # [batch, positions, heads, head_dim]
    freqs = torch.arange(12).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [positions, 1, head_dim]
    half = HEAD_DIM // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    want = x * emb.cos() + rotated * emb.sin()
    torch.testing.assert_close(apply_rope(x, cos[:, None], sin[:, None]), want, atol=1e-5, rtol=1e-5)


def test_models_declare_their_capabilities() -> None:
    """The native forward has trees and hidden states; transformers' has neither; a compiled model adds
    greedy decoding and compiled drafting; a bucketed model has forward_tree and greedy_decode exactly
    where its model has them (never hidden states, never compiled drafting), and its warm-up drafts
    only where it can."""
    native = NativeCausalLM.from_hf(tiny_model("llama", vocab_size=96))
    hf = HFCausalLM(tiny_model("llama", vocab_size=96))
    compiled = CompiledCausalLM(native)
    config = PreCompileConfig(batch_size=1, prefill_length=[8])
    capabilities = (TreeForward, HiddenStates, GreedyDecoding, CompiledDrafting)

    def has(model) -> tuple[bool, ...]:
        return tuple(isinstance(model, c) for c in capabilities)

    assert has(native) == (True, True, False, False)
    assert has(hf) == (False, False, False, False)
    assert has(compiled) == (True, True, True, True)
    assert has(BucketedModel(native, config)) == (True, False, False, False)
    assert has(BucketedModel(hf, config)) == (False, False, False, False)
    assert has(BucketedModel(compiled, config)) == (True, False, True, False)
    assert not hasattr(BucketedModel(hf, config), "forward_tree")  # what a getattr probe sees, too
    bucketed = BucketedModel(native, config)
    assert warm_up(bucketed, config, [(1, False)], greedy=[(1, 3)]) == [(1, 8)]  # no greedy_decode: skipped


def test_a_bucketed_forward_tree_scores_the_tree() -> None:
    """BucketedModel.forward_tree is the model's forward_tree."""
    native = NativeCausalLM.from_hf(tiny_model("llama", vocab_size=96))
    bucketed = BucketedModel(native, PreCompileConfig(batch_size=1, prefill_length=[8]))
    ids = torch.randint(2, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    want = native.forward_tree(ids, native.new_cache(2, 16), PARENTS)
    torch.testing.assert_close(bucketed.forward_tree(ids, bucketed.new_cache(2, 16), PARENTS), want)


def test_require_names_the_parameter() -> None:
    """require passes a model with the capability and otherwise raises a ValueError naming the
    parameter that asked for it, the model's role and its type."""
    native = NativeCausalLM.from_hf(tiny_model("llama", vocab_size=96))
    hf = HFCausalLM(tiny_model("llama", vocab_size=96))
    require(native, TreeForward, "SpeculativeConfig.tree", which="draft model")
    with pytest.raises(
        ValueError,
        match=r"^SpeculativeConfig.tree needs the native forward for the draft model .*HFCausalLM verifies"
        " chains only",
    ):
        require(hf, TreeForward, "SpeculativeConfig.tree", which="draft model")
    with pytest.raises(
        ValueError, match=r"^EagleConfig needs the native forward for the target .*no hidden states"
    ):
        require(hf, HiddenStates, "EagleConfig", which="target")
    with pytest.raises(ValueError, match=r"^compile needs a compiled model"):
        require(native, GreedyDecoding, "compile")


def test_a_tensor_parallel_group_is_a_rank_group() -> None:
    """TensorParallelGroup has what models/tensor_parallel.py's RankGroup asks for, by structure."""
    group: RankGroup = TensorParallelGroup(1, 2, 1)
    assert (group.rank, group.size) == (1, 2)
    assert set(RankGroup.__annotations__) <= set(TensorParallelGroup.__annotations__)


def test_models_import_neither_distributed_nor_proposers() -> None:
    """speculative.models imports nothing of speculative.distributed, .proposers, .engine or .server."""
    code = (
        "import sys\n"
        "import speculative.models.llama, speculative.models.tensor_parallel, speculative.models.compiled\n"
        "import speculative.models.loading, speculative.models.eagle, speculative.models.cpu_tuning\n"
        "bad = [m for m in sys.modules if m.startswith(('speculative.distributed', 'speculative.proposers',"
        " 'speculative.engine', 'speculative.server'))]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
