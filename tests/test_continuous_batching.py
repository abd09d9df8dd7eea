"""Continuous batching: sequences admitted to, and dropped from, a running batch between steps
give exactly the tokens they give alone."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, save_eagle_head_for, tiny_model

from speculative import LLM, SamplingParams, SpeculativeConfig

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16], [20, 21, 22]]
SETUPS = {
    "draft, native": dict(model_impl="native", method="draft_model"),
    "draft, transformers": dict(model_impl="transformers", method="draft_model"),
    "draft + lookup, native": dict(model_impl="native", method="draft_model", prompt_lookup_min=1),
    "draft + lookup, transformers": dict(
        model_impl="transformers", method="draft_model", prompt_lookup_min=1
    ),
    "ngram, native": dict(model_impl="native", method="ngram"),
    "autoregressive, native": dict(model_impl="native", method=None),
    "draft tree, native": dict(model_impl="native", method="draft_model", tree="dynamic"),
    "ngram trie, native": dict(model_impl="native", method="ngram", tree="static"),
    # Without the global cache: with it, a seeded sampled row's drafts, and so its text, depend on the
    # responses that finished before (its distribution does not).
    "suffix, native": dict(model_impl="native", method="suffix", suffix_decoding_max_cached_requests=0),
    "suffix tree, native": dict(
        model_impl="native", method="suffix", tree="static", suffix_decoding_max_cached_requests=0
    ),
}


def _llm(model_impl: str, method: str | None, tree: str | None = None, **options) -> LLM:
    target = tiny_model("llama", num_layers=2)
    draft = noisy_copy(target, 0.03) if method == "draft_model" else None
    config = (
        SpeculativeConfig.from_dict(
            dict(method=method, num_speculative_tokens=3, tree=tree, tree_width=2, tree_nodes=6, **options)
        )
        if method
        else None
    )
    return LLM(target, draft_model=draft, speculative_config=config, model_impl=model_impl, seed=0)


def _params() -> list[SamplingParams]:
    """Greedy and seeded sampled requests, with several lengths and a penalty (needs context)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=8, ignore_eos=True),
    ]


def _alone(llm: LLM, i: int) -> list[list[int]]:
    return [c.token_ids for c in llm.generate([PROMPTS[i]], _params()[i])[0].outputs]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_rows_admitted_mid_run_give_their_tokens_alone(setup: str) -> None:
    llm = _llm(**SETUPS[setup])
    expected = [_alone(llm, i) for i in range(len(PROMPTS))]
    engine = llm.engine
    sequences = [llm.make_sequences(PROMPTS[i], p, i) for i, p in enumerate(_params())]
    engine.add(sequences[0])
    engine.step()
    engine.step()
    engine.add(sequences[1] + sequences[2])  # joins a batch whose rows are 2 steps ahead
    engine.step()
    engine.add(sequences[3])
    steps = 0
    while engine.sequences:
        engine.step()
        steps += 1
        assert steps < 100
    for i, group in enumerate(sequences):
        assert [r.output_token_ids for r in group] == expected[i], f"prompt {i}"
        assert all(r.finish_reason == "length" for r in group)
    assert engine.batch is None and engine.cache is None
    if setup.startswith("draft"):  # a draft's KV buffers go with the batch, as the target's do
        assert getattr(engine.proposer, "draft", engine.proposer).cache is None  # (with lookup: its draft)


def _run_out(engine) -> None:
    steps = 0
    while engine.sequences:
        engine.step()
        steps += 1
        assert steps < 100


def _eagle(tmp_path) -> LLM:
    """An LLM whose proposer reads the target's hidden states of every prompt token."""
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
    return LLM(target, draft_model=save_eagle_head_for(target, tmp_path / "eagle"), speculative_config=config)


@pytest.mark.parametrize("setup", [*SETUPS, "eagle, native"])
def test_prompts_prefilled_a_chunk_at_a_time_between_steps_give_their_tokens_alone(
    setup: str, tmp_path
) -> None:
    llm = _eagle(tmp_path) if setup == "eagle, native" else _llm(**SETUPS[setup])
    expected = [_alone(llm, i) for i in range(len(PROMPTS))]
    engine = llm.engine
    sequences = [llm.make_sequences(PROMPTS[i], p, i) for i, p in enumerate(_params())]
    engine.add(sequences[0])
    engine.step()
    engine.begin_prefill(sequences[2])  # 7 tokens: 3, 3, then 1
    assert engine.prefill_chunk(3) is None and engine.prefilling.tokens_left == 4
    assert engine.sequences == sequences[0]  # the running batch is untouched until the last chunk
    engine.step()
    assert engine.prefill_chunk(3) is None
    engine.step()
    assert engine.prefill_chunk(3) == [] and engine.prefilling is None
    assert engine.sequences == sequences[0] + sequences[2]
    engine.step()
    engine.begin_prefill(sequences[3])  # n = 2: both rows share the prompt's chunks
    assert engine.prefill_chunk(2) is None
    engine.step()
    engine.prefill_chunk()
    engine.add(sequences[1])
    _run_out(engine)
    for i, group in enumerate(sequences):
        assert [r.output_token_ids for r in group] == expected[i], f"prompt {i}"


def test_an_eagle_head_reads_the_hidden_states_of_every_chunk(tmp_path, monkeypatch) -> None:
    llm = _eagle(tmp_path)
    engine, width = llm.engine, len(PROMPTS[2])
    observed, observe = [], engine.proposer.observe
    monkeypatch.setattr(engine.proposer, "observe", lambda f: observed.append(f) or observe(f))
    engine.add(llm.make_sequences(PROMPTS[2], _params()[2], 2))
    engine.reset()
    engine.begin_prefill(llm.make_sequences(PROMPTS[2], _params()[2], 2))
    for _ in range(3):
        engine.prefill_chunk(3)
    whole, chunked = observed
    torch.testing.assert_close(chunked[0, :width], whole[0, :width])


def test_a_long_prompt_joining_running_rows_is_fed_to_an_eagle_head_alone(tmp_path, monkeypatch) -> None:
    """A long prompt that joins running rows further along than its own room is fed to the head apart
    from them (before, every row was fed padded to its length: the head's cache overflowed), and every
    row drafts what it drafts alone: the same tokens accepted."""
    llm = _eagle(tmp_path)
    running = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    joining = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [([3, 4, 5], running), ([7, 8, 9, 10], running), (list(range(2, 62)), joining)]
    alone = []
    for i, (prompt, params) in enumerate(prompts):
        (s,) = llm.make_sequences(prompt, params, i)
        llm.engine.run([s])
        alone.append((s.output_token_ids, s.metrics.num_accepted))
    engine = llm.engine
    together = [llm.make_sequences(p, params, i)[0] for i, (p, params) in enumerate(prompts)]
    engine.add(together[:2])
    while min(len(s.output_token_ids) for s in together[:2]) < 25:  # past the joiner's 60 + 4 + k
        engine.step()
    head, fed = engine.proposer.head, []
    forward = head.forward

    def counted(ids, *args, **kwargs):
        fed.append(ids.numel())
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(head, "forward", counted)
    engine.add(together[2:])
    engine.step()
    # 59 positions of the long prompt, then one proposal: at most k + 1 positions of 3 rows, and
    # 2 drafts of 3
    assert sum(fed) <= 59 + 3 * 4 + 2 * 3
    _run_out(engine)
    assert [(s.output_token_ids, s.metrics.num_accepted) for s in together] == alone


def test_a_chunked_prefill_outlives_the_batch_beside_it_and_abort_or_reset_ends_it() -> None:
    llm = _llm("native", "draft_model")
    expected = _alone(llm, 2)
    engine = llm.engine
    short = llm.make_sequences(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), 1)
    chunked = llm.make_sequences(PROMPTS[2], _params()[2], 2)
    engine.add(short)
    engine.begin_prefill(chunked)
    engine.prefill_chunk(4)
    _run_out(engine)  # the batch beside it ends ...
    assert engine.batch is None and engine.prefilling.tokens_left == 3  # ... the chunked prefill goes on
    with pytest.raises(RuntimeError, match="a chunked prefill is under way"):
        engine.begin_prefill(llm.make_sequences(PROMPTS[0], _params()[0], 0))
    assert engine.prefill_chunk() == []
    _run_out(engine)
    assert chunked[0].output_token_ids == expected[0]

    pair = llm.make_sequences(PROMPTS[3], _params()[3], 3)  # n = 2
    engine.begin_prefill(pair)
    engine.prefill_chunk(1)
    engine.abort(pair[:1])  # one of the prompt's rows leaves, the other still joins
    assert engine.prefill_chunk() == [] and engine.sequences == pair[1:] and pair[0].finish_reason == "abort"
    _run_out(engine)
    assert pair[1].finish_reason == "length"
    for ended_by in ("abort", "reset"):
        again = llm.make_sequences(PROMPTS[0], _params()[0], 0)
        engine.begin_prefill(again)
        engine.prefill_chunk(2)
        engine.abort(again) if ended_by == "abort" else engine.reset()
        assert engine.prefilling is None and engine.batch is None
    with pytest.raises(RuntimeError, match="no chunked prefill is under way"):
        engine.prefill_chunk()


def test_a_chunked_prefill_takes_the_new_rows_of_one_prompt_without_prompt_logprobs() -> None:
    llm = _llm("native", None)
    two = llm.make_sequences(PROMPTS[0], _params()[0], 0) + llm.make_sequences(PROMPTS[1], _params()[1], 1)
    wanting = llm.make_sequences(PROMPTS[0], SamplingParams(max_tokens=4, prompt_logprobs=1), 0)
    for sequences in (two, wanting):
        with pytest.raises(ValueError, match="the new sequences of one prompt"):
            llm.engine.begin_prefill(sequences)
    llm.engine.begin_prefill(two[:1])
    with pytest.raises(ValueError, match="max_tokens must be >= 1 or None; got 0"):
        llm.engine.prefill_chunk(0)


@pytest.mark.parametrize("setup", ["draft, native", "draft, transformers", "draft + lookup, native"])
def test_aborted_rows_leave_and_the_rest_are_unchanged(setup: str) -> None:
    llm = _llm(**SETUPS[setup])
    expected = _alone(llm, 2)
    engine = llm.engine
    first, kept = (llm.make_sequences(PROMPTS[i], _params()[i], i) for i in (0, 2))
    engine.add(first + kept)
    engine.step()
    engine.abort(first)
    assert engine.sequences == kept
    while engine.sequences:
        engine.step()
    assert first[0].finish_reason == "abort" and kept[0].output_token_ids == expected[0]


def test_a_row_whose_processor_raises_fails_alone() -> None:
    llm = _llm("native", "draft_model")
    expected = _alone(llm, 0)

    def broken(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) >= 3:
            raise RuntimeError("processor exploded")
        return logits

    engine = llm.engine
    good = llm.make_sequences(PROMPTS[0], _params()[0], 0)
    bad = llm.make_sequences(
        PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20, logits_processors=[broken]), 1
    )
    engine.add(good + bad)
    while engine.sequences:
        engine.step()
    assert bad[0].finish_reason == "error" and "processor exploded" in bad[0].error
    assert good[0].output_token_ids == expected[0]
    with pytest.raises(RuntimeError, match="prompt 0 failed: RuntimeError: processor exploded"):
        llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20, logits_processors=[broken]))


def test_generate_starts_clean_after_an_abandoned_stream() -> None:
    llm = _llm("native", "draft_model")
    expected = _alone(llm, 0)
    from speculative.config import GenerationConfig

    for _ in llm.stream([PROMPTS[2]], _params()[2], config=GenerationConfig(streaming_chunks=1)):
        break  # left mid-generation: its rows must not leak into the next batch
    assert llm.engine.batch is None
    assert _alone(llm, 0) == expected


def test_a_row_that_finishes_gives_its_place_to_the_last_row() -> None:
    """Rows that finish leave holes that rows from the batch's end fill: the K/V cache then copies one
    row per row that left, not every row after it. Every row still gives its solo tokens."""
    llm = _llm("native", None)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 9, 9, 9, 9)]
    prompts = [*PROMPTS, [30, 31]]
    expected = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    engine, orders = llm.engine, []
    sequences = [llm.make_sequences(p, q, i) for i, (p, q) in enumerate(zip(prompts, params))]
    engine.add([s for group in sequences for s in group])
    select = engine.cache.select_rows
    engine.cache.select_rows = lambda rows: orders.append(rows.tolist()) or select(rows)
    while engine.sequences:
        engine.step()
    assert orders[0] == [4, 1, 2, 3]  # row 0 left after its second token; the last row took its place
    assert [g[0].output_token_ids for g in sequences] == expected


def test_a_draft_prefills_rows_of_very_different_lengths_apart_and_drafts_as_for_each_alone() -> None:
    """Rows that join the draft together, a long prompt behind a short one (one prefill forward each,
    then the cache's rows put back in order), draft what each drafts alone: the same tokens accepted."""
    llm = _llm("native", "draft_model")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[3, 4], list(range(2, 42)), [7, 8, 9], list(range(50, 80))]
    alone = []
    for i, prompt in enumerate(prompts):
        (s,) = llm.make_sequences(prompt, params, i)
        llm.engine.run([s])
        alone.append((s.output_token_ids, s.metrics.num_accepted))
    engine = llm.engine
    together = [llm.make_sequences(p, params, i)[0] for i, p in enumerate(prompts)]
    engine.add(together[:2])  # all new to the draft: its first proposal prefills them
    engine.step()
    engine.add(together[2:])  # joining running rows: prefilled, then caught up with them
    _run_out(engine)
    assert [(s.output_token_ids, s.metrics.num_accepted) for s in together] == alone
    assert all(accepted > 0 for _, accepted in alone)
