"""torch.compile of the native forward: the same tokens as eager, and no recompiles once warmed up.

Compiling is slow on a small CPU (seconds per graph), so these tests use one tiny model pair.
"""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_model
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.demo.train_eagle import eagle_head
from speculative.models.base import decode, decode_steps
from speculative.models.compiled import SPAN_MULTIPLE, CompiledCausalLM
from speculative.models.eagle_checkpoint import save_eagle_head
from speculative.models.llama import NativeCausalLM
from speculative.models.packed import STATIC_ROWS_MAX
from speculative.precompile import PreCompileConfig
from speculative.tree import batch_tree

pytestmark = pytest.mark.slow  # cold inductor compiles: minutes on 2 cores (see pyproject.toml)

# lengths 3 .. 70: spans of these prompts plus 24 tokens cross multiples of SPAN_MULTIPLE
PROMPTS = [[5, 6, 7], [9, 10, 11, 12] * 5, [3, 4, 5] * 20 + [8] * 10]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", hidden_size=32, num_layers=2)
    return target, noisy_copy(target, 0.02)


def test_compiled_greedy_equals_eager_without_recompiles(pair) -> None:
    target, draft = pair
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    config = SpeculativeConfig(num_speculative_tokens=3)
    eager = LLM(target, draft_model=draft, speculative_config=config)
    compiled = LLM(
        target,
        draft_model=draft,
        speculative_config=config,
        compile=True,
        precompile=PreCompileConfig(batch_size=[1, 3]),
    )
    assert isinstance(compiled.target.model.model, CompiledCausalLM)
    graphs = counters["stats"]["unique_graphs"]  # every graph the runs below need, compiled by the warm-up
    for batch in ([PROMPTS[0]], [PROMPTS[1]], [PROMPTS[2]], PROMPTS):
        want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
        got = [o.outputs[0].token_ids for o in compiled.generate(batch, params)]
        assert got == want
    assert counters["stats"]["unique_graphs"] == graphs


def test_int8_prefills_short_and_long_are_compiled_by_the_warm_up(pair) -> None:
    """Compiled int8 prefills of at most 16 rows and of more run in graphs of their own (where the
    vector ISA takes packed.py's reduction): the warm-up makes both, so that a first prompt of 17-64
    tokens compiles nothing during its request (it did: 9-47 s on SmolLM2-135M)."""
    target, _ = pair
    compiled = LLM(target, compile=True, quantization="int8", precompile=PreCompileConfig(batch_size=[1]))
    graphs = counters["stats"]["unique_graphs"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompt in ([5, 6, 7], PROMPTS[1], [3, 4] * 16):  # 3, 20 and 32 tokens
        compiled.generate([prompt], params)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_shrinking_batch_and_a_longer_cache_compile_nothing_new(pair) -> None:
    """Without buckets, rows leave a compiled batch as they finish, and a later batch has more rows
    and a longer cache: the cache's views of its buffers keep their batch and length dynamic, so the
    graphs compiled by the first batch serve the second (once, each size compiled a graph of its own)."""
    target, draft = pair
    config = SpeculativeConfig(num_speculative_tokens=3)
    eager = LLM(target, draft_model=draft, speculative_config=config)
    compiled = LLM(target, draft_model=draft, speculative_config=config, compile=True)

    def run(prompts: list[list[int]], lengths: list[int]) -> None:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in compiled.generate(prompts, params)] == want

    run([PROMPTS[0], PROMPTS[1], [7, 8, 9, 10]], [6, 14, 24])  # 3 rows, then 2, then 1
    graphs = counters["stats"]["unique_graphs"]
    run([PROMPTS[2], PROMPTS[1], [4, 5] * 30, [6, 7, 8]], [30, 9, 20, 16])  # 4 rows, a longer cache
    assert counters["stats"]["unique_graphs"] == graphs


def _tag_safe_roots(node) -> list[str]:
    """The sources of the guard tree's nn.Modules whose guards one dict-tag check skips."""
    if node.is_tag_safe_root():
        return [node.get_source()]
    return [source for child in node.get_child_managers() for source in _tag_safe_roots(child)]


def test_guards_of_unchanged_layers_are_skipped_and_a_changed_model_is_followed(pair) -> None:
    """A compiled call's guards over the fused layers and the lm_head are one dict-tag check each
    (models/compiled.py), yet the graph follows what changes: an in-place change of a weight (its
    prepacked copy laid out again) and a draft vocabulary (a new lm_head) give eager's logits."""
    target, _ = pair
    native = NativeCausalLM.from_hf(target)
    compiled = CompiledCausalLM(native)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])

    def same_logits() -> None:
        caches = [model.new_cache(1, 16) for model in (native, compiled)]
        for cache in caches:
            native.forward(ids[:, :-1], cache)
        want = native.forward(ids[:, -1:], caches[0])
        torch.testing.assert_close(compiled.forward(ids[:, -1:], caches[1]), want, atol=1e-5, rtol=0)

    same_logits()
    entries = _debug_get_cache_entry_list(NativeCausalLM.run.__code__)
    roots = {source for entry in entries for source in _tag_safe_roots(entry.guard_manager.root)}
    assert {"L['self']._layers", "L['self']._lm_head"} <= roots
    with torch.no_grad():
        native.model.layers[0].mlp.down_proj.weight.mul_(-1.5)
    same_logits()
    native.restrict_vocabulary(torch.arange(0, native.vocab_size, 2))
    same_logits()


@pytest.mark.parametrize("batch", [2, 1])  # batch 1: verifications in graphs of their own query length
def test_compiled_logits_match_eager_across_spans(pair, batch) -> None:
    target, _ = pair
    native = NativeCausalLM.from_hf(target)
    compiled = CompiledCausalLM(native)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, native.vocab_size, (batch, 2 * SPAN_MULTIPLE + 8), generator=generator)
    eager_cache = native.new_cache(batch, ids.shape[1])
    compiled_cache = compiled.new_cache(batch, ids.shape[1])
    assert compiled_cache.max_length % SPAN_MULTIPLE == 1  # a span never covers the whole buffer
    start = SPAN_MULTIPLE - 3
    num_tokens = torch.tensor([start, start - 5][:batch])  # rows of different lengths
    for cache, model in ((eager_cache, native), (compiled_cache, compiled)):
        model.forward(ids[:, :start], cache, num_tokens=num_tokens)
    steps = [1, 4, 1, 1, 5, 1] * 3  # decode and verify steps across two span multiples
    for q in steps:
        query = ids[:, start : start + q]
        want = native.forward(query, eager_cache)
        got = compiled.forward(query, compiled_cache)
        assert (got - want).abs().max() < 1e-5
        start += q
    assert torch.equal(eager_cache.lengths, compiled_cache.lengths)


def test_batch_one_verifications_have_a_graph_per_query_length_and_prefills_share_one() -> None:
    """On CPU a batch-1 call wanting every position's logits (a verification) of 2 to STATIC_ROWS_MAX
    tokens is compiled for its query length, so that its matmuls and attention unroll over the rows;
    prefills (logits at their last token) of any length share one graph."""
    # a model of its own shape: graphs compiled for the pair by other tests would serve it too
    compiled = CompiledCausalLM(NativeCausalLM.from_hf(tiny_model("llama", hidden_size=48, num_layers=1)))
    ids = torch.arange(64)[None] % compiled.vocab_size

    def graphs_after(q: int, verification: bool) -> int:
        cache = compiled.new_cache(1, 64)
        compiled.forward(ids[:, :8], cache, logits_indices=torch.tensor([[7]]))
        compiled.forward(
            ids[:, 8 : 8 + q], cache, logits_indices=None if verification else torch.tensor([[q - 1]])
        )
        return counters["stats"]["unique_graphs"]

    before = counters["stats"]["unique_graphs"]
    assert graphs_after(3, False) == before + 1  # the prefills' graph (8 tokens, then 3)
    for q in (4, 5, 2):
        assert graphs_after(q, False) == before + 1
    assert graphs_after(3, True) == before + 2
    assert graphs_after(5, True) == before + 3
    assert graphs_after(5, True) == before + 3
    assert (
        graphs_after(STATIC_ROWS_MAX + 2, True) == before + 4
    )  # more rows: dynamic, every position's logits
    assert graphs_after(STATIC_ROWS_MAX + 3, True) == before + 4


@pytest.mark.parametrize("query_tokens", [1, 2])
def test_greedy_decode_is_one_call_and_equals_stepping(pair, query_tokens) -> None:
    """A draft's greedy steps from its query (1 token, or 2 after a whole block was kept): one compiled
    call, the tokens and logits of the eager model's forward of the query and one-token steps."""
    target, _ = pair
    native = NativeCausalLM.from_hf(target)
    compiled = CompiledCausalLM(native)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, native.vocab_size, (2, SPAN_MULTIPLE - 2), generator=generator)
    eager_cache = native.new_cache(2, 2 * SPAN_MULTIPLE)
    compiled_cache = compiled.new_cache(2, 2 * SPAN_MULTIPLE)
    lengths = torch.tensor([ids.shape[1], ids.shape[1] - 7])  # rows of different lengths
    for cache in (eager_cache, compiled_cache):  # all but each row's last tokens, which the query feeds
        native.forward(ids, cache, num_tokens=lengths - query_tokens)
    query = ids.gather(1, lengths[:, None] - query_tokens + torch.arange(query_tokens))
    want_ids, want_logits = decode(native, query, eager_cache, 6)  # crosses a multiple
    got_ids, got_logits = compiled.greedy_decode(query, compiled_cache, 6)
    assert torch.equal(got_ids, want_ids)
    assert (got_logits - want_logits).abs().max() < 1e-5
    assert torch.equal(compiled_cache.lengths, eager_cache.lengths)
    assert compiled_cache.lengths.tolist() == (lengths + 5).tolist()


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_head_greedy_decode_is_one_call_and_equals_stepping(pair, layout) -> None:
    """An EAGLE head's drafting in one compiled call: the target's features it lacks (rows needing
    different numbers, right padded), then its steps; the tokens and logits of the eager head fed
    those features, then one token at a time with its own hidden state of the step before."""
    target, _ = pair
    sizes = {"intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    head = eagle_head(target, sizes, layout)
    compiled = CompiledCausalLM(head)
    generator = torch.Generator().manual_seed(2)
    hidden_size = head.config.hidden_size
    width = head.fc.in_features - (hidden_size if layout == "eagle" else 0)  # the target's feature
    ids = torch.randint(0, head.vocab_size, (2, SPAN_MULTIPLE - 2), generator=generator)
    features = torch.randn(2, ids.shape[1], width, generator=generator)
    lengths = torch.tensor([ids.shape[1], ids.shape[1] - 7])
    need = torch.tensor([3, 1])  # positions not fed yet, per row
    index = (lengths - need)[:, None] + torch.arange(3)
    query = ids.gather(1, index.clamp(max=ids.shape[1] - 1))
    query_features = features.gather(1, index.clamp(max=ids.shape[1] - 1)[..., None].expand(-1, -1, width))
    caches = head.new_cache(2, 2 * SPAN_MULTIPLE), compiled.new_cache(2, 2 * SPAN_MULTIPLE)
    for cache in caches:  # the context but the positions the query feeds
        head.forward(ids, features, cache, num_tokens=lengths - need)
    eager_cache, compiled_cache = caches
    logits, hidden = head.forward(
        query, query_features, eager_cache, num_tokens=need, logits_indices=(need - 1)[:, None]
    )
    last = [hidden]

    def step(tokens: torch.Tensor, i: int) -> torch.Tensor:
        if i == 0:
            return logits
        out, state = head.forward(tokens, last.pop(), eager_cache)
        last.append(state)
        return out

    want_ids, want_logits = decode_steps(step, 5, query)  # crosses a multiple
    got_ids, got_logits = compiled.head_greedy_decode(query, query_features, compiled_cache, 5, need)
    assert torch.equal(got_ids, want_ids)
    assert (got_logits - want_logits).abs().max() < 1e-4
    assert compiled_cache.lengths.tolist() == eager_cache.lengths.tolist() == (lengths + 4).tolist()


def test_compile_needs_the_native_forward() -> None:
    with pytest.raises(ValueError, match="compile=True needs the native forward"):
        LLM(tiny_model("llama"), model_impl="transformers", compile=True)
    with pytest.raises(TypeError, match="compiles a NativeCausalLM"):
        CompiledCausalLM(tiny_model("llama"))


def test_cli_compile_flags() -> None:
    from speculative.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "--compile"]).compile is True
    assert parser.parse_args(["generate"]).compile is False
    assert parser.parse_args(["bench", "--compile"]).compile is True
    assert parser.parse_args(["bench"]).compile is None  # None: BenchConfig's default (False)
    for flags, want in (([], None), (["--draft-compile"], True), (["--no-draft-compile"], False)):
        assert parser.parse_args(["serve", *flags]).draft_compile is want


def test_a_compiled_call_in_another_thread_makes_the_settings_there(pair) -> None:
    """torch keeps dynamo's settings per thread: a thread that only runs compiled calls (a server's
    engine thread) gets the raised graph limit and duck sizing off from its first call."""
    import threading

    import torch.fx.experimental._config as fx_config

    llm = LLM(pair[0], compile=True)
    seen = {}

    def run() -> None:
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))
        seen.update(limit=torch._dynamo.config.recompile_limit, duck=fx_config.use_duck_shape)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == {"limit": 64, "duck": False}


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_drafter_compiled_alone_keeps_greedy_output(pair, tmp_path, method) -> None:
    """LLM(draft_compile=True) beside an eager target: the drafter runs compiled (a draft model's k
    greedy drafts, an EAGLE head's drafting: one compiled call each), the target eagerly; greedy output
    and steps are the eager engine's, and later runs compile nothing."""
    target, draft = pair
    if method == "eagle3":
        sizes = {"intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
        save_eagle_head(eagle_head(target, sizes, "eagle3"), tmp_path / "head")
        draft = str(tmp_path / "head")
    config = SpeculativeConfig(method=method, num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    eager = LLM(target, draft_model=draft, speculative_config=config)
    alone = LLM(target, draft_model=draft, speculative_config=config, draft_compile=True)
    assert isinstance(alone.target.model, NativeCausalLM)
    proposer = alone.engine.proposer
    compiled = proposer.compiled if method == "eagle3" else proposer.model
    assert isinstance(compiled, CompiledCausalLM)
    want = eager.generate(PROMPTS, params)
    got = alone.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.metrics.num_steps for o in got] == [o.metrics.num_steps for o in want]
    graphs = counters["stats"]["unique_graphs"]
    alone.generate(PROMPTS, params)
    assert counters["stats"]["unique_graphs"] == graphs
    greedy = compiled._head_greedy if method == "eagle3" else compiled._greedy
    assert 3 in greedy


@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_an_eagle_head_on_a_compiled_target_keeps_greedy_output(pair, tmp_path, tree) -> None:
    """With an EAGLE head, the compiled target's chain calls also return the hidden states the head
    reads (a graph of their own), in trees too; a chain's or a tree's drafting is one compiled call
    of the head (k = 3 steps or levels), compiled once. Greedy output and steps are the eager
    engine's. (The batch's 3 rows shrink trees of width 6 and 12 nodes to width 2 and 4 nodes.)"""
    target, _ = pair
    sizes = {"intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    save_eagle_head(eagle_head(target, sizes, "eagle3"), tmp_path / "head")
    config = SpeculativeConfig(
        method="eagle3", num_speculative_tokens=3, tree=tree, tree_nodes=12, tree_width=6
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    eager, compiled = (
        LLM(target, draft_model=str(tmp_path / "head"), speculative_config=config, compile=c)
        for c in (False, True)
    )
    assert isinstance(compiled.target.model, CompiledCausalLM)
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in compiled.generate(PROMPTS, params)] == want
    graphs = counters["stats"]["unique_graphs"]
    assert (
        compiled.generate(PROMPTS, params)[0].metrics.num_steps
        == eager.generate(PROMPTS, params)[0].metrics.num_steps
    )
    assert counters["stats"]["unique_graphs"] == graphs
    head = compiled.engine.proposer.compiled
    if tree is None:
        assert list(head._head_greedy) == [3]
    else:  # a tree's whole growth is one compiled call too
        shapes = {(3, "dynamic", *batch_tree(6, 12, rows, 3)) for rows in (1, 2, 3)}  # rows finish apart
        assert (3, "dynamic", 2, 4) in head._trees and set(head._trees) <= shapes


@pytest.mark.parametrize(
    "method, tree", [("draft_model", "dynamic"), ("draft_model", "static"), ("ngram", "static")]
)
def test_compiled_trees_keep_greedy_output_and_compile_only_their_own_graphs(pair, method, tree) -> None:
    """Tree calls (the draft's levels, the target's verification) run compiled, with graphs of their
    own: greedy output is the eager engine's, step for step, batches of one and of two (whose trees
    shrink: width 4 and 8 nodes to 2 and 4); once their shapes were met, later runs compile nothing
    new."""
    target, draft = pair
    config = SpeculativeConfig(method=method, num_speculative_tokens=3, tree=tree, tree_nodes=8, tree_width=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    draft = draft if method == "draft_model" else None
    eager, compiled = (
        LLM(target, draft_model=draft, speculative_config=config, compile=c) for c in (False, True)
    )
    for batch in ([PROMPTS[1]], PROMPTS[:2]):
        want = eager.generate(batch, params)
        got = compiled.generate(batch, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.metrics.num_steps for o in got] == [o.metrics.num_steps for o in want]
    graphs, model, trees = counters["stats"]["unique_graphs"], compiled.target.model, []
    assert isinstance(model, CompiledCausalLM)
    run = model._compiled
    model._compiled = lambda *args, **kwargs: trees.append("tree_masks" in kwargs) or run(*args, **kwargs)
    compiled.generate(PROMPTS[:2], params)
    assert counters["stats"]["unique_graphs"] == graphs
    assert any(trees)  # the verifications went through the compiled run
    if method == "draft_model":  # each proposal grew its tree in one compiled call
        assert list(compiled.engine.proposer.model._trees) == [(3, tree, 4, 8), (3, tree, 2, 4)]


def test_a_graph_outside_cuda_graphs_warns(pair) -> None:
    """In mode "reduce-overhead", a graph inductor cannot put in a CUDA graph runs without one, and
    says so: here every graph, on a CPU; on a GPU none should (tests/test_cuda.py)."""
    model = NativeCausalLM.from_hf(pair[0])
    compiled = CompiledCausalLM(model, mode="reduce-overhead")
    ids = torch.tensor([PROMPTS[0]])
    with pytest.warns(RuntimeWarning, match="runs without CUDA graphs"):
        logits = compiled.forward(ids, compiled.new_cache(1, 32))
    assert torch.equal(logits.argmax(-1), model.forward(ids, model.new_cache(1, 32)).argmax(-1))
