"""The live profiler's settings: a frozen dataclass, validated when made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProfilerConfig:
    """How the live profiler samples, what it costs at most and what it collects.

    - ``sample_every``: profile one call in N per layer (the highest rate; the budget may
      lower it); ``max_sample_every``: the lowest rate the budget may go to.
    - ``budget``: the profiler's measured cost as a fraction of serving time (0.005 = 0.5%);
      ``None`` keeps N fixed.
    - ``duty_on_s`` / ``duty_period_s``: sample only during the first ``duty_on_s`` seconds
      of every period (``None``: always).
    - ``window_s``: aggregation window; ``max_queue``: closed windows held while the sink is
      slow before the oldest are dropped; ``export_batch``: windows per sink call.
    - ``counters``: per-layer perf counters (hardware where offered, else software), read
      on one sampled call in ``counter_every`` (two reads per layer cost more than the
      timing; layer rows say over how many calls their counters were summed: ``calls``).
    - ``host_interval_s``: psutil process statistics every so often (``None``: off; only
      with a sink); ``leak_window_s`` / ``leak_min_growth_mb``: steady RSS growth this long
      and this large raises a leak warning.
    - ``gpu`` / ``cupti``: CUDA events and CUPTI kernel records for modules on a CUDA device.
    - ``control_s``: how often the background thread wakes up.
    - ``hook_twin``: sampled calls run a hook twin of the model (:mod:`profiler._twin`), so
      no other call goes through a hook; False: they run the model itself with
      process-wide hooks for their length (every module call in the process then takes
      torch's hooked path meanwhile).
    - ``layer_window_calls`` / ``layer_window_max_s``: windows closed on the timer carry
      layer rows once that many calls were sampled since the last ones, or that long after;
      until then layer statistics keep accumulating (their rows say when they started).
    """

    sample_every: int = 100
    window_s: float = 10.0
    max_queue: int = 64
    export_batch: int = 16
    budget: float | None = 0.005
    max_sample_every: int = 100_000
    duty_on_s: float | None = None
    duty_period_s: float = 5.0
    counters: bool = True
    counter_every: int = 4
    host_interval_s: float | None = 10.0
    leak_window_s: float = 600.0
    leak_min_growth_mb: float = 64.0
    gpu: bool = True
    cupti: bool = True
    control_s: float = 1.0
    layer_window_calls: int = 8
    layer_window_max_s: float = 60.0
    hook_twin: bool = True

    def __post_init__(self) -> None:
        if self.sample_every < 1:
            raise ValueError("sample_every must be >= 1")
        if self.max_sample_every < self.sample_every:
            raise ValueError("max_sample_every must be >= sample_every")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.counter_every < 1:
            raise ValueError("counter_every must be >= 1")
        if self.max_queue < 1 or self.export_batch < 1:
            raise ValueError("max_queue and export_batch must be >= 1")
        if self.budget is not None and not 0 < self.budget < 1:
            raise ValueError("budget must be a fraction in (0, 1), e.g. 0.005 for 0.5%, or None")
        if self.duty_on_s is not None and not 0 < self.duty_on_s <= self.duty_period_s:
            raise ValueError("duty_on_s must be in (0, duty_period_s]")
        if self.duty_period_s <= 0:
            raise ValueError("duty_period_s must be > 0")
        if self.host_interval_s is not None and self.host_interval_s <= 0:
            raise ValueError("host_interval_s must be > 0 or None")
        if self.leak_window_s <= 0 or self.leak_min_growth_mb <= 0:
            raise ValueError("leak_window_s and leak_min_growth_mb must be > 0")
        if self.control_s <= 0:
            raise ValueError("control_s must be > 0")
        if self.layer_window_calls < 1 or self.layer_window_max_s < 0:
            raise ValueError("layer_window_calls must be >= 1 and layer_window_max_s >= 0")
