"""The overhead budget: the profiler's measured cost against the time spent serving.

The profiler measures what it costs, continuously: begin/end of every call, the hooks of
sampled calls (their own time, timed inside them, plus the dispatch cost torch adds per
hooked module call, calibrated once per process), turning a sampled call into layer rows,
host sampling, closing windows and exporting them. A :class:`RateController` turns those
measurements into the sampling rate: one call in N is profiled per layer, and N goes up when
the cost would pass ``budget`` × serving time and back down (toward the configured N) when
there is headroom.

Only the sampled part of the cost depends on N; the per-call and background parts do not.
So the controller gives the sampling the budget that is left after those, aims below it
(``target``, 70% of the budget by default, so noise does not tip it over), and chooses N from
what one sampled call costs and how many calls are served. It reads every quantity as a sum
over the last few periods, each period weighing :data:`DECAY` times the one after it, not
from the last period alone: at low traffic a period holds one sampled call or none, and the
background cost comes in bursts (a window's export, a host sample). Judged one period at a
time, a period with 20 ms of background among ones with 3.5 ms sent N up 16× as if that
background were its own, twice in a row, and periods without a sampled call had no cost to
bring it back down: MiniLM at 7 calls a second went from 1 call in 100 to 1 in 25 600 while
the profiler cost 0.25% against its 0.5% budget. The share of serving time the per-call and
background costs take is read over a longer run (:data:`FIXED_DECAY`): a burst every few
minutes (a saved reservoir) read over three periods sent N to its floor each time it came. It
lowers the rate as far as needed at once (at most 16× per step) and raises it at most 2× per
step, so one cheap period cannot swing it.

The background work itself follows the serving time (:class:`Pacer`): a window's export, a host
sample and a saved reservoir each run only as often as the time served since their last run
pays for them at their share of the budget, within bounds on how stale they may get.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, fields

#: how much a period counts against the one after it in the controller's sums: the last period
#: weighs 1, the one before 0.7, then 0.49, ... (about the last three periods in all)
DECAY = 0.7
#: the same for the share of serving time the per-call and background costs take: those come
#: in bursts tens of seconds apart (a window's export, a saved reservoir), so they are read
#: over about the last twenty periods
FIXED_DECAY = 0.95


@dataclass
class Period:
    """What happened since the controller last looked (differences of cumulative totals), or
    the controller's weighted sum of such periods (hence floats)."""

    calls: float = 0
    serving_ns: float = 0
    sampled: float = 0
    sampled_cost_ns: float = 0
    fixed_cost_ns: float = 0

    @property
    def overhead(self) -> float:
        if self.serving_ns <= 0:
            return 0.0
        return (self.sampled_cost_ns + self.fixed_cost_ns) / self.serving_ns


class RateController:
    """Chooses N for "profile one call in N" so that the measured overhead stays under
    ``budget`` (a fraction of serving time, 0.005 = 0.5%). ``budget=None`` turns adaptation
    off (N stays ``base_every``: benchmarks and offline profiles)."""

    def __init__(
        self,
        base_every: int,
        budget: float | None,
        max_every: int = 1_000_000,
        *,
        target: float = 0.7,
    ) -> None:
        if base_every < 1 or max_every < base_every:
            raise ValueError("need 1 <= base_every <= max_every")
        if budget is not None and not 0 < budget < 1:
            raise ValueError("budget must be a fraction in (0, 1), e.g. 0.005 for 0.5%")
        if not 0 < target <= 1:
            raise ValueError("target must be in (0, 1]")
        self.base_every = base_every
        self.budget = budget
        self.max_every = max_every
        self.target = target
        self.every = base_every
        self.last: Period | None = None
        #: the periods so far, summed with the older ones weighing less (:func:`_decayed`)
        self._recent: Period | None = None
        self._fixed: Period | None = None  # the same with :data:`FIXED_DECAY`
        self.state = "within budget"

    def update(self, period: Period) -> int:
        """Take one period's measurements; returns the new N."""
        self.last = period
        if self.budget is None or period.calls == 0 or period.serving_ns <= 0:
            return self.every
        h = self._recent = _decayed(self._recent, period)
        f = self._fixed = _decayed(self._fixed, period, FIXED_DECAY)
        goal = self.target * self.budget * h.serving_ns
        fixed = f.fixed_cost_ns / f.serving_ns * h.serving_ns  # their share, over the longer run
        allowed = goal - fixed
        every = self.every
        if h.sampled > 0 and h.sampled_cost_ns > 0:
            if allowed <= 0:
                wanted = float(self.max_every)
            else:  # one sampled call's cost, at a rate of one in N calls, within the allowance
                wanted = h.sampled_cost_ns / h.sampled * h.calls / allowed
        elif fixed < 0.5 * goal:
            wanted = every / 2  # nothing sampled and plenty left: sample more
        else:
            wanted = float(every)
        if wanted < every:
            wanted = max(wanted, every / 2)
            if wanted > 0.8 * every:  # not worth a change (hysteresis)
                wanted = every
        else:
            wanted = min(wanted, every * 16.0)
        new = int(min(max(round(wanted), self.base_every), self.max_every))
        if allowed <= 0:
            self.state = (
                "over budget: per-call and background costs alone exceed it at this traffic"
            )
        elif new >= self.max_every and h.overhead > self.budget:
            self.state = "over budget at the lowest sampling rate"
        elif new > self.base_every:
            self.state = "rate lowered to stay within budget"
        else:
            self.state = "within budget"
        self.every = new
        return new


def _decayed(recent: Period | None, period: Period, decay: float = DECAY) -> Period:
    """``period`` added to the sums of the ones before it, those weighed by ``decay``."""
    if recent is None:
        return period
    return Period(**{f.name: decay * getattr(recent, f.name) + getattr(period, f.name)
                     for f in fields(Period)})


class Pacer:
    """When to run a recurring piece of background work (a window's export, a host sample, a
    saved reservoir) so that what it costs follows the time spent serving, not the clock.

    A run is due once ``min_s`` has passed since the last one and the serving time since then
    pays for a run at ``fraction`` (its share of the budget: a run that cost 3 ms at a fraction
    of 0.1% waits for 3 s of serving), or once ``max_s`` has passed whatever the traffic. What
    a run costs is the median of the last few measured (:meth:`cost`), so one slow run (a
    store busy with another writer) does not space the next ones out. ``fraction=None``: every
    ``min_s``, as without a budget. Times are ``time.monotonic()`` seconds; serving time is the
    cumulative figure of the profiler's ledger (nanoseconds)."""

    def __init__(self, fraction: float | None, min_s: float, max_s: float, *,
                 now: float, serving_ns: float = 0.0) -> None:
        if fraction is not None and fraction <= 0:
            raise ValueError("fraction must be > 0 or None")
        if not 0 < min_s <= max_s:
            raise ValueError("need 0 < min_s <= max_s")
        self.fraction, self.min_s, self.max_s = fraction, min_s, max_s
        self._at, self._serving_ns = now, serving_ns
        self._costs: collections.deque[float] = collections.deque(maxlen=8)

    def due(self, now: float, serving_ns: float) -> bool:
        elapsed = now - self._at
        if elapsed < self.min_s:
            return False
        if elapsed >= self.max_s or self.fraction is None or not self._costs:
            return True
        return statistics.median(self._costs) <= self.fraction * (serving_ns - self._serving_ns)

    def ran(self, now: float, serving_ns: float) -> None:
        """A run starts now (its cost comes with :meth:`cost` when known)."""
        self._at, self._serving_ns = now, serving_ns

    def cost(self, cost_ns: float) -> None:
        self._costs.append(cost_ns)
