"""torch.compile of the native forward, behind the LanguageModel protocol.

`CompiledCausalLM(model)` shares a NativeCausalLM's weights and computes its forward with
`torch.compile(model.run)`, the sizes that change from call to call (batch, query length, cache
length, attention span) marked dynamic, so that one compiled graph serves them all. Dynamo still
specializes sizes of 1, so a model compiles one graph per kind of call on its first such call: one
query token or several (verification, a draft's first step, a short prefill), at batch 1 or more. On
CPU, a batch-1 verification (every position's logits: k + 1 tokens) or greedy drafting of 2 to
packed.STATIC_ROWS_MAX query tokens has a graph for its query length instead, in which the matmuls and
attention unroll over the few rows.
The span is rounded up to a multiple of SPAN_MULTIPLE (the causal mask hides the positions past
each row's length): free on CPU, and it bounds the shapes a CUDA graph is recorded for.
`greedy_decode` runs several greedy decoding steps (a draft model's k) as one compiled graph, one
graph per number of steps and kind of query; `head_greedy_decode` an EAGLE head's whole drafting
(the target's features it has not read, then its k steps); `draft_tree` a draft model's or EAGLE
head's whole token tree, its levels' attention masks built in the graph. Token-tree calls
(`forward_tree`: a verification, a level of a guided tree) have graphs of their own, the trees'
attention masks built eagerly and passed in.

CPU: the decode-sized calls (at most SMALL_CALL_ROWS query tokens, which NativeCausalLM may run on
one thread: cpu_tuning.small_call_threads) are compiled; longer ones (prefills) run eagerly on every
thread: they are compute-bound, compiling them gains little, and dynamo guards on the thread count,
so they could need graphs of their own. Inductor (C++) fuses the norms, RoPE, the K/V writes and the
gating between the matmuls; the matmuls stay PackedLinear's, its prepacked oneDNN kernels called as
an opaque custom op.
CUDA: every call compiled, mode "reduce-overhead" (CUDA graphs), the cache tensors marked as static
addresses (new_cache); a graph inductor leaves out of CUDA graphs runs without one and warns
(_compile). tests/test_cuda.py checks it on a GPU.

`compile_in_background(models, warm_up)` compiles in a thread of its own (a server that answers at
once): until its warm-up has run, the models' calls from every other thread run eagerly
(NativeCausalLM's forward, the same function uncompiled: the same outputs), then compiled; a warm-up
that fails leaves them eager.

Settings made in each thread before its first compiled call (torch keeps them per thread, so a
server's engine thread needs its own: apply_dynamo_settings): dynamo's limit of graphs per code
object raised to MIN_RECOMPILE_LIMIT (every model's graphs share NativeCausalLM.run's code object),
duck sizing off (two sizes that happen to be equal in the first call are not assumed equal forever),
and dynamo's recursive dict tags on. A compiled call first checks the guards of its graph: on every
tensor, type and constant the trace read, about 1,800 for a 30-layer model, which took longer than a
millisecond a call on CPU. The model's fused layers (FusedLayer, PackedLinear) are nn.Modules that
register nothing, and with the tags a subtree of nn.Modules whose attribute dicts did not change
since the last check (any assignment changes a dict's tag) skips its guards: what is left is the
inputs', the cache's and the model's own few. (Tensors are taken as unchanged there: an in-place
change of a held tensor's shape, `.data =` or `resize_`, would go unseen; the engine makes none.)
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config
from torch import Tensor
from torch._dynamo.utils import counters

from speculative.kv_cache import StaticKVCache
from speculative.models.base import LanguageModel, decode, decode_steps
from speculative.models.bucketed import BucketedModel, warm_up
from speculative.models.cpu_tuning import SMALL_CALL_ROWS
from speculative.models.gemv import GEMV_PASS
from speculative.models.llama import SPAN_MULTIPLE, NativeCausalLM
from speculative.models.packed import STATIC_ROWS_MAX
from speculative.precompile import PreCompileConfig

# Graphs of every model share the one code object of NativeCausalLM.run, and dynamo's default limit
# on graphs per code object (8) is below a target's and a draft's together.
MIN_RECOMPILE_LIMIT = 64

# compile_in_background: its thread's niceness (the lowest priority, which the compiler processes it
# starts inherit), and Python's thread switch interval while it compiles (seconds; 5 ms by default):
# compiling holds the interpreter lock most of the time, and an eager forward beside it waits for the
# lock between every two of its operations (docs/server.md, Under load)
BACKGROUND_NICENESS = 19
SWITCH_INTERVAL = 1e-4


_SETTINGS = threading.local()  # whether this thread has dynamo's settings (apply_dynamo_settings)


def apply_dynamo_settings() -> None:
    """The module docstring's process-wide dynamo settings, in the calling thread: torch keeps them per
    thread (a server's engine thread saw none of those its main thread made: dynamo's default limit of
    8 graphs per code object, duck sizing on), so every compiled call makes them in its thread first."""
    if getattr(_SETTINGS, "applied", False):
        return
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, MIN_RECOMPILE_LIMIT)
    config.use_recursive_dict_tags_for_guards = True
    fx_config.use_duck_shape = False
    _SETTINGS.applied = True


def _standard_strides(tensor: Tensor) -> Tensor:
    """The tensor with a row-major layout's strides (strides are guarded too, and the same shapes come
    as slices of wider tensors or not): a copy unless it has them already."""
    stride, expected = tensor.stride(), 1
    for size, have in zip(reversed(tensor.shape), reversed(stride)):
        if have != expected:
            return tensor.clone(memory_format=torch.contiguous_format)
        expected *= size
    return tensor


def graphs_compiled() -> int:
    """Graphs torch.compile has made in this process so far: a call during which the count rose
    compiled one, and its time is mostly that."""
    return counters["stats"]["unique_graphs"]


def default_mode(device: torch.device) -> str | None:
    """torch.compile's mode for a device: CUDA graphs ("reduce-overhead") on CUDA, inductor's default
    elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


class CompiledCausalLM:
    """A NativeCausalLM whose forward runs compiled (see the module docstring); it shares the model's
    weights, so the same model can also run eagerly elsewhere.

    mode: torch.compile's mode; None picks `default_mode(model.device)`.
    Capabilities (models/base.py): TreeForward, HiddenStates, GreedyDecoding and CompiledDrafting; over
    an EAGLE head (an EagleHead is a NativeCausalLM whose forwards read features) only its drafting calls
    apply: draft_with and head_greedy_decode.
    """

    def __init__(self, model: NativeCausalLM, mode: str | None = None) -> None:
        if not isinstance(model, NativeCausalLM):
            raise TypeError(f"CompiledCausalLM compiles a NativeCausalLM; got {type(model).__name__}")
        self.model = model
        self.mode = mode if mode is not None else default_mode(model.device)
        # CPU: longer calls (prefills) run eagerly, on every thread, where compiling gains little and
        # each thread count would need graphs of its own (dynamo guards on it)
        self.max_compiled_rows = SMALL_CALL_ROWS if model.device.type == "cpu" else None
        self._warming: threading.Thread | None = None  # compile_in_background's thread, until it succeeds
        apply_dynamo_settings()
        self._compiled = self._compile(model.run)
        self._positions: dict[tuple[int, int], Tensor] = {}  # (batch, q) -> _every_position
        self._marked = lambda: None  # a weak reference to the first cache view marked dynamic (_dynamic)
        self._greedy: dict[int, Callable[..., tuple[Tensor, Tensor]]] = {}  # steps -> compiled greedy_decode
        self._head_greedy: dict[int, Callable[..., tuple[Tensor, Tensor]]] = {}  # head_greedy_decode's
        self._trees: dict[tuple, Callable[..., tuple[Tensor, Tensor]]] = {}  # draft_with's, by key

    def _compile(self, fn: Callable) -> Callable:
        """torch.compile of `fn` in this model's mode; in "reduce-overhead", a call during which inductor
        left a graph out of CUDA graphs (it then runs without one) warns."""
        if self.model.device.type != "cpu" or self.mode is not None:
            compiled = torch.compile(fn, mode=self.mode)
        else:
            compiled = torch.compile(fn, options={"post_grad_custom_post_pass": GEMV_PASS})
        if self.mode != "reduce-overhead":

            def in_any_thread(*args, **kwargs):
                apply_dynamo_settings()
                return compiled(*args, **kwargs)

            return in_any_thread

        def call(*args, **kwargs):
            apply_dynamo_settings()
            skipped = counters["inductor"]["cudagraph_skips"]
            out = compiled(*args, **kwargs)
            if counters["inductor"]["cudagraph_skips"] > skipped:
                warnings.warn(
                    f"a compiled graph of {getattr(fn, '__name__', 'a call')} runs without CUDA graphs "
                    "(TORCH_LOGS=cudagraphs says why): slower, still exact",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return out

        return call

    def _eager(self, input_ids: Tensor) -> bool:
        """Whether a call of input_ids [batch, q] runs eagerly: from a thread other than a background
        warm-up's while one runs (or after one failed), or on CPU with more than max_compiled_rows
        tokens."""
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            return True
        return self.max_compiled_rows is not None and input_ids.numel() > self.max_compiled_rows

    vocab_size = property(lambda self: self.model.vocab_size)
    max_length = property(lambda self: self.model.max_length)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)

    def new_cache(self, batch_size: int, max_length: int) -> StaticKVCache:
        """The model's cache, one position longer than a multiple of SPAN_MULTIPLE: a span then never
        covers the whole buffer (a case dynamo would compile apart)."""
        cache = self.model.new_cache(batch_size, -(-max_length // SPAN_MULTIPLE) * SPAN_MULTIPLE + 1)
        if self.mode == "reduce-overhead":  # CUDA graphs replay on the same buffers
            for tensor in (*cache.keys, *cache.values):
                torch._dynamo.mark_static_address(tensor)
        return cache

    def _run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        key_positions: Tensor,
        logits_indices: Tensor | None,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        verification = logits_indices is None
        if verification:  # one graph for both: all positions' logits are a gather of all
            logits_indices = self._every_position(*input_ids.shape)
        input_ids, positions, logits_indices = self._dynamic(
            input_ids,
            positions,
            logits_indices,
            cache=keys + values,
            key_positions=key_positions,
            few_static=verification,
        )
        extra = {} if hidden_layers is None else {"hidden_layers": hidden_layers}  # a graph of its own
        return self._owned(
            self._compiled(input_ids, positions, keys, values, key_positions, logits_indices, **extra)
        )

    def _owned(self, out: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        """A compiled call's outputs as the caller's own tensors. Under CUDA graphs ("reduce-overhead")
        they live in the graphs' shared memory pool, where the next replay of any graph overwrites
        them (torch raises on reading one after that): a draft's tokens and logits are read after the
        target's verification replays, so every output is copied out. Elsewhere they are the call's own
        already."""
        if self.mode != "reduce-overhead":
            return out
        return out.clone() if isinstance(out, Tensor) else tuple(t.clone() for t in out)

    def _dynamic(
        self,
        *tensors: Tensor,
        cache: list[Tensor],
        key_positions: Tensor,
        few_static: bool,
    ) -> list[Tensor]:
        """`tensors` ([batch, q] each) with standard strides, their sizes and those of key_positions and
        the RoPE tables marked dynamic, and the batch and length of the cache's keys and values
        (`cache`, [batch, kv_heads, max_length, head_dim] each), which are views of the cache's buffers
        made anew as rows join and leave (marked once, when the buffers were made, the views were not:
        a graph for each batch size and cache length, compiled as a batch shrank). Views are marked when
        they are new, as their first one tells (marking all 2 x layers on every call costs time). With
        `few_static` (a verification, a draft's query), on CPU, a batch of one row of 2 to
        packed.STATIC_ROWS_MAX tokens is static instead: a graph for each such q, whose matmuls and
        attention unroll over the rows. (Not every call's: a short prompt's prefill would need a graph
        of its own for each length.)"""
        tensors = [_standard_strides(tensor) for tensor in tensors]
        batch, q = tensors[0].shape
        static = few_static and self.model.device.type == "cpu" and batch == 1 and 1 < q <= STATIC_ROWS_MAX
        for tensor in tensors:
            if static:
                torch._dynamo.mark_static(tensor)
            else:
                torch._dynamo.maybe_mark_dynamic(tensor, (0, 1))
        if self._marked() is not cache[0]:  # the views are new: the cache's rows changed
            for tensor in cache:
                torch._dynamo.maybe_mark_dynamic(tensor, (0, 2))
            self._marked = weakref.ref(cache[0])
        torch._dynamo.maybe_mark_dynamic(key_positions, 0)
        for table in (self.model._rope_cos, self.model._rope_sin):  # they grow with the longest span
            torch._dynamo.maybe_mark_dynamic(table, 0)
        return tensors

    def _every_position(self, batch: int, q: int) -> Tensor:
        """[batch, q] int64 = arange(q) in every row; kept for decode-sized shapes (making it anew is a
        noticeable part of a draft forward: docs/internals.md#measured-choices)."""
        indices = self._positions.get((batch, q))
        if indices is None:
            indices = torch.arange(q, device=self.device).repeat(batch, 1)
            if batch * q <= SMALL_CALL_ROWS:
                self._positions[batch, q] = indices
        return indices

    def forward(
        self,
        input_ids: Tensor,
        cache: StaticKVCache,
        num_tokens: Tensor | None = None,
        logits_indices: Tensor | None = None,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """NativeCausalLM.forward, compiled (with `hidden_layers`, a graph that also returns them);
        on CPU, eager for more than SMALL_CALL_ROWS tokens."""
        if self._eager(input_ids):
            return self.model.forward(input_ids, cache, num_tokens, logits_indices, hidden_layers)
        run = self._run
        if hidden_layers is not None:
            self.check_hidden_layers(hidden_layers)
            run = functools.partial(self._run, hidden_layers=tuple(hidden_layers))
        return self.model.forward_with(run, input_ids, cache, num_tokens, logits_indices, SPAN_MULTIPLE)

    __call__ = forward

    def check_hidden_layers(self, hidden_layers: tuple[int, ...]) -> None:
        """The model's check_hidden_layers (HiddenStates)."""
        self.model.check_hidden_layers(hidden_layers)

    def forward_tree(
        self,
        input_ids: Tensor,
        cache: StaticKVCache,
        parents: Tensor,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """NativeCausalLM.forward_tree, compiled: graphs of their own for tree calls, the masks computed
        eagerly and passed in, their sizes dynamic as the chains' are; on CPU, eager for more than
        SMALL_CALL_ROWS tokens."""
        if self._eager(input_ids):
            return self.model.forward_tree(input_ids, cache, parents, hidden_layers=hidden_layers)
        extra = {} if hidden_layers is None else {"hidden_layers": tuple(hidden_layers)}

        def body(
            input_ids: Tensor,
            positions: Tensor,
            keys: list[Tensor],
            values: list[Tensor],
            key_positions: Tensor,
            logits_indices: None,
            slots: Tensor,
            masks: dict[int | None, Tensor],
        ) -> Tensor | tuple[Tensor, Tensor]:
            cache_views = keys + values
            input_ids, positions, slots = self._dynamic(
                input_ids, positions, slots, cache=cache_views, key_positions=key_positions, few_static=False
            )
            masks = {window: _standard_strides(mask) for window, mask in masks.items()}
            for mask in masks.values():  # [batch, 1, q, span]
                torch._dynamo.maybe_mark_dynamic(mask, (0, 2, 3))
            run = functools.partial(self._compiled, slots=slots, tree_masks=masks, **extra)
            return self._owned(run(input_ids, positions, keys, values, key_positions, None))

        return self.model.forward_tree(
            input_ids, cache, parents, hidden_layers=hidden_layers, body=body, span_multiple=SPAN_MULTIPLE
        )

    def greedy_decode(self, input_ids: Tensor, cache: StaticKVCache, steps: int) -> tuple[Tensor, Tensor]:
        """`steps` greedy decoding steps in one compiled call: input_ids [batch, q >= 1] fed first, then
        each step's argmax. Returns the tokens [batch, steps] and the float32 logits [batch, steps,
        vocab] they are the first maximal index of; the cache gains input_ids and every token but the
        last.

        A draft model's k steps (its query: the tokens it has not seen) in one call instead of k (each
        call costs dynamo's guards, the graph's wrapper and its Python around: docs/models.md#fast-path).
        One graph per `steps` and per query kind (one token or several), compiled on its first use
        (warm_up_pair compiles the engine's). On CPU, a query of more than SMALL_CALL_ROWS tokens
        steps through `forward`, as `forward` would run it.
        """
        if self._eager(input_ids):
            return decode(self, input_ids, cache, steps)
        compiled = self._greedy.get(steps)
        if compiled is None:
            compiled = self._greedy[steps] = self._compile(_greedy_run(self.model.run, steps))

        def run(
            input_ids: Tensor,
            positions: Tensor,
            keys: list[Tensor],
            values: list[Tensor],
            key_positions: Tensor,
            logits_indices: None,
        ) -> tuple[Tensor, Tensor]:
            input_ids, positions = self._dynamic(
                input_ids, positions, cache=keys + values, key_positions=key_positions, few_static=True
            )
            return self._owned(compiled(input_ids, positions, keys, values, key_positions))

        written = input_ids.shape[1] + steps - 1
        return self.model.forward_with(run, input_ids, cache, span_multiple=SPAN_MULTIPLE, written=written)

    def head_greedy_decode(
        self,
        input_ids: Tensor,
        features: Tensor,
        cache: StaticKVCache,
        steps: int,
        num_tokens: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """An EAGLE head's (the model is an EagleHead) whole greedy drafting of `steps` tokens in one
        compiled call: input_ids [batch, q] fed first with their features [batch, q, feature] (the
        target's, or the head's hidden state), num_tokens [batch] of them real (right padding after),
        the first token drafted from each row's last real one; then each step's argmax fed
        with the head's hidden state of the step before. Returns the tokens [batch, steps] and float32
        logits [batch, steps, vocab] as greedy_decode does; the cache gains num_tokens and every token
        but the last. One graph per `steps` and kind of query (dynamo specializes a batch or q of 1);
        on CPU, more than SMALL_CALL_ROWS query tokens run the same function eagerly."""
        greedy = _head_greedy_run(self.model, steps)
        if not self._eager(input_ids):
            compiled = self._head_greedy.get(steps)
            if compiled is None:
                compiled = self._head_greedy[steps] = self._compile(greedy)
            greedy = compiled

        def run(
            input_ids: Tensor,
            positions: Tensor,
            keys: list[Tensor],
            values: list[Tensor],
            key_positions: Tensor,
            logits_indices: None,
        ) -> tuple[Tensor, Tensor]:
            ids, fed, positions, last = self._dynamic(
                input_ids,
                features,
                positions,
                (num_tokens - 1)[:, None],
                cache=keys + values,
                key_positions=key_positions,
                few_static=False,
            )
            return self._owned(greedy(ids, fed, positions, last, keys, values, key_positions))

        written = input_ids.shape[1] + steps - 1
        return self.model.forward_with(
            run, input_ids, cache, num_tokens + steps - 1, span_multiple=SPAN_MULTIPLE, written=written
        )

    def draft_with(
        self,
        key: tuple,
        grow: Callable[..., tuple[Tensor, Tensor]],
        input_ids: Tensor,
        cache: StaticKVCache,
        num_tokens: Tensor,
        nodes: int,
        features: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """A drafter's whole proposal in one compiled call. `grow(input_ids, positions, last, keys,
        values, key_positions[, features])` is the drafter's loop as a function of tensors over
        `self.model` (NativeCausalLM.run's arguments; proposers/draft_tree.py's tree_run makes one for
        trees): input_ids [batch, q] are fed first (with `features` [batch, q, F] when the model is an
        EagleHead: the target's features there), num_tokens [batch] of them real (right padding
        after), `last` [batch, 1] each row's last real one; `grow` then writes `nodes` more cache
        slots a row and returns two tensors (a tree's token_ids [batch, n] and parents
        [batch, 1 + n]). The cache gains num_tokens + nodes. One graph per `key` (the drafting's
        shape) and kind of query; on CPU, more than SMALL_CALL_ROWS query tokens run `grow` eagerly.

        Growing a tree's levels eagerly costs a compiled forward_tree call plus its masks and the
        growth's own small operations a level; here they fuse around the levels' forwards
        (docs/models.md#fast-path)."""
        if not self._eager(input_ids):
            compiled = self._trees.get(key)
            if compiled is None:
                compiled = self._trees[key] = self._compile(grow)
            grow = compiled

        def run(
            input_ids: Tensor,
            positions: Tensor,
            keys: list[Tensor],
            values: list[Tensor],
            key_positions: Tensor,
            logits_indices: None,
        ) -> tuple[Tensor, Tensor]:
            ids, positions, last, *fed = self._dynamic(
                input_ids,
                positions,
                (num_tokens - 1)[:, None],
                *([] if features is None else [features]),
                cache=keys + values,
                key_positions=key_positions,
                few_static=False,
            )
            return self._owned(grow(ids, positions, last, keys, values, key_positions, *fed))

        q = input_ids.shape[1]
        return self.model.forward_with(
            run, input_ids, cache, num_tokens + nodes, span_multiple=SPAN_MULTIPLE, written=q + nodes
        )


def _greedy_run(run: Callable[..., Tensor], steps: int) -> Callable[..., tuple[Tensor, Tensor]]:
    """`steps` greedy steps of NativeCausalLM.run as one function of tensors (what is compiled): step 0
    feeds the query at `positions` [batch, q] (logits at its last token), step i > 0 one token at the
    last position + i."""

    def greedy(
        input_ids: Tensor, positions: Tensor, keys: list[Tensor], values: list[Tensor], key_positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        last = positions[:, -1:]  # [batch, 1]

        def step(ids: Tensor, i: int) -> Tensor:
            if i == 0:  # logits at the query's last token only
                return run(
                    ids, positions, keys, values, key_positions, torch.full_like(last, positions.shape[1] - 1)
                )
            return run(ids, last + i, keys, values, key_positions, None)

        return decode_steps(step, steps, input_ids)

    return greedy


def _head_greedy_run(head: NativeCausalLM, steps: int) -> Callable[..., tuple[Tensor, Tensor]]:
    """`steps` greedy steps of an EagleHead's run_head as one function of tensors (what is compiled):
    step 0 feeds the query at `positions` [batch, q] with `features` (logits and hidden state at
    `last` [batch, 1], each row's last real query token), step i > 0 one token at that position + i
    with the head's hidden state of step i - 1."""

    def greedy(
        input_ids: Tensor,
        features: Tensor,
        positions: Tensor,
        last: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        key_positions: Tensor,
    ) -> tuple[Tensor, Tensor]:
        root = positions.gather(1, last)  # [batch, 1]
        hidden = [features]

        def step(ids: Tensor, i: int) -> Tensor:
            at, indices = (positions, last) if i == 0 else (root + i, None)
            logits, state = head.run_head(ids, hidden.pop(), at, keys, values, key_positions, indices)
            hidden.append(state)
            return logits

        return decode_steps(step, steps, input_ids)

    return greedy


def compile_in_background(
    models: Sequence[CompiledCausalLM],
    warm_up: Callable[[], None],
    done: Callable[[BaseException | None, float], None],
) -> threading.Thread:
    """Run `warm_up` (calls of `models`, which compile their graphs: warm_up_pair's) in a new daemon
    thread and return it; until it has run, the models' calls from every other thread run eagerly,
    and after it compiled. `done(error, seconds)` is called in that thread at its end (error None, or
    what the warm-up raised: the models then stay eager, as the warm-up could not compile them)."""

    def run() -> None:
        start, error = time.perf_counter(), None
        if sys.platform == "linux":  # this thread's priority, and that of the compilers it starts
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            warm_up()
        except Exception as raised:  # the models stay eager: a server keeps serving
            error = raised
        else:
            for model in models:
                model._warming = None
        finally:
            sys.setswitchinterval(interval)
        done(error, time.perf_counter() - start)

    thread = threading.Thread(target=run, name="compile-in-background", daemon=True)
    for model in models:
        model._warming = thread
    thread.start()
    return thread


def prepare_model(
    model: LanguageModel, compile: bool = False, precompile: PreCompileConfig | None = None
) -> LanguageModel:
    """`model` compiled (CompiledCausalLM) when `compile`, and then bucketed (BucketedModel) when
    `precompile` is given. ValueError when compiling a model that does not run the native forward."""
    if compile and not isinstance(model, CompiledCausalLM):
        if not isinstance(model, NativeCausalLM):
            raise ValueError(
                f"compile=True needs the native forward (model types llama, mistral, qwen2, "
                f"qwen3 with model_impl 'auto' or 'native'); got {type(model).__name__}"
            )
        model = CompiledCausalLM(model)
    return BucketedModel(model, precompile) if precompile is not None else model


def warm_up_pair(
    target: LanguageModel,
    draft: LanguageModel | None,
    precompile: PreCompileConfig,
    num_speculative_tokens: int,
    every_width: bool = False,
    every_draft_length: bool = False,
) -> None:
    """Warm up (compiling where compiled) every standalone shape of `precompile` on the calls the engine
    makes: the target's prefill, plain step (q = 1) and verification (q = k + 1; with `every_width`,
    every q in 2 .. k + 1, the widths of a proposer that may propose fewer than k, such as n-gram
    lookup, or of adaptive k: a batch-1 verification has a graph per q on CPU); the draft's prefill and
    its drafting: k steps (with `every_draft_length`, each of 1 .. k steps: adaptive k) from a query of
    1 token or of 2 (2 tokens, last logits, and one-token steps; compiled, a greedy drafting is one
    greedy_decode)."""
    k = num_speculative_tokens
    widths = range(2, k + 2) if every_width else [k + 1] if k else []
    warm_up(target, precompile, [(1, False)] + [(q, False) for q in widths])
    if draft is not None:
        warm_up_draft(draft, precompile, k, every_draft_length)


def warm_up_draft(
    draft: LanguageModel, precompile: PreCompileConfig, num_speculative_tokens: int, every_draft_length: bool
) -> None:
    """warm_up_pair's draft half: for every standalone shape of `precompile`, the draft's prefill and its
    drafting of k steps (every 1 .. k with `every_draft_length`) from a query of 1 token or of 2.
    Batch sizes 1 and 2 make every graph of a draft model's calls: a batch of 2 rows marks its batch
    dynamic, so that its graphs serve every larger batch."""
    k = num_speculative_tokens
    lengths = range(1, k + 1) if every_draft_length else [k]
    warm_up(draft, precompile, [(2, True), (1, False)], greedy=[(q, j) for j in lengths for q in (1, 2)])
