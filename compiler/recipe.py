"""A recipe is data, not code: what to do to a model. ``compiler.build`` does it.

Each part is a frozen dataclass validated in ``__post_init__`` (``RecipeError``, a
``ValueError``) and has one transform registered for its type (see ``compiler._registry``).
A recipe round-trips through JSON exactly and has a stable hash, so the same recipe always
names the same variant in the store, the compile cache and the search.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import re2

from compiler._errors import RecipeError
from compiler.parts import (
    BACKEND_MODES,
    Backend,
    BackendKind,
    DynamicShapes,
    Fusion,
    Kernels,
    Layout,
    Partition,
    ShapeBuckets,
    choice,
    only_keys,
    values,
)

#: What this module offers; the backend's types live in ``compiler.parts`` and are named here
#: too, where they were first defined.
__all__ = [
    "BACKEND_MODES", "DEFAULT_KEY", "FP32", "GRANULARITIES", "MAX_KEY_CHARS", "PRECISIONS",
    "REGEX_MAX_MEM", "REGEX_PREFIX", "SCHEMES", "Backend", "BackendKind", "Granularity",
    "LayerQuant", "Precision", "Quantization", "Recipe", "Scheme",
]


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    #: float8 (e4m3) weights and dynamically scaled activations, one scale per row (torchao);
    #: CUDA GPUs of compute capability 8.9 or newer only (Ada, Hopper)
    FP8 = "fp8"
    INT8 = "int8"


class Scheme(StrEnum):
    DYNAMIC = "dynamic"
    STATIC = "static"
    WEIGHT_ONLY = "weight_only"


class Granularity(StrEnum):
    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"


PRECISIONS = values(Precision)
SCHEMES = values(Scheme)
GRANULARITIES = values(Granularity)
DEFAULT_KEY = "_default"
REGEX_PREFIX = "re:"
#: Longest layer key accepted (module names are far shorter; a key is matched against every
#: module name of the model, in the serving process when the agent builds a variant).
MAX_KEY_CHARS = 256
#: Memory RE2 may use for one compiled key (its program and DFA cache); a key that needs more
#: is refused rather than matched slowly.
REGEX_MAX_MEM = 1 << 20


@dataclass(frozen=True)
class LayerQuant:
    """What to do to one layer's arithmetic.

    ``precision`` is the number format; for ``int8`` a ``scheme`` is required (``dynamic``:
    activations quantized per call; ``static``: activation scales calibrated ahead of time;
    ``weight_only``: int8 weights, float activations) and ``granularity`` says whether weights
    get one scale (``per_tensor``) or one per output channel (``per_channel``).
    """

    precision: Precision = Precision.FP32
    scheme: Scheme | None = None
    granularity: Granularity = Granularity.PER_CHANNEL

    def __post_init__(self) -> None:
        precision = choice(
            Precision, self.precision, f"precision must be one of {PRECISIONS}, not {self.precision!r}"
        )
        object.__setattr__(self, "precision", precision)
        if precision is Precision.INT8:
            scheme = choice(
                Scheme, self.scheme, f"int8 needs a scheme from {SCHEMES}, not {self.scheme!r}"
            )
            object.__setattr__(self, "scheme", scheme)
        elif self.scheme is not None:
            raise RecipeError(f"scheme {self.scheme!r} only applies to int8, not {precision}")
        granularity = choice(
            Granularity,
            self.granularity,
            f"granularity must be one of {GRANULARITIES}, not {self.granularity!r}",
        )
        object.__setattr__(self, "granularity", granularity)

    @property
    def is_identity(self) -> bool:
        return self.precision is Precision.FP32

    def label(self) -> str:
        if self.precision is not Precision.INT8:
            return self.precision.value
        gran = "pc" if self.granularity is Granularity.PER_CHANNEL else "pt"
        return f"int8-{self.scheme}-{gran}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": self.precision.value}
        if self.precision is Precision.INT8:
            out["scheme"] = self.scheme.value if self.scheme is not None else None
            out["granularity"] = self.granularity.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerQuant:
        only_keys(data, {"precision", "scheme", "granularity"}, "layer choice")
        return cls(**dict(data))

    @classmethod
    def parse(cls, text: str) -> LayerQuant:
        """Parse a label as written by :meth:`label` (``int8-dynamic-pc``, ``bf16``, ...)."""
        if text in ("fp32", "fp16", "bf16", "fp8"):
            return cls(precision=text)
        parts = text.split("-")
        if len(parts) == 3 and parts[0] == "int8":
            gran = {"pc": "per_channel", "pt": "per_tensor"}.get(parts[2])
            if gran is not None:
                return cls(precision="int8", scheme=parts[1], granularity=gran)
        raise RecipeError(f"not a layer choice: {text!r} (e.g. fp32, bf16, fp8, int8-dynamic-pc)")


FP32 = LayerQuant()


@functools.lru_cache(maxsize=1024)
def _layer_regex(pattern: str) -> Any:
    """The compiled RE2 program of a layer key's pattern (cached: a recipe's keys are
    compiled when it is validated, and matching every module name reuses them)."""
    options = re2.Options()
    options.log_errors = False  # refused keys are reported as RecipeError, not on stderr
    options.max_mem = REGEX_MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise RecipeError(f"bad regex in {REGEX_PREFIX + pattern!r}: {why}") from None


@dataclass(frozen=True)
class Quantization:
    """Per-layer choices by qualified module name.

    Keys, in increasing match priority: ``_default`` (every layer), ``re:<pattern>``
    (a full match on the module name; the first matching pattern in order wins), and an
    exact module name. Layers nothing matches stay fp32.

    Patterns are RE2 syntax and matched by RE2 (``google-re2``), which never backtracks: the
    time to match is linear in the name whatever the pattern, so a key cannot stall the
    process that builds the variant (Python's ``re`` took 35 s per module name for a
    24-character key with ten ``.*``). RE2 lacks look-around and backreferences; such keys,
    keys RE2 cannot compile within :data:`REGEX_MAX_MEM`, and keys longer than
    :data:`MAX_KEY_CHARS` are refused here (``RecipeError``). Each pattern is compiled once
    per process (:func:`_layer_regex`), at validation, and reused for every module name.
    """

    rules: tuple[tuple[str, LayerQuant], ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        defaults, regexes, exact = [], [], []
        for key, rule in self.rules:
            if not isinstance(key, str) or not key:
                raise RecipeError(f"layer keys must be non-empty strings, not {key!r}")
            if len(key) > MAX_KEY_CHARS:
                raise RecipeError(
                    f"layer key {key[:40]!r}... is {len(key)} characters; at most {MAX_KEY_CHARS}"
                )
            if not isinstance(rule, LayerQuant):
                raise RecipeError(f"rule {key!r} must map to a LayerQuant, not {rule!r}")
            if key in seen:
                raise RecipeError(f"layer key {key!r} appears twice")
            seen.add(key)
            if key == DEFAULT_KEY:
                defaults.append((key, rule))
            elif key.startswith(REGEX_PREFIX):
                _layer_regex(key[len(REGEX_PREFIX) :])  # RecipeError if RE2 refuses it
                regexes.append((key, rule))
            else:
                exact.append((key, rule))
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
        for key, rule in self.rules:
            if key.startswith(REGEX_PREFIX) and _layer_regex(key[len(REGEX_PREFIX) :]).fullmatch(name):
                return rule, key
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
    dynamic: DynamicShapes = field(default_factory=DynamicShapes)

    VERSION: ClassVar[int] = 1
    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = ("quantization", "backend")
    APPLY_ORDER: ClassVar[tuple[str, ...]] = (
        "fusion", "layout", "kernels", "quantization", "partition", "dynamic", "backend",
        "buckets",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = _PART_TYPES[f.name]
            if not isinstance(value, expected):
                raise RecipeError(f"recipe part {f.name!r} must be {expected.__name__}")
        if not self.buckets.is_identity and not self.dynamic.is_identity:
            raise RecipeError(
                "a recipe takes shape buckets or dynamic shapes, not both (two answers to "
                "variable-length inputs)"
            )

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
        back = self.backend.label()
        extras = [
            part.label()
            for part in (self.fusion, self.layout, self.kernels, self.buckets, self.dynamic,
                         self.partition)
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
    "dynamic": DynamicShapes,
}
