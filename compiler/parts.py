"""Recipe parts beyond per-layer precision: the backend, fusion, layout, hand-written kernels,
shape buckets, dynamic shapes and partition strategy.

Each part is a frozen dataclass validated in ``__post_init__`` (``RecipeError``, a
``ValueError``) with ``to_dict``/``from_dict`` and one transform registered for its type. Every
part's default does nothing, and ``Recipe.to_dict`` leaves a part out while it is at its
default, so recipes written before these parts existed keep their JSON and their hash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from compiler._errors import RecipeError

E = TypeVar("E", bound=StrEnum)


class MemoryFormat(StrEnum):
    CONTIGUOUS = "contiguous"
    CHANNELS_LAST = "channels_last"


class PartitionStrategy(StrEnum):
    LATENCY = "latency"
    MEMORY = "memory"


class LinearKernel(StrEnum):
    DEFAULT = "default"
    TRITON = "triton"


class BackendKind(StrEnum):
    EAGER = "eager"
    INDUCTOR = "inductor"
    ONNXRUNTIME = "onnxruntime"
    OPENVINO = "openvino"


class BackendMode(StrEnum):
    DEFAULT = "default"
    MAX_AUTOTUNE = "max-autotune"
    F32 = "f32"  # OpenVINO in fp32 (its default: the device's default precision, e.g. bf16)


def values(kind: type[StrEnum]) -> tuple[str, ...]:
    """The JSON words of a choice, in declaration order."""
    return tuple(member.value for member in kind)


MEMORY_FORMATS = values(MemoryFormat)
PARTITION_STRATEGIES = values(PartitionStrategy)
LINEAR_KERNELS = values(LinearKernel)
MAX_BUCKETS = 16
BACKENDS = values(BackendKind)
MODES = values(BackendMode)
#: The modes each backend takes (the first is its default); the API's recipe body says the same.
BACKEND_MODES: dict[BackendKind, tuple[BackendMode, ...]] = {
    BackendKind.EAGER: (BackendMode.DEFAULT,),
    BackendKind.INDUCTOR: (BackendMode.DEFAULT, BackendMode.MAX_AUTOTUNE),
    BackendKind.ONNXRUNTIME: (BackendMode.DEFAULT,),
    BackendKind.OPENVINO: (BackendMode.DEFAULT, BackendMode.F32),
}
#: How a non-default mode is written after the backend's kind in labels (``inductor-max``,
#: ``openvino-f32``); :meth:`Backend.label` and :meth:`Backend.parse` are the one mapping.
MODE_TAGS: dict[BackendMode, str] = {BackendMode.MAX_AUTOTUNE: "max", BackendMode.F32: "f32"}
#: What Inductor may run under CPU autocast: the ops a pt2e int8 graph leaves float (attention's
#: matmuls, the glue between int8 kernels), which Inductor then lowers to int8 kernels with
#: bf16 between them. Written ``+bf16`` after the rest of a label (``inductor-max+bf16``).
AUTOCAST_DTYPES = ("bf16",)


def choice(kind: type[E], value: object, message: str) -> E:
    """``value`` as a member of ``kind`` (its JSON word or the member itself); ``RecipeError``
    with ``message`` otherwise. The members are ``StrEnum``s, so they compare, hash, format
    and serialize as their words: recipe JSON and hashes are the same as with plain strings."""
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    raise RecipeError(message)


def only_keys(data: Mapping[str, Any], allowed: set[str], what: str) -> None:
    if not isinstance(data, Mapping):
        raise RecipeError(f"{what} must be a JSON object")
    extra = set(data) - allowed
    if extra:
        raise RecipeError(f"unknown {what} field(s): {', '.join(sorted(extra))}")


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise RecipeError(f"{name} must be true or false, not {value!r}")
    return value


@dataclass(frozen=True)
class Backend:
    """How the transformed module runs: eager PyTorch, compiled by Inductor (``default`` or
    ``max-autotune``), or (optional extras) ONNX Runtime or OpenVINO (``default``: the device's
    default precision; ``f32``), whose own quantizers (NNCF for OpenVINO) make int8 layers.

    ``autocast`` (Inductor only): run the model under CPU autocast in that dtype, so what the
    recipe's precisions leave fp32 (attention, and everything between int8 layers) runs in
    bf16 where autocast's op lists say so. Left out of ``to_dict`` when unset, so the hashes
    of recipes without it are what they were."""

    kind: BackendKind = BackendKind.EAGER
    mode: BackendMode = BackendMode.DEFAULT
    autocast: str | None = None

    def __post_init__(self) -> None:
        kind = choice(BackendKind, self.kind, f"backend must be one of {BACKENDS}, not {self.kind!r}")
        mode = choice(BackendMode, self.mode, f"backend mode must be one of {MODES}, not {self.mode!r}")
        if mode not in BACKEND_MODES[kind]:
            allowed = ", ".join(m.value for m in BACKEND_MODES[kind])
            raise RecipeError(f"backend {kind} takes mode {allowed}, not {mode}")
        if self.autocast is not None:
            if self.autocast not in AUTOCAST_DTYPES:
                raise RecipeError(
                    f"backend autocast must be one of {AUTOCAST_DTYPES}, not {self.autocast!r}")
            if kind is not BackendKind.INDUCTOR:
                raise RecipeError(f"autocast applies to the inductor backend only, not {kind}")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "mode", mode)

    def label(self) -> str:
        """``inductor``, ``inductor-max``, ``openvino-f32``, ``inductor-max+bf16``, ...: the
        kind, the mode's tag unless it is the default, and the autocast dtype if any."""
        tag = MODE_TAGS.get(self.mode)
        out = self.kind.value if tag is None else f"{self.kind.value}-{tag}"
        return out if self.autocast is None else f"{out}+{self.autocast}"

    @classmethod
    def parse(cls, text: str) -> Backend:
        """The backend a :meth:`label` names."""
        head, plus, autocast = text.partition("+")
        kind, _, tag = head.partition("-")
        mode = next((m for m, t in MODE_TAGS.items() if t == tag), None if tag else BackendMode.DEFAULT)
        if mode is None or (plus and not autocast):
            raise RecipeError(f"not a backend label: {text!r} (e.g. inductor, inductor-max, "
                              "openvino-f32, inductor+bf16)")
        return cls(kind, mode, autocast or None)

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind.value, "mode": self.mode.value}
        if self.autocast is not None:
            out["autocast"] = self.autocast
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Backend:
        only_keys(data, {"kind", "mode", "autocast"}, "backend")
        return cls(**dict(data))


@dataclass(frozen=True)
class Fusion:
    """Operator fusions done before quantization and compilation.

    ``conv_bn`` folds an eval-mode BatchNorm into the convolution before it (exact up to
    rounding); ``conv_bn_relu`` also runs the ReLU after it inside the convolution's kernel
    (needs ``conv_bn``); ``linear_act`` runs a Linear and the activation after it (ReLU, GELU,
    SiLU, tanh) as one kernel; ``linear_siblings`` runs linears of one parent that read the
    same tensor (query, key, value) as one linear (``compiler._siblings``; compiled recipes);
    ``conv_gemm`` runs each plain convolution as one GEMM over its receptive fields
    (``compiler._conv_gemm``: im2col; compiled recipes, after ``conv_bn`` where both are on).
    Which kernel does the fused work depends on the machine and the backend and is written to
    the build report (Inductor fuses epilogues itself; eager on x86 uses oneDNN's fused
    pointwise kernels where they measure faster).
    """

    conv_bn: bool = False
    conv_bn_relu: bool = False
    linear_act: bool = False
    linear_siblings: bool = False
    conv_gemm: bool = False

    NAMES: ClassVar[tuple[str, ...]] = ("conv_bn", "conv_bn_relu", "linear_act", "linear_siblings",
                                        "conv_gemm")

    def __post_init__(self) -> None:
        for name in self.NAMES:
            _bool(getattr(self, name), f"fusion.{name}")
        if self.conv_bn_relu and not self.conv_bn:
            raise RecipeError("fusion.conv_bn_relu needs conv_bn (the BatchNorm is folded first)")

    @property
    def is_identity(self) -> bool:
        return not any(getattr(self, n) for n in self.NAMES)

    def label(self) -> str:
        names = [n for n in self.NAMES if getattr(self, n)]
        return "fuse:" + "+".join(names) if names else ""

    def to_dict(self) -> dict[str, Any]:
        out = {"conv_bn": self.conv_bn, "conv_bn_relu": self.conv_bn_relu, "linear_act": self.linear_act}
        for name in ("linear_siblings", "conv_gemm"):  # written only when on: older recipes
            if getattr(self, name):  # keep their hashes
                out[name] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fusion:
        only_keys(data, set(cls.NAMES), "fusion")
        return cls(**dict(data))


@dataclass(frozen=True)
class Layout:
    """Memory format of 4-D activations and convolution weights: ``contiguous`` (NCHW) or
    ``channels_last`` (NHWC, what oneDNN and cuDNN convolutions prefer). Inputs are converted
    on the way in; outputs come back in whatever format the last layer produced (values are
    the same)."""

    memory_format: MemoryFormat = MemoryFormat.CONTIGUOUS

    def __post_init__(self) -> None:
        fmt = choice(
            MemoryFormat,
            self.memory_format,
            f"layout must be one of {MEMORY_FORMATS}, not {self.memory_format!r}",
        )
        object.__setattr__(self, "memory_format", fmt)

    @property
    def is_identity(self) -> bool:
        return self.memory_format is MemoryFormat.CONTIGUOUS

    def label(self) -> str:
        return "" if self.is_identity else self.memory_format.value

    def to_dict(self) -> dict[str, Any]:
        return {"memory_format": self.memory_format.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        only_keys(data, {"memory_format"}, "layout")
        return cls(**dict(data))


@dataclass(frozen=True)
class Kernels:
    """Hand-written kernels to use where they apply.

    ``linear="triton"``: on a CUDA device, layers the quantization part makes int8 weight-only
    run pgc's fused Triton kernel (int8 weights dequantized in registers inside the matmul,
    bias and a following ReLU/GELU fused into its epilogue). Elsewhere (no CUDA, no Triton)
    the layers keep the default path and the report says why; Triton is never imported on a
    CPU build.
    """

    linear: LinearKernel = LinearKernel.DEFAULT

    def __post_init__(self) -> None:
        kernel = choice(
            LinearKernel,
            self.linear,
            f"kernels.linear must be one of {LINEAR_KERNELS}, not {self.linear!r}",
        )
        object.__setattr__(self, "linear", kernel)

    @property
    def is_identity(self) -> bool:
        return self.linear is LinearKernel.DEFAULT

    def label(self) -> str:
        return "" if self.is_identity else f"{self.linear.value}-linear"

    def to_dict(self) -> dict[str, Any]:
        return {"linear": self.linear.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Kernels:
        only_keys(data, {"linear"}, "kernels")
        return cls(**dict(data))


@dataclass(frozen=True)
class ShapeBuckets:
    """Pad variable-length inputs up to the nearest bucket so that a compiled variant sees a
    few shapes only (one compile per bucket, not per length).

    ``sizes`` are the bucket lengths, increasing (empty: off); ``dim`` the axis that varies
    (1: the sequence of ``[batch, seq]`` token inputs); ``pad_value`` what padding holds (0:
    BERT's ``[PAD]`` id and "masked" in an attention mask, so padded tokens are ignored by a
    model that honours its mask). Every tensor input whose ``dim`` has the same length as the
    first tensor input's is padded. Outputs come back unpadded: token-level outputs (those
    whose ``dim`` follows the input length) are cut back to the input length; pooled outputs
    are returned as they are. Inputs longer than the largest bucket run unpadded.
    """

    sizes: tuple[int, ...] = ()
    dim: int = 1
    pad_value: int = 0

    def __post_init__(self) -> None:
        sizes = self.sizes
        if isinstance(sizes, list):
            sizes = tuple(sizes)
            object.__setattr__(self, "sizes", sizes)
        if not isinstance(sizes, tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in sizes
        ):
            raise RecipeError(f"buckets.sizes must be a list of integers, not {self.sizes!r}")
        if any(s <= 0 for s in sizes):
            raise RecipeError("bucket sizes must be positive")
        if list(sizes) != sorted(set(sizes)):
            raise RecipeError(f"bucket sizes must be strictly increasing, not {list(sizes)}")
        if len(sizes) > MAX_BUCKETS:
            raise RecipeError(f"at most {MAX_BUCKETS} buckets (each one is a compile)")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise RecipeError(f"buckets.dim must be a non-negative integer, not {self.dim!r}")
        if not isinstance(self.pad_value, int) or isinstance(self.pad_value, bool):
            raise RecipeError(f"buckets.pad_value must be an integer, not {self.pad_value!r}")

    @property
    def is_identity(self) -> bool:
        return not self.sizes

    def bucket_for(self, length: int) -> int | None:
        """The smallest bucket that holds ``length`` (None: longer than every bucket)."""
        for size in self.sizes:
            if size >= length:
                return size
        return None

    def label(self) -> str:
        return "" if self.is_identity else "buckets " + "/".join(str(s) for s in self.sizes)

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "dim": self.dim, "pad_value": self.pad_value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShapeBuckets:
        only_keys(data, {"sizes", "dim", "pad_value"}, "buckets")
        kwargs = dict(data)
        if "sizes" in kwargs:
            if not isinstance(kwargs["sizes"], (list, tuple)):
                raise RecipeError("buckets.sizes must be a list of integers")
            kwargs["sizes"] = tuple(kwargs["sizes"])
        return cls(**kwargs)


@dataclass(frozen=True)
class DynamicShapes:
    """Compile one axis of the inputs as dynamic, so that one compiled graph serves every
    length along it (variable-length text served unpadded) instead of one graph per length.

    ``dim``: the axis (1: the sequence of ``[batch, seq]`` token inputs; None: off). Every
    tensor input whose ``dim`` has the same length as the first tensor input's gets it. A
    package is exported with that axis symbolic (``torch.export.Dim``) and checked against the
    model at several lengths; ``torch.compile`` compiles with ``dynamic=True``; ONNX Runtime
    and OpenVINO graphs have every axis dynamic already. A model that fixes the axis (a
    position table sized to one length, a reshape to a constant) gets no package (the report
    says why) and is compiled by ``torch.compile`` for the lengths it takes.
    """

    dim: int | None = None

    def __post_init__(self) -> None:
        if self.dim is not None and (
            not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0
        ):
            raise RecipeError(f"dynamic.dim must be a non-negative integer, not {self.dim!r}")

    @property
    def is_identity(self) -> bool:
        return self.dim is None

    def label(self) -> str:
        return "" if self.is_identity else f"dynamic dim {self.dim}"

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DynamicShapes:
        if not isinstance(data, Mapping):
            raise RecipeError("dynamic must be an object like {\"dim\": 1}")
        only_keys(data, {"dim"}, "dynamic")
        return cls(**data)


@dataclass(frozen=True)
class Partition:
    """How a compiled variant trades memory for latency.

    ``latency``: the whole model is one compiled graph with frozen, prepacked weights (fastest;
    the prepacked copies cost memory). ``memory``: each repeated block (e.g. every transformer
    layer) is compiled on its own without freezing, so the weights stay the module's own
    parameters (no prepacked copies), identical blocks share one compiled kernel set and
    compile time drops; glue between blocks runs eagerly. Graphs that exist only whole (a
    pt2e-quantized model) are compiled whole either way, and the report says so.
    """

    strategy: PartitionStrategy = PartitionStrategy.LATENCY

    def __post_init__(self) -> None:
        strategy = choice(
            PartitionStrategy,
            self.strategy,
            f"partition must be one of {PARTITION_STRATEGIES}, not {self.strategy!r}",
        )
        object.__setattr__(self, "strategy", strategy)

    @property
    def is_identity(self) -> bool:
        return self.strategy is PartitionStrategy.LATENCY

    def label(self) -> str:
        return "" if self.is_identity else "memory"

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Partition:
        only_keys(data, {"strategy"}, "partition")
        return cls(**dict(data))
