"""The recipe as a request body, derived from the compiler's own types.

Every choice (precision, scheme, granularity, backend kind and mode, layout, kernels,
partition) is a ``Literal`` of the words of the compiler's enum, and the defaults, the
backend-mode table and the bucket limit are the compiler's, so the OpenAPI document cannot
drift from what :meth:`compiler.Recipe.from_dict` takes. The body adds what JSON Schema can say
and the compiler checks in code (``int8`` needs a scheme, a mode belongs to one backend, layer
keys are valid regexes), so that generated bodies are valid recipes;
:meth:`RecipeBody.to_recipe` hands the result to the compiler, which stays the judge.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StringConstraints,
    create_model,
    model_validator,
)

from compiler import Recipe
from compiler.parts import AUTOCAST_DTYPES, MAX_BUCKETS, Kernels, Layout, Partition
from compiler.recipe import (
    BACKEND_MODES,
    Backend,
    BackendKind,
    Granularity,
    LayerQuant,
    Precision,
    Scheme,
)
from pgc_daemon.api.schemas._common import STRICT, _integral


def words(*members: StrEnum) -> Any:
    """``Literal`` of the members' words: what the JSON schema lists and a strict body takes."""
    return Literal[tuple(m.value for m in members)]  # type: ignore[valid-type]


#: A layer key: ``_default``, a module's qualified name, or ``re:`` and a pattern made of
#: names, ``\.``, ``.``, ``.*``, ``.+``, ``\d`` and ``\d+`` (always a valid regex).
LAYER_KEY_PATTERN = r"^(?:[A-Za-z0-9_][A-Za-z0-9_.\-]*|re:(?:[A-Za-z0-9_\-]|\\\.|\.\*|\.\+|\.|\\d\+|\\d)+)$"
LayerKey = Annotated[str, StringConstraints(pattern=LAYER_KEY_PATTERN, max_length=300)]

_GRANULARITY = words(*Granularity)
_DEFAULT_GRANULARITY = LayerQuant().granularity.value


class FloatChoice(BaseModel):
    model_config = STRICT
    precision: words(*(p for p in Precision if p is not Precision.INT8))  # type: ignore[valid-type]
    granularity: _GRANULARITY = _DEFAULT_GRANULARITY  # type: ignore[valid-type]


class Int8Choice(BaseModel):
    model_config = STRICT
    precision: words(Precision.INT8)  # type: ignore[valid-type]
    scheme: words(*Scheme)  # type: ignore[valid-type]
    granularity: _GRANULARITY = _DEFAULT_GRANULARITY  # type: ignore[valid-type]


LayerChoice = Annotated[FloatChoice | Int8Choice, Field(discriminator="precision")]


def _keys_by_pattern(schema: dict[str, Any]) -> None:
    # pydantic writes a key pattern as ``patternProperties``, which lets other keys through;
    # the server refuses them, so the schema must too.
    pattern_props = schema.pop("patternProperties", {})
    if pattern_props:
        schema["additionalProperties"] = next(iter(pattern_props.values()))
    schema["propertyNames"] = {"pattern": LAYER_KEY_PATTERN, "maxLength": 300}


def _backend_body(kind: BackendKind) -> type[BaseModel]:
    """One body per backend kind, with the modes that kind takes; the default backend's
    ``kind`` may be left out."""
    modes = BACKEND_MODES[kind]
    kind_default: Any = kind.value if kind is Backend().kind else ...
    extra: dict[str, Any] = {}
    if kind is BackendKind.INDUCTOR:
        extra["autocast"] = (Literal[AUTOCAST_DTYPES] | None, None)  # type: ignore[valid-type]
    return create_model(  # type: ignore[call-overload, no-any-return]
        f"{kind.name.title().replace('_', '')}Backend",
        __config__=STRICT,
        kind=(words(kind), kind_default),
        mode=(words(*modes), modes[0].value),
        **extra,
    )


BACKEND_BODIES: dict[BackendKind, type[BaseModel]] = {k: _backend_body(k) for k in BackendKind}
BackendBody = Union[tuple(BACKEND_BODIES.values())]  # type: ignore[valid-type]  # noqa: UP007


class FusionBody(BaseModel):
    model_config = STRICT
    conv_bn: bool = False
    conv_bn_relu: bool = Field(False, description="implies conv_bn (the BatchNorm is folded first)")
    linear_act: bool = False

    @model_validator(mode="after")
    def _relu_needs_bn(self) -> FusionBody:
        if self.conv_bn_relu:
            self.conv_bn = True
        return self


class LayoutBody(BaseModel):
    model_config = STRICT
    memory_format: words(*type(Layout().memory_format)) = Layout().memory_format.value  # type: ignore[valid-type]


class KernelsBody(BaseModel):
    model_config = STRICT
    linear: words(*type(Kernels().linear)) = Kernels().linear.value  # type: ignore[valid-type]


class BucketsBody(BaseModel):
    model_config = STRICT
    sizes: list[Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(_integral)]] = Field(
        default_factory=list,
        max_length=MAX_BUCKETS,
        json_schema_extra={"uniqueItems": True},
        description="distinct bucket lengths (taken in increasing order)",
    )
    dim: Annotated[int, Field(ge=0, le=16), BeforeValidator(_integral)] = 1
    pad_value: Annotated[int, Field(ge=-(2**31), le=2**31 - 1), BeforeValidator(_integral)] = 0

    @model_validator(mode="after")
    def _sorted(self) -> BucketsBody:
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError("bucket sizes must be distinct")
        self.sizes = sorted(self.sizes)
        return self


class PartitionBody(BaseModel):
    model_config = STRICT
    strategy: words(*type(Partition().strategy)) = Partition().strategy.value  # type: ignore[valid-type]


class RecipeBody(BaseModel):
    """A recipe as ``compiler.Recipe.to_dict`` writes it: per-layer choices by key (in
    increasing priority: ``_default``, ``re:`` patterns in order, exact names), a backend, and
    the optional graph parts (fusion, layout, kernels, shape buckets, partition)."""

    model_config = STRICT
    version: Literal[Recipe.VERSION] = Recipe.VERSION  # type: ignore[valid-type]
    quantization: dict[LayerKey, LayerChoice] = Field(
        default_factory=dict, max_length=200, json_schema_extra=_keys_by_pattern
    )
    backend: BackendBody = Field(default_factory=BACKEND_BODIES[Backend().kind])  # type: ignore[valid-type]
    fusion: FusionBody | None = None
    layout: LayoutBody | None = None
    kernels: KernelsBody | None = None
    buckets: BucketsBody | None = None
    partition: PartitionBody | None = None

    def to_recipe(self) -> Recipe:
        """The compiler's recipe (``RecipeError`` if it refuses what the schema let through)."""
        return Recipe.from_dict(self.model_dump(exclude_none=True))
