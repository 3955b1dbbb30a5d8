"""Per-layer timing through forward hooks, present only while a sampled call runs.

Hooks go on every module of the served model for the length of one call and come off right
after, so unsampled calls pay nothing. Inclusive times are taken for every module; a leaf
reports its inclusive time and a container reports its *self* time (inclusive minus its
children), which is where functional code such as attention matmuls and pooling runs. The
layer times of one call therefore add up to (nearly) the whole call.

Hooks are thread-safe for the case that matters: only the sampling thread's calls are timed
(another thread running the same module at the same moment is ignored).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from torch import nn

_perf_ns = time.perf_counter_ns


class LayerTimer:
    """Times the modules of one model for one call at a time."""

    def __init__(self, model: nn.Module, counters: Any | None = None) -> None:
        self.names: dict[int, str] = {}
        self.op_types: dict[int, str] = {}
        self.children: dict[int, list[int]] = {}
        self.modules: list[nn.Module] = []
        for name, mod in model.named_modules():
            key = id(mod)
            if key in self.names:
                continue  # a shared module is timed under its first name
            self.names[key] = name or "(root)"
            self.op_types[key] = type(mod).__name__
            self.children[key] = [id(c) for c in mod.children()]
            self.modules.append(mod)
        self.counters = counters
        self._inclusive: dict[int, int] = {}
        self._counter_totals: dict[int, dict[str, float]] = {}
        self._starts: dict[int, list[Any]] = {}
        self._thread: int | None = None
        self._handles: list[Any] = []

    def _pre(self, mod: nn.Module, _args: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        snap = self.counters.read() if self.counters is not None else None
        self._starts.setdefault(id(mod), []).append((_perf_ns(), snap))

    def _post(self, mod: nn.Module, _args: Any, _out: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        end = _perf_ns()
        key = id(mod)
        stack = self._starts.get(key)
        if not stack:
            return
        start, snap = stack.pop()
        self._inclusive[key] = self._inclusive.get(key, 0) + (end - start)
        if snap is not None:
            now = self.counters.read()
            acc = self._counter_totals.setdefault(key, {})
            for k, v in now.items():
                acc[k] = acc.get(k, 0.0) + (v - snap.get(k, 0.0))

    def attach(self) -> None:
        self._thread = threading.get_ident()
        self._inclusive = {}
        self._counter_totals = {}
        self._starts = {}
        pre, post = self._pre, self._post
        handles = self._handles
        for mod in self.modules:
            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._thread = None

    def _called_below(self, key: int) -> list[int]:
        """The nearest descendants of ``key`` that ran in this call (containers such as
        ``ModuleList`` are never called themselves, so look through them)."""
        out: list[int] = []
        stack = list(self.children[key])
        while stack:
            k = stack.pop()
            if k in self._inclusive:
                out.append(k)
            else:
                stack.extend(self.children.get(k, ()))
        return out

    def results(self) -> list[tuple[str, str, float, dict[str, float] | None]]:
        """(name, op type, milliseconds, counters) per layer for the call just timed: leaves
        with their inclusive time, containers with their self time when it is positive."""
        out = []
        incl = self._inclusive
        for key, total in incl.items():
            counters = self._counter_totals.get(key)
            below = self._called_below(key)
            if not below:
                out.append((self.names[key], self.op_types[key], total / 1e6, counters))
                continue
            self_ns = total - sum(incl[k] for k in below)
            if self_ns > 0:
                if counters is not None:
                    counters = dict(counters)
                    for k in below:
                        for ck, cv in self._counter_totals.get(k, {}).items():
                            counters[ck] = counters.get(ck, 0.0) - cv
                out.append(
                    (self.names[key], self.op_types[key] + " (self)", self_ns / 1e6, counters)
                )
        return out
