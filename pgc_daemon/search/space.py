"""The search space, shaped by the live profile.

Layers that carry most of the live time get a choice of their own; every other layer shares
one ``_default`` choice. That keeps the space small where it does not matter and lets the
search spend its few trials where the time goes (for MiniLM: the feed-forward projections).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from compiler import Backend, Hardware, LayerQuant, Quantization, Recipe
from compiler.recipe import DEFAULT_KEY

QUANTIZABLE = (nn.Linear,)
BASE_CHOICES = ("fp32", "int8-dynamic-pc", "int8-dynamic-pt", "int8-weight_only-pc")


@dataclass(frozen=True)
class Space:
    hot_layers: tuple[str, ...]
    layer_choices: tuple[str, ...]
    default_choices: tuple[str, ...]
    backends: tuple[str, ...]

    def suggest(self, trial: Any) -> Recipe:
        params = {"default": trial.suggest_categorical("default", self.default_choices)}
        for name in self.hot_layers:
            params[f"layer:{name}"] = trial.suggest_categorical(f"layer:{name}", self.layer_choices)
        params["backend"] = trial.suggest_categorical("backend", self.backends)
        return self.recipe(params)

    def recipe(self, params: dict[str, Any]) -> Recipe:
        rules: dict[str, LayerQuant] = {DEFAULT_KEY: LayerQuant.parse(params["default"])}
        for name in self.hot_layers:
            choice = params.get(f"layer:{name}", params["default"])
            if choice != params["default"]:
                rules[name] = LayerQuant.parse(choice)
        quant = Quantization.of(rules) if any(not c.is_identity for c in rules.values()) else Quantization()
        return Recipe(quantization=quant, backend=Backend(params["backend"]))

    def params(self, default: str, backend: str, **layers: str) -> dict[str, Any]:
        """Parameters for an enqueued trial: every hot layer follows ``default`` unless named."""
        out: dict[str, Any] = {"default": default, "backend": backend}
        for name in self.hot_layers:
            out[f"layer:{name}"] = layers.get(name, default)
        return out

    def params_for(self, recipe: Recipe) -> dict[str, Any] | None:
        """The parameters that give ``recipe`` in this space, or None when it cannot be said
        here (a layer choice outside the space, a rule on a layer that is not hot, another
        backend). Used to warm-start a study from another study's best recipes."""
        rules = dict(recipe.quantization.rules)
        default = rules.pop(DEFAULT_KEY, LayerQuant()).label()
        if default not in self.default_choices or recipe.backend.kind not in self.backends:
            return None
        if recipe.backend.mode != "default":
            return None
        layers: dict[str, str] = {}
        for key, choice in rules.items():
            if key not in self.hot_layers or choice.label() not in self.layer_choices:
                return None
            layers[key] = choice.label()
        params = self.params(default, recipe.backend.kind, **layers)
        return params if self.recipe(params) == recipe else None

    def baselines(self) -> list[dict[str, Any]]:
        """What every search tries first: fp32 compiled, and all-int8 per-channel compiled."""
        backend = "inductor" if "inductor" in self.backends else self.backends[0]
        out = [self.params("fp32", backend)] if backend == "inductor" else []
        for choice in ("int8-static-pc", "int8-dynamic-pc"):
            if choice in self.default_choices:
                out.append(self.params(choice, backend))
        return out

    @property
    def size(self) -> int:
        return len(self.default_choices) * len(self.layer_choices) ** len(self.hot_layers) * len(self.backends)

    def grid(self) -> Iterator[dict[str, Any]]:
        keys = ["default"] + [f"layer:{n}" for n in self.hot_layers] + ["backend"]
        pools: list[Sequence[str]] = (
            [self.default_choices] + [self.layer_choices] * len(self.hot_layers) + [self.backends]
        )
        for combo in itertools.product(*pools):
            yield dict(zip(keys, combo))

    def to_dict(self) -> dict[str, Any]:
        return {
            "hot_layers": list(self.hot_layers),
            "layer_choices": list(self.layer_choices),
            "default_choices": list(self.default_choices),
            "backends": list(self.backends),
            "size": self.size,
        }


def quantizable_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, QUANTIZABLE)]


def hot_layers(
    model: nn.Module,
    profile: Sequence[dict[str, Any]],
    *,
    coverage: float = 0.8,
    max_hot: int = 6,
) -> list[str]:
    """The quantizable layers that cover ``coverage`` of the quantizable layers' live time,
    hottest first, at most ``max_hot``."""
    candidates = set(quantizable_layers(model))
    rows = [r for r in profile if r["layer"] in candidates]
    rows.sort(key=lambda r: r.get("share", 0.0), reverse=True)
    total = sum(r.get("share", 0.0) for r in rows)
    chosen, acc = [], 0.0
    for r in rows:
        if len(chosen) >= max_hot or (total and acc >= coverage * total):
            break
        chosen.append(r["layer"])
        acc += r.get("share", 0.0)
    return chosen


def choices_for(hardware: Hardware) -> tuple[str, ...]:
    """Layer choices worth trying on this machine (bf16 only where there are bf16 units,
    fp16 only on a GPU); the search measures which of them are really fast."""
    out = list(BASE_CHOICES)
    if hardware.bf16_fast or hardware.cuda:
        out.append("bf16")
    if hardware.cuda:
        out.append("fp16")
    return tuple(out)


def build_space(
    model: nn.Module,
    profile: Sequence[dict[str, Any]],
    hardware: Hardware,
    *,
    coverage: float = 0.8,
    max_hot: int = 6,
    backends: Sequence[str] = ("inductor", "eager"),
) -> Space:
    choices = choices_for(hardware)
    return Space(
        hot_layers=tuple(hot_layers(model, profile, coverage=coverage, max_hot=max_hot)),
        layer_choices=choices,
        default_choices=choices,
        backends=tuple(backends),
    )
