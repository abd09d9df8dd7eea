"""Adaptive draft length: the k of each step, from measured acceptance and measured step times.

With c_i the chance that draft i is accepted once drafts 1..i-1 were (measured per position), a step
that drafts k tokens gives E(k) = 1 + sum_{i<=k} prod_{j<=i} c_j tokens per row on average (Leviathan et
al. 2023's expected tokens per step, with a per-position acceptance). It costs t_B(k), measured for the
batch size B: the whole step's wall time (drafting, verification, acceptance, the host sync), an
exponential moving average for each k tried (a step slower than _OUTLIER times the average counts as
that much: at 32 rows one slow last step of a batch, 44 ms against 26, raised a plain step's average by
a quarter, enough to switch speculation on where it lost), the line through them for k not tried. The
step drafts k = argmax_k E(k) / t_B(k) over 0..max_k, where k = 0 is a plain step: speculation switched
off for batch sizes where it does not pay. The first batch size starts by measuring max_k and 0, twice
each, and keeps the least of the two (a first step also pays for first calls and, since rows join the
drafter lazily, for its prefill of the prompts: counted in the average, it switched speculation off for
good at batch 1, where it doubles the speed); a batch size met later starts from the step times of the
nearest one measured, rescaled at its own first step and replaced k by k as it measures them: batches
shrink a row at a time as rows finish, and probing max_k and 0 at each size costs more than it teaches.
Now and then a neighbour of the best k is measured again so that the estimates follow the workload:
after _EXPLORE steps at a batch size, then at intervals that double (up to _EXPLORE_MAX) while the best
k stays the same, back to _EXPLORE when it changes. An exploration step is not free: where plain steps
are best, its drafter first catches up on every token it skipped (a draft model also prefills the rows
that joined since it last proposed).
"""

from __future__ import annotations

from collections import deque

_WARMUP = 2  # measurements of max_k and of 0 at each batch size before choosing
_EXPLORE = 16  # steps at a batch size before a neighbour of the best k is measured again ...
_EXPLORE_MAX = 256  # ... an interval that doubles up to this while the best k stays the same
_DECAY = 0.98  # per step, for the acceptance counts
_SMOOTHING = 0.3  # weight of a new step time in its moving average
_OUTLIER = 1.5  # a step time beyond this times its k's mean counts as this much (see observe)


class DraftLength:
    """Chooses k for each step; `adaptive=False` always gives max_k."""

    def __init__(self, max_k: int, adaptive: bool) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.reached = [1.0] * max_k  # decayed counts: drafts at position i whose predecessors were accepted
        self.accepted = [0.5] * max_k  # ... and of those, accepted (a prior of 1/2)
        self.times: dict[int, dict[int, float]] = {}  # batch size -> k -> mean step seconds
        self.borrowed: dict[int, set[int]] = {}  # batch size -> the k whose times are another size's
        self.counts: dict[int, dict[int, int]] = {}
        self.explore: dict[int, tuple[int, int, int]] = {}  # batch size -> (best k, interval, next step)
        self.history: deque[int] = deque(maxlen=1000)  # the k of the latest steps, for reports

    def choose(self, batch_size: int) -> int:
        """The k for the next step of a batch of `batch_size` rows."""
        if not self.adaptive:
            return self.max_k
        counts = self.counts.setdefault(batch_size, {})
        if not counts and batch_size not in self.times:
            self._borrow(batch_size)
        if batch_size not in self.borrowed:  # measured from scratch: max_k and 0 first
            for k in (self.max_k, 0):
                if counts.get(k, 0) < _WARMUP:
                    return k
        best = max(
            range(self.max_k + 1), key=lambda k: self.expected_tokens(k) / self.step_time(batch_size, k)
        )
        steps = sum(counts.values())
        last, interval, due = self.explore.get(batch_size, (best, _EXPLORE, _EXPLORE))
        if best != last:
            interval, due = _EXPLORE, steps + _EXPLORE
        if steps < due:
            self.explore[batch_size] = (best, interval, due)
            return best
        interval = min(2 * interval, _EXPLORE_MAX)
        self.explore[batch_size] = (best, interval, steps + interval)
        neighbours = [k for k in (best - 1, best + 1) if 0 <= k <= self.max_k]
        return min(neighbours, key=lambda k: counts.get(k, 0))

    def _borrow(self, batch_size: int) -> None:
        """Start a new batch size from the step times of the nearest batch size that has measured at
        least two k of its own (nothing when none has)."""
        sources = [b for b, times in self.times.items() if len(set(times) - self.borrowed.get(b, set())) >= 2]
        if sources:
            nearest = min(sources, key=lambda b: (abs(b - batch_size), b))
            self.times[batch_size] = dict(self.times[nearest])
            self.borrowed[batch_size] = set(self.times[batch_size])

    def observe(
        self, batch_size: int, k: int, seconds: float, accepted: list[int], drafted: list[int]
    ) -> None:
        """One step's figures: its k and wall time, and per row the drafts accepted and proposed."""
        self.history.append(k)
        if not self.adaptive:
            return
        times = self.times.setdefault(batch_size, {})
        counts = self.counts.setdefault(batch_size, {})
        borrowed = self.borrowed.get(batch_size, set())
        if borrowed and not counts:  # the first step of a borrowed curve: scale it to this size
            scale = seconds / self.step_time(batch_size, k)
            for j in borrowed:
                times[j] *= scale
        if k in borrowed or k not in times:
            borrowed.discard(k)
            times[k] = seconds
        elif batch_size not in self.borrowed and counts.get(k, 0) < _WARMUP:  # the warm-up's least
            times[k] = min(times[k], seconds)
        else:  # one slow step (rows joining or finishing in it, another process) moves the mean a little
            times[k] = (1 - _SMOOTHING) * times[k] + _SMOOTHING * min(seconds, _OUTLIER * times[k])
        counts[k] = counts.get(k, 0) + 1
        if k == 0:
            return
        self.reached = [r * _DECAY for r in self.reached]
        self.accepted = [a * _DECAY for a in self.accepted]
        for n_accepted, n_drafted in zip(accepted, drafted):
            for i in range(min(n_drafted, n_accepted + 1)):  # positions reached: up to the first rejection
                self.reached[i] += 1
                self.accepted[i] += i < n_accepted

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens per row per step when drafting k."""
        total, chance = 1.0, 1.0
        for i in range(k):
            chance *= self.accepted[i] / self.reached[i]
            total += chance
        return total

    def step_time(self, batch_size: int, k: int) -> float:
        """t_B(k): the measured mean, or the line through the two measured k nearest to k."""
        times = self.times[batch_size]
        if k in times:
            return times[k]
        known = sorted(times, key=lambda j: (abs(j - k), j))[:2]
        (k0, t0), (k1, t1) = sorted((j, times[j]) for j in known)
        estimate = t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        return max(estimate, min(times.values()) * 0.5)
