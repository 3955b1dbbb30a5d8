"""A recipe is data, not code: what to do to a model. ``compiler.build`` does it.

Each part is a frozen dataclass validated in ``__post_init__`` (``RecipeError``, a
``ValueError``) and has one transform registered for its type (see ``compiler._registry``).
A recipe round-trips through JSON exactly and has a stable hash, so the same recipe always
names the same variant in the store, the compile cache and the search.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from compiler._errors import RecipeError
from compiler.parts import Fusion, Kernels, Layout, Partition, ShapeBuckets, only_keys

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
SCHEMES = ("dynamic", "static", "weight_only")
GRANULARITIES = ("per_tensor", "per_channel")
BACKENDS = ("eager", "inductor", "onnxruntime")
MODES = ("default", "max-autotune")
DEFAULT_KEY = "_default"
REGEX_PREFIX = "re:"


@dataclass(frozen=True)
class LayerQuant:
    """What to do to one layer's arithmetic.

    ``precision`` is the number format; for ``int8`` a ``scheme`` is required (``dynamic``:
    activations quantized per call; ``static``: activation scales calibrated ahead of time;
    ``weight_only``: int8 weights, float activations) and ``granularity`` says whether weights
    get one scale (``per_tensor``) or one per output channel (``per_channel``).
    """

    precision: str = "fp32"
    scheme: str | None = None
    granularity: str = "per_channel"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise RecipeError(f"precision must be one of {PRECISIONS}, not {self.precision!r}")
        if self.precision == "int8":
            if self.scheme not in SCHEMES:
                raise RecipeError(f"int8 needs a scheme from {SCHEMES}, not {self.scheme!r}")
        elif self.scheme is not None:
            raise RecipeError(f"scheme {self.scheme!r} only applies to int8, not {self.precision}")
        if self.granularity not in GRANULARITIES:
            raise RecipeError(
                f"granularity must be one of {GRANULARITIES}, not {self.granularity!r}"
            )

    @property
    def is_identity(self) -> bool:
        return self.precision == "fp32"

    def label(self) -> str:
        if self.precision != "int8":
            return self.precision
        gran = "pc" if self.granularity == "per_channel" else "pt"
        return f"int8-{self.scheme}-{gran}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": self.precision}
        if self.precision == "int8":
            out["scheme"] = self.scheme
            out["granularity"] = self.granularity
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerQuant:
        only_keys(data, {"precision", "scheme", "granularity"}, "layer choice")
        return cls(**dict(data))

    @classmethod
    def parse(cls, text: str) -> LayerQuant:
        """Parse a label as written by :meth:`label` (``int8-dynamic-pc``, ``bf16``, ...)."""
        if text in ("fp32", "fp16", "bf16"):
            return cls(precision=text)
        parts = text.split("-")
        if len(parts) == 3 and parts[0] == "int8":
            gran = {"pc": "per_channel", "pt": "per_tensor"}.get(parts[2])
            if gran is not None:
                return cls(precision="int8", scheme=parts[1], granularity=gran)
        raise RecipeError(f"not a layer choice: {text!r} (e.g. fp32, bf16, int8-dynamic-pc)")


FP32 = LayerQuant()


@dataclass(frozen=True)
class Quantization:
    """Per-layer choices by qualified module name.

    Keys, in increasing match priority: ``_default`` (every layer), ``re:<pattern>``
    (``re.fullmatch`` on the module name; the first matching pattern in order wins), and an
    exact module name. Layers nothing matches stay fp32.
    """

    rules: tuple[tuple[str, LayerQuant], ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        defaults, regexes, exact = [], [], []
        for key, choice in self.rules:
            if not isinstance(key, str) or not key:
                raise RecipeError(f"layer keys must be non-empty strings, not {key!r}")
            if not isinstance(choice, LayerQuant):
                raise RecipeError(f"rule {key!r} must map to a LayerQuant, not {choice!r}")
            if key in seen:
                raise RecipeError(f"layer key {key!r} appears twice")
            seen.add(key)
            if key == DEFAULT_KEY:
                defaults.append((key, choice))
            elif key.startswith(REGEX_PREFIX):
                try:
                    re.compile(key[len(REGEX_PREFIX) :])
                except re.error as exc:
                    raise RecipeError(f"bad regex in {key!r}: {exc}") from None
                regexes.append((key, choice))
            else:
                exact.append((key, choice))
        # Canonical order: default, regexes as given (their order is their priority), then
        # exact names sorted (their order does not matter), so equal recipes hash equal.
        object.__setattr__(self, "rules", tuple(defaults + regexes + sorted(exact)))

    @classmethod
    def of(cls, mapping: Mapping[str, LayerQuant | str | Mapping[str, Any]]) -> Quantization:
        rules = []
        for key, value in mapping.items():
            if isinstance(value, str):
                value = LayerQuant.parse(value)
            elif isinstance(value, Mapping):
                value = LayerQuant.from_dict(value)
            rules.append((key, value))
        return cls(tuple(rules))

    def choice_for(self, name: str) -> tuple[LayerQuant, str | None]:
        """The choice for a module name and the key that decided it (None: nothing matched)."""
        table = dict(self.rules)
        if name in table:
            return table[name], name
        for key, choice in self.rules:
            if key.startswith(REGEX_PREFIX) and re.fullmatch(key[len(REGEX_PREFIX) :], name):
                return choice, key
        if DEFAULT_KEY in table:
            return table[DEFAULT_KEY], DEFAULT_KEY
        return FP32, None

    @property
    def is_identity(self) -> bool:
        return all(choice.is_identity for _, choice in self.rules)

    def to_dict(self) -> dict[str, Any]:
        return {key: choice.to_dict() for key, choice in self.rules}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Quantization:
        if not isinstance(data, Mapping):
            raise RecipeError("quantization must be an object of layer key -> choice")
        return cls.of(data)


@dataclass(frozen=True)
class Backend:
    """How the transformed module runs: eager PyTorch, compiled by Inductor (``default`` or
    ``max-autotune``), or exported to ONNX and run by ONNX Runtime (optional: needs the
    ``onnx`` extra; int8 layers are then quantized by ONNX Runtime's own quantizer)."""

    kind: str = "eager"
    mode: str = "default"

    def __post_init__(self) -> None:
        if self.kind not in BACKENDS:
            raise RecipeError(f"backend must be one of {BACKENDS}, not {self.kind!r}")
        if self.mode not in MODES:
            raise RecipeError(f"backend mode must be one of {MODES}, not {self.mode!r}")
        if self.kind == "eager" and self.mode != "default":
            raise RecipeError("backend mode applies to inductor only")
        if self.kind == "onnxruntime" and self.mode != "default":
            raise RecipeError("backend mode applies to inductor only")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "mode": self.mode}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Backend:
        only_keys(data, {"kind", "mode"}, "backend")
        return cls(**dict(data))


@dataclass(frozen=True)
class Recipe:
    """A whole variant: each field is one part.

    ``compiler.build`` applies the parts in :attr:`APPLY_ORDER` (graph rewrites, then
    precision, then compilation, then the shape-bucket wrapper outermost), not in field order:
    fields are in the order they were added, which keeps ``to_dict`` (and so the hash) of
    older recipes unchanged. Parts after ``backend`` are left out of ``to_dict`` while they are
    at their default.
    """

    quantization: Quantization = field(default_factory=Quantization)
    backend: Backend = field(default_factory=Backend)
    fusion: Fusion = field(default_factory=Fusion)
    layout: Layout = field(default_factory=Layout)
    kernels: Kernels = field(default_factory=Kernels)
    buckets: ShapeBuckets = field(default_factory=ShapeBuckets)
    partition: Partition = field(default_factory=Partition)

    VERSION: ClassVar[int] = 1
    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = ("quantization", "backend")
    APPLY_ORDER: ClassVar[tuple[str, ...]] = (
        "fusion", "layout", "kernels", "quantization", "partition", "backend", "buckets",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = _PART_TYPES[f.name]
            if not isinstance(value, expected):
                raise RecipeError(f"recipe part {f.name!r} must be {expected.__name__}")

    def parts(self) -> list[Any]:
        """The parts in the order ``build`` applies them."""
        return [getattr(self, name) for name in self.APPLY_ORDER]

    @property
    def is_identity(self) -> bool:
        return self.quantization.is_identity and all(
            getattr(self, f.name) == f.default_factory()  # type: ignore[misc, operator]
            for f in dataclasses.fields(self)
            if f.name != "quantization"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.ALWAYS_WRITTEN or value != f.default_factory():  # type: ignore[misc, operator]
                out[f.name] = value.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        if not isinstance(data, Mapping):
            raise RecipeError("a recipe must be a JSON object")
        version = data.get("version", cls.VERSION)
        if version != cls.VERSION:
            raise RecipeError(f"recipe version {version!r} is not supported (expected 1)")
        only_keys(data, {"version", *_PART_TYPES}, "recipe")
        kwargs = {
            name: _PART_TYPES[name].from_dict(data[name]) for name in _PART_TYPES if name in data
        }
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"recipe is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @property
    def hash(self) -> str:
        """SHA-256 of the canonical JSON: equal recipes, equal hashes, across processes.
        ``to_dict`` is already canonical (fixed field order, rules normalized in
        ``Quantization``); keys are not sorted, since regex order is priority."""
        canonical = json.dumps(self.to_dict(), separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def label(self) -> str:
        """A short human name, e.g. ``int8-dynamic-pc+2 fp32 · inductor``."""
        q = self.quantization
        if q.is_identity:
            head = "fp32"
        else:
            default = dict(q.rules).get(DEFAULT_KEY, FP32)
            others = [c for k, c in q.rules if k != DEFAULT_KEY]
            head = default.label()
            if others:
                counts: dict[str, int] = {}
                for c in others:
                    counts[c.label()] = counts.get(c.label(), 0) + 1
                head += "+" + ",".join(f"{n} {lbl}" for lbl, n in sorted(counts.items()))
        back = self.backend.kind if self.backend.mode == "default" else f"{self.backend.kind}-max"
        extras = [
            part.label()
            for part in (self.fusion, self.layout, self.kernels, self.buckets, self.partition)
            if part.label()
        ]
        return " · ".join([head, back, *extras])


_PART_TYPES: dict[str, Any] = {
    "quantization": Quantization,
    "backend": Backend,
    "fusion": Fusion,
    "layout": Layout,
    "kernels": Kernels,
    "buckets": ShapeBuckets,
    "partition": Partition,
}
