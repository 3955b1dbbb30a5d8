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
(``target``, 70% of the budget by default, so noise does not tip it over), and scales N by
how far the sampled cost is from that allowance. It lowers the rate as far as needed at once
(at most 16× per step) and raises it at most 2× per step, so one cheap period cannot swing it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Period:
    """What happened since the controller last looked (differences of cumulative totals)."""

    calls: int = 0
    serving_ns: int = 0
    sampled: int = 0
    sampled_cost_ns: int = 0
    fixed_cost_ns: int = 0

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
        self.state = "within budget"

    def update(self, period: Period) -> int:
        """Take one period's measurements; returns the new N."""
        self.last = period
        if self.budget is None or period.calls == 0 or period.serving_ns <= 0:
            return self.every
        goal = self.target * self.budget * period.serving_ns
        allowed = goal - period.fixed_cost_ns
        every = self.every
        if period.sampled > 0 and period.sampled_cost_ns > 0:
            if allowed <= 0:
                wanted = float(self.max_every)
            else:
                wanted = every * period.sampled_cost_ns / allowed
        elif period.fixed_cost_ns < 0.5 * goal:
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
        elif new >= self.max_every and period.overhead > self.budget:
            self.state = "over budget at the lowest sampling rate"
        elif new > self.base_every:
            self.state = "rate lowered to stay within budget"
        else:
            self.state = "within budget"
        self.every = new
        return new
