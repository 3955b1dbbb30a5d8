"""pgc's compiler: recipes (what a variant is) and ``build`` (making one)."""

from compiler._errors import BuildError, CompilerError, RecipeError
from compiler._registry import BuildReport, Example, register_transform, registered_parts
from compiler.build import BuiltVariant, build, run, warm
from compiler.fidelity import METRICS, choose_metric, compare, fidelity
from compiler.fingerprint import fingerprint
from compiler.hardware import Hardware, probe
from compiler.recipe import Backend, LayerQuant, Quantization, Recipe

__all__ = [
    "METRICS",
    "Backend",
    "BuildError",
    "BuildReport",
    "BuiltVariant",
    "CompilerError",
    "Example",
    "Hardware",
    "LayerQuant",
    "Quantization",
    "Recipe",
    "RecipeError",
    "build",
    "choose_metric",
    "compare",
    "fidelity",
    "fingerprint",
    "probe",
    "register_transform",
    "registered_parts",
    "run",
    "warm",
]
