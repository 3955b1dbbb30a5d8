"""CUPTI kernel activity through cupti-python, attributed to layers by external correlation.

While a sampling window is open the tracer enables two activity kinds: concurrent kernel
records (name, start/end on the GPU clock, grid and block) and external correlation records
(which of our ids was pushed when the CUDA API call that launched a kernel was made). Layers
push an id on entry and pop it on exit (:class:`~profiler._gpu.CudaLayerEvents`), so every
kernel maps, through its CUDA correlation id, to the innermost layer that launched it.

Enabling and disabling are cheap; delivering records is not, so records are only flushed
(``activity_flush_all``) by the profiler's background thread when it resolves sampled calls,
never on the request path. Buffers are handed to CUPTI on request and parsed in the
completion callback into plain tuples (the callback's record objects do not outlive it).
:meth:`CuptiTracer.shutdown` disables both kinds, flushes, and detaches CUPTI from the
process (``cuptiFinalize``).

Caveat: CUPTI's activity API has one set of buffer callbacks per process. torch.profiler
(Kineto) uses CUPTI too; do not run both at once in one process.

Everything imports lazily; :func:`cupti_status` says why the tracer is off.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pgc.profiler")

BUFFER_BYTES = 4 * 1024 * 1024
MAX_RECORDS = 200_000


@dataclass(frozen=True)
class Kernel:
    """One kernel execution, as CUPTI recorded it."""

    name: str
    start_ns: int
    end_ns: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    correlation: int
    stream: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _dist_version(name: str) -> str | None:
    from importlib import metadata  # noqa: PLC0415

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def cupti_status() -> tuple[bool, str]:
    """(usable, why): whether the CUPTI tracer can run in this process."""
    version = _dist_version("cupti-python")
    try:
        from cupti import cupti  # noqa: F401, PLC0415
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return False, f"cupti-python is not importable ({type(exc).__name__}: {exc})"
    from profiler._gpu import cuda_status  # noqa: PLC0415

    ok, why = cuda_status()
    if not ok:
        return False, f"cupti-python {version} is installed, but {why}"
    return True, f"cupti-python {version}"


class CuptiTracer:
    """Kernel records of sampling windows, keyed by our external correlation ids."""

    def __init__(self) -> None:
        from cupti import cupti  # noqa: PLC0415

        self._c = cupti
        self._lock = threading.Lock()
        self._kernels: list[Kernel] = []
        self._external: dict[int, int] = {}  # CUDA correlation id -> our external id
        self._registered = False
        self.is_open = False
        self.dropped = 0
        self.records = 0
        self.error: str | None = None

    # buffer callbacks (CUPTI's threads) ------------------------------------------------

    def _requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0

    def _completed(self, activities: list[Any]) -> None:
        c = self._c
        kernels: list[Kernel] = []
        external: dict[int, int] = {}
        kernel_kind = int(c.ActivityKind.CONCURRENT_KERNEL)
        ext_kind = int(c.ActivityKind.EXTERNAL_CORRELATION)
        for a in activities:
            kind = int(a.kind)
            if kind == kernel_kind:
                kernels.append(Kernel(
                    name=str(a.name),
                    start_ns=int(a.start),
                    end_ns=int(a.end),
                    grid=(int(a.grid_x), int(a.grid_y), int(a.grid_z)),
                    block=(int(a.block_x), int(a.block_y), int(a.block_z)),
                    correlation=int(a.correlation_id),
                    stream=int(a.stream_id),
                ))
            elif kind == ext_kind:
                external[int(a.correlation_id)] = int(a.external_id)
        with self._lock:
            room = MAX_RECORDS - len(self._kernels)
            if len(kernels) > room:
                self.dropped += len(kernels) - max(room, 0)
                kernels = kernels[: max(room, 0)]
            self._kernels.extend(kernels)
            self._external.update(external)
            self.records += len(kernels)

    # window control (the profiler decides when) ----------------------------------------

    def open(self) -> None:
        """Start recording kernels (a sampling window begins)."""
        if self.is_open:
            return
        c = self._c
        if not self._registered:
            c.activity_register_callbacks(self._requested, self._completed)
            self._registered = True
        c.activity_enable(c.ActivityKind.EXTERNAL_CORRELATION)
        c.activity_enable(c.ActivityKind.CONCURRENT_KERNEL)
        self.is_open = True

    def close(self) -> None:
        """Stop recording (the window ended); recorded kernels wait for :meth:`collect`."""
        if not self.is_open:
            return
        c = self._c
        self.is_open = False
        c.activity_disable(c.ActivityKind.CONCURRENT_KERNEL)
        c.activity_disable(c.ActivityKind.EXTERNAL_CORRELATION)

    def push(self, external_id: int) -> None:
        c = self._c
        c.activity_push_external_correlation_id(c.ExternalCorrelationKind.CUSTOM0, external_id)

    def pop(self) -> None:
        c = self._c
        c.activity_pop_external_correlation_id(c.ExternalCorrelationKind.CUSTOM0)

    # background thread ----------------------------------------------------------------

    def collect(self) -> dict[int, list[Kernel]]:
        """Flush CUPTI's buffers and return kernels by our external id (kernels nobody
        pushed an id for, e.g. another thread's, are left out). Background thread only."""
        self._c.activity_flush_all(1)
        with self._lock:
            kernels, self._kernels = self._kernels, []
            external, self._external = self._external, {}
        out: dict[int, list[Kernel]] = {}
        for k in kernels:
            ext = external.get(k.correlation)
            if ext is not None:
                out.setdefault(ext, []).append(k)
        return out

    def shutdown(self) -> None:
        """Tear down: stop recording, deliver what is left, detach CUPTI from the process."""
        try:
            self.close()
            if self._registered:
                self._c.activity_flush_all(1)
                self._c.finalize()
                self._registered = False
        except Exception as exc:  # noqa: BLE001 - teardown must not raise into shutdown
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("CUPTI teardown failed: %s", self.error)
        with self._lock:
            self._kernels, self._external = [], {}
