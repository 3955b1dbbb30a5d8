"""Per-thread CPU counters through ``perf_event_open(2)``, called through ctypes.

Hardware events (cycles, instructions, cache references and misses: IPC and miss rates) are
used where the kernel offers them; on virtual machines it usually does not (``ENOENT``), and
the counters fall back to software events (task clock, context switches, page faults), which
every Linux kernel keeps. What is available is detected once per process
(:func:`counter_availability`) and reported with the reason for anything that is off.

All events of one thread form one group, so a snapshot is a single ``read(2)`` of the group
leader. A group belongs to the thread that opened it (``pid=0, cpu=-1`` counts the calling
thread on any CPU), so :class:`PerfCounters` opens one group per thread on first use and
closes it when the thread ends. Values are scaled by ``time_enabled / time_running`` when
the kernel multiplexes hardware counters.

Where ``perf_event_paranoid`` forbids counting in the kernel, events are opened user-only;
context switches happen in the kernel and would then read zero, so they come from
``getrusage(RUSAGE_THREAD)`` instead (one more system call per snapshot).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import resource
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1

#: event name -> (type, config). Names carry their unit where it is not a count.
EVENTS: dict[str, tuple[int, int]] = {
    "cycles": (PERF_TYPE_HARDWARE, 0),
    "instructions": (PERF_TYPE_HARDWARE, 1),
    "cache_references": (PERF_TYPE_HARDWARE, 2),
    "cache_misses": (PERF_TYPE_HARDWARE, 3),
    "branch_misses": (PERF_TYPE_HARDWARE, 5),
    "task_clock_ns": (PERF_TYPE_SOFTWARE, 1),
    "page_faults": (PERF_TYPE_SOFTWARE, 2),
    "context_switches": (PERF_TYPE_SOFTWARE, 3),
    "cpu_migrations": (PERF_TYPE_SOFTWARE, 4),
}
HARDWARE_EVENTS: tuple[str, ...] = ("cycles", "instructions", "cache_references", "cache_misses")
SOFTWARE_EVENTS: tuple[str, ...] = ("task_clock_ns", "context_switches", "page_faults")

_FLAG_DISABLED = 1 << 0
_FLAG_EXCLUDE_KERNEL = 1 << 5
_FLAG_EXCLUDE_HV = 1 << 6
_FORMAT_TOTAL_TIME_ENABLED = 1 << 0
_FORMAT_TOTAL_TIME_RUNNING = 1 << 1
_FORMAT_GROUP = 1 << 3
_PERF_FLAG_FD_CLOEXEC = 1 << 3
_IOC_ENABLE = 0x2400
_IOC_FLAG_GROUP = 1

_SYSCALL_NR = {
    "x86_64": 298,
    "amd64": 298,
    "aarch64": 241,
    "arm64": 241,
    "riscv64": 241,
    "ppc64le": 319,
    "ppc64": 319,
    "s390x": 331,
    "i386": 336,
    "i686": 336,
}


class _PerfEventAttr(ctypes.Structure):
    """``struct perf_event_attr`` up to ``config1`` (``PERF_ATTR_SIZE_VER0``, 64 bytes): the
    kernel accepts the first published size and zero-fills the rest."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class CounterAvailability:
    """What :class:`PerfCounters` will count in this process, and why anything is off.

    ``mode``: ``hardware`` (at least cycles and instructions), ``software`` (software events
    only) or ``off``. ``events``: the keys ``read()`` reports. ``unavailable``: event -> reason.
    ``kernel``: whether kernel-side work is counted. ``context_switches_from``: ``perf``,
    ``getrusage`` or ``None``.
    """

    mode: str
    events: tuple[str, ...]
    unavailable: dict[str, str] = field(default_factory=dict)
    kernel: bool = False
    paranoid: int | None = None
    context_switches_from: str | None = None
    reason: str | None = None

    @property
    def ipc(self) -> bool:
        return "cycles" in self.events and "instructions" in self.events

    def summary(self) -> str:
        if self.mode == "off":
            return f"off ({self.reason})"
        hw = [e for e in self.events if EVENTS.get(e, (1,))[0] == PERF_TYPE_HARDWARE]
        text = f"{self.mode}: {', '.join(self.events)}"
        if not hw and self.reason:
            text += f" (hardware events off: {self.reason})"
        return text

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["events"] = list(self.events)
        d["ipc"] = self.ipc
        return d


def _paranoid() -> int | None:
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall_nr() -> int | None:
    if platform.system() != "Linux":
        return None
    return _SYSCALL_NR.get(platform.machine().lower())


def _open_event(name: str, group_fd: int, exclude_kernel: bool) -> int:
    """Open one event for the calling thread; raises ``OSError`` with the kernel's errno."""
    nr = _syscall_nr()
    if nr is None:
        raise OSError(errno.ENOSYS, f"perf_event_open is not available on {platform.system()} "
                      f"{platform.machine()}")
    ev_type, config = EVENTS[name]
    attr = _PerfEventAttr()
    attr.type = ev_type
    attr.size = ctypes.sizeof(_PerfEventAttr)
    attr.config = config
    attr.read_format = _FORMAT_GROUP | _FORMAT_TOTAL_TIME_ENABLED | _FORMAT_TOTAL_TIME_RUNNING
    flags = _FLAG_EXCLUDE_HV
    if exclude_kernel:
        flags |= _FLAG_EXCLUDE_KERNEL
    if group_fd == -1:
        flags |= _FLAG_DISABLED  # the leader starts the whole group at once
    attr.flags = flags
    libc = _libc()
    fd = libc.syscall(
        ctypes.c_long(nr), ctypes.byref(attr), ctypes.c_int(0), ctypes.c_int(-1),
        ctypes.c_int(group_fd), ctypes.c_ulong(_PERF_FLAG_FD_CLOEXEC),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _why(err: OSError, paranoid: int | None) -> str:
    code = err.errno
    if code == errno.ENOENT or code == errno.EOPNOTSUPP:
        return "not offered by this CPU or hypervisor (ENOENT: virtual machines rarely expose a PMU)"
    if code in (errno.EACCES, errno.EPERM):
        return f"not permitted (perf_event_paranoid={paranoid}; needs CAP_PERFMON or a lower setting)"
    if code == errno.ENOSYS:
        return str(err.strerror)
    if code == errno.EINVAL:
        return "rejected by the kernel (EINVAL)"
    return f"{errno.errorcode.get(code or 0, code)}: {err.strerror}"


class _Group:
    """The open events of one thread. Closing happens when the thread's local storage goes
    (the thread ended) or when :meth:`PerfCounters.close` is called."""

    __slots__ = ("fds", "leader", "size", "fmt", "_unpack", "__weakref__")

    def __init__(self, names: Sequence[str], exclude_kernel: bool) -> None:
        self.fds: list[int] = []
        try:
            for name in names:
                self.fds.append(_open_event(name, self.fds[0] if self.fds else -1, exclude_kernel))
        except OSError:
            self.close()
            raise
        self.leader = self.fds[0]
        n = len(self.fds)
        self.size = 8 * (3 + n)
        self.fmt = f"{3 + n}Q"
        self._unpack = struct.Struct(self.fmt).unpack
        _libc().ioctl(self.leader, _IOC_ENABLE, _IOC_FLAG_GROUP)

    def values(self) -> tuple[float, ...]:
        raw = self._unpack(os.read(self.leader, self.size))
        enabled, running = raw[1], raw[2]
        if running and running < enabled:
            scale = enabled / running
            return tuple(v * scale for v in raw[3:])
        return raw[3:]

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        """Close the group's descriptors (``_close`` bound early: ``__del__`` may run at
        interpreter exit, after the ``os`` module's globals are gone)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                _close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()


def _probe(
    hardware: Sequence[str], software: Sequence[str], allow_kernel: bool
) -> CounterAvailability:
    paranoid = _paranoid()
    if _syscall_nr() is None:
        why = f"perf_event_open is not available on {platform.system()} {platform.machine()}"
        return CounterAvailability("off", (), {}, False, paranoid, None, why)
    unavailable: dict[str, str] = {}

    def try_open(name: str, exclude_kernel: bool) -> OSError | None:
        try:
            os.close(_open_event(name, -1, exclude_kernel))
            return None
        except OSError as exc:
            return exc

    kernel = allow_kernel
    if kernel:
        probe_err = try_open(software[0] if software else hardware[0], False)
        if probe_err is not None and probe_err.errno in (errno.EACCES, errno.EPERM):
            kernel = False
    exclude = not kernel
    usable: list[str] = []
    for name in (*hardware, *software):
        if name not in EVENTS:
            raise ValueError(f"unknown perf event {name!r}; known: {sorted(EVENTS)}")
        err = try_open(name, exclude)
        if err is None:
            usable.append(name)
        else:
            unavailable[name] = _why(err, paranoid)
    cs_from: str | None = None
    if "context_switches" in usable and not kernel:
        # switches are counted in the kernel: user-only counting always reads zero
        usable.remove("context_switches")
        cs_from = "getrusage"
        why = (f"not permitted (perf_event_paranoid={paranoid})" if allow_kernel
               else "turned off (allow_kernel=False)")
        unavailable["context_switches"] = (
            f"kernel-side counting {why}; taken from getrusage(RUSAGE_THREAD)"
        )
    elif "context_switches" in usable:
        cs_from = "perf"
    elif "context_switches" in software and hasattr(resource, "RUSAGE_THREAD"):
        cs_from = "getrusage"
    hw = [n for n in usable if EVENTS[n][0] == PERF_TYPE_HARDWARE]
    if usable:
        # the events must also open together, as one group
        try:
            group = _Group(usable, exclude)
            group.values()
            group.close()
        except OSError as exc:
            if hw:  # a group the PMU cannot schedule: keep the software events only
                for n in hw:
                    unavailable[n] = f"cannot be grouped: {_why(exc, paranoid)}"
                usable = [n for n in usable if n not in hw]
                hw = []
            else:
                for n in usable:
                    unavailable[n] = _why(exc, paranoid)
                usable = []
    events = tuple(usable) + (("context_switches",) if cs_from == "getrusage" else ())
    hw_reason = next((unavailable[n] for n in hardware if n in unavailable), None)
    if "cycles" in hw and "instructions" in hw:
        mode = "hardware"
    elif events:
        mode = "software"
    else:
        mode = "off"
    reason: str | None = hw_reason if mode != "hardware" else None
    if mode == "off":
        reason = next(iter(unavailable.values()), "no events requested")
    return CounterAvailability(mode, events, unavailable, kernel, paranoid, cs_from, reason)


@functools.lru_cache(maxsize=8)
def counter_availability(
    hardware: tuple[str, ...] = HARDWARE_EVENTS,
    software: tuple[str, ...] = SOFTWARE_EVENTS,
    allow_kernel: bool = True,
) -> CounterAvailability:
    """Which events open here (detected once per process and event set)."""
    return _probe(hardware, software, allow_kernel)


class PerfCounters:
    """Cumulative counts of the calling thread: ``read()`` returns ``{event: value}``.

    The ``counters`` object :class:`~profiler.LayerTimer` takes. Events that do not open here
    are left out (see :attr:`availability`); with none at all, ``read()`` returns ``{}``.
    Thread-safe: each thread reads its own group.
    """

    def __init__(
        self,
        hardware: Sequence[str] = HARDWARE_EVENTS,
        software: Sequence[str] = SOFTWARE_EVENTS,
        *,
        allow_kernel: bool = True,
    ) -> None:
        self.availability = counter_availability(tuple(hardware), tuple(software), allow_kernel)
        av = self.availability
        self._perf_names = tuple(e for e in av.events if not (
            e == "context_switches" and av.context_switches_from == "getrusage"))
        self._rusage = av.context_switches_from == "getrusage"
        self._exclude_kernel = not av.kernel
        self._local = threading.local()
        self._groups: weakref.WeakSet[_Group] = weakref.WeakSet()
        self._closed = False
        self.names: tuple[str, ...] = av.events

    @property
    def available(self) -> bool:
        return bool(self.names)

    def _group(self) -> _Group | None:
        group = getattr(self._local, "group", None)
        if group is None and self._perf_names and not self._closed:
            try:
                group = _Group(self._perf_names, self._exclude_kernel)
            except OSError:
                self._local.group = False  # this thread cannot open them (fd limit): stop trying
                return None
            self._local.group = group
            self._groups.add(group)
        return group or None

    def reader(self) -> Callable[[], tuple[float, ...]] | None:
        """A reader for the calling thread: counts as a tuple in :attr:`names` order, with no
        dictionary built and no thread-local lookup. A sampled call reads twice per layer,
        right after heavy kernels when little is in cache, so every step saved shows."""
        group = self._group()
        if self._rusage:
            values = group.values if group is not None else (lambda: ())
            getrusage, who = resource.getrusage, resource.RUSAGE_THREAD

            def read() -> tuple[float, ...]:
                ru = getrusage(who)
                return (*values(), float(ru.ru_nvcsw + ru.ru_nivcsw))

            return read
        return group.values if group is not None else None

    def read(self) -> dict[str, float]:
        group = self._group()
        out = dict(zip(self._perf_names, group.values())) if group is not None else {}
        if self._rusage:
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            out["context_switches"] = float(ru.ru_nvcsw + ru.ru_nivcsw)
        return out

    def close(self) -> None:
        """Close every thread's group (reads afterwards return only getrusage values)."""
        self._closed = True
        for group in list(self._groups):
            group.close()


def derived(counters: dict[str, float] | None) -> dict[str, float]:
    """Ratios a person reads: IPC, cache miss rate, CPU utilisation of the layer's thread."""
    if not counters:
        return {}
    out: dict[str, float] = {}
    cyc, ins = counters.get("cycles"), counters.get("instructions")
    if cyc and ins is not None:
        out["ipc"] = ins / cyc
    refs, miss = counters.get("cache_references"), counters.get("cache_misses")
    if refs and miss is not None:
        out["cache_miss_rate"] = miss / refs
    return out
