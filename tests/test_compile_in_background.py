"""compile_in_background (what `serve --compile` / `--draft-compile` does): while its warm-up runs, the
models' calls from every other thread run eagerly with the same logits, then compiled; a warm-up that
fails leaves them eager. And an eager forward is right while torch compiles in another thread. (No graph is
compiled here: the compiled call is stood in for; tests/server/test_serve_draft_compile.py compiles
for real.)"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import tiny_model

from speculative.models.compiled import CompiledCausalLM, compile_in_background
from speculative.models.llama import NativeCausalLM

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture
def model() -> CompiledCausalLM:
    compiled = CompiledCausalLM(NativeCausalLM.from_hf(tiny_model("llama", hidden_size=32)))
    calls = compiled.compiled_calls = []

    def stand_in(*args, **kwargs):  # the compiled graph's place: the same function, uncompiled
        calls.append(threading.current_thread())
        return compiled.model.run(*args, **kwargs)

    compiled._compiled = stand_in
    return compiled


def _logits(model) -> torch.Tensor:
    return model.forward(IDS, model.new_cache(1, 16))


def test_other_threads_run_eagerly_until_the_warm_up_has_run(model) -> None:
    want = _logits(model.model)
    go, ended = threading.Event(), []

    def warm_up() -> None:
        go.wait(timeout=30)
        torch.testing.assert_close(_logits(model), want)  # the warm-up's own calls: compiled

    thread = compile_in_background([model], warm_up, lambda error, seconds: ended.append(error))
    assert torch.equal(_logits(model), want)  # meanwhile, here: eager
    assert model.compiled_calls == []
    go.set()
    thread.join(timeout=30)
    assert ended == [None] and model.compiled_calls == [thread]
    torch.testing.assert_close(_logits(model), want)  # after: compiled, here too
    assert model.compiled_calls == [thread, threading.current_thread()]


def test_a_warm_up_that_fails_leaves_the_model_eager(model) -> None:
    ended = []

    def warm_up() -> None:
        raise RuntimeError("no compiler here")

    compile_in_background([model], warm_up, lambda error, seconds: ended.append(error)).join(timeout=30)
    assert [type(error) for error in ended] == [RuntimeError]
    assert torch.equal(_logits(model), _logits(model.model))
    assert model.compiled_calls == []


def test_an_eager_forward_beside_another_threads_compile_is_right() -> None:
    """torch.compiler.is_compiling() is one flag for the whole process, true in every thread while any
    compiles: the model's layers asked it which kernel to call, and an eager call then took the
    compiled graphs' op, which calls the layer again (RecursionError: the demo server's first requests
    beside its background compile)."""
    model = NativeCausalLM.from_hf(tiny_model("llama", hidden_size=32))
    want = _logits(model)
    with torch.compiler._compile_session_context():  # what another thread's torch.compile sets
        assert torch.equal(_logits(model), want)
