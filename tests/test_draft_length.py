"""Adaptive draft length: k per step from measured acceptance and step times; exact for any k."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from conftest import noisy_copy, tiny_model
from scipy.stats import chi2
from test_distribution import LENGTH, SAMPLES, chi_square, exact_probs, pair, sample  # noqa: F401

from speculative import LLM, SamplingParams, SpeculativeConfig
from speculative.engine import draft_length
from speculative.engine.draft_length import DraftLength
from speculative.methods import DraftModelConfig


def _measured(
    max_k: int,
    cost,
    acceptance: float,
    steps: int = 200,
    batch_size: int = 1,
    chooser: DraftLength | None = None,
) -> DraftLength:
    """A DraftLength (new, or `chooser`) fed `steps` steps of a fake workload at `batch_size` (one row's
    figures): step time cost(k), per-draft acceptance."""
    chooser = chooser or DraftLength(max_k, adaptive=True)
    for step in range(steps):
        k = chooser.choose(batch_size)
        accepted = 0
        while accepted < k and (step * 7919 + accepted * 104729) % 1000 < acceptance * 1000:
            accepted += 1
        chooser.observe(batch_size, k, cost(k), [accepted], [k])
    return chooser


def test_cheap_drafts_that_are_accepted_get_the_longest_k() -> None:
    chooser = _measured(4, lambda k: 10.0 + 0.5 * k, acceptance=0.9)
    assert chooser.choose(1) == 4


def test_speculation_switches_off_where_it_does_not_pay() -> None:
    chooser = _measured(4, lambda k: 10.0 + 6.0 * k, acceptance=0.3)
    assert chooser.choose(1) == 0
    assert chooser.history.count(0) > 150  # the exploration steps aside


def test_a_k_that_the_proposer_cuts_is_worth_the_width_it_drafts() -> None:
    """A proposer that drafts one token a row whatever k is asked (a draft with prompt lookup first, at
    32 rows): each step's time is its width's, each k is valued at the width it gave, and plain decoding
    wins where one draft does not pay (valued at its own k, the k of 4 looked like 4 drafts for one
    draft's time, and a batch size where it never drafted 4 stayed in its warm-up, drafting every step)."""
    chooser = DraftLength(4, adaptive=True)
    for step in range(300):
        k = chooser.choose(32)
        width = min(k, 1)
        accepted = [int((step * 31 + row) % 10 < 4) if width else 0 for row in range(32)]  # 0.4 a draft
        chooser.observe(32, width, 10.0 + 9.0 * width, accepted, [width] * 32, chosen=k)
    assert chooser.widths[32][4] == pytest.approx(1.0)
    assert chooser.choose(32) == 0
    assert list(chooser.history).count(0) > 270


def test_exploration_thins_out_while_the_best_k_holds() -> None:
    """Where plain steps are best, the neighbour is measured again at doubling intervals: a few steps
    in a thousand, not one in sixteen. (Two steps each: the first takes in what plain steps left.)"""
    chooser = _measured(4, lambda k: 10.0 + 6.0 * k, acceptance=0.3, steps=1000)
    explorations = 1000 - chooser.history.count(0) - 2  # less the warm-up's two steps of max_k
    assert 6 <= explorations <= 16  # at 16, 48, 112, 240, 496 and 752 steps: still measured, rarely


def test_plain_batch_sizes_explore_together_as_rarely_as_one_batch_size() -> None:
    """A server's batch size wanders as rows join and finish. Where drafting pays at none of its sizes,
    they share one exploration schedule: over 17 sizes no more drafting steps than at one size (with
    a schedule of each size's own, 54 of these 1000 steps drafted, most of them switches from plain
    decoding, each making the drafter catch up on every row)."""
    rng, walk = random.Random(0), random.Random(1)

    def accepted(k: int) -> int:  # drafts accepted before the first rejection, each with chance 0.3
        return next((i for i in range(k) if rng.random() >= 0.3), k)

    chooser, size = DraftLength(4, adaptive=True), 16
    for _ in range(1000):
        size = min(24, max(8, size + walk.choice((-1, 0, 1))))
        k = chooser.choose(size)
        rows = [accepted(k) for _ in range(size)]
        chooser.observe(size, k, (10.0 + 6.0 * k) * size / 16, rows, [k] * size)
    one_size = _measured(4, lambda k: 10.0 + 6.0 * k, acceptance=0.3, steps=1000)
    assert len(chooser.counts) == 17
    assert 1000 - chooser.history.count(0) <= 1000 - one_size.history.count(0) + 4


def test_explorations_from_plain_decoding_spend_a_bounded_share_on_switches() -> None:
    """Where plain decoding is best and a switch to drafting costs a dozen plain steps (the drafter's
    intake of every row's context), explorations keep switches to about _SWITCH_SHARE of the time
    (with explorations every _EXPLORE_MAX steps alone, switches took 5.4% of these 3000 steps' time)."""
    rng = random.Random(0)
    chooser, previous, drafting = DraftLength(4, adaptive=True), 0, 0
    switching = total = 0.0
    for _ in range(3000):
        k = chooser.choose(32)
        seconds = 6.0 + 8.0 * k + (70.0 if k and not previous else 0.0)  # ms: a switch's intake
        switching += seconds - (6.0 + 8.0 * k) if k and not previous else 0.0
        total += seconds
        rows = [next((i for i in range(k) if rng.random() >= 0.3), k) for _ in range(32)]
        chooser.observe(32, k, seconds, rows, [k] * 32)
        previous, drafting = k, drafting + (k > 0)
    assert drafting < 100
    assert switching / total < 0.03


def _loaded_server(chooser: DraftLength, steps: int, acceptance: float, draft_ms: float, rng) -> tuple:
    """`steps` steps at 32 rows: a plain step 6 ms, a drafting one 6 + draft_ms * k, a switch from plain
    decoding 70 ms more (the drafter's intake); per-draft acceptance `acceptance`. Returns the
    switches' ms, all the steps' ms and the k of each step."""
    switching = total = 0.0
    ks, previous = [], chooser._last_k or 0
    for _ in range(steps):
        k = chooser.choose(32)
        seconds = 6.0 + draft_ms * k + (70.0 if k and not previous else 0.0)
        switching += seconds - (6.0 + draft_ms * k)
        total += seconds
        rows = [next((i for i in range(k) if rng.random() >= acceptance), k) for _ in range(32)]
        chooser.observe(32, k, seconds, rows, [k] * 32)
        previous = k
        ks.append(k)
    return switching, total, ks


def test_explorations_that_keep_finding_plain_decoding_best_fade_out() -> None:
    """Where drafting keeps losing, each cycle of explorations from plain decoding (one of each drafting
    k) that confirms it halves the share of time explorations may spend on switches, down to
    _SWITCH_SHARE_MIN: over a long run they cost a fraction of a percent (at a constant _SWITCH_SHARE:
    2%, whatever the run's length)."""
    rng, chooser = random.Random(0), DraftLength(4, adaptive=True)
    _loaded_server(chooser, 20000, 0.3, 8.0, rng)
    switching, total, ks = _loaded_server(chooser, 20000, 0.3, 8.0, rng)
    assert chooser._share == draft_length._SWITCH_SHARE_MIN
    assert switching / total < 0.004
    assert sum(k > 0 for k in ks) < 60


def test_a_workload_where_drafting_pays_again_is_found_after_explorations_faded() -> None:
    """After a long stretch where the drafts were rarely accepted (0.1), they are accepted 0.9 of the
    time: the next exploration, due once the plain steps took 1 / _SWITCH_SHARE_MIN switches' cost,
    finds it (the acceptance measured before the plain stretch does not outweigh its own), and drafting
    then runs nearly every step, the share back at _SWITCH_SHARE."""
    rng, chooser = random.Random(0), DraftLength(4, adaptive=True)
    _loaded_server(chooser, 20000, 0.1, 2.0, rng)
    assert chooser._share == draft_length._SWITCH_SHARE_MIN
    assert chooser.history.count(0) > 990
    plain_steps = 70.0 / draft_length._SWITCH_SHARE_MIN / 6.0  # 4,667 plain steps of 6 ms
    _, _, ks = _loaded_server(chooser, int(plain_steps) + 1200, 0.9, 2.0, rng)
    assert sum(k > 0 for k in ks[-1000:]) > 950
    assert chooser._share == draft_length._SWITCH_SHARE


def test_a_middle_k_when_acceptance_falls_off() -> None:
    chooser = _measured(6, lambda k: 10.0 + 2.0 * k, acceptance=0.6)
    assert 1 <= chooser.choose(1) <= 3


def test_batch_sizes_are_measured_apart() -> None:
    """Same acceptance, costlier drafts at batch 8: speculation pays at batch 1 and not at batch 8."""
    chooser = _measured(4, lambda k: 10.0 + 0.5 * k, acceptance=0.9, batch_size=1)
    _measured(4, lambda k: 10.0 + 20.0 * k, acceptance=0.9, steps=100, batch_size=8, chooser=chooser)
    assert chooser.choose(1) == 4 and chooser.choose(8) == 0


def test_a_new_batch_size_starts_from_the_nearest_measured_one() -> None:
    """No probing of max_k and 0 at each new batch size: it borrows the nearest size's step times,
    rescaled at its first step, and goes on from the best k."""
    chooser = _measured(6, lambda k: 10.0 + 1.0 * k, acceptance=0.8, batch_size=4)
    best = chooser.choose(4)
    assert 0 < best < 6
    first = chooser.choose(3)
    assert first == best  # not max_k, not 0
    chooser.observe(3, first, 0.75 * (10.0 + 1.0 * first), [1], [first])  # the same curve, 3/4 as long
    assert chooser.step_time(3, 0) == pytest.approx(0.75 * 10.0)
    _measured(6, lambda k: 0.75 * (10.0 + 1.0 * k), acceptance=0.8, steps=40, batch_size=3, chooser=chooser)
    assert chooser.counts[3].get(6, 0) + chooser.counts[3].get(0, 0) <= 2  # at most exploration steps


def test_plain_decoding_is_measured_at_once_where_a_borrowed_curve_says_draft() -> None:
    """Batch 16 starts from batch 4's step times, where drafting pays; at 16 a drafting step costs
    twice a plain one per token drafted, and plain decoding wins. Its plain time is measured at the
    second step, and drafting stops within a few steps (borrowed alone, the curve kept drafting on
    for the 16 steps of an exploration interval)."""
    chooser = _measured(4, lambda k: 10.0 + 1.0 * k, acceptance=0.7, batch_size=4)
    assert chooser.choose(4) > 0
    ks = []
    for step in range(24):
        k = chooser.choose(16)
        ks.append(k)
        accepted = [sum((row * 31 + i + step) % 10 < 7 for i in range(k)) for row in range(16)]
        chooser.observe(16, k, 100.0 + 100.0 * k, accepted, [k] * 16)
    assert ks[1] == 0
    assert sum(k > 0 for k in ks) <= 4
    assert ks[-16:] == [0] * 16


def test_a_large_batch_met_one_step_at_a_time_does_not_switch_drafting_on_at_each_visit() -> None:
    """A closed loop's tail: the batch shrinks a row a step, so batch 45 is met for one step at a time,
    after a plain step of 46 rows. Its step times were borrowed from batch 1 (cheap drafts, accepted
    0.8 of the time), its one drafting step was a switch (no sample of its time); batch 8 has since
    measured plain decoding best. Each visit decodes plainly (on its borrowed curve it switched to
    drafting at every visit, paying a drafter's intake each time)."""
    chooser = _measured(4, lambda k: 10.0 + 0.5 * k, acceptance=0.8, batch_size=1)
    chooser.observe(1, 0, 10.0, [0], [0])  # a plain step, as an exploration is

    def visit_45() -> int:
        k = chooser.choose(45)
        seconds = 300.0 * (1 + k) + (500.0 if k else 0.0)  # compute-bound; a switch's intake
        chooser.observe(45, k, seconds, [1] * 45, [k] * 45)
        return k

    assert visit_45() > 0  # on batch 1's curve
    _measured(4, lambda k: 20.0 * (1 + k), acceptance=0.8, steps=200, batch_size=8, chooser=chooser)
    assert chooser.choose(8) == 0
    ks = []
    for _ in range(10):
        chooser.observe(46, 0, 300.0, [0] * 46, [0] * 46)
        ks.append(visit_45())
    assert ks == [0] * 10


def test_a_switch_whose_intake_outweighs_what_drafting_saves_is_not_made() -> None:
    """At batch 32 drafting one token gives 1.3x plain decoding's tokens a second, but the batch is met
    one step at a time after plain steps of 33 rows, so that each visit would be a switch whose intake
    (the drafter taking in every row's skipped tokens) costs ten plain steps. After the first such
    switch has shown its cost, the visits decode plainly (at 1.3x >= _SWITCH_GAIN each one switched)."""
    cost = lambda k: 100.0 + 30.0 * k  # noqa: E731
    chooser = _measured(1, cost, acceptance=0.7, steps=100, batch_size=32)
    assert chooser.history.count(1) > 80
    ks = []
    for _ in range(10):
        for _ in range(5):
            chooser.observe(33, 0, 100.0, [0] * 33, [0] * 33)
        k = chooser.choose(32)
        ks.append(k)
        chooser.observe(32, k, cost(k) + (1000.0 if k else 0.0), [1] * 32, [k] * 32)
    assert ks == [1] + [0] * 9


def test_a_batch_size_between_two_measured_ones_starts_from_the_line_between_them() -> None:
    """Drafting pays at batch 1 and not at batch 64 (a closed loop's first level and its largest). Batch
    31, nearer to 1, starts from step times between the two, where drafting does not pay (from batch
    1's alone, it drafted through a closed loop's tail, one new size a step)."""
    chooser = _measured(4, lambda k: 10.0 + 0.5 * k, acceptance=0.8, batch_size=1)
    _measured(4, lambda k: 300.0 * (1 + k), acceptance=0.8, steps=100, batch_size=64, chooser=chooser)
    assert chooser.choose(1) > 0 and chooser.choose(64) == 0
    chooser.choose(31)
    assert max(range(5), key=lambda k: chooser._rate(31, k)) == 0


def test_a_first_step_that_prefills_the_drafter_does_not_switch_speculation_off() -> None:
    """The first drafting step also pays for the drafter's prefill of the prompt (a hundred times a
    step): the warm-up keeps the least of its measurements, and drafting, which pays, goes on."""
    chooser = DraftLength(4, adaptive=True)
    prefill = 1000.0
    for _ in range(50):
        k = chooser.choose(1)
        chooser.observe(1, k, 10.0 + 0.5 * k + (prefill if k else 0.0), [k], [k])
        prefill = 0.0 if k else prefill
    assert chooser.history.count(4) >= 45  # all but the warm-up's plain steps and an exploration


def test_fixed_k_is_still_available() -> None:
    chooser = DraftLength(3, adaptive=False)
    assert [chooser.choose(b) for b in (1, 8, 64)] == [3, 3, 3]


def _forced(llm: LLM, schedule: list[int]) -> None:
    """Replace the chooser's choice with a fixed cycle of k, plain steps (k = 0) included."""
    cycle = itertools.cycle(schedule)
    llm.engine.draft_length.choose = lambda batch_size, backlog=None: next(cycle)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_is_exact_whatever_k_each_step_has(method: str) -> None:
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=True)
    draft = noisy_copy(target, 0.03) if method == "draft_model" else None
    llm = LLM(target, draft_model=draft, speculative_config=config)
    baseline = LLM(target)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in baseline.generate(prompts, params)]
    _forced(llm, [4, 0, 0, 2, 0, 3, 1, 0, 0, 0, 4])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    # Rows admitted while the draft cache is behind (after plain steps).
    engine = llm.engine
    sequences = [llm.make_sequences(p, params, i) for i, p in enumerate(prompts)]
    _forced(llm, [0, 0, 0, 3])
    engine.add(sequences[0])
    for _ in range(3):
        engine.step()
    engine.add(sequences[1] + sequences[2])
    while engine.sequences:
        engine.step()
    assert [g[0].output_token_ids for g in sequences] == expected


def test_sampling_is_exact_whatever_k_each_step_has(pair) -> None:  # noqa: F811
    target, draft = pair
    prompt = [2, 3, 4, 5]
    llm = LLM(
        target,
        draft_model=draft,
        speculative_config=SpeculativeConfig(num_speculative_tokens=2, adaptive=True),
        seed=5,
    )
    _forced(llm, [2, 0, 1, 0, 0, 2, 1])
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    stat, dof = chi_square(
        sample(llm, [prompt] * SAMPLES, [params] * SAMPLES), exact_probs(target, prompt, 1.0, -1)
    )
    assert chi2.sf(stat, dof) > 1e-3, f"chi-square {stat:.1f} on {dof} dof"


def test_plain_steps_are_measured_again_while_drafting_looks_best() -> None:
    """The warm-up's plain steps were slow (first calls), so drafting looked best; plain decoding is
    among what exploration measures again, and the chooser finds that it is best after all."""
    chooser, plain_steps = DraftLength(4, adaptive=True), 0
    for _ in range(600):
        k = chooser.choose(1)
        plain_steps += k == 0
        cost = (40.0 if plain_steps <= 2 else 8.0) if k == 0 else 14.0 + 4.0 * k
        chooser.observe(1, k, cost, [min(k, 1)], [k])  # the first draft accepted, none after
    assert chooser.choose(1) == 0
    assert chooser.history.count(0) > 500


def test_a_machine_that_speeds_up_does_not_leave_plain_decoding_looking_slow() -> None:
    """For 150 steps every step is 4x as slow (another process on the cores) and drafting pays; then
    the machine is fast again and drafting does not pay (one draft in three accepted, a drafting step
    50% dearer per draft). Plain decoding was last measured in the slow period: a step time kept apart
    for each k left it looking 3.6x as slow as it is and the chooser drafted in 499 of the last 500
    steps. Each step's time also tells how fast the machine is for the other k."""
    chooser = DraftLength(4, adaptive=True)
    for step in range(800):
        k = chooser.choose(1)
        slow, acceptance = (4.0, 0.85) if step < 150 else (1.0, 0.3)
        accepted = 0
        while accepted < k and (step * 7919 + accepted * 104729) % 1000 < acceptance * 1000:
            accepted += 1
        chooser.observe(1, k, slow * 10.0 * (1.0 + 0.5 * k), [accepted], [k])
    assert chooser.choose(1) == 0
    assert list(chooser.history)[-500:].count(0) > 450


def test_a_k_measured_again_after_others_learns_its_time_against_theirs() -> None:
    """Drafting is dear for 100 steps (20 a draft against a plain step of 10), then cheap (0.5 a draft,
    most drafts accepted): plain decoding's explorations of k = 1 must teach the chooser that drafting
    now pays. (Rescaling every k by each sample's move kept the first ratio of 3 for good.)"""
    chooser = DraftLength(4, adaptive=True)
    for step in range(600):
        k = chooser.choose(1)
        accepted = 0
        while accepted < k and (step * 7919 + accepted * 104729) % 1000 < 900:
            accepted += 1
        chooser.observe(1, k, 10.0 + (20.0 if step < 100 else 0.5) * k, [accepted], [k])
    assert chooser.choose(1) >= 3
    assert list(chooser.history)[-300:].count(0) < 30


def test_what_a_drafter_catches_up_on_after_plain_steps_is_not_its_step_time() -> None:
    """The first drafting step after plain steps also takes in what they left (here 100 ms, against
    10.25 ms for a drafting step): counted as that k's time, drafting, which has become much better
    than plain decoding (acceptance rose), would look worse for good. (So dear a switch also makes
    explorations from plain decoding wait 500 plain steps: _SWITCH_SHARE.)"""
    chooser, acceptance, last = DraftLength(1, adaptive=True), 0.0, 0
    for step in range(1400):
        if step == 200:
            acceptance = 0.9
        k = chooser.choose(1)
        accepted = 0
        while accepted < k and (step * 7919 + accepted * 104729) % 1000 < acceptance * 1000:
            accepted += 1
        catch_up = 100.0 if k and last == 0 else 0.0
        chooser.observe(1, k, 10.0 + 0.25 * k + catch_up, [accepted], [k])
        last = k
    assert chooser.choose(1) == 1
    assert chooser.history.count(0) < 400


def test_a_step_costs_what_the_host_did_before_the_next() -> None:
    """A step's time for the chooser runs to the next step's start: work between steps (a server
    admitting rows, here a sleep) is part of its cost; the batch's last step counts its own time."""
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(num_speculative_tokens=2, adaptive=True)
    llm = LLM(target, draft_model=noisy_copy(target, 0.03), speculative_config=config)
    engine, seen = llm.engine, []
    engine.draft_length.choose = lambda rows, backlog=None: 0  # plain steps: one token each
    observe = engine.draft_length.observe
    engine.draft_length.observe = lambda rows, k, seconds, *rest, **chosen: (
        seen.append(seconds) or observe(rows, k, seconds, *rest, **chosen)
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add(llm.make_sequences([5, 6, 7], params, 0))
    with engine.recording_steps() as steps:
        engine.step()
        assert seen == []  # its time runs on
        time.sleep(0.2)
        while engine.sequences:
            engine.step()
    assert len(seen) == len(steps) == 2
    assert seen[0] >= 0.2 + steps[0].step_s and seen[1] == steps[1].step_s


def test_a_step_that_compiles_a_graph_is_no_step_time(monkeypatch) -> None:
    """A compiled model's first call of a shape compiles a graph (19 s for a SmolLM2 step of 25 ms):
    the engine gives the chooser no time for that step, and the chooser measures that k again."""
    import speculative.engine.engine as engine_module

    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(num_speculative_tokens=2, adaptive=True)
    llm = LLM(target, draft_model=noisy_copy(target, 0.03), speculative_config=config)
    engine, seen = llm.engine, []
    engine.draft_length.choose = lambda rows, backlog=None: 1
    observe = engine.draft_length.observe
    engine.draft_length.observe = lambda rows, k, seconds, *rest, **chosen: (
        seen.append(seconds) or observe(rows, k, seconds, *rest, **chosen)
    )
    graphs = iter([0, 0, 0, 1, 1, 1])  # the second step compiles one
    monkeypatch.setattr(engine_module, "graphs_compiled", lambda: next(graphs))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add(llm.make_sequences([5, 6, 7], params, 0))
    for _ in range(3):
        engine.step()
    assert seen[0] > 0 and seen[1] is None
    chooser = DraftLength(2, adaptive=True)
    chooser.observe(1, 2, None, [1], [2])
    assert chooser.choose(1) == 2 and chooser.times.get(1, {}) == {}  # the warm-up still to come


def test_an_admission_between_steps_is_not_part_of_a_step_time() -> None:
    """Rows admitted between two steps (a server's new requests: the target prefills their prompts, the
    same whatever k) do not count in the step's time; the host's other work in between does."""
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(num_speculative_tokens=2, adaptive=True)
    llm = LLM(target, draft_model=noisy_copy(target, 0.03), speculative_config=config)
    engine, seen = llm.engine, []
    engine.draft_length.choose = lambda rows, backlog=None: 0
    observe = engine.draft_length.observe
    engine.draft_length.observe = lambda rows, k, seconds, *rest, **chosen: (
        seen.append(seconds) or observe(rows, k, seconds, *rest, **chosen)
    )
    prefill = engine._prefill
    engine._prefill = lambda batch: time.sleep(0.5) or prefill(batch)  # a long prompt's prefill
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add(llm.make_sequences([5, 6, 7], params, 0))
    with engine.recording_steps() as steps:
        engine.step()
        time.sleep(0.1)
        engine.add(llm.make_sequences([8, 9], params, 1))
        engine.step()
    # counted: the 0.1 s between the two; not counted: the 0.5 s prefill (0.6 s and more when it was)
    assert 0.1 + steps[0].step_s <= seen[0] < 0.5 + steps[0].step_s


def test_drafting_about_even_with_plain_decoding_does_not_alternate_with_it() -> None:
    """A weak drafter (half its drafts accepted, a drafting step 60% slower than a plain one: 6% fewer
    tokens a second) and step times that vary by +-15%: the noise often makes drafting look the
    better, but switched on after plain steps only where it promises a clear gain, it alternates
    with plain decoding rarely (it did 32 times in 2,000 steps), each switch costing a catch-up."""
    rng, chooser, last, switches = random.Random(1), DraftLength(1, adaptive=True), 0, 0
    for _ in range(2000):
        k = chooser.choose(4)
        accepted = int(k > 0 and rng.random() < 0.5)
        catch_up = 15.0 if k and last == 0 else 0.0
        chooser.observe(4, k, (10.0 + 6.0 * k) * rng.uniform(0.85, 1.15) + catch_up, [accepted], [k])
        switches += k > 0 and last == 0
        last = k
    assert switches <= 15


def test_one_slow_step_does_not_switch_speculation_on() -> None:
    """Plain steps best by a small margin (a batch of many rows); one plain step three times as slow as
    the others (rows finishing in it) must not make drafting look better."""
    cost = lambda k: 10.0 + 16.0 * k  # noqa: E731
    chooser = _measured(4, cost, acceptance=0.75, steps=100)
    assert chooser.choose(1) == 0
    chooser.observe(1, 0, 3 * cost(0), [0], [0])
    assert chooser.choose(1) == 0


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_rows_joining_while_speculation_is_off_cost_the_draft_nothing(model_impl: str) -> None:
    """A draft model prefills rows that join during plain steps only when it next proposes: joins while
    k = 0 run no draft forward at all, and a row that joined and left unproposed-for is never fed.
    Every row still gives its solo output."""
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(num_speculative_tokens=3, adaptive=True)
    llm = LLM(target, draft_model=noisy_copy(target, 0.03), speculative_config=config, model_impl=model_impl)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 5, 6, 7], [20, 21, 22]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 3, 16, 12)]
    expected = [LLM(target).generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    engine = llm.engine
    draft = engine.proposer.model
    fed: list[int] = []
    forward = draft.forward
    draft.forward = lambda tokens, cache, **kw: fed.append(tokens.shape[0]) or forward(tokens, cache, **kw)
    sequences = [llm.make_sequences(p, q, i) for i, (p, q) in enumerate(zip(prompts, params))]
    _forced(llm, [0])
    engine.add(sequences[0])
    engine.step()
    engine.add(sequences[1])  # finishes (3 tokens) before the draft ever proposes
    engine.step()
    engine.add(sequences[2])
    engine.step()
    engine.step()
    assert fed == [] and sequences[1][0].finish_reason == "length"
    _forced(llm, [3, 0, 2, 0, 0])
    engine.step()  # the two running rows are prefilled for this proposal, in one forward
    assert fed[0] == 2
    engine.add(sequences[3])  # joins a batch whose draft cache is behind after the next plain step
    while engine.sequences:
        engine.step()
    assert [g[0].output_token_ids for g in sequences] == expected


@pytest.mark.parametrize("tree", [None, "dynamic"])
@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("case", ["the long row leaves", "a long row joins"])
def test_many_plain_steps_do_not_overflow_the_draft_cache(
    case: str, model_impl: str, tree: str | None
) -> None:
    """Many plain steps before the next proposal feeds the draft all it skipped, while the longest row
    leaves (its length must not stay in the draft cache's bound: it once overflowed the cache) or while
    a row longer than the draft cache's buffers joins (its length must not enter that bound before its
    prefill)."""
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(num_speculative_tokens=3, adaptive=True)
    llm = LLM(target, draft_model=noisy_copy(target, 0.03), speculative_config=config, model_impl=model_impl)
    prompts = [list(range(3, 43)), [5, 6, 7, 8, 9]]  # 40 and 5 tokens
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 30)]
    if case == "a long row joins":
        params[0] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = [LLM(target).generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    engine = llm.engine
    sequences = [llm.make_sequences(p, q, i) for i, (p, q) in enumerate(zip(prompts, params))]
    _forced(llm, [3] + [0] * 40)
    if case == "the long row leaves":
        engine.add(sequences[0] + sequences[1])
    else:
        engine.add(sequences[1])
        engine.step()  # the draft proposes for the short row
        engine.add(sequences[0])
    for _ in range(22):
        engine.step()
    _forced(llm, [3])
    while engine.sequences:
        engine.step()
    assert [g[0].output_token_ids for g in sequences] == expected


def test_a_drafter_that_never_drafts_leaves_one_measured_step_time() -> None:
    """An n-gram drafter that finds nothing to propose makes every step a plain one (k = 0): with one
    measured k the chooser takes its time for every k, and keeps choosing."""
    chooser = DraftLength(4, adaptive=True)
    for _ in range(50):
        chooser.choose(1)
        chooser.observe(1, 0, 10.0, [0], [0])
    assert chooser.step_time(1, 3) == pytest.approx(10.0)
    assert chooser.choose(1) in range(5)


def test_a_batch_of_disable_by_batch_size_rows_or_more_decodes_plainly() -> None:
    """vLLM's `disable_by_batch_size`: whatever k would be chosen, fixed or adaptive, a step of that
    many rows or more drafts nothing."""
    fixed = DraftLength(3, adaptive=False, disable_by_batch_size=8)
    assert [fixed.choose(b) for b in (1, 7, 8, 64)] == [3, 3, 0, 0]
    adaptive = _measured(4, lambda k: 10.0 + 0.5 * k, acceptance=0.9, batch_size=1)
    adaptive.disable_by_batch_size = 8
    _measured(4, lambda k: 10.0 + 0.5 * k, acceptance=0.9, steps=50, batch_size=8, chooser=adaptive)
    assert list(adaptive.history)[-50:] == [0] * 50  # drafting pays there too, but is not chosen
    assert adaptive.choose(1) == 4


@pytest.mark.parametrize(
    "method, tree", [("draft_model", None), ("draft_model", "dynamic"), ("ngram", "static")]
)
@pytest.mark.parametrize("adaptive", [False, True])
def test_steps_of_disable_by_batch_size_rows_are_plain_and_the_output_exact(
    method: str, tree: str | None, adaptive: bool
) -> None:
    """Three rows of different lengths under disable_by_batch_size=2: plain steps while two or more
    run, drafting once one is left (the draft then takes in every token it skipped), and every row's
    greedy output the target's alone."""
    if adaptive and tree:
        pytest.skip("adaptive k excludes trees")
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(
        method=method, num_speculative_tokens=3, adaptive=adaptive, tree=tree, disable_by_batch_size=2
    )
    draft = noisy_copy(target, 0.03) if method == "draft_model" else None
    llm = LLM(target, draft_model=draft, speculative_config=config)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [10, 11, 12, 13, 5, 6, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 6, 12)]
    expected = [LLM(target).generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    with llm.engine.recording_steps() as steps:
        outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(s.k == 0 for s in steps if s.num_rows >= 2)
    alone = [s for s in steps if s.num_rows == 1]
    assert alone and (adaptive or all(s.k == 3 for s in alone))


@pytest.mark.parametrize("limit", [1, 0, 2.5, True, "8"])
def test_disable_by_batch_size_is_an_integer_of_at_least_two(limit) -> None:
    with pytest.raises(ValueError, match=r"disable_by_batch_size must be None or an integer >= 2"):
        SpeculativeConfig(disable_by_batch_size=limit)


def test_a_drafting_steps_intake_of_joined_rows_is_kept_out_of_its_time() -> None:
    """A drafting step whose drafter first took in rows that joined (a draft model's prefill of their
    prompts) is a sample of its time less that intake: counted in, the k
    measured at a batch's first drafting step, every row new, looked several times as dear and kept
    plain decoding where drafting paid. A switch's cost keeps the intake."""
    steps = [(4, 0.040), (4, 0.040), (0, 0.011), (0, 0.011), (4, 0.100), (4, 0.060), (4, 0.040)]
    intakes = {5: 0.02, 6: 0.02}  # the switch (step 4, after plain steps) and the step after it
    with_intake, without = DraftLength(4, adaptive=True), DraftLength(4, adaptive=True)
    for step, (k, seconds) in enumerate(steps):
        intake = intakes.get(step, 0.0)
        with_intake.observe(8, k, seconds, [k] * 8, [k] * 8, intake=intake)
        less = seconds if step == 4 else seconds - intake
        without.observe(8, k, less, [k] * 8, [k] * 8)
    assert with_intake.times[8][4] == pytest.approx(without.times[8][4])
    assert with_intake.times[8][4] < 0.045
    assert with_intake._switch_cost == pytest.approx(without._switch_cost)
    assert with_intake._switch_cost > 0.05


@pytest.mark.parametrize("lookup", [False, True])
def test_the_engine_hands_adaptive_k_the_drafts_intake_of_joined_rows(lookup: bool) -> None:
    """A draft model times its prefill of the rows that joined since its last proposal, and the engine
    passes that to adaptive k with the step (0 for steps where no row joined), and how many rows joined
    the running batch before the step (not those a batch starts with)."""
    target = tiny_model("llama", num_layers=2)
    options = DraftModelConfig(prompt_lookup_min=2 if lookup else 0)
    config = SpeculativeConfig(num_speculative_tokens=3, adaptive=True, options=options)
    llm = LLM(target, draft_model=noisy_copy(target, 0.03), speculative_config=config)
    engine = llm.engine
    observed: list[tuple[int, float, int]] = []
    observe = engine.draft_length.observe
    engine.draft_length.observe = lambda *a, intake=0.0, joined=0, **kw: (
        observed.append((a[1], intake, joined)) or observe(*a, intake=intake, joined=joined, **kw)
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _forced(llm, [3] * 40)
    engine.add(llm.make_sequences([5, 6, 7, 8, 9], params, 0))
    engine.step()
    intake = engine.proposer.intake_seconds
    engine.step()
    assert engine.proposer.intake_seconds == 0.0  # nobody joined since
    engine.add(llm.make_sequences([3, 4, 10, 11], params, 1))
    engine.step()
    joined = engine.proposer.intake_seconds
    while engine.sequences:
        engine.step()
    assert intake > 0.0 and joined > 0.0
    assert observed[0] == (3, intake, 0) and observed[2] == (3, joined, 1)
    assert all(seconds == 0.0 and rows == 0 for _, seconds, rows in observed[3:])


def test_explorations_from_plain_decoding_find_a_longer_draft_that_pays_where_one_draft_does_not() -> None:
    """At 16 rows one draft does not pay (a drafting step's fixed cost outweighs its gain) while four
    do (1.26x plain decoding), but the warm-up measured k = 4 in steps that also paid the drafter's
    first intake of the rows, so plain decoding looked best. Explorations from plain decoding measure
    each drafting k in turn, find k = 4 and draft from then on (measuring k = 1 alone, plain decoding's
    neighbour, they kept finding nothing, and plain decoding stayed for good)."""
    rng, chooser, ks = random.Random(0), DraftLength(4, adaptive=True), []
    for _ in range(3000):
        k = chooser.choose(16)
        rows = [next((i for i in range(k) if rng.random() >= 0.85), k) for _ in range(16)]
        intake = 60.0 if k and len(ks) < 4 else 0.0  # the warm-up's steps of max_k
        chooser.observe(16, k, 15.0 + (14.0 + 4.0 * k + intake if k else 0.0), rows, [k] * 16)
        ks.append(k)
    assert sum(k >= 3 for k in ks[-1000:]) > 950


def _switching_run(
    chooser: DraftLength, steps: int, batch_size: int, cost, acceptance: float, rng, switch: float = 70.0
) -> list[int]:
    """`steps` steps at `batch_size` rows: a step drafting k costs cost(k) ms, a switch from plain decoding
    `switch` ms more (the drafter's intake); per-draft acceptance `acceptance`. Returns the k of each
    step."""
    ks, previous = [], chooser._last_k or 0
    for _ in range(steps):
        k = chooser.choose(batch_size)
        rows = [next((i for i in range(k) if rng.random() >= acceptance), k) for _ in range(batch_size)]
        seconds = cost(k) + (switch if k and not previous else 0.0)
        chooser.observe(batch_size, k, seconds, rows, [k] * batch_size)
        previous = k
        ks.append(k)
    return ks


def _first_intake(max_k: int, cost):
    """cost(k), with 60 ms more on the first two steps of max_k: the warm-up's, where the drafter also
    takes in every row's prompt, so that max_k first looks dear."""
    warmup = iter([60.0] * 2)
    return lambda k: cost(k) + (next(warmup, 0.0) if k == max_k else 0.0)


def test_explorations_from_plain_decoding_try_every_drafting_k_before_their_share_fades() -> None:
    """Drafts accepted 0.95 of the time, a drafting step's cost mostly fixed (40 ms, 0.5 a draft, beside
    plain decoding's 15): one, two and three drafts lose (0.64x, 0.93x, 0.98x plain decoding), four pay
    1.19x, and the warm-up measured k = 4 with the drafter's first intake. The explorations from plain
    decoding try k = 1, 2, 3 and 4 at one share of the time and find k = 4 within 1,100 steps: each
    waits until the plain steps took 1 / share times its expected cost, the switch and what its two
    steps lose against plain decoding, and k = 4's, estimated from the warm-up's dear steps, is the
    largest (paced by the switch alone, k = 4 came within 400 steps, the explorations' steps costing
    what they cost). (Halving the share after each exploration that lost, k = 4 came at an eighth of
    it, after 1,180 steps.)"""
    rng, chooser = random.Random(0), DraftLength(4, adaptive=True)
    cost = _first_intake(4, lambda k: 15.0 + (40.0 + 0.5 * k if k else 0.0))
    ks = _switching_run(chooser, 1600, 16, cost, 0.95, rng, switch=30.0)
    assert sum(k == 4 for k in ks[-500:]) > 475


def test_drafting_that_pays_goes_on_after_one_plain_step_explored() -> None:
    """One draft pays 1.15x plain decoding, found by an exploration from plain decoding whose switch cost
    70 ms (more than 16 plain steps save at 1.15x). The explorations of plain decoding from drafting
    are one plain step each, and drafting goes on after them: the drafter then takes in one token a
    row more, no switch. (Charged a switch's intake, drafting stopped at the first such exploration
    and waited for the next exploration from plain decoding: 72 of the last 1,000 steps drafted.)"""
    rng, chooser = random.Random(0), DraftLength(1, adaptive=True)
    cost = _first_intake(1, lambda k: 15.0 + 9.0 * k)
    ks = _switching_run(chooser, 2000, 16, cost, 0.85, rng)
    assert sum(k == 1 for k in ks[-1000:]) > 950


def test_the_share_of_explorations_is_back_where_the_load_moved_far_from_where_it_faded() -> None:
    """At 64 rows drafting keeps losing and the share of time for explorations from plain decoding fades
    to _SWITCH_SHARE_MIN; the load then falls to 16 rows, where drafting pays 1.6x. The share is back at
    _SWITCH_SHARE there, and drafting found within a few hundred steps (at _SWITCH_SHARE_MIN the first
    exploration waited 2,800 plain steps)."""
    rng, chooser = random.Random(0), DraftLength(4, adaptive=True)
    _switching_run(chooser, 20000, 64, lambda k: 20.0 + (30.0 + 8.0 * k if k else 0.0), 0.3, rng)
    assert chooser._share == draft_length._SWITCH_SHARE_MIN
    ks = _switching_run(chooser, 1500, 16, lambda k: 10.0 + (5.0 + 2.0 * k if k else 0.0), 0.85, rng)
    assert sum(k > 0 for k in ks[-500:]) > 475


def test_after_a_drafting_step_an_estimated_k_is_measured_where_a_smaller_batch_decodes_plainly() -> None:
    """At 32 rows one draft and plain decoding were measured, four drafts (which pay most) only estimated
    from 16 rows' times, and 24 rows measured plain decoding best (a slow stretch). After drafting steps
    the next one measures k = 4 there, no switch to pay, and drafting goes on (decoding plainly instead,
    the rule after plain steps, waited for an exploration from plain decoding: 70 plain steps here, at
    a server's batch size hundreds)."""
    rng, cost = random.Random(0), lambda k: 20.0 + (4.0 + 4.0 * k if k else 0.0)  # ms at 32 rows
    chooser = _measured(4, lambda k: 10.0 + 2.0 * k, acceptance=0.9, steps=100, batch_size=16)
    chooser.choose(32)  # 32 rows start from 16's times
    for k in (1, 0, 0, 1, 1):
        chooser.observe(32, k, cost(k), [k] * 32, [k] * 32)
    for k in (0, 0, 1, 1, 1):
        chooser.observe(24, k, 15.0 + 30.0 * k, [0] * 24, [k] * 24)
    assert 4 in chooser.borrowed[32] and chooser._plain_below(32)
    ks = _switching_run(chooser, 300, 32, cost, 0.9, rng)
    assert ks[0] == 4 and sum(k > 0 for k in ks) >= 295


def _joining_run(chooser: DraftLength, steps: int, row_intake: float, rng) -> list[int]:
    """`steps` steps at 32 rows where one row joins (and one finishes) every step: a plain step 100 ms,
    one drafting one token 130 ms (1.12x plain decoding's tokens a second at the acceptance of 0.45),
    plus the drafter's intake of every row that joined since its last proposal, `row_intake` ms each.
    Returns the k of each step."""
    ks, pending = [], 0
    for _ in range(steps):
        pending += 1
        k = chooser.choose(32)
        intake = row_intake * pending if k else 0.0
        pending = 0 if k else pending
        rows = [int(k > 0 and rng.random() < 0.45) for _ in range(32)]
        chooser.observe(32, k, (130.0 if k else 100.0) + intake, rows, [k] * 32, intake=intake, joined=1)
        ks.append(k)
    return ks


def test_the_drafters_intake_of_joining_rows_is_a_cost_of_drafting() -> None:
    """One draft pays 1.12x plain decoding on step times, but a row joins every step and the drafter's
    intake of each costs 20 ms, which plain decoding never pays for a row that finishes while it runs:
    with it drafting loses (0.97x), and adaptive k decodes plainly. (Kept out of the step times and
    charged nowhere, it drafted 996 of the last 1,000 steps.) Where the intake is cheap (1 ms a row),
    drafting still pays and runs."""
    ks = _joining_run(DraftLength(1, adaptive=True), 3000, 20.0, random.Random(0))
    assert sum(k > 0 for k in ks[-1000:]) < 50
    ks = _joining_run(DraftLength(1, adaptive=True), 3000, 1.0, random.Random(0))
    assert sum(k > 0 for k in ks[-1000:]) > 950


def test_explorations_from_plain_decoding_cost_a_bounded_share_of_the_time() -> None:
    """A busy server where drafting loses (64 rows: a plain step 190 ms, a drafting one 590 + 50 ms a
    draft, drafts accepted 0.3 of the time, a switch only 20 ms more): the explorations from plain
    decoding, their switches and what their own two steps take beyond plain decoding's time for their
    tokens, cost about the share of the time they are paced by (2%, fading): 1.7% of the first 2,000
    steps' time, the warm-up's two drafting steps included. (Paced by their switches alone: 2.6%.)"""
    rng, chooser = random.Random(0), DraftLength(4, adaptive=True)
    total = plain = 0.0
    run = 0
    for _ in range(2000):
        k = chooser.choose(64)
        rows = [next((i for i in range(k) if rng.random() >= 0.3), k) for _ in range(64)]
        seconds = (590.0 + 50.0 * k if k else 190.0) + (20.0 if k and run > 1 else 0.0)
        chooser.observe(64, k, seconds, rows, [k] * 64)
        total += seconds
        plain += 190.0 * (1 + sum(rows) / 64)  # plain decoding's time for the tokens a row got
        run = 0 if k else run + 1
    assert 1.0 - plain / total < 0.02


def _levels_and_tails(chooser: DraftLength, cycles: int, rng, backlog: bool) -> float:
    """A closed loop's levels: 400 steps at 64 rows where drafting loses a little (a plain step 190 ms,
    a drafting one 200 + 10 ms a draft, drafts accepted 0.05 of the time), a row finishing and a new
    one of 100 tokens joining at most steps, then a tail of 3 steps a size down to one row, where
    drafting pays. A switch costs 0.07 ms a token the drafter takes in (its backlog: what came after
    its latest proposal), which `choose` is handed where `backlog` (else it prices a switch a row).
    Returns the share of the 64-row steps' time beyond plain decoding's for their tokens."""
    rows: list[list[int]] = []  # per row: its length, its length when drafted for last
    total = plain = 0.0

    def step(accept: float, cost) -> tuple[list[int], float]:
        pending = sum(n - d for n, d in rows)
        k = chooser.choose(len(rows), pending if backlog else None)
        accepted = [next((i for i in range(k) if rng.random() >= accept), k) for _ in rows]
        seconds = cost(k) + (0.07 * pending if k and chooser._last_k == 0 else 0.0)
        chooser.observe(len(rows), k, seconds / 1000, accepted, [k] * len(rows))
        for row, a in zip(rows, accepted):
            row[0] += a + 1
            row[1] = row[0] if k else row[1]
        return accepted, seconds

    for _ in range(cycles):
        rows.extend([100, 0] for _ in range(64 - len(rows)))
        for _ in range(400):
            accepted, seconds = step(0.05, lambda k: 200.0 + 10.0 * k if k else 190.0)
            total, plain = total + seconds, plain + 190.0 * (1 + sum(accepted) / 64)
            if rng.random() < 0.7:
                rows[rng.randrange(64)] = [100, 0]
        while len(rows) > 1:
            for _ in range(3):
                step(0.8, lambda k: 12.0 + 0.5 * k * len(rows) if k else 10.0)
            rows.pop()
    return 1.0 - plain / total


def test_a_switch_is_priced_by_the_tokens_the_drafter_takes_in() -> None:
    """Where an exploration from plain decoding costs mostly its switch, the switch is priced by its
    backlog at the latest switch's cost a token, and the explorations at 64 rows keep to their share
    of the time (2%, fading): 1.6% here. Priced a row instead, the switches of a level's tail (a few
    rows, each a few dozen tokens behind) made one at 64 rows, after hundreds of plain steps in which
    most rows joined, look a fraction of its cost: 2.8%."""
    assert _levels_and_tails(DraftLength(4, adaptive=True), 8, random.Random(0), backlog=True) < 0.02


def test_the_engine_hands_adaptive_k_the_backlog_of_the_drafter() -> None:
    """Before each step the engine passes `choose` the tokens of the rows' contexts that came after the
    proposer last drafted for them: a row that joined since counts all of its context, and each plain
    step adds a token a row; a drafting step leaves none."""
    target = tiny_model("llama", num_layers=2)
    config = SpeculativeConfig(num_speculative_tokens=3, adaptive=True)
    llm = LLM(target, draft_model=noisy_copy(target, 0.03), speculative_config=config)
    engine, backlogs, ks = llm.engine, [], iter([2, 0, 0, 0, 2, 0])
    engine.draft_length.choose = lambda rows, backlog=None: backlogs.append(backlog) or next(ks)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add(llm.make_sequences([5, 6, 7, 8, 9], params, 0))  # a prompt of 5 and its first token
    engine.step()  # drafts
    engine.step()  # plain
    engine.add(llm.make_sequences([3, 4, 10], params, 1))  # a prompt of 3 and its first token
    for _ in range(4):  # plain, plain, drafting, plain
        engine.step()
    assert backlogs == [6, 0, 1 + 4, 2 + 5, 3 + 6, 0]
