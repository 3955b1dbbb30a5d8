"""The one suggestion engine: what a per-layer profile suggests, for the API's live profile
(``GET /profile``: one line per layer) and for ``pgc profile`` (a ranked list that adds
repeated roles, the hardware's int8/bf16 paths and layout conversions).

Thresholds, as shares of the summed per-layer time:

- :data:`HOT` (15%, inclusive): one layer (or one repeated role) this large is worth a choice
  of its own; the search's profile-guided space gives hot layers their own choices too.
- :data:`INT8_LAYER` (2%, inclusive): below this an int8-capable layer is not worth naming on
  its own (a quantized kernel saves at most about half of its time).
- :data:`INT8_PATH` (5%, exclusive): the int8-capable op types together must carry more than
  this for the hardware's int8 or bf16 path to be worth a mention.
- :data:`LAYOUT_WORTH` (2%, exclusive): layout conversions above this are worth removing.

Before there was one engine the API called a layer hot at ``>= 15%`` and the CLI at ``> 15%``,
and the API's int8 list left out LSTM and GRU (which have dynamic int8 kernels); both now use
the inclusive bound and the CLI's wider op list.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

HOT = 0.15
INT8_LAYER = 0.02
INT8_PATH = 0.05
LAYOUT_WORTH = 0.02
#: the row of a compiled variant's time outside its kernels (``profiler._compiled.BETWEEN``)
BETWEEN = "(between kernels)"
#: Op types with int8 kernels (oneDNN / FBGEMM on CPU, tensor cores on GPU).
INT8_OPS = frozenset({"Linear", "Conv1d", "Conv2d", "Conv3d", "LSTM", "GRU"})

Kind = Literal["hot_layer", "hot_group", "int8_path", "bf16_path", "layout"]


class HardwareInfo(Protocol):
    """What the engine reads of ``compiler.Hardware`` (duck-typed: no torch import here)."""

    features: Mapping[str, bool]
    gpu_capability: tuple[int, int] | None
    int8_fast: bool
    bf16_fast: bool


@dataclass(frozen=True)
class Suggestion:
    kind: Kind
    target: str | None
    latency_ratio: float
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_hot(share: float) -> bool:
    return share >= HOT


def _hot_message(name: str, op: str, share: float) -> str:
    if name == BETWEEN:  # no layer: quantizing or fusing one does not shorten it
        return (f"{share:.0%} of the time is between kernels (the wrapper's calls and the "
                "runtime between them): fewer, larger kernels or a larger batch shorten it")
    return f"{name} ({op}) takes {share:.0%} of the time: a quantization or fusion candidate"


def for_layer(op_type: str, share: float) -> str | None:
    """The one-line suggestion for one layer (the API profile's ``suggestion``)."""
    if is_hot(share):
        return "hot: a quantization or fusion candidate"
    if op_type in INT8_OPS and share >= INT8_LAYER:
        return "int8 candidate"
    return None


def _int8_path(device: str, hw: HardwareInfo, ops: str, share: float) -> list[Suggestion]:
    if device == "cuda":
        cap = hw.gpu_capability
        fast8 = cap is not None and tuple(cap) >= (7, 5)
        path = f"int8 tensor cores (sm_{cap[0]}{cap[1]})" if fast8 and cap else None
    else:
        fast8 = hw.int8_fast
        names = [n for n, k in (("AMX-INT8", "amx_int8"), ("AVX512-VNNI", "avx512_vnni"),
                                ("AVX-VNNI", "avx_vnni")) if hw.features.get(k)]
        path = " and ".join(names) if names else None
    out = []
    if fast8:
        out.append(Suggestion(
            "int8_path", ops, share,
            f"{ops} layers carry {share:.0%} of the time and this hardware has {path}: int8 "
            "(dynamic, per-channel) has a fast path here; compile it (Inductor) to get it, "
            "eager int8 is slower",
        ))
    else:
        out.append(Suggestion(
            "int8_path", ops, share,
            f"{ops} layers carry {share:.0%} of the time but this CPU has no VNNI or AMX: int8 "
            "gains little here" + ("; bf16 has a fast path (AVX512-BF16/AMX-BF16)" if hw.bf16_fast else ""),
        ))
    if device != "cuda" and hw.bf16_fast:
        out.append(Suggestion(
            "bf16_path", ops, share,
            "bf16 has a fast path on this CPU (AVX512-BF16/AMX-BF16): a lower-risk alternative "
            "to int8 for accuracy-sensitive layers",
        ))
    return out


def _layout(layout: Mapping[str, Any]) -> list[Suggestion]:
    ratio = float(layout.get("ratio", 0.0))
    if ratio > LAYOUT_WORTH:
        where = next(iter(layout.get("layers", {})), "?")
        what = next(iter(layout.get("ops", {})), "?")
        return [Suggestion(
            "layout", where, ratio,
            f"{layout['ms_per_call']:.2f} ms per call ({ratio:.1%}) goes to layout conversions, "
            f"mostly {what} in {where}: keep one layout end to end (channels_last for "
            "convolutions) or fuse the conversion away",
        )]
    return [Suggestion(
        "layout", None, ratio,
        f"layout conversions take {ratio:.1%} of the time: nothing to gain there",
    )]


def suggest(
    layers: Iterable[Mapping[str, Any]],
    *,
    groups: Iterable[Mapping[str, Any]] = (),
    device: str = "cpu",
    hardware: HardwareInfo | None = None,
    layout: Mapping[str, Any] | None = None,
) -> list[Suggestion]:
    """What a profile suggests, most valuable first. ``layers`` and ``groups`` carry
    ``latency_ratio`` (or ``share``) and ``op_type``; hardware and layout suggestions need
    ``hardware`` and ``layout``."""
    rows = [(r["layer"], r["op_type"], float(r.get("latency_ratio", r.get("share", 0.0)))) for r in layers]
    out = [
        Suggestion("hot_layer", name, share, _hot_message(name, op, share))
        for name, op, share in rows
        if is_hot(share)
    ]
    for g in groups:
        if g["layers"] > 1 and is_hot(g["latency_ratio"]):
            out.append(Suggestion(
                "hot_group", g["group"], g["latency_ratio"],
                f"{g['group']} ({g['layers']} × {g['op_type']}) take {g['latency_ratio']:.0%} of "
                "the time together: quantization or fusion candidates, one choice for all of them",
            ))
    by_op: dict[str, float] = {}
    for _name, op, share in rows:
        by_op[op] = by_op.get(op, 0.0) + share
    int8_share = sum(v for k, v in by_op.items() if k in INT8_OPS)
    if hardware is not None and int8_share > INT8_PATH:
        ops = ", ".join(sorted(k for k in by_op if k in INT8_OPS))
        out.extend(_int8_path(device, hardware, ops, int8_share))
    if layout:
        out.extend(_layout(layout))
    return out
