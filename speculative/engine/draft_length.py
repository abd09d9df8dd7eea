"""Adaptive draft length: the k of each step, from measured acceptance and measured step times.

With c_i the chance that draft i is accepted once drafts 1..i-1 were (measured per position), a step
that drafts k tokens gives E(k) = 1 + sum_{i<=k} prod_{j<=i} c_j tokens per row on average (Leviathan et
al. 2023's expected tokens per step, with a per-position acceptance). It costs t_B(k), measured for the
batch size B: the time from the step's start to the next step's start (drafting, verification,
acceptance, the host sync, and what the host did before the next step, such as a server publishing
the tokens; not the target's prefill of rows admitted in between, which costs the same whatever k, while
a drafter's intake of their prompts is its next drafting step's), a moving mean for each k
tried (decay _TIME_DECAY per sample; a mean, not a median, so that rare long periods, such as the
prefill of a whole batch of new rows, count for what they cost), the line through them for k not
tried. The machine's pace moves every k's time alike (another process on the cores, a longer
context), while only the k being run is measured: so a sample of the k that the step before was
also measured at rescales the other k's times by as much as it moved k's mean (kept apart, a plain
step's time from a slow minute made drafting look better for good), while a k measured after others
(an exploration) moves its own time only, which is how the times' ratios are learned.
The step drafts k = argmax_k E(k) / t_B(k) over 0..max_k, where k = 0 is a plain step:
speculation switched off for batch sizes where it does not pay. After plain steps, drafting must
promise _SWITCH_GAIN times plain decoding's tokens a second to be switched on (a drafter then takes in
every token it skipped, a cost no step time holds), so that where the two are about even (a weak
drafter, a large batch) the steps do not alternate between them, paying that cost each time; and what
it saves over _EXPLORE plain steps' time must cover that intake (the switch's backlog, below): where a
batch shrinks a row a step (a closed loop's tail), every size where drafting paid switched it on for a
step or two, each switch paying the drafter's prefill of every remaining row, several plain steps'
time. Not after a single plain step between drafting steps (an exploration of plain decoding): the
drafter then takes in one token a row more than a drafting step whose drafts were all rejected leaves
it, no switch; charged the intake of a switch after hundreds of
plain steps, drafting that paid 1.15x went back to plain decoding at the first such exploration and
stayed there until the next exploration from it (docs/server.md#under-load). The first
batch size starts by measuring max_k and 0, twice each, and keeps the least of the two (a first step
also pays for first calls and, since rows join the drafter lazily, for its prefill of the prompts:
counted in the mean, it switched speculation off for good at batch 1, where it doubles the speed) until
the first measurement after the warm-up replaces it; a batch size met later starts from the step
times of those measured (between two, on the line between their times; beyond them, the nearest
one's), rescaled at its own first step and replaced k by k as it measures them: batches shrink a
row at a time as rows finish, and probing max_k and 0 at each size costs more than it teaches.
Where drafting looks best on such borrowed times, plain decoding's own time is measured at the size's
second step (a plain step after drafting costs no switch): a curve borrowed from a smaller batch, where
drafting costs relatively less, otherwise kept drafting on for an exploration interval where plain
decoding won. And speculation's gain shrinks as the batch grows (a verification of k + 1 tokens a row
costs ever more against a plain step once the forward is compute-bound, while the acceptance does not
depend on the batch), so after plain steps a step whose drafting rests on an estimate (plain decoding's
or k's time not measured at its batch size) decodes plainly where a smaller batch size has plain
decoding best on times measured there. Without it, a large batch size met one step at a time (a closed
loop's tail, where the batch shrinks a row a step) switched drafting on at every visit on a curve
borrowed from a small batch, each switch paying the drafter's intake, and never learned: a switch's step
is no sample of its k's time (below). After a drafting step such an estimate is measured instead, no
switch to pay: decoding plainly there, as it did, left a batch size of 32 where drafting paid 1.3x
plainly decoded until an exploration from plain decoding, hundreds of steps later
(docs/server.md#under-load).

Now and then a neighbour of the best k, or plain decoding, whichever was measured least recently, is
measured again so that the estimates follow the workload (without plain decoding among them, a plain
step's time from long ago kept speculation on at 32 rows, where it lost); where plain decoding is best,
each drafting k in turn, the least recently measured (of those never measured at the batch size, the
best estimated): part of a drafting step's cost does not grow with k (the drafter's forward, the
verification's), so one draft can lose where four win, and explorations that measured only k = 1, plain
decoding's neighbour, kept plain decoding where a longer draft paid (docs/server.md#under-load).
Explorations come after _EXPLORE steps at a batch size, then at intervals that double (up to
_EXPLORE_MAX) while the best k stays the same, back to _EXPLORE when it changes. The batch sizes where
plain decoding is best share one such schedule, counted in steps of every size: a server's batch size
wanders as rows join and finish, and a schedule of each size's own would explore as often as there are
sizes, each time from plain decoding, a switch. A switch costs what the drafter takes in (below): up to
a prefill of every row's context, many plain steps' time at a large batch, which an interval of
_EXPLORE_MAX steps would pay again and again (the figures: docs/server.md#under-load). So that schedule
also waits until the plain steps since its last exploration took 1 / share times the next exploration's
expected cost (`_exploration_cost`): its switch and what its two steps take beyond plain decoding's time
for their tokens, t_B(k) (1 - rate_k / rate_0) each. A switch's cost is its backlog (the tokens of the
rows' contexts that came after the drafter's latest proposal, all of a row's that joined since: what the
engine passes `choose`) at the latest switch's cost a token (its step time over its k's mean there,
over its backlog). A cost a row instead, taken from a switch at the end of a closed loop's level (a few
rows, each a few dozen tokens behind), priced a switch at 60 rows of SmolLM2, after dozens of plain steps
in which most rows had joined, at 0.14-0.30 s where it took 0.52-0.71 s, and explorations took about
twice their share (docs/server.md#under-load). Explorations from
plain decoding then cost at most that share of the time, however dear a switch or a drafting step; paced
by the latest switch's cost alone (often a cheap one, at a few rows), those at 64 rows of SmolLM2, a
switch of about 120 ms and two steps twice as long as a plain one's 190 ms, spent several times the
share (docs/server.md#under-load). The share starts at _SWITCH_SHARE and halves (down to
_SWITCH_SHARE_MIN) each time a whole cycle of such explorations (one of each drafting k, as they take
turns) finds plain decoding still best, back to _SWITCH_SHARE when one finds drafting better: where
drafting keeps losing (a weak drafter under load) the explorations' cost fades to a fraction of a
percent, and a change of workload is still found, later. (Halved after each exploration that lost, the
share was an eighth by the last drafting k tried, so that a k that paid where fewer drafts did not
waited the longest to be measured.) It is back at _SWITCH_SHARE, its schedule at _EXPLORE steps, once
the batch size is more than twice or less than half the one where it last halved: what lost at 64 rows
says little about 16. The acceptance an exploration from plain decoding measures outweighs what was
measured before the plain steps (which would otherwise hold the estimate for a dozen explorations): a
drafter that became worth running is run again after one.
A drafting step right after plain steps is not a sample of its k's time: its drafter first takes in
every token it skipped (a draft model also prefills the rows that joined meanwhile), a cost of
switching, not of drafting; an exploration from plain decoding is therefore measured twice, the
second time clean. Nor is a step that compiled a graph (a compiled model's first call of a shape,
seconds where the step takes milliseconds): the engine passes no time for it. And a drafting step's time
leaves out the drafter's intake of rows that joined since its last proposal (a draft model's prefill of
their contexts, which the proposer times: IntakeTimingProposer): counted in, it made the k measured at a
batch's first drafting step, where every row is new, look several times as dear, and a k that the
explorations did not measure again kept that time, so that plain decoding stayed where drafting paid
(docs/server.md#under-load). A switch's cost keeps it. It is still a cost of drafting: a row that
joins and finishes while the steps are plain never joins the drafter. So every drafting k is charged
it apart (`intake_cost`), as the mean a drafting step pays: the drafter's intake of a row that joined
(a moving mean over drafting steps after a drafting step, whose intake is that of the rows that joined
in between) times the rows that join a step (a moving mean over every step, a share of the batch's
rows) times the batch size. At 32 rows of SmolLM2 under load it is a few percent of a drafting step,
about what drafting with its draft gains there.

A proposal can be narrower than the k asked: a draft with prompt lookup first drafts a chain of its
own length (the demo's: 1) beside lookups that shrink with the batch (at 32 rows every proposal is one
token wide), and a lookup that found nothing proposes none. Such a step is timed as a step of the
width it had, and each k asked is valued at the mean width it gave at that batch size (E and t at that
width, between the two nearest where it is fractional), so that a k the proposer cuts is worth what it
delivers; the warm-up counts the k asked. Valued at its own k, a k of 4 that drafted one token looked
like four drafts for the price of one, and a batch size where max_k never drafted max_k tokens never
left its warm-up: the demo's drafter at 32 rows drafted every step (docs/server.md#under-load).
"""

from __future__ import annotations

from collections import deque

_WARMUP = 2  # measurements of max_k and of 0 at each batch size before choosing
_EXPLORE = 16  # steps at a batch size before another k is measured again ...
_EXPLORE_MAX = 256  # ... an interval that doubles up to this while the best k stays the same
_DECAY = 0.98  # per step, for the acceptance counts
_TIME_DECAY = 0.9  # per sample of a k at a batch size, for its moving mean
_SWITCH_GAIN = 1.1  # drafting's promised tokens a second over plain decoding's to switch it on
_SWITCH_SHARE = 0.02  # of the plain steps' time, at most, for the switches of explorations from them ...
_SWITCH_SHARE_MIN = _SWITCH_SHARE / 8  # ... halved down to this while explorations find plain decoding best


class DraftLength:
    """Chooses k for each step; `adaptive=False` always gives max_k. A batch of at least
    `disable_by_batch_size` rows (None: no such batch) always gets 0, a plain step."""

    def __init__(self, max_k: int, adaptive: bool, disable_by_batch_size: int | None = None) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.reached = [1.0] * max_k  # decayed counts: drafts at position i whose predecessors were accepted
        self.accepted = [0.5] * max_k  # ... and of those, accepted (a prior of 1/2)
        self.times: dict[int, dict[int, float]] = {}  # batch size -> k -> mean step seconds
        self.borrowed: dict[int, set[int]] = {}  # batch size -> the k whose times are another size's
        self.counts: dict[int, dict[int, int]] = {}  # batch size -> width drafted -> steps timed
        self.asked: dict[int, dict[int, int]] = {}  # batch size -> k asked -> steps timed
        self.widths: dict[int, dict[int, float]] = {}  # batch size -> k asked -> mean width drafted
        self.seen: dict[int, dict[int, int]] = {}  # batch size -> k asked -> its steps there when last run
        self.explore: dict[int, tuple[int, int, int]] = {}  # batch size -> (best k, interval, next step)
        self._plain_explore = (_EXPLORE, _EXPLORE)  # (interval, next step) where plain decoding is best
        self._plain_seconds = 0.0  # plain steps' time since the last exploration from them
        self._switch_cost = 0.0  # seconds: the latest switch's step time over its k's mean
        self._intake = 0.0  # seconds a token: the latest switch's cost over the backlog it took in
        self._backlog = 0  # the tokens a drafter would take in at the step chosen last (choose)
        self._share = _SWITCH_SHARE  # of the plain steps' time for explorations' switches (docstring)
        self._from_plain: int | None = None  # the k of an exploration from plain decoding under way
        self._lost: set[int] = set()  # the drafting k such explorations found losing since the share moved
        self._faded_at: int | None = None  # the batch size where the share last halved
        self._steps = 0  # steps observed, of every batch size
        self.history: deque[int] = deque(maxlen=1000)  # the k of the latest steps, for reports
        self._sums: dict[tuple[int, int], tuple[float, float]] = {}  # (B, k) -> decayed (seconds, samples)
        self._provisional: set[tuple[int, int]] = set()  # (B, k) whose time is still the warm-up's
        self._last_k: int | None = None  # the k of the step observed last
        self._plain_run = 0  # plain steps observed since the last drafting step
        self._explored: int | None = None  # the k of the step being an exploration
        self._again: int | None = None  # an exploration to measure once more (it came after plain steps)
        self._last_sample: tuple[int, int] | None = None  # (B, k) of the latest step time taken
        self._joins = 0.0  # rows that joined a step, over its batch's rows: a moving mean over every step
        self._row_intake = 0.0  # seconds: the drafter's intake of a row that joined, a moving mean

    def choose(self, batch_size: int, backlog: int | None = None) -> int:
        """The k for the next step of a batch of `batch_size` rows. `backlog`: the tokens of their contexts
        that came after the drafter's latest proposal (a row that joined since: all of its context), what
        a switch from plain decoding makes a drafter take in (None: one a row)."""
        self._backlog = batch_size if backlog is None else backlog
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            self._again = None  # an exploration's second measurement: due again after the next switch
            return 0
        if not self.adaptive:
            return self.max_k
        if self._again is not None:
            k, self._again = self._again, None
            return k
        counts = self.counts.setdefault(batch_size, {})
        if not counts and batch_size not in self.times:
            self._borrow(batch_size)
        if batch_size not in self.borrowed:  # measured from scratch: max_k and 0 first
            asked = self.asked.get(batch_size, {})
            for k in (self.max_k, 0):
                if asked.get(k, 0) < _WARMUP:
                    return k
        rate = [self._rate(batch_size, k) for k in range(self.max_k + 1)]
        best = max(range(self.max_k + 1), key=rate.__getitem__)
        if self._plain_run > 1 and not self._pays_switch(batch_size, rate[best] / rate[0]):
            best = 0
        estimated = best and not {0, best} <= self._own(batch_size)
        if estimated and not self._last_k and self._plain_below(batch_size):
            best = 0  # after plain steps, an estimate against a smaller batch's measurements (docstring)
        if self._from_plain is not None:  # its measurements are in: did drafting win?
            self._lost = set() if best else self._lost | {self._from_plain}
            if best:
                self._share, self._faded_at = _SWITCH_SHARE, None
            elif len(self._lost) == self.max_k:  # a whole cycle of drafting k lost
                self._share, self._lost = max(self._share / 2, _SWITCH_SHARE_MIN), set()
                self._faded_at = batch_size
            self._from_plain = None
        elif self._faded_at is not None and not self._faded_at / 2 <= batch_size <= 2 * self._faded_at:
            self._share, self._lost, self._faded_at = _SWITCH_SHARE, set(), None  # a load far from the fade's
            self._plain_explore = (_EXPLORE, min(self._plain_explore[1], self._steps + _EXPLORE))
        steps = sum(counts.values())
        last, interval, due = self.explore.get(batch_size, (best, _EXPLORE, _EXPLORE))
        if best != last:
            interval, due = _EXPLORE, steps + _EXPLORE
        self.explore[batch_size] = (best, interval, due)
        if best and steps and 0 in self.borrowed.get(batch_size, ()):
            self._explored = 0  # plain decoding's time here is another size's: measure it, no switch to pay
            return 0
        if best == 0:  # plain decoding's batch sizes share one schedule, in steps of every size
            interval, due = self._plain_explore
            if self._steps < due:
                return 0
            drafting = set(range(1, self.max_k + 1))  # every drafting k in turn: one may lose where more pay
            k = self._least_recent(batch_size, drafting, rate)
            if self._plain_seconds * self._share < self._exploration_cost(batch_size, k, rate):
                return 0
            interval = min(2 * interval, _EXPLORE_MAX)
            self._plain_explore, self._plain_seconds = (interval, self._steps + interval), 0.0
            self._discount_acceptance(batch_size)
            self._explored = self._from_plain = k
            return k
        if steps < due:
            return best
        interval = min(2 * interval, _EXPLORE_MAX)
        self.explore[batch_size] = (best, interval, steps + interval)
        others = {k for k in (best - 1, best + 1, 0) if 0 <= k <= self.max_k} - {best}
        self._explored = self._least_recent(batch_size, others, rate)
        return self._explored

    def _least_recent(self, batch_size: int, ks: set[int], rate: list[float]) -> int:
        """Of `ks`, the k measured least recently at `batch_size`; of those never measured there, the best
        estimated (`rate`: each k's tokens a second a row)."""
        seen = self.seen.get(batch_size, {})  # empty at a batch size first met in an exploration
        return min(ks, key=lambda k: (seen.get(k, -1), -rate[k], k))

    def _exploration_cost(self, batch_size: int, k: int, rate: list[float]) -> float:
        """Seconds an exploration of k from plain decoding is expected to cost over plain steps: the
        switch (the drafter's intake of the backlog at the latest switch's cost a token) and, for each of
        its two steps, the time its tokens take beyond plain decoding's (t_B(k) (1 - rate_k / rate_0))."""
        step = self.step_time(batch_size, self.widths.get(batch_size, {}).get(k, k))
        return self._switch_estimate() + 2 * step * max(0.0, 1.0 - rate[k] / rate[0])

    def _switch_estimate(self) -> float:
        """Seconds a switch to drafting would cost now: the backlog at the latest switch's cost a token."""
        return self._intake * self._backlog

    def _pays_switch(self, batch_size: int, gain: float) -> bool:
        """Whether drafting at `gain` times plain decoding's tokens a second is worth switching on after
        plain steps: at least _SWITCH_GAIN, and what it saves over _EXPLORE plain steps' time at least
        the drafter's intake of the backlog (`_switch_estimate`, module docstring)."""
        saved = (gain - 1.0) * _EXPLORE * self.step_time(batch_size, 0)
        return gain >= _SWITCH_GAIN and saved >= self._switch_estimate()

    def _own(self, batch_size: int) -> set[int]:
        """The widths whose step times at `batch_size` were measured there (not borrowed)."""
        return set(self.times.get(batch_size, ())) - self.borrowed.get(batch_size, set())

    def _plain_below(self, batch_size: int) -> bool:
        """Whether a smaller batch size has plain decoding best on step times measured there (plain
        decoding's and at least one width's)."""
        expected = [self.expected_tokens(k) for k in range(self.max_k + 1)]
        for size in sorted(b for b in self.times if b < batch_size):
            own, times = self._own(size), self.times[size]
            drafting = [expected[k] / (times[k] + self.intake_cost(size)) for k in own if 0 < k <= self.max_k]
            if 0 in own and drafting and max(drafting) <= expected[0] / times[0]:
                return True
        return False

    def _rate(self, batch_size: int, k: int) -> float:
        """Tokens a second per row when asking for k drafts: E / t at the mean width k gave here (module
        docstring), k itself where it has not been asked here."""
        width = self.widths.get(batch_size, {}).get(k, k)
        low = int(width)
        expected = self.expected_tokens(low)
        if width > low:
            expected += (width - low) * (self.expected_tokens(low + 1) - expected)
        return expected / (self.step_time(batch_size, width) + (self.intake_cost(batch_size) if k else 0.0))

    def intake_cost(self, batch_size: int) -> float:
        """Seconds a drafting step of `batch_size` rows pays on average for the drafter's intake of the
        rows that joined before it: a cost of drafting, not in its step time (module docstring)."""
        return self._row_intake * self._joins * batch_size

    def _discount_acceptance(self, batch_size: int) -> None:
        """Before an exploration from plain decoding: the acceptance measured before the plain steps
        (counts that decay only as drafts are made) weighs at most one step's rows of it, so that what
        the exploration measures decides, and a workload that changed meanwhile is seen at once."""
        scale = min(1.0, batch_size / self.reached[0])
        self.reached = [r * scale for r in self.reached]
        self.accepted = [a * scale for a in self.accepted]

    def _borrow(self, batch_size: int) -> None:
        """Start a new batch size from the step times of the batch sizes that have measured at least two
        k of their own (nothing when none has): between two such sizes, each k's time on the line
        between theirs (drafting's cost against plain decoding's grows with the batch, so a size
        between one where drafting pays and one where it does not is neither); beyond them, the nearest
        one's times."""
        sources = [b for b, times in self.times.items() if len(set(times) - self.borrowed.get(b, set())) >= 2]
        if not sources:
            return
        below = max((b for b in sources if b < batch_size), default=None)
        above = min((b for b in sources if b > batch_size), default=None)
        if below is None or above is None:
            times = dict(self.times[above if below is None else below])
        else:
            low, high, share = self.times[below], self.times[above], (batch_size - below) / (above - below)
            times = {k: low[k] + share * (high[k] - low[k]) for k in low.keys() & high.keys()}
            if len(times) < 2:
                times = dict(self.times[min((below, above), key=lambda b: (abs(b - batch_size), b))])
        self.times[batch_size] = times
        self.borrowed[batch_size] = set(times)

    def observe(
        self,
        batch_size: int,
        k: int,
        seconds: float | None,
        accepted: list[int],
        drafted: list[int],
        chosen: int | None = None,
        intake: float = 0.0,
        joined: int = 0,
    ) -> None:
        """One step's figures: its k, the width of its proposal (the drafts verified a row: at most the
        k `chosen` for it, None: k), and its time (module docstring; None where the step compiled a
        graph: not a step of that k, which the chooser measures again), and per row the drafts accepted
        and proposed. `intake`: seconds of that time the drafter spent taking in rows that joined since
        its last proposal, kept out of the k's time (module docstring) but not out of a switch's cost;
        `joined`: the rows that joined the batch since the step before (their intake, where it drafted
        after a drafting step)."""
        self.history.append(k)
        if not self.adaptive:
            return
        chosen = k if chosen is None else chosen
        self._steps += 1
        self._joins = _DECAY * self._joins + (1 - _DECAY) * joined / batch_size
        if k and self._last_k and joined and seconds is not None:  # the intake of the rows that joined
            self._row_intake = (
                _TIME_DECAY * (self._row_intake or intake / joined) + (1 - _TIME_DECAY) * intake / joined
            )
        switched, self._last_k = k > 0 and self._last_k == 0, k
        self._plain_run = self._plain_run + 1 if k == 0 else 0
        explored, self._explored = self._explored, None
        if switched and explored == chosen:
            self._again = chosen
        if chosen:
            widths = self.widths.setdefault(batch_size, {})
            mean = widths.get(chosen, k)
            widths[chosen] = _TIME_DECAY * mean + (1 - _TIME_DECAY) * k
        if seconds is not None:  # None: the step compiled a graph, which its time holds
            self.times.setdefault(batch_size, {})
            counts = self.counts.setdefault(batch_size, {})
            if not switched:
                self._time(batch_size, k, max(seconds - intake, 0.0))
            elif self.times[batch_size]:
                self._switch_cost = max(0.0, seconds - self.step_time(batch_size, k))
                self._intake = self._switch_cost / max(self._backlog, 1)
            if k == 0:
                self._plain_seconds += seconds
            counts[k] = counts.get(k, 0) + 1
            asked = self.asked.setdefault(batch_size, {})
            asked[chosen] = asked.get(chosen, 0) + 1
            self.seen.setdefault(batch_size, {})[chosen] = sum(counts.values())
        if k == 0:
            return
        self.reached = [r * _DECAY for r in self.reached]
        self.accepted = [a * _DECAY for a in self.accepted]
        for n_accepted, n_drafted in zip(accepted, drafted):
            for i in range(min(n_drafted, n_accepted + 1)):  # positions reached: up to the first rejection
                self.reached[i] += 1
                self.accepted[i] += i < n_accepted

    def _time(self, batch_size: int, k: int, seconds: float) -> None:
        """Take `seconds` as a sample of t_B(k) (B = batch_size)."""
        times, counts = self.times[batch_size], self.counts[batch_size]
        borrowed = self.borrowed.get(batch_size, set())
        if borrowed and not counts:  # the first step of a borrowed curve: scale it to this size
            scale = seconds / self.step_time(batch_size, k)
            for j in borrowed:
                times[j] *= scale
        borrowed.discard(k)
        key = (batch_size, k)
        total, weight = self._sums.get(key, (0.0, 0.0))
        if batch_size not in self.borrowed and counts.get(k, 0) < _WARMUP:  # the warm-up's least
            seconds = min(seconds, total / weight) if weight else seconds
            self._sums[key], times[k] = (seconds, 1.0), seconds
            self._provisional.add(key)
            return
        # k's time was measured here already (not the warm-up's, nor borrowed or interpolated)
        previous = times[k] if key in self._sums and key not in self._provisional else None
        if key in self._provisional:  # the warm-up's figure gives way to the first measured after it
            self._provisional.discard(key)
            total, weight = 0.0, 0.0
        total, weight = _TIME_DECAY * total + seconds, _TIME_DECAY * weight + 1.0
        self._sums[key] = (total, weight)
        times[k] = total / weight
        if previous is not None and self._last_sample == key:  # a run of k: the machine's pace moved
            self._rescale(batch_size, times[k] / previous, but=k)  # every k's time as it moved k's
        self._last_sample = key

    def _rescale(self, batch_size: int, factor: float, but: int) -> None:
        """Multiply the step times of every k but `but` at `batch_size` by `factor`."""
        times = self.times[batch_size]
        for j in times:
            if j != but:
                times[j] *= factor
                if (batch_size, j) in self._sums:
                    total, weight = self._sums[batch_size, j]
                    self._sums[batch_size, j] = (total * factor, weight)

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens per row per step when drafting k."""
        total, chance = 1.0, 1.0
        for i in range(k):
            chance *= self.accepted[i] / self.reached[i]
            total += chance
        return total

    def step_time(self, batch_size: int, k: float) -> float:
        """t_B(k): the measured time, or the line through the two measured k nearest to k (where only one
        k is measured yet, its time); k may be a mean width, between two k."""
        times = self.times[batch_size]
        if k in times:
            return times[k]
        if len(times) == 1:
            return next(iter(times.values()))
        known = sorted(times, key=lambda j: (abs(j - k), j))[:2]
        (k0, t0), (k1, t1) = sorted((j, times[j]) for j in known)
        estimate = t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        return max(estimate, min(times.values()) * 0.5)
