"""CUDA events around the layers of sampled calls, never synchronizing on the request path.

A sampled call records a pair of CUDA events around every layer (and around the whole call)
on the current stream. Recording is asynchronous; the events are resolved later, on the
profiler's background thread, by :meth:`CudaLayerEvents.resolve`, which waits for the call's
last event (that blocks only the background thread, not the device or the serving thread)
and reads the elapsed times. Events come from a pool, so a sampled call allocates none once
warm.

When a :class:`~profiler._cupti.CuptiTracer` is open, each layer also pushes a CUPTI external
correlation id (``call seq << 20 | layer index + 1``) for the kernels it launches, so the
tracer's kernel records can be attributed to the innermost enclosing layer.

Nothing here is imported unless a CUDA module is watched; :func:`cuda_status` says why the
GPU path is off on a machine without one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

EXT_SHIFT = 20
EXT_MASK = (1 << EXT_SHIFT) - 1


@functools.lru_cache(maxsize=1)
def cuda_status() -> tuple[bool, str]:
    """(usable, why): whether CUDA events can time layers in this process."""
    import torch  # noqa: PLC0415

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    try:
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        name = torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001 - a broken driver is a reason, not a crash
        return False, f"CUDA initialisation failed: {type(exc).__name__}: {exc}"
    return True, f"{name} (CUDA {torch.version.cuda})"


def module_device(module: Any) -> str:
    """``cuda`` when the module's first parameter or buffer lives on a CUDA device."""
    for tensor in (*module.parameters(), *module.buffers()):
        return "cuda" if tensor.is_cuda else tensor.device.type
    return "cpu"


@dataclass
class GpuCall:
    """The CUDA events of one sampled call, waiting to be resolved."""

    seq: int
    start: Any = None
    end: Any = None
    pairs: list[tuple[int, Any, Any]] = field(default_factory=list)
    external: bool = False


class CudaLayerEvents:
    """Records CUDA events around layers (the ``gpu`` object of a :class:`LayerTimer`)."""

    def __init__(self, tracer: Any | None = None, pool_max: int = 4096) -> None:
        import torch  # noqa: PLC0415

        self._torch = torch
        self.tracer = tracer
        self._pool: list[Any] = []
        self._pool_max = pool_max
        self._call: GpuCall | None = None

    def _event(self) -> Any:
        pool = self._pool
        return pool.pop() if pool else self._torch.cuda.Event(enable_timing=True)

    def release(self, *events: Any) -> None:
        if len(self._pool) < self._pool_max:
            self._pool.extend(events)

    # request path (inside the sampled call) --------------------------------------------

    def start_call(self, seq: int) -> None:
        ev = self._event()
        ev.record()
        tracer = self.tracer
        self._call = GpuCall(seq, start=ev, external=tracer is not None and tracer.is_open)

    def pre(self, i: int) -> Any:
        call = self._call
        if call is not None and call.external:
            self.tracer.push((call.seq << EXT_SHIFT) | (i + 1))  # type: ignore[union-attr]
        ev = self._event()
        ev.record()
        return ev

    def post(self, i: int, start: Any) -> None:
        ev = self._event()
        ev.record()
        call = self._call
        if call is not None:
            call.pairs.append((i, start, ev))
            if call.external:
                self.tracer.pop()  # type: ignore[union-attr]

    def end_call(self) -> None:
        call = self._call
        if call is not None and call.end is None:
            ev = self._event()
            ev.record()
            call.end = ev

    def take(self) -> GpuCall | None:
        call, self._call = self._call, None
        return call

    # background thread ----------------------------------------------------------------

    def resolve(self, call: GpuCall) -> tuple[dict[int, float], float]:
        """GPU milliseconds per module (inclusive) and for the whole call. Waits for the
        call's last event: call only off the request path."""
        call.end.synchronize()
        per: dict[int, float] = {}
        for i, a, b in call.pairs:
            per[i] = per.get(i, 0.0) + a.elapsed_time(b)
        total = call.start.elapsed_time(call.end)
        self.release(call.start, call.end, *(e for _, a, b in call.pairs for e in (a, b)))
        return per, total
