"""CUPTI kernel activity through cupti-python, attributed to layers by external correlation.

While a sampling window is open the tracer enables concurrent kernel records (name, start/end
on the GPU clock, grid and block), external correlation records (which of our ids was pushed
when the CUDA API call that launched a kernel was made) and the runtime and driver API kinds:
CUPTI writes an external correlation record only for an API call it records (seen on an H200
with CUDA 13.0: with the kernel kinds alone, no correlation record ever came). The API
records themselves are counted and dropped; so that there are few of them, every API but
the kernel launches is switched off per callback id (``activity_enable_runtime_api`` /
``activity_enable_driver_api``) each time the tracer opens: a sampled MiniLM call makes
about 30 runtime calls per kernel (events, device and stream queries), and each would cost
an API record and a correlation record. Layers push an id on entry and pop it on exit
(:class:`~profiler._gpu.CudaLayerEvents`), so every kernel maps, through its CUDA
correlation id, to the innermost layer that launched it.

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
        self.delivered: dict[int, int] = {}  # records CUPTI handed over, by activity kind
        self.api_filter = "not opened yet"  # which API calls get records (see open())
        self._api_switches: list[tuple[Any, int, int]] | None = None
        self.error: str | None = None

    # buffer callbacks (CUPTI's threads) ------------------------------------------------

    def _requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0

    def _completed(self, activities: list[Any]) -> None:
        # Runs on a CUPTI thread: an exception here would be lost, so it is kept in
        # ``error`` (and the status) instead.
        try:
            self._parse(activities)
        except Exception as exc:  # noqa: BLE001 - see above
            self.error = f"parsing CUPTI records failed: {type(exc).__name__}: {exc}"
            log.warning("%s", self.error)

    def _parse(self, activities: list[Any]) -> None:
        c = self._c
        kernels: list[Kernel] = []
        external: dict[int, int] = {}
        kernel_kind = int(c.ActivityKind.CONCURRENT_KERNEL)
        ext_kind = int(c.ActivityKind.EXTERNAL_CORRELATION)
        for a in activities:
            kind = int(a.kind)
            self.delivered[kind] = self.delivered.get(kind, 0) + 1
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

    # window control (the profiler decides when) ----------------------------------------

    def open(self) -> None:
        """Start recording kernels (a sampling window begins)."""
        if self.is_open:
            return
        c = self._c
        if not self._registered:
            c.activity_register_callbacks(self._requested, self._completed)
            self._registered = True
        for kind in self._kinds():
            c.activity_enable(kind)
        self.api_filter = self._launches_only()
        self.is_open = True

    def _launches_only(self) -> str:
        """Switch off the records of every runtime and driver API except kernel launches.
        CUPTI forgets this when the API kinds are disabled (seen on an H200: applied once,
        later windows recorded every API again), so it is applied at every open, from a list
        built once (about 1 500 calls into CUPTI, a fraction of a millisecond). Says what it
        did."""
        c = self._c
        if self._api_switches is None:
            switches = []
            tables = [
                (getattr(c, "RuntimeApiTraceCbid", None) or getattr(c, "runtime_api_trace_cbid", None),
                 c.activity_enable_runtime_api),
                (getattr(c, "DriverApiTraceCbid", None) or getattr(c, "driver_api_trace_cbid", None),
                 c.activity_enable_driver_api),
            ]
            for table, enable in tables:
                if table is None:
                    return "all API calls (this cupti-python has no callback-id tables)"
                for name, cbid in table.__members__.items():
                    if name.upper() in ("INVALID", "SIZE", "FORCE_INT"):
                        continue
                    launch = "launch" in name.lower() and "hostfunc" not in name.lower()
                    switches.append((enable, int(cbid), int(launch)))
            self._api_switches = switches
        try:
            for enable, cbid, on in self._api_switches:
                enable(cbid, on)
        except Exception as exc:  # noqa: BLE001 - older CUPTI: keep every API record
            return f"all API calls (per-API switch refused: {type(exc).__name__}: {exc})"
        kept = sum(on for _, _, on in self._api_switches)
        return f"kernel launches only ({kept} launch APIs)"

    def _kinds(self) -> list[Any]:
        k = self._c.ActivityKind
        return [k.RUNTIME, k.DRIVER, k.EXTERNAL_CORRELATION, k.CONCURRENT_KERNEL]

    def close(self) -> None:
        """Stop recording (the window ended); recorded kernels wait for :meth:`collect`."""
        if not self.is_open:
            return
        c = self._c
        self.is_open = False
        for kind in reversed(self._kinds()):
            c.activity_disable(kind)

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
        return self._take()

    def _take(self) -> dict[int, list[Kernel]]:
        """The kernels delivered so far, by our external id. A correlation record can come a
        flush before its kernel's (the API call was recorded, the kernel still ran), so
        unmatched ones are kept, the oldest dropped beyond ``MAX_RECORDS``."""
        out: dict[int, list[Kernel]] = {}
        with self._lock:
            kernels, self._kernels = self._kernels, []
            external = self._external
            for k in kernels:
                ext = external.pop(k.correlation, None)
                if ext is not None:
                    out.setdefault(ext, []).append(k)
            if len(external) > MAX_RECORDS:
                for stale in list(external)[: len(external) - MAX_RECORDS]:
                    del external[stale]
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
