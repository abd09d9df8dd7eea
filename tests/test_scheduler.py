"""The server's scheduler without HTTP: continuous batching gives every request its offline output."""

from __future__ import annotations

import asyncio

import pytest
from conftest import byte_tokenizer, noisy_copy, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.server.scheduler import QueueFull, RequestStream, Scheduler


def _llm() -> LLM:
    tokenizer = byte_tokenizer()
    target = tiny_model("llama", vocab_size=257, eos_token_id=256, bos_token_id=256)
    return LLM(
        target,
        draft_model=noisy_copy(target, 0.03),
        tokenizer=tokenizer,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
    )


PROMPTS = ["def add(a, b):", "hello", "x = [1, 2", "The quick brown fox"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=15, ignore_eos=True, n=2),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["e"]),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
]


async def _collect(stream: RequestStream) -> tuple[dict[int, str], dict[int, list[int]], list]:
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    updates = []
    async for update in stream:
        updates.append(update)
        for d in update.sequences:
            texts[d.index] = texts.get(d.index, "") + d.text
            ids.setdefault(d.index, []).extend(d.token_ids)
    return texts, ids, updates


def test_concurrent_requests_get_their_offline_outputs() -> None:
    llm = _llm()
    expected = llm.generate(PROMPTS, PARAMS)

    async def main():
        scheduler = Scheduler(llm, max_num_seqs=3, max_waiting=8)
        scheduler.start()
        streams = []
        for i, (prompt, params) in enumerate(zip(PROMPTS * 2, PARAMS * 2)):
            streams.append(scheduler.submit(llm.tokenizer(prompt)["input_ids"], params, f"r{i}"))
            await asyncio.sleep(0.01 * i)  # arrivals spread over the running batch's steps
        results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 60)
        assert scheduler.num_running == 0 and scheduler.num_waiting == 0
        await scheduler.shutdown(5)
        return results, scheduler

    results, scheduler = asyncio.run(main())
    for i, (texts, ids, updates) in enumerate(results):
        out = expected[i % len(PROMPTS)]
        assert [texts[c.index] for c in out.outputs] == [c.text for c in out.outputs], i
        assert [ids[c.index] for c in out.outputs] == [c.token_ids for c in out.outputs], i
        assert updates[-1].finished and updates[-1].metrics.num_generated == sum(
            len(c.token_ids) for c in out.outputs
        )
        assert max(len(d.token_ids) for u in updates for d in u.sequences) > 1  # several tokens per step
    sent = sum(len(token_ids) for _, ids, _ in results for token_ids in ids.values())
    assert scheduler.metrics.generation_tokens._value.get() == sent
    assert scheduler.metrics.num_accepted_tokens._value.get() > 0


def test_aborts_free_rows_and_the_queue_has_a_limit() -> None:
    llm = _llm()
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    expected = llm.generate(PROMPTS[0], PARAMS[0])[0].outputs[0].text

    async def main():
        scheduler = Scheduler(llm, max_num_seqs=2, max_waiting=1)
        scheduler.start()
        ids = llm.tokenizer(PROMPTS[1])["input_ids"]
        first, second, queued = (scheduler.submit(ids, long, f"a{i}") for i in range(3))
        with pytest.raises(QueueFull, match="max_waiting=1"):
            scheduler.submit(ids, long, "refused")
        async for _ in first:
            break
        for stream in (first, second, queued):
            stream.abort()
        for _ in range(1000):  # the scheduler's thread frees the rows after it counts them out
            if scheduler.num_running == 0 and scheduler.num_waiting == 0 and scheduler.engine.batch is None:
                break
            await asyncio.sleep(0.01)
        assert scheduler.num_running == 0 and scheduler.engine.batch is None
        texts, _, _ = await _collect(scheduler.submit(llm.tokenizer(PROMPTS[0])["input_ids"], PARAMS[0], "b"))
        await scheduler.shutdown(5)
        return texts

    assert asyncio.run(main())[0] == expected


def test_a_failing_request_fails_alone() -> None:
    llm = _llm()
    expected = llm.generate(PROMPTS[0], PARAMS[0])[0].outputs[0].text

    def broken(output_ids, logits):
        if len(output_ids) > 2:
            raise RuntimeError("boom")
        return logits

    async def main():
        scheduler = Scheduler(llm)
        scheduler.start()
        bad = scheduler.submit([5, 6, 7], SamplingParams(max_tokens=30, logits_processors=[broken]), "bad")
        good = scheduler.submit(llm.tokenizer(PROMPTS[0])["input_ids"], PARAMS[0], "good")
        (_, _, bad_updates), (texts, _, _) = await asyncio.gather(_collect(bad), _collect(good))
        await scheduler.shutdown(5)
        return bad_updates, texts

    bad_updates, texts = asyncio.run(main())
    assert "boom" in bad_updates[-1].error
    assert texts[0] == expected


@pytest.mark.parametrize("budget", [None, 20, 8])
def test_prefills_between_steps_stay_within_max_prefill_tokens(budget) -> None:
    """With max_prefill_tokens the requests waiting together are prefilled a few at a time, their
    prompts at most that many tokens together between two steps of running rows, a longer prompt a
    chunk at a time (with no row running, the oldest whole); without it, all at once. Either way each
    gets its offline output."""
    llm = _llm()
    prompts = [llm.tokenizer(p)["input_ids"] for p in PROMPTS * 2]  # 14, 5, 9 and 19 tokens, twice
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    expected = [o.outputs[0].token_ids for o in offline]
    gaps = [[]]  # per pause between two steps: (prompt tokens prefilled, rows running then) per prefill
    engine, add, chunk, step = llm.engine, llm.engine.add, llm.engine.prefill_chunk, llm.engine.step

    def recording_add(sequences, *args, **kwargs):
        gaps[-1].append(([len(s.prompt_token_ids) for s in sequences], len(engine.sequences)))
        return add(sequences, *args, **kwargs)

    def recording_chunk(max_tokens=None):
        gaps[-1].append(([max_tokens or engine.prefilling.tokens_left], len(engine.sequences)))
        return chunk(max_tokens)

    def recording_step():
        gaps.append([])
        return step()

    engine.add, engine.prefill_chunk, engine.step = recording_add, recording_chunk, recording_step

    async def main():
        scheduler = Scheduler(llm, max_num_seqs=8, max_prefill_tokens=budget)
        streams = [scheduler.submit(p, params, f"r{i}") for i, p in enumerate(prompts)]  # all waiting
        scheduler.start()
        results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 60)
        await scheduler.shutdown(5)
        return results

    results = asyncio.run(main())
    assert [ids[0] for _, ids, _ in results] == expected
    prefills = [p for gap in gaps for p in gap]
    if budget is None:
        assert [lengths for lengths, _ in prefills] == [[len(p) for p in prompts]]
        return
    assert len(prefills) > 2
    for gap in gaps:
        if gap and gap[0][1]:  # rows were running: they waited for this gap's prefills only
            assert sum(sum(lengths) for lengths, _ in gap) <= budget, gaps
    if budget == 20:  # every prompt fits: none is chunked, several short ones go together
        assert any(len(lengths) > 1 for lengths, _ in prefills)
    else:  # the 14, 9 and 19-token prompts behind running rows go in chunks
        assert sum(1 for lengths, _ in prefills if lengths[0] not in {len(p) for p in prompts}) > 2
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1"):
        Scheduler(llm, max_prefill_tokens=0)


def test_a_prompt_the_prefix_cache_holds_counts_only_the_rest_against_max_prefill_tokens() -> None:
    """Behind a running request, a 46-token prompt whose first 32 tokens the prefix cache holds costs
    14 tokens of prefill: it goes in whole under a bound of 16 (counted whole, it went in chunks)."""
    tokenizer = byte_tokenizer()
    target = tiny_model("llama", vocab_size=257, eos_token_id=256, bos_token_id=256)
    llm = LLM(target, tokenizer=tokenizer, enable_prefix_caching=True)
    shared = [(7 * i) % 200 + 20 for i in range(40)]
    llm.generate([{"prompt_token_ids": shared}], SamplingParams(temperature=0.0, max_tokens=1))
    prompt = shared + [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    engine, begin, added = llm.engine, llm.engine.begin_prefill, []
    engine.begin_prefill = lambda sequences, *args: (added.append("chunks"), begin(sequences, *args))[1]

    async def main():
        scheduler = Scheduler(llm, max_num_seqs=8, max_prefill_tokens=16)
        scheduler.start()
        running = scheduler.submit(
            [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), "a"
        )
        while not engine.sequences:
            await asyncio.sleep(0.005)
        done = await asyncio.wait_for(_collect(scheduler.submit(prompt, params, "b")), 60)
        await asyncio.wait_for(_collect(running), 60)
        await scheduler.shutdown(5)
        return done

    _, ids, updates = asyncio.run(main())
    assert ids[0] == expected
    assert updates[-1].num_cached_tokens == 32
    assert not added  # prefilled whole, not begun in chunks


def test_a_chunked_prefill_that_fails_or_is_aborted_loses_its_own_request_only() -> None:
    """Behind a running request, two long prompts go in chunks: the first's second chunk raises (it
    fails with that error), the second's client leaves after its first chunk (its rows never join);
    the running request and one after them get their offline outputs."""
    llm = _llm()
    engine, chunk = llm.engine, llm.engine.prefill_chunk
    long_prompt = llm.tokenizer(PROMPTS[3])["input_ids"]  # 19 tokens
    short = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    after = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first, last = llm.tokenizer(PROMPTS[0])["input_ids"], llm.tokenizer(PROMPTS[1])["input_ids"]
    expected = [
        llm.generate([{"prompt_token_ids": p}], q)[0].outputs[0].token_ids
        for p, q in ((first, short), (last, after))
    ]
    streams, calls = [], []

    def flaky_chunk(max_tokens=None):
        calls.append(engine.prefilling.batch.sequences[0].prompt_index)
        if len(calls) == 2:
            raise RuntimeError("chunk exploded")
        out = chunk(max_tokens)
        if len(calls) == 3:
            streams[2].abort()
        return out

    engine.prefill_chunk = flaky_chunk

    async def main():
        scheduler = Scheduler(llm, max_num_seqs=8, max_prefill_tokens=4)
        for i, (prompt, params) in enumerate(
            [(first, short), (long_prompt, short), (long_prompt, short), (last, after)]
        ):
            streams.append(scheduler.submit(prompt, params, f"r{i}"))
        scheduler.start()
        done = await asyncio.wait_for(asyncio.gather(*(_collect(streams[i]) for i in (0, 1, 3))), 60)
        assert scheduler.num_running == 0 and engine.prefilling is None
        await scheduler.shutdown(5)
        return done

    (_, first_ids, _), (_, _, failed), (_, last_ids, _) = asyncio.run(main())
    assert first_ids[0] == expected[0] and last_ids[0] == expected[1]
    assert failed[-1].error == "RuntimeError: chunk exploded"
    assert calls[:3] == [1, 1, 2] and 2 not in calls[3:]  # the aborted one's prefill ended there


def test_an_error_that_recurs_at_once_makes_the_engine_thread_wait_not_spin(caplog) -> None:
    """Setting the gauges raises on every turn of the engine thread, idle too: it backs off (a few turns
    a second, not thousands), and once the error is gone it serves again."""
    llm = _llm()
    prompt = llm.tokenizer(PROMPTS[0])["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids

    async def main():
        scheduler = Scheduler(llm)
        turns, set_gauges = [], scheduler._set_gauges

        def broken():
            turns.append(1)
            raise RuntimeError("gauges exploded")

        scheduler._set_gauges = broken
        scheduler.start()
        await asyncio.sleep(1.0)
        scheduler._set_gauges = set_gauges
        spun = len(turns)
        (_, ids, _) = await asyncio.wait_for(_collect(scheduler.submit(prompt, params, "after")), 60)
        await scheduler.shutdown(5)
        return spun, ids

    spun, ids = asyncio.run(main())
    assert 1 <= spun <= 12, spun  # 20 ms, 40, 80, ... apart
    assert ids[0] == expected
    assert "gauges exploded" in caplog.text


def test_a_step_that_raises_fails_the_running_requests_alone() -> None:
    """The step raises once while a long prompt is being prefilled in chunks and another request waits:
    the running request fails with the step's error, the chunked one and the waiting one get their
    offline outputs."""
    llm = _llm()
    engine, step = llm.engine, llm.engine.step
    tokenize = lambda text: llm.tokenizer(text)["input_ids"]  # noqa: E731
    running, chunked, waiting = tokenize(PROMPTS[0]), tokenize(PROMPTS[3]), tokenize(PROMPTS[1])  # 14, 19, 5
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = [
        llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in (chunked, waiting)
    ]
    steps = []

    def failing_step():
        steps.append(engine.prefilling is not None)
        if len(steps) == 3:
            assert engine.prefilling is not None  # the chunked prefill is under way
            raise RuntimeError("step exploded")
        return step()

    engine.step = failing_step

    async def main():
        scheduler = Scheduler(llm, max_num_seqs=8, max_prefill_tokens=4)
        streams = [scheduler.submit(p, params, f"r{i}") for i, p in enumerate((running, chunked, waiting))]
        scheduler.start()
        results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 60)
        await scheduler.shutdown(5)
        return results

    (_, _, failed), (_, chunked_ids, _), (_, waiting_ids, _) = asyncio.run(main())
    assert failed[-1].error == "RuntimeError: step exploded"
    assert [chunked_ids[0], waiting_ids[0]] == expected


def test_a_prefill_that_raises_fails_its_request_alone_and_prompts_count_once() -> None:
    """Two requests prefilled together, one of whose prefills raises: they are prefilled again one at a
    time, the failing one fails alone, and each prompt counts once in the prompt tokens metric."""
    llm = _llm()
    engine, add = llm.engine, llm.engine.add
    good, bad = llm.tokenizer(PROMPTS[0])["input_ids"], [9, 9, 9, 9]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": good}], params)[0].outputs[0].token_ids

    def failing_add(sequences, *args, **kwargs):
        if any(s.prompt_token_ids == bad for s in sequences):
            raise RuntimeError("prefill exploded")
        return add(sequences, *args, **kwargs)

    engine.add = failing_add

    async def main():
        scheduler = Scheduler(llm)
        streams = [
            scheduler.submit(good, params, "good"),
            scheduler.submit(bad, params, "bad"),
        ]  # waiting together
        scheduler.start()
        results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 60)
        await scheduler.shutdown(5)
        return results, scheduler.metrics.prompt_tokens._value.get()

    ((_, ids, _), (_, _, failed)), counted = asyncio.run(main())
    assert ids[0] == expected and failed[-1].error == "RuntimeError: prefill exploded"
    assert counted == len(good) + len(bad)
