"""Which kernel max-autotune picked for each GEMM of a package, recorded and replayed.

Under ``max-autotune`` Inductor times every candidate kernel of a GEMM (its C++ templates
with their block sizes, oneDNN's and ATen's library calls) and keeps the fastest. A
profiling twin (``compiler.build_profiling_twin``) is its variant compiled again with kernel
events, so it times them again: on a busy machine it may keep others. Those compute other
numbers (measured: an int8 static, bf16 MiniLM twin kept oneDNN for 6 linears its variant
ran as AMX templates, cosine 0.9974 against the variant), and the serving process refuses
such a twin, so the variant serves without per-layer rows. The twin's rows must also time
the kernels that serve, not others.

So every package records its picks (:class:`Pick`, saved in the artifact's manifest), and the
twin's build replays its variant's: the candidate at the same place in the same GEMM's list
(Inductor lists them in a fixed order), where it is there by that name; its own fastest
otherwise, counted as missed. The hook is Inductor's ``InductorChoices.override_best_choice``,
set for the compiling thread only (``V.set_choices_handler``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V


@dataclass(frozen=True)
class Pick:
    """One GEMM's choice: the GEMM (:func:`_gemm`), how many candidates it had, and the
    place and name (less Inductor's counter) of the one kept."""

    gemm: str
    candidates: int
    index: int
    choice: str

    def to_json(self) -> list[Any]:
        return [self.gemm, self.candidates, self.index, self.choice]

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> Pick:
        gemm, candidates, index, choice = data
        return cls(str(gemm), int(candidates), int(index), str(choice))


class Picking(InductorChoices):
    """Records each pick; with ``replay``, keeps the recorded candidate of each GEMM instead of
    the fastest, where the same GEMM lists one of that name at that place."""

    def __init__(self, replay: Sequence[Pick] | None = None) -> None:
        super().__init__()
        self.picks: list[Pick] = []
        self.replay = list(replay) if replay is not None else None
        self.replayed = 0
        self.missed = 0
        self._used: set[int] = set()

    def override_best_choice(self, best_choice: Any, timings: dict[Any, float]) -> Any:
        choices = list(timings)
        chosen = best_choice
        gemm = _gemm(choices)
        if self.replay is not None:
            wanted = self._recorded(gemm, len(choices))
            if wanted is not None and _name(choices[wanted.index]) == wanted.choice:
                chosen = choices[wanted.index]
                self.replayed += 1
            else:
                self.missed += 1
        index = next((i for i, c in enumerate(choices) if c is chosen), -1)
        self.picks.append(Pick(gemm, len(choices), index, _name(chosen)))
        return chosen

    def _recorded(self, gemm: str, candidates: int) -> Pick | None:
        """The first recorded pick of this GEMM not replayed yet (same shapes, same list)."""
        for i, pick in enumerate(self.replay or ()):
            if i not in self._used and pick.gemm == gemm and pick.candidates == candidates:
                self._used.add(i)
                return pick
        return None

    def describe(self) -> str | None:
        """A note for the build's report, or None where nothing was replayed or missed."""
        if self.replay is None or not (self.replayed or self.missed):
            return None
        note = f"autotune: {self.replayed} of {self.replayed + self.missed} GEMM kernel " \
               "choices replayed from the variant's build"
        return note + (f" ({self.missed} chosen again by timing)" if self.missed else "")


_REPLAY: contextvars.ContextVar[Mapping[str, Sequence[Pick]] | None] = contextvars.ContextVar(
    "pgc_autotune_replay", default=None)


@contextlib.contextmanager
def replaying(picks: Mapping[str, Sequence[Pick]] | None) -> Iterator[None]:
    """Packages compiled in the block replay ``picks`` (by package file name)."""
    token = _REPLAY.set(picks)
    try:
        yield
    finally:
        _REPLAY.reset(token)


def replay_digest() -> str:
    """What packages compiled now replay, for their cache key: ``-`` outside
    :func:`replaying` (or with nothing to replay), else a digest of the picks. A twin built to
    other picks is another artifact, never the one stored for the old picks."""
    replay = _REPLAY.get()
    if replay is None:
        return "-"
    data = json.dumps(picks_to_json(replay), sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:16]


@contextlib.contextmanager
def picking(package: str) -> Iterator[Picking]:
    """Record (and, inside :func:`replaying`, replay) the picks of the package named
    ``package`` compiled in the block, on this thread."""
    replay = _REPLAY.get()
    handler = Picking(replay.get(package, ()) if replay is not None else None)
    with V.set_choices_handler(handler):
        yield handler


def picks_to_json(picks: Mapping[str, Sequence[Pick]]) -> dict[str, list[list[Any]]]:
    return {name: [p.to_json() for p in seq] for name, seq in picks.items()}


def picks_from_json(data: Any) -> dict[str, list[Pick]] | None:
    """A manifest's ``autotune`` entry, or None where it has none or it is malformed (an
    artifact from before picks were recorded: the twin then times its own)."""
    if not isinstance(data, dict):
        return None
    try:
        return {str(name): [Pick.from_json(p) for p in seq] for name, seq in data.items()}
    except (TypeError, ValueError):
        return None


_COUNTER = re.compile(r"_\d+$")


def _name(choice: Any) -> str:
    name = _COUNTER.sub("", str(getattr(choice, "name", "")))
    return f"{type(choice).__name__}:{name}"


def _gemm(choices: Sequence[Any]) -> str:
    """A GEMM told apart by its output's shape and dtype and its first input's shape, as the
    candidates see them (their other inputs differ: packed weights)."""
    first = choices[0]
    layout = getattr(first, "layout", None)
    inputs = getattr(first, "input_nodes", None) or []
    shape_in = _shape(inputs[0]) if inputs else "?"
    dtype = str(getattr(layout, "dtype", "")).removeprefix("torch.")
    return (f"{_dims(getattr(layout, 'size', ()))} {dtype} <- {shape_in}"
            f" [{', '.join(sorted({_name(c) for c in choices}))}]")


def _shape(node: Any) -> str:
    try:
        return _dims(node.get_size())
    except Exception:  # noqa: BLE001 - a node without a size: the GEMM is told apart less
        return "?"


def _dims(sizes: Sequence[Any]) -> str:
    return "x".join(str(s) for s in sizes)
