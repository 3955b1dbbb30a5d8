"""Per-layer sensitivity: how much the model's output moves when only one layer is changed.

For each candidate layer and each choice (``int8-dynamic-pc``, ``int8-static-pt``, ``bf16``,
...) the model is built with that layer alone changed (eager, so the numbers are about
arithmetic, not kernels) and compared with fp32 on the given inputs:

- model level: RMS error, SQNR (dB) and max abs error of the whole output, and the fidelity by
  the model's metric (cosine for embeddings, top-1 agreement for logits, SQNR otherwise);
- layer level: the SQNR of the layer's own output, with the layer run alone on the fp32
  inputs it saw (how hard the layer is to quantize, apart from how much the model cares).

Static int8 exports the model once and calibrates each layer's copy on ``calibration`` (the
live inputs; ``inputs`` when not given). The report serializes to JSON and to plain rows for
the store (``store.repo.save_sensitivity``); the search orders and prunes its choices with it
(most sensitive layers stay fp32 first).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from compiler import _pt2e
from compiler._errors import brief_error
from compiler._quant import INT8_MODULES, STATIC_MODULES
from compiler._registry import Example
from compiler.build import build
from compiler.fidelity import (
    choose_metric,
    compare,
    drop_floor,
    fidelity,
    float_leaves,
    judgments,
)
from compiler.recipe import LayerQuant, Quantization, Recipe


@dataclass(frozen=True)
class LayerSensitivity:
    layer: str
    choice: str
    fidelity: float | None
    """Model-level fidelity by ``metric`` with only this layer changed (1 = identical)."""
    rms: float | None
    sqnr_db: float | None
    max_abs: float | None
    layer_sqnr_db: float | None
    """SQNR of the layer's own output when run alone on its fp32 inputs."""
    status: str = "ok"
    """``ok``, or why this layer cannot take this choice (then the numbers are None)."""

    @property
    def drop(self) -> float | None:
        return None if self.fidelity is None else 1.0 - self.fidelity


@dataclass
class SensitivityReport:
    metric: str
    inputs: int
    rows: list[LayerSensitivity] = field(default_factory=list)
    seconds: float = 0.0
    samples: int = 0
    """The yes-or-no judgments each row's drop is the share of (``top1``: rows compared);
    0 for continuous metrics, and where not known (a report stored before it was kept)."""

    def floor(self, row: LayerSensitivity) -> float | None:
        """The least drop ``row``'s measured one makes likely (``compiler.fidelity.drop_floor``):
        what the search prunes a choice by, so that one changed row of 8 does not."""
        return None if row.drop is None else drop_floor(self.metric, row.drop, self.samples)

    def ranked(self, choice: str | None = None) -> list[LayerSensitivity]:
        """Measured rows, most sensitive first (lowest fidelity, then lowest SQNR)."""
        rows = [r for r in self.rows if r.status == "ok" and (choice is None or r.choice == choice)]
        return sorted(
            rows,
            key=lambda r: (
                r.fidelity if r.fidelity is not None else -1.0,
                r.sqnr_db if r.sqnr_db is not None else -1.0,
                r.layer,
            ),
        )

    def most_sensitive(self, choice: str, n: int) -> list[str]:
        return [r.layer for r in self.ranked(choice)[:n]]

    def get(self, layer: str, choice: str) -> LayerSensitivity | None:
        return next((r for r in self.rows if r.layer == layer and r.choice == choice), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "inputs": self.inputs,
            "seconds": round(self.seconds, 3),
            "samples": self.samples,
            "rows": [_finite(asdict(r)) for r in self.rows],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_rows(self) -> list[dict[str, Any]]:
        """One plain dict per (layer, choice), as ``store.repo.save_sensitivity`` takes them."""
        return [{**_finite(asdict(r)), "metric": self.metric, "inputs": self.inputs,
                 "samples": self.samples} for r in self.rows]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SensitivityReport:
        rows = [LayerSensitivity(**r) for r in data.get("rows", [])]
        return cls(metric=data["metric"], inputs=int(data["inputs"]), rows=rows,
                   seconds=float(data.get("seconds", 0.0)), samples=int(data.get("samples", 0)))

    @classmethod
    def from_json(cls, text: str) -> SensitivityReport:
        return cls.from_dict(json.loads(text))


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: an exact layer (no error at all) gets SQNR 999 dB."""
    return {
        k: (999.0 if isinstance(v, float) and math.isinf(v) and v > 0 else v) for k, v in d.items()
    }


def candidate_layers(model: nn.Module, choice: LayerQuant) -> list[str]:
    kinds: tuple[type, ...] = STATIC_MODULES if choice.scheme == "static" else INT8_MODULES
    if choice.precision != "int8":
        kinds = (nn.Linear, nn.Conv2d)
    return [n for n, m in model.named_modules() if n and isinstance(m, kinds)]


def _outputs(module: nn.Module, inputs: Sequence[Example]) -> list[Any]:
    with torch.inference_mode():
        return [module(*a, **k) for a, k in inputs]


def _merged(outputs: Sequence[Any]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for out in outputs for t in float_leaves(out)])


def _layer_io(model: nn.Module, names: Sequence[str], inputs: Sequence[Example]) -> dict[str, list[tuple[Any, Any]]]:
    """Each named layer's (input args, output) on ``inputs`` in the fp32 model."""
    mods = dict(model.named_modules())
    got: dict[str, list[tuple[Any, Any]]] = {n: [] for n in names}
    handles = [
        mods[n].register_forward_hook(
            lambda _m, a, o, n=n: got[n].append((tuple(x.detach() for x in a), o.detach()))
        )
        for n in names
    ]
    try:
        _outputs(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return got


def _layer_sqnr(layer: nn.Module, io: list[tuple[Any, Any]], choice: LayerQuant) -> float | None:
    """The layer alone, changed by ``choice``, on the inputs it saw in the fp32 model."""
    if not io:
        return None
    wrapper = nn.Sequential(copy.deepcopy(layer)).eval()
    examples: list[Example] = [(args, {}) for args, _ in io]
    recipe = Recipe(quantization=Quantization.of({"0": choice}))
    variant = build(wrapper, recipe, calibration=examples if choice.scheme == "static" else ())
    if "0" not in variant.report.applied:
        return None
    outs = _outputs(variant.module, examples)
    return compare(torch.cat([o.reshape(-1) for _, o in io]), torch.cat([o.reshape(-1) for o in outs]))["sqnr_db"]


def sensitivity(
    model: nn.Module,
    inputs: Sequence[Example],
    choices: Sequence[str | LayerQuant] = ("int8-dynamic-pc",),
    *,
    layers: Sequence[str] | None = None,
    metric: str | None = None,
    calibration: Sequence[Example] | None = None,
    max_inputs: int = 16,
) -> SensitivityReport:
    """Per-layer sensitivity of ``model`` on ``inputs`` for each of ``choices``.

    ``layers`` defaults to every layer that can take a choice (Linear; Conv2d for static
    int8). ``metric`` defaults to :func:`compiler.choose_metric` of the fp32 output. At most
    ``max_inputs`` inputs are used (and as many calibration inputs). Layers that cannot take a
    choice are reported with the reason and no numbers.
    """
    started = time.perf_counter()
    model = model.eval()
    inputs = list(inputs)[:max_inputs]
    if not inputs:
        raise ValueError("sensitivity needs at least one input")
    calib = list(calibration)[:max_inputs] if calibration else inputs
    refs = _outputs(model, inputs)
    metric = metric or choose_metric(refs[0])
    ref_flat = _merged(refs)
    parsed = [c if isinstance(c, LayerQuant) else LayerQuant.parse(c) for c in choices]
    report = SensitivityReport(metric=metric, inputs=len(inputs), samples=judgments(metric, refs))
    all_layers = sorted({n for c in parsed for n in candidate_layers(model, c)} | set(layers or ()))
    wanted = list(layers) if layers is not None else all_layers
    io = _layer_io(model, [n for n in wanted if n in dict(model.named_modules())], inputs)
    exported: torch.fx.GraphModule | None = None
    modules = dict(model.named_modules())
    for choice in parsed:
        possible = set(candidate_layers(model, choice))
        for name in wanted:
            if name not in possible:
                why = "no such layer" if name not in modules else (
                    f"{type(modules[name]).__name__} cannot take {choice.label()}"
                )
                report.rows.append(LayerSensitivity(name, choice.label(), None, None, None, None, None, why))
                continue
            try:
                if choice.scheme == "static":
                    if exported is None:
                        exported = _pt2e.export(model, calib[0])
                    with _pt2e.quiet():
                        gm = copy.deepcopy(exported)
                    with torch.no_grad():
                        variant: nn.Module = _pt2e.quantize_region(gm, {name: choice}, set(), None, calib)
                    if _pt2e.layer_status(variant).get(name) != "static":  # type: ignore[arg-type]
                        raise RuntimeError("the x86 quantizer did not quantize it")
                else:
                    built = build(model, Recipe(quantization=Quantization.of({name: choice})))
                    if name not in built.report.applied:
                        raise RuntimeError(built.report.skipped.get(name, "not applied"))
                    variant = built.module
                outs = _outputs(variant, inputs)
            except Exception as exc:  # noqa: BLE001 - this layer cannot take it: say why
                report.rows.append(LayerSensitivity(
                    name, choice.label(), None, None, None, None, None,
                    f"failed: {brief_error(exc)}",
                ))
                continue
            c = compare(ref_flat, _merged(outs))
            try:
                layer_db = _layer_sqnr(modules[name], io.get(name, []), choice)
            except Exception:  # noqa: BLE001 - the model-level numbers still stand
                layer_db = None
            report.rows.append(LayerSensitivity(
                layer=name, choice=choice.label(), fidelity=fidelity(metric, refs, outs),
                rms=c["rms"], sqnr_db=c["sqnr_db"], max_abs=c["max_abs"], layer_sqnr_db=layer_db,
            ))
    report.seconds = time.perf_counter() - started
    return report
