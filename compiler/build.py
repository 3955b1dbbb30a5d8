"""``build(model, recipe)``: apply a recipe's parts in order to a copy of the model; and
``load_artifact``: a variant another process built, loaded without compiling.

A variant built as AOTInductor packages, an ONNX Runtime model or OpenVINO IR is kept whole in
the compile cache's artifacts folder (see ``compiler.cache``). ``build`` returns the artifact
stored for its exact key instead of building; ``load_artifact`` takes one by digest (what a
worker recorded) and needs only that it fits this process: the same model and recipe, on the
same kind of machine and libraries. Nothing is compiled either way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compiler import _backend, _buckets, _dynamic, _fusion, _kernels, _layout, _quant  # noqa: F401
from compiler._errors import ArtifactUnavailable, BuildError, CompilerError, brief_error
from compiler._registry import BuildContext, BuildReport, Example, analysis_for, transform_for
from compiler._kernel_map import kernel_events, with_kernel_events
from compiler._outputs import register_dataclasses
from compiler.cache import CacheKey, CompileCache, cache_key, checked_path, incompatible
from compiler.recipe import Recipe

if TYPE_CHECKING:
    from compiler._autotune_picks import Pick

_AFTER_QUANTIZATION = Recipe.APPLY_ORDER[Recipe.APPLY_ORDER.index("quantization") + 1 :]
_AFTER_BACKEND = Recipe.APPLY_ORDER[Recipe.APPLY_ORDER.index("backend") + 1 :]


@dataclass
class BuiltVariant:
    """A built variant: the module to serve, the recipe it came from, and what was done."""

    module: nn.Module
    recipe: Recipe
    report: BuildReport
    artifact: str | None = None
    """The digest of the artifact this variant was saved as or loaded from (None: not kept)."""

    @property
    def hookable(self) -> bool:
        """Whether per-layer forward hooks see this module's layers. Compiled modules inline
        their layers (and adding hooks would force a recompile), so they are profiled end to
        end only."""
        return not self.report.compiled

    @property
    def kernel_layers(self) -> dict[str, list[list[str]]] | None:
        """For a compiled module whose kernels are known (an AOTInductor package): which
        layers each kernel computes (``compiler._kernel_map``); None otherwise."""
        return getattr(self.module, "kernel_layers", None)

    @property
    def own_pool(self) -> bool:
        """Whether the module computes on a thread pool of its own (ONNX Runtime's session,
        OpenVINO's compiled model), which ``torch.set_num_threads`` does not reach."""
        return callable(getattr(self.module, "at_threads", None))


def build(
    model: nn.Module,
    recipe: Recipe,
    *,
    calibration: Sequence[Example] = (),
    example: Example | None = None,
    cache: CompileCache | None = None,
) -> BuiltVariant:
    """Build ``recipe`` on a deep copy of ``model`` (the original is never changed).

    ``calibration`` holds real inputs for parts that calibrate (static int8); ``example`` is
    one input for parts that trace (the first calibration input when not given). With an
    input to run, a compiled variant is compiled here and the report names the kernels it
    runs; without one, the first call compiles, so callers warm a variant before serving it
    (see :func:`warm`). With a ``cache``, the same key (see ``compiler.cache``) returns the
    variant built before in this process, or the artifact stored for the key (loaded, not
    compiled), or rebuilds it from the quantized graph saved on disk by another process; a
    variant built as packages is stored as an artifact (``variant.artifact``).
    """
    key: CacheKey | None = None
    stale: str | None = None
    if cache is not None:
        key = cache_key(model, recipe, calibration)
        hit = cache.get(key)
        if hit is not None:  # the very same compiled module; a report of its own
            report = dataclasses.replace(copy.deepcopy(hit.report), cache="hit")
            return BuiltVariant(
                module=hit.module, recipe=hit.recipe, report=report, artifact=hit.artifact
            )
        if cache.has_artifact(key.digest):
            try:
                loaded = _load_artifact(model, recipe, key.digest, cache, key)
            except ArtifactUnavailable as exc:
                stale = f"stored artifact not loaded ({exc}); built again"
            else:
                cache.put(key, loaded)
                return loaded
    started = time.perf_counter()
    report = BuildReport()
    if stale:
        report.notes.append(stale)
    ctx = BuildContext(
        calibration=list(calibration), example=example, report=report, recipe=recipe
    )
    ctx.state["original"] = model  # a packaged variant serves other shapes with it
    try:
        with torch.no_grad(), (cache.inductor_dir() if cache is not None else contextlib.nullcontext()):
            if (first := ctx.first_input()) is not None:  # its dataclasses, for the exporters
                register_dataclasses(model(*first[0], **first[1]))
            loaded = cache.load(key.for_graph()) if cache is not None and key is not None else None
            if loaded is not None:
                module, meta = loaded
                _restore(ctx, meta)
                report.cache = "hit"
                names = list(_AFTER_QUANTIZATION)
            else:
                module = copy.deepcopy(model).eval()
                if cache is not None:
                    cache.miss()
                    report.cache = "miss"
                names = list(Recipe.APPLY_ORDER)
                for part in recipe.parts():
                    analysis = analysis_for(part)
                    if analysis is not None:
                        analysis(module, part, ctx)
            for name in names:
                part = getattr(recipe, name)
                module = transform_for(part)(module, part, ctx)
                if name == "quantization" and cache is not None and key is not None:
                    _save(cache, key.for_graph(), module, ctx)
        report.build_s = time.perf_counter() - started
        variant = BuiltVariant(module=module, recipe=recipe, report=report)
        if cache is not None and key is not None:
            variant.artifact = _store_artifact(cache, key, recipe, ctx)
            cache.put(key, variant)
    except CompilerError:
        raise
    except Exception as exc:  # a library failed on this model: say which recipe, keep cause
        raise BuildError(f"building {recipe.label()} failed: {brief_error(exc)}") from exc
    finally:
        made = ctx.state.get("artifact") or {}
        if made.get("folder") is not None:  # the packages' temporary folder
            shutil.rmtree(made["folder"], ignore_errors=True)
    return variant


def build_profiling_twin(
    model: nn.Module,
    recipe: Recipe,
    *,
    calibration: Sequence[Example] = (),
    example: Example | None = None,
    cache: CompileCache,
) -> BuiltVariant | None:
    """``recipe``'s variant built again with kernel events (``compiler._kernel_map``), stored
    as an artifact of its own (``twin.artifact``; load it with ``load_artifact(...,
    profiled=True)``). A live profiler runs the twin on sampled calls only, so the variant's
    per-layer rows cost its other calls nothing (kernel events cost every call of a package
    carrying them, 3% of MiniLM's). Starts from the quantized graph the variant's build saved
    (same calibration: the same graph), and keeps the GEMM kernels max-autotune kept for the
    variant's artifact (:mod:`compiler._autotune_picks`) rather than timing them again. None
    when the variant is not made of AOTInductor packages (eager modules are seen by hooks;
    ONNX Runtime and OpenVINO by nothing yet) or when its kernels could not be mapped to
    layers."""
    if recipe.backend.kind != "inductor":
        return None
    with _as_twin(model, recipe, calibration, cache):
        twin = build(model, recipe, calibration=calibration, example=example, cache=cache)
    return twin if twin.kernel_layers is not None and twin.artifact is not None else None


def profiling_twin_digest(
    model: nn.Module, recipe: Recipe, calibration: Sequence[Example], cache: CompileCache
) -> str | None:
    """The artifact digest :func:`build_profiling_twin` would store the twin under now (its
    key includes the variant's picks it replays), or None where it builds none: a stored
    twin of another digest was built for other kernels than the variant's."""
    if recipe.backend.kind != "inductor":
        return None
    with _as_twin(model, recipe, calibration, cache):
        return cache_key(model, recipe, calibration).digest


@contextlib.contextmanager
def _as_twin(
    model: nn.Module, recipe: Recipe, calibration: Sequence[Example], cache: CompileCache
) -> Iterator[None]:
    """Kernel events on, and the picks of the variant's stored artifact replayed."""
    from compiler._autotune_picks import replaying

    picks = _variant_picks(model, recipe, calibration, cache)
    with kernel_events(), replaying(picks):
        yield


def _variant_picks(
    model: nn.Module, recipe: Recipe, calibration: Sequence[Example], cache: CompileCache
) -> dict[str, list[Pick]] | None:
    """The GEMM picks recorded in the stored artifact of ``recipe``'s variant (built without
    kernel events), or None where there is none to read (the twin then times its own)."""
    from compiler._autotune_picks import picks_from_json

    try:
        _, manifest = cache.open_artifact(cache_key(model, recipe, calibration).digest)
    except ArtifactUnavailable:
        return None
    return picks_from_json(manifest.get("autotune"))


def load_artifact(
    model: nn.Module, recipe: Recipe, digest: str, *, cache: CompileCache, profiled: bool = False
) -> BuiltVariant:
    """The variant stored in ``cache``'s artifacts as ``digest``, loaded without compiling.

    ``model`` is the fp32 model the artifact was built from (its fingerprint must match; a
    packaged variant serves shapes it was not compiled for with it). The artifact must fit
    this process: every file's checksum, the graph, the recipe, the device, the library
    versions and the code-generation environment are checked; the calibration may differ.
    Raises :class:`ArtifactUnavailable` saying what is missing, corrupt or incompatible, so
    the caller can :func:`build` instead. ``profiled``: the artifact is a profiling twin
    (:func:`build_profiling_twin`), built with kernel events where this process has none."""
    environ = with_kernel_events() if profiled else None
    return _load_artifact(model, recipe, digest, cache, cache_key(model, recipe, environ=environ))


def _load_artifact(
    model: nn.Module, recipe: Recipe, digest: str, cache: CompileCache, here: CacheKey
) -> BuiltVariant:
    started = time.perf_counter()
    folder, manifest = cache.open_artifact(digest)
    why = incompatible(manifest.get("key", {}), here)
    if why is not None:
        raise ArtifactUnavailable(
            f"artifact {digest[:12]} is incompatible with this process: {why}"
        )
    saved = manifest.get("report", {})
    report = BuildReport(
        applied=dict(saved.get("applied", {})),
        skipped=dict(saved.get("skipped", {})),
        kernel_paths=dict(saved.get("kernel_paths", {})),
        notes=list(saved.get("notes", [])),
        compiled=bool(saved.get("compiled", True)),
        cache="artifact",
    )
    ctx = BuildContext(calibration=[], example=None, report=report, recipe=recipe)
    leaves = manifest.get("state", {}).get("token_leaves")
    ctx.state["token_leaves"] = frozenset(leaves) if leaves is not None else None
    try:
        with cache.inductor_dir():
            module = _artifact_module(manifest, folder, model)
            for name in _AFTER_BACKEND:
                part = getattr(recipe, name)
                module = transform_for(part)(module, part, ctx)
    except Exception as exc:  # a library refused it (another ISA, a missing op): build instead
        raise ArtifactUnavailable(
            f"artifact {digest[:12]} could not be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    cache.artifact_loaded()
    report.build_s = time.perf_counter() - started
    report.notes.append(
        f"loaded from artifact {digest[:12]} in {report.build_s:.1f}s "
        f"(built in {float(saved.get('build_s', 0.0)):.1f}s); nothing compiled"
    )
    return BuiltVariant(module=module, recipe=recipe, report=report, artifact=digest)


def _artifact_module(manifest: dict[str, Any], folder: Path, model: nn.Module) -> nn.Module:
    kind = manifest["kind"]
    if kind == "aoti":
        from compiler._aoti import load_aoti

        order = manifest["order"]
        if not set(order) <= set(manifest["files"]):  # only files whose checksum was checked
            raise ValueError("the manifest names packages it has no checksum for")
        return load_aoti(folder, order, manifest["inputs"], model, manifest.get("kernels"))
    if kind == "onnx":
        from compiler._ort import load_onnx

        checked = checked_path(folder / "model.onnx", manifest["files"]["model.onnx"])
        return load_onnx(checked, manifest["input_names"], manifest["out_spec"], model)
    if kind == "openvino":
        from compiler._openvino import FILES, load_openvino

        if not set(FILES) <= set(manifest["files"]):  # only files whose checksum was checked
            raise ValueError("the manifest names IR files it has no checksum for")
        return load_openvino(
            folder, manifest["input_names"], manifest["out_spec"], manifest["mode"], model
        )
    raise ValueError(f"unknown artifact kind {kind!r}")


def _store_artifact(
    cache: CompileCache, key: CacheKey, recipe: Recipe, ctx: BuildContext
) -> str | None:
    """Save what the backend left in ``ctx.state["artifact"]`` (packages, an ONNX model or
    OpenVINO IR)."""
    made = ctx.state.get("artifact")
    if not made or cache.artifacts is None:
        return None
    token = ctx.state.get("token_leaves")
    meta: dict[str, Any] = {
        "recipe": recipe.to_dict(),
        "report": ctx.report.to_dict(),
        "state": {"token_leaves": sorted(token) if token is not None else None},
    }
    if made["kind"] == "aoti":
        files: dict[str, Path | bytes] = {n: made["folder"] / n for n in made["files"]}
        meta.update(order=list(made["files"]), inputs=made["inputs"], kernels=made.get("kernels"))
        if made.get("autotune"):
            from compiler._autotune_picks import picks_to_json

            meta["autotune"] = picks_to_json(made["autotune"])
    elif made["kind"] == "openvino":
        files = dict(made["files"])
        meta.update(input_names=made["input_names"], out_spec=made["out_spec"], mode=made["mode"])
    else:
        files = {"model.onnx": made["onnx"]}
        meta.update(input_names=made["input_names"], out_spec=made["out_spec"])
    digest = cache.save_artifact(key, made["kind"], files, meta)
    if digest is None:
        ctx.report.notes.append(
            f"compile cache: artifact not saved ({cache.artifacts} not writable)"
        )
    return digest


def _save(cache: CompileCache, key: CacheKey, module: nn.Module, ctx: BuildContext) -> None:
    """Keep the quantized graph when it is a whole-model pt2e graph (what calibration made)."""
    if not ctx.state.get("pt2e") or not isinstance(module, torch.fx.GraphModule):
        return
    example = ctx.first_input()
    if example is None:
        return
    from compiler._pt2e import export_program

    try:
        program = export_program(module, example)
    except Exception as exc:  # noqa: BLE001 - not cached, only slower next time
        ctx.report.notes.append(f"compile cache: quantized graph not saved ({type(exc).__name__})")
        return
    token = ctx.state.get("token_leaves")
    cache.save(
        key,
        program,
        {
            "report": ctx.report.to_dict(),
            "state": {
                "pt2e": True,
                "token_leaves": sorted(token) if token is not None else None,
            },
        },
    )


def _restore(ctx: BuildContext, meta: dict[str, Any]) -> None:
    saved = meta.get("report", {})
    ctx.report.applied.update(saved.get("applied", {}))
    ctx.report.skipped.update(saved.get("skipped", {}))
    ctx.report.kernel_paths.update(
        {k: v for k, v in saved.get("kernel_paths", {}).items() if not k.startswith("<")}
    )
    ctx.report.notes.extend(n for n in saved.get("notes", []) if not n.startswith("torch.compile"))
    ctx.report.notes.append("compile cache: quantized graph loaded from disk (no calibration)")
    state = meta.get("state", {})
    ctx.state["pt2e"] = bool(state.get("pt2e"))
    if state.get("token_leaves") is not None:
        ctx.state["token_leaves"] = frozenset(state["token_leaves"])


def at_threads(module: nn.Module, threads: int) -> nn.Module | None:
    """A variant's module with its own thread pool sized ``threads`` (ONNX Runtime's session
    or OpenVINO's compiled model made again), or None where the module computes on torch's
    threads (set those with ``torch.set_num_threads``)."""
    resize = getattr(module, "at_threads", None)
    return resize(threads) if callable(resize) else None


def run(module: nn.Module, example: Example) -> object:
    args, kwargs = example
    return module(*args, **kwargs)


def warm(variant: BuiltVariant, examples: Sequence[Example], *, rounds: int = 2) -> float:
    """Call the variant on each example ``rounds`` times (compiling it if it compiles).

    Returns the seconds spent. Raises :class:`BuildError` when the variant cannot run.
    """
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for ex in examples:
                    run(variant.module, ex)
    except Exception as exc:
        raise BuildError(
            f"variant {variant.recipe.label()} failed on warm-up: {type(exc).__name__}: {exc}"
        ) from exc
    return time.perf_counter() - started
