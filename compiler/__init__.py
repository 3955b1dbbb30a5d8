"""pgc's compiler: recipes (what a variant is), ``build`` (making one), the compile cache, and
per-layer sensitivity."""

from compiler import _quiet  # noqa: F401 - first: before anything imports torchao
from compiler._errors import BuildError, CompilerError, RecipeError
from compiler._registry import BuildReport, Example, register_transform, registered_parts
from compiler.build import BuiltVariant, build, run, warm
from compiler.cache import CacheKey, CompileCache, cache_key
from compiler.fidelity import METRICS, choose_metric, compare, fidelity
from compiler.fingerprint import fingerprint
from compiler.hardware import Hardware, probe
from compiler.parts import Fusion, Kernels, Layout, Partition, ShapeBuckets
from compiler.recipe import Backend, LayerQuant, Quantization, Recipe
from compiler.sensitivity import LayerSensitivity, SensitivityReport, sensitivity

__all__ = [
    "METRICS",
    "Backend",
    "BuildError",
    "BuildReport",
    "BuiltVariant",
    "CacheKey",
    "CompileCache",
    "CompilerError",
    "Example",
    "Fusion",
    "Hardware",
    "Kernels",
    "LayerQuant",
    "LayerSensitivity",
    "Layout",
    "Partition",
    "Quantization",
    "Recipe",
    "RecipeError",
    "SensitivityReport",
    "ShapeBuckets",
    "build",
    "cache_key",
    "choose_metric",
    "compare",
    "fidelity",
    "fingerprint",
    "probe",
    "register_transform",
    "registered_parts",
    "run",
    "sensitivity",
    "warm",
]
