"""pgc's compiler: recipes (what a variant is), ``build`` (making one), the compile cache and its
artifacts (``load_artifact``: a variant another process built, loaded without compiling), and
per-layer sensitivity.

The errors load at once; everything else on first use (PEP 562), so a process that only needs
to name a compiler error (the CLI's error handling, ``pgc --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from compiler._errors import (
    ArtifactUnavailable,
    BuildError,
    CompilerError,
    RecipeError,
    UnsafeFolderError,
    brief_error,
)
from compiler.private import private_dir

if TYPE_CHECKING:
    from compiler._registry import BuildReport, Example, register_transform, registered_parts
    from compiler.build import (
        BuiltVariant, at_threads, build, build_profiling_twin, load_artifact,
        profiling_twin_digest, run, warm,
    )
    from compiler.cache import CacheKey, CompileCache, cache_key
    from compiler.fidelity import METRICS, choose_metric, compare, fidelity, judgments
    from compiler.fingerprint import fingerprint
    from compiler._openvino import search_backends as openvino_backends
    from compiler.hardware import FP8_CAPABILITY, Hardware, probe
    from compiler._quiet import recompile_limit_hits, silence_recompile_limit
    from compiler.parts import DynamicShapes, Fusion, Kernels, Layout, Partition, ShapeBuckets
    from compiler.recipe import Backend, LayerQuant, Quantization, Recipe
    from compiler.sensitivity import LayerSensitivity, SensitivityReport, sensitivity
    from compiler._siblings import may_have_sibling_linears
    from compiler._conv_gemm import has_eligible_convs
    from compiler._quant import refused
    from compiler._as_built import as_built
    from compiler._ort import untraceable
    from compiler._twin_weights import SharedWeights, share_weights

_LAZY: dict[str, str] = {
    "BuildReport": "compiler._registry",
    "Example": "compiler._registry",
    "register_transform": "compiler._registry",
    "registered_parts": "compiler._registry",
    "BuiltVariant": "compiler.build",
    "at_threads": "compiler.build",
    "build": "compiler.build",
    "build_profiling_twin": "compiler.build",
    "load_artifact": "compiler.build",
    "profiling_twin_digest": "compiler.build",
    "run": "compiler.build",
    "warm": "compiler.build",
    "CacheKey": "compiler.cache",
    "CompileCache": "compiler.cache",
    "cache_key": "compiler.cache",
    "METRICS": "compiler.fidelity",
    "choose_metric": "compiler.fidelity",
    "compare": "compiler.fidelity",
    "fidelity": "compiler.fidelity",
    "judgments": "compiler.fidelity",
    "fingerprint": "compiler.fingerprint",
    "openvino_backends": "compiler._openvino",
    "recompile_limit_hits": "compiler._quiet",
    "silence_recompile_limit": "compiler._quiet",
    "FP8_CAPABILITY": "compiler.hardware",
    "Hardware": "compiler.hardware",
    "probe": "compiler.hardware",
    "DynamicShapes": "compiler.parts",
    "Fusion": "compiler.parts",
    "Kernels": "compiler.parts",
    "Layout": "compiler.parts",
    "Partition": "compiler.parts",
    "ShapeBuckets": "compiler.parts",
    "Backend": "compiler.recipe",
    "LayerQuant": "compiler.recipe",
    "Quantization": "compiler.recipe",
    "Recipe": "compiler.recipe",
    "LayerSensitivity": "compiler.sensitivity",
    "SensitivityReport": "compiler.sensitivity",
    "sensitivity": "compiler.sensitivity",
    "may_have_sibling_linears": "compiler._siblings",
    "has_eligible_convs": "compiler._conv_gemm",
    "refused": "compiler._quant",
    "as_built": "compiler._as_built",
    "untraceable": "compiler._ort",
    "SharedWeights": "compiler._twin_weights",
    "share_weights": "compiler._twin_weights",
}
#: Public names whose object has another name in its module.
_RENAMED = {"openvino_backends": "search_backends"}

__all__ = sorted(
    [
        *_LAZY, "ArtifactUnavailable", "BuildError", "CompilerError", "RecipeError",
        "UnsafeFolderError", "brief_error", "private_dir",
    ]
)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'compiler' has no attribute {name!r}")
    _load()
    return globals()[name]


def _load() -> None:
    """Import every submodule, then bind the public names. All at once, because some names are
    also submodules (``build``, ``fidelity``, ``fingerprint``, ``sensitivity``): importing a
    submodule binds the module to the package's attribute, and the function must win."""
    importlib.import_module("compiler._quiet")  # first: before anything imports torchao
    modules = {m: importlib.import_module(m) for m in set(_LAZY.values())}
    for attr, module in _LAZY.items():
        globals()[attr] = getattr(modules[module], _RENAMED.get(attr, attr))


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
