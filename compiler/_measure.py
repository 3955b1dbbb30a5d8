"""Kernel-path choices made by measurement, remembered per machine.

When two kernels can do the same work (oneDNN's fused conv+ReLU or ATen's conv then ReLU), a
transform times both on the real input shape and keeps the faster. Timing on a busy machine
is noisy, and a rebuild must give the same variant, so a choice is made once per (machine,
torch version, operation, shape) and remembered: in this process, and in the compile cache's
folder when one is set (``compiler.cache``), so other processes and restarts reuse it.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compiler.hardware import probe

_LOCK = threading.Lock()
_CHOICES: dict[str, dict[str, Any]] = {}
_path: Path | None = None


def set_store(folder: str | os.PathLike[str] | None) -> None:
    """Remember choices in ``folder/kernel_choices.json`` (None: this process only)."""
    global _path
    with _LOCK:
        _path = None if folder is None else Path(folder) / "kernel_choices.json"
        if _path is not None and _path.exists():
            try:
                _CHOICES.update(json.loads(_path.read_text()))
            except (OSError, ValueError):
                pass


def _save() -> None:
    if _path is None:
        return
    try:
        _path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_CHOICES, indent=0, sort_keys=True))
        os.replace(tmp, _path)
    except OSError:
        pass


def _time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def remembered(what: str) -> tuple[str, dict[str, float]] | None:
    """The choice remembered for ``what`` on this machine, and its milliseconds, if any."""
    with _LOCK:
        known = _CHOICES.get(_key(what))
    return None if known is None else (known["choice"], dict(known["ms"]))


def _key(what: str) -> str:
    return f"{probe().key()}|torch {torch.__version__}|{what}"


def choose(
    what: str, candidates: dict[str, Callable[[], Any]], *, reps: int = 7, rounds: int = 3
) -> tuple[str, dict[str, float]]:
    """The fastest candidate for ``what`` (an operation and its shapes) on this machine, and
    the median milliseconds measured. Candidates are timed interleaved over ``rounds`` so a
    burst of load hits all of them; a remembered choice is returned without timing."""
    key = _key(what)
    with _LOCK:
        known = _CHOICES.get(key)
    if known is not None and known["choice"] in candidates:
        return known["choice"], dict(known["ms"])
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in candidates.items():
                samples[name].append(_time(fn, reps) * 1e3)
    ms = {name: round(min(v), 4) for name, v in samples.items()}
    best = min(ms, key=ms.__getitem__)
    with _LOCK:
        _CHOICES[key] = {"choice": best, "ms": ms}
        _save()
    return best, ms


def forget() -> None:
    """Drop remembered choices (tests)."""
    with _LOCK:
        _CHOICES.clear()
