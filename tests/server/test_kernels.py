"""The oneDNN kernels a server makes ahead of its requests (Scheduler.start, scheduler.kernel_calls): one
call of each distinct linear shape per row count, not whole forwards; every kernel that generation
then meets among them; made by the engine thread while it is idle (and in a share of its time between
steps), so that requests never wait for all of them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from conftest import save_eagle_head_for

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.models import few_rows, packed
from speculative.models.cpu_tuning import SMALL_CALL_ROWS
from speculative.models.llama import NativeCausalLM
from speculative.models.packed import onednn_row_counts, round_onednn_rows
from speculative.server.scheduler import KernelCall, Scheduler, kernel_calls

from .conftest import speculative_llm, tiny_pair

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),
    reason="the kernels are oneDNN's (PackedLinear's prepacked copy)",
)


def _models(llm: LLM) -> list[NativeCausalLM]:
    models = [llm.target.model, llm.draft.model if llm.draft is not None else None]
    models.append(getattr(llm.engine.proposer, "head", None))
    return [m for m in models if m is not None]


def _record(models: list[NativeCausalLM]) -> tuple[list[tuple], Callable[[], None]]:
    """Record every oneDNN call of these models' PackedLinears as (shape [out, in], with a residual,
    rows, threads); returns the record and the function that stops recording."""
    seen: list[tuple] = []
    linears = {id(p): p for m in models for p in m.packed_linears()}.values()
    for linear in linears:
        onednn = linear._onednn

        def recording(x, residual, linear=linear, onednn=onednn):
            key = (tuple(linear.weight.shape), residual is not None, x.shape[0], torch.get_num_threads())
            seen.append(key)
            return onednn(x, residual)

        linear._onednn = recording

    def stop() -> None:
        for linear in linears:
            del linear._onednn

    return seen, stop


def _key(call: KernelCall) -> tuple:
    return (tuple(call.linear().weight.shape), call.residual, call.rows, call.threads)


@pytest.fixture
def rounding():
    """round_onednn_rows on (a server's setting), as it was afterwards."""
    before = packed._row_rounding
    round_onednn_rows()
    yield
    round_onednn_rows(before)


def test_a_started_scheduler_makes_each_kernel_with_one_call_of_each_linear_shape(rounding) -> None:
    """The idle engine thread makes the kernels: for the tiny pair (2 layers each, the same shapes) one
    call of each of its 5 kinds of call (q/k/v, o + residual, gate/up, down + residual, lm_head) per
    row count, on the engine's threads, instead of a forward of every layer of both models per count."""
    target, draft, tokenizer = tiny_pair()
    llm = speculative_llm(target, draft, tokenizer)
    models = _models(llm)
    if llm.target.model._lm_head.prepacked is None:
        pytest.skip("no oneDNN prepacking on this CPU")
    seen, stop = _record(models)
    try:

        async def main() -> int:
            scheduler = Scheduler(llm)
            scheduler.start()
            made = len(scheduler._kernels)
            for _ in range(6000):
                if scheduler.kernels_left == 0:
                    break
                await asyncio.sleep(0.01)
            await scheduler.shutdown(5)
            assert scheduler.kernels_left == 0
            return made

        made = asyncio.run(main())
    finally:
        stop()
    few = llm.target.model._lm_head.few_rows  # few_rows.py's kernel takes a few rows, not oneDNN
    counts = [rows for rows in onednn_row_counts() if not (few and rows <= few_rows.ROWS_MAX)]
    kinds = {(shape, residual) for shape, residual, _, _ in seen}
    hidden, inner, vocab = 64, 128, target.config.vocab_size
    heads = 4 * 16 + 2 * 2 * 16  # q, k and v heads of 16
    assert kinds == {
        ((heads, hidden), False),
        ((hidden, hidden), True),
        ((2 * inner, hidden), False),
        ((hidden, inner), True),
        ((vocab, hidden), False),
    }
    assert made == len(seen) == 5 * len(counts)
    assert Counter(seen) == Counter(
        (shape, residual, rows, torch.get_num_threads()) for shape, residual in kinds for rows in counts
    )
    assert [rows for _, _, rows, _ in seen] == sorted(rows for _, _, rows, _ in seen)  # small counts first


@pytest.mark.parametrize("drafter", ["draft", "eagle"])
@pytest.mark.parametrize("small_call_threads", [None, 1])
def test_generation_meets_only_the_kernels_made(rounding, tmp_path, drafter, small_call_threads) -> None:
    """Every oneDNN call of a server's generation (prefills of assorted widths and batches, one longer
    than a chunk, speculative steps; a draft model or an EAGLE head) is one that kernel_calls made, also
    where small forwards run on fewer threads (OMP_WAIT_POLICY=PASSIVE)."""
    if small_call_threads is not None and torch.get_num_threads() <= small_call_threads:
        pytest.skip("needs more threads than a small forward's")
    target, draft, tokenizer = tiny_pair(max_position_embeddings=1024)
    if drafter == "draft":
        llm = speculative_llm(target, draft, tokenizer)
    else:
        target.save_pretrained(tmp_path / "target")
        tokenizer.save_pretrained(tmp_path / "target")
        head = save_eagle_head_for(target, tmp_path / "eagle")
        config = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
        llm = LLM(str(tmp_path / "target"), draft_model=head, speculative_config=config)
    models = _models(llm)
    if models[0]._lm_head.prepacked is None:
        pytest.skip("no oneDNN prepacking on this CPU")
    for model in models:
        model.small_call_threads = small_call_threads
    made = {_key(call) for call in kernel_calls(llm)}
    seen, stop = _record(models)
    try:
        prompts = [[5 + i % 80 for i in range(n)] for n in (3, 17, 40, 70, 130, 530)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.generate([{"prompt_token_ids": prompts[1]}] * 9, params)
    finally:
        stop()
    assert seen and set(seen) <= made, sorted(set(seen) - made)
    if small_call_threads is not None:
        assert {n for *_, rows, n in seen if rows <= SMALL_CALL_ROWS} == {1, torch.get_num_threads()}


class _SlowKernel:
    """A stand-in kernel call that takes a while and notes the threads that make it and the number of
    sequences the scheduler was running each time."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.running: list[int] = []
        self.scheduler: Scheduler | None = None

    def make(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.running.append(self.scheduler.num_running)
        time.sleep(0.005)


def test_requests_do_not_wait_for_the_kernels(monkeypatch) -> None:
    """The engine thread makes the kernels one at a time while it has nothing else to do, and between
    steps while requests run (KERNEL_SHARE): a request that arrives while many are left is answered
    before they are all made, and the making goes on during it and after it."""
    target, draft, tokenizer = tiny_pair()
    llm = speculative_llm(target, draft, tokenizer)
    kernel = _SlowKernel()
    calls = (kernel,) * 20_000  # 100 s of kernels
    monkeypatch.setattr("speculative.server.scheduler.kernel_calls", lambda llm: calls)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main() -> tuple[int, int, int]:
        scheduler = kernel.scheduler = Scheduler(llm)
        scheduler.start()
        await asyncio.sleep(0.05)  # the engine thread is making kernels
        stream = scheduler.submit([5, 6, 7], params, "r")
        tokens = 0
        async for update in stream:
            tokens += sum(len(d.token_ids) for d in update.sequences)
        left = scheduler.kernels_left
        for _ in range(1000):  # the idle engine goes on
            if scheduler.kernels_left < left:
                break
            await asyncio.sleep(0.01)
        later = scheduler.kernels_left
        await scheduler.shutdown(5)
        return tokens, left, later

    tokens, left, later = asyncio.run(main())
    assert tokens == 40
    assert 0 < later < left < len(calls)
    assert kernel.threads == {"speculative-engine"}
    assert kernel.running[0] == 0 and 1 in kernel.running  # made idle, and between the request's steps
