"""The search space, shaped by the live profile and by per-layer sensitivity.

The live profile says which quantizable layers carry the time (the smallest set covering 80%
of it: the *candidates*). Sensitivity (``compiler.sensitivity``: the output error when only one
layer changes) says which of those need a say of their own: the most sensitive candidates
become *hot* layers with their own choice, every other layer shares one ``_default`` choice.
A choice that breaks the accuracy budget on its own for a layer is pruned for that layer (and,
for the default, when it does so on any layer the default covers). That keeps the space small
where it does not matter and spends the few trials a search has where time and accuracy are
at stake (for MiniLM: the feed-forward projections, the output projections most sensitive).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from compiler import (
    Backend,
    DynamicShapes,
    Fusion,
    Hardware,
    Kernels,
    LayerQuant,
    Layout,
    Quantization,
    Recipe,
    SensitivityReport,
    ShapeBuckets,
    as_built,
    has_eligible_convs,
    may_have_sibling_linears,
)
from compiler.recipe import DEFAULT_KEY
from pgc_daemon.optimizer.search.hotprofile import hot_layers
from pgc_daemon.optimizer.search.offers import (
    AUTOCAST_BACKENDS,
    GPU_BACKENDS,
    MAX_AUTOTUNE,
    backends_for,
    choices_for,
    on_gpu,
)
from profiler import parse_key

SAFE = "fp32"
#: a hot layer's own parameter is this and its name
LAYER_PREFIX = "layer:"
#: the int8 each peer backend is tried in first: ONNX Runtime's dynamic quantization, and
#: OpenVINO in its default precision with NNCF's static int8 (measured fastest of each here)
PEER_BASELINES = {"onnxruntime": "int8-dynamic-pc", "openvino": "int8-static-pc"}
#: Whole-graph choices for convolutional models: as written, or BatchNorm folded, conv+ReLU
#: fused and channels-last activations (what oneDNN's convolutions prefer), or (Inductor
#: backends, models with plain 1-D or 2-D convolutions) BatchNorm folded and each convolution
#: one GEMM (``compiler._conv_gemm``; other backends take the graph as written).
GRAPH_CHOICES = ("fused_cl", "as_is")
CONV_GEMM = "conv_gemm"
FUSED = Fusion(conv_bn=True, conv_bn_relu=True)
GEMMS = Fusion(conv_bn=True, conv_gemm=True)
CHANNELS_LAST = Layout("channels_last")
#: What the space offers for variable-length inputs: pad to the live buckets, compile the
#: sequence axis dynamic, or neither (the variant serves the shapes it was built for).
SHAPE_CHOICES = ("live", "dynamic", "none")


@dataclass(frozen=True)
class Space:
    """``layer_choices`` is what every hot layer may take unless ``per_layer`` narrows it
    (after pruning by sensitivity); ``pruned`` says what was taken out and why."""

    hot_layers: tuple[str, ...]
    layer_choices: tuple[str, ...]
    default_choices: tuple[str, ...]
    backends: tuple[str, ...]
    per_layer: tuple[tuple[str, tuple[str, ...]], ...] = ()
    pruned: tuple[tuple[str, str, str], ...] = field(default=(), compare=False)
    graph_choices: tuple[str, ...] = ()
    """``GRAPH_CHOICES`` for models with convolutions (empty: not offered)."""
    bucket_sizes: tuple[int, ...] = ()
    """Sequence-length buckets seen in live traffic (two or more: shapes vary, and the space
    offers ``shape_choices`` for them)."""
    shape_choices: tuple[str, ...] = SHAPE_CHOICES
    sibling_linears: bool = False
    """Linears may read one tensor (query, key, value): Inductor recipes fuse them."""
    gpu: bool = False
    """The model is on a CUDA device: int8 weight-only layers run pgc's Triton kernel."""

    def choices_of(self, layer: str) -> tuple[str, ...]:
        return dict(self.per_layer).get(layer, self.layer_choices)

    def suggest(self, trial: Any) -> Recipe:
        params = {"default": trial.suggest_categorical("default", self.default_choices)}
        for name in self.hot_layers:
            key = f"{LAYER_PREFIX}{name}"
            params[key] = trial.suggest_categorical(key, self.choices_of(name))
        params["backend"] = trial.suggest_categorical("backend", self.backends)
        if self.graph_choices:
            params["graph"] = trial.suggest_categorical("graph", self.graph_choices)
        if self.bucket_sizes:
            params["buckets"] = trial.suggest_categorical("buckets", self.shape_choices)
        return self.recipe(params)

    def recipe(self, params: dict[str, Any]) -> Recipe:
        rules: dict[str, LayerQuant] = {DEFAULT_KEY: LayerQuant.parse(params["default"])}
        for name in self.hot_layers:
            choice = params.get(f"{LAYER_PREFIX}{name}", params["default"])
            if choice != params["default"]:
                rules[name] = LayerQuant.parse(choice)
        quant = (
            Quantization.of(rules) if any(not c.is_identity for c in rules.values()) else Quantization()
        )
        parts: dict[str, Any] = {"quantization": quant, "backend": Backend.parse(params["backend"])}
        if params.get("graph") == "fused_cl":
            parts.update(fusion=FUSED, layout=CHANNELS_LAST)
        if params.get("graph") == CONV_GEMM and parts["backend"].kind == "inductor":
            parts["fusion"] = GEMMS
        if self.sibling_linears and parts["backend"].kind == "inductor":
            parts["fusion"] = replace(parts.get("fusion", Fusion()), linear_siblings=True)
        if params.get("buckets") == "live" and self.bucket_sizes:
            parts["buckets"] = ShapeBuckets(self.bucket_sizes)
        if params.get("buckets") == "dynamic" and self.bucket_sizes and \
                parts["backend"].kind == "inductor":  # the others are dynamic already
            parts["dynamic"] = DynamicShapes(dim=1)
        if self.gpu and any(c.scheme == "weight_only" for c in rules.values()):
            parts["kernels"] = Kernels("triton")
        # what a peer backend builds of it: its label says what runs, and parameters that
        # build the same variant are one recipe, measured once (the study's duplicates)
        return as_built(Recipe(**parts))

    def params(self, default: str, backend: str, **layers: str) -> dict[str, Any]:
        """Parameters for an enqueued trial: every hot layer follows ``default`` unless named,
        or stays fp32 where ``default`` was pruned for it."""
        out: dict[str, Any] = {"default": default, "backend": backend}
        for name in self.hot_layers:
            want = layers.get(name, default)
            out[f"{LAYER_PREFIX}{name}"] = want if want in self.choices_of(name) else SAFE
        if self.graph_choices:
            out["graph"] = self.graph_choices[0]
        if self.bucket_sizes:  # exact lengths beat padding to a bucket (MiniLM int8 at
            # length 22: 3.15 ms dynamic, 3.08 static at 22, so ~4.4 padded to 32)
            out["buckets"] = "dynamic" if "dynamic" in self.shape_choices else "live"
        return out

    def params_for(self, recipe: Recipe) -> dict[str, Any] | None:
        """The parameters that give ``recipe`` in this space, or None when it cannot be said
        here (a layer choice outside the space, a rule on a layer that is not hot, another
        backend). Used to warm-start a study from another study's best recipes."""
        rules = dict(recipe.quantization.rules)
        default = rules.pop(DEFAULT_KEY, LayerQuant()).label()
        backend = recipe.backend.label()
        if default not in self.default_choices or backend not in self.backends:
            return None
        layers: dict[str, str] = {}
        for key, choice in rules.items():
            if key not in self.hot_layers or choice.label() not in self.choices_of(key):
                return None
            layers[key] = choice.label()
        params = self.params(default, backend, **layers)
        if self.graph_choices and recipe.fusion.is_identity and recipe.layout.is_identity:
            params["graph"] = "as_is"
        if CONV_GEMM in self.graph_choices and recipe.fusion.conv_gemm:
            params["graph"] = CONV_GEMM
        if self.bucket_sizes:
            params["buckets"] = ("live" if not recipe.buckets.is_identity else
                                 "none" if recipe.dynamic.is_identity else "dynamic")
            if params["buckets"] not in self.shape_choices:
                return None
        return params if self.recipe(params) == recipe else None

    def baselines(self, sensitive: Sequence[str] = ()) -> list[dict[str, Any]]:
        """What every search tries first: fp32 compiled, all-int8 per-channel compiled
        (static), the same through max-autotune with bf16 between its kernels where the CPU
        has AMX (:data:`AUTOCAST_BACKENDS`), each installed peer backend in its own int8
        (:data:`PEER_BASELINES`: where a peer wins, as ONNX Runtime does on small convnets and
        LSTMs, the search starts from it instead of finding it by chance), all-int8 dynamic
        compiled, all-int8 static through :data:`MAX_AUTOTUNE`, fp32 under bf16 autocast
        where offered (nearly lossless), for models with plain convolutions all-int8 static
        through :data:`MAX_AUTOTUNE` and fp32 under bf16 autocast with each convolution one
        GEMM (:data:`CONV_GEMM`), and all-int8 with the ``sensitive`` hot layers in
        bf16 where offered (in the int8 graph; MiniLM at batch 1, AVX-512-BF16 EPYC: 1.10x
        faster than keeping them fp32 at the same cosine, 0.9959), else fp32. On a GPU:
        :meth:`gpu_baselines`."""
        if self.gpu:
            return self.gpu_baselines()
        backend = "inductor" if "inductor" in self.backends else self.backends[0]
        out = [self.params("fp32", backend)] if backend == "inductor" else []
        points = [("int8-static-pc", backend)]
        # where the CPU has AMX, right after: MiniLM at batch 1, 1.21x int8 static through
        # max-autotune alone (4.97x against 4.10x fp32 eager), 1.45x OpenVINO NNCF int8
        points += [("int8-static-pc", b) for b in AUTOCAST_BACKENDS[1:] if b in self.backends]
        points += [(c, peer) for peer, c in PEER_BASELINES.items() if peer in self.backends]
        points.append(("int8-dynamic-pc", backend))
        points += [("int8-static-pc", MAX_AUTOTUNE)] if MAX_AUTOTUNE in self.backends else []
        # and the fp32 model under bf16 autocast, for tight budgets: MiniLM 3.79x at cosine
        # 0.99999 on the Xeon with AMX, where bf16 weights through Inductor gave 3.51x
        points += [(SAFE, b) for b in AUTOCAST_BACKENDS[:1] if b in self.backends]
        for choice, on in points:
            if choice in self.default_choices:
                out.append(self.params(choice, on))
        if CONV_GEMM in self.graph_choices:  # the digits CNN at batch 1 (Xeon with AMX): as
            # GEMMs int8 static 62 µs, fp32 under bf16 autocast 55, ONNX Runtime int8 75
            for choice, on in (("int8-static-pc", MAX_AUTOTUNE), (SAFE, AUTOCAST_BACKENDS[1])):
                if choice in self.default_choices and on in self.backends:
                    out.append({**self.params(choice, on), "graph": CONV_GEMM})
        keep = {n: "bf16" if "bf16" in self.choices_of(n) else SAFE
                for n in sensitive if n in self.hot_layers}
        for choice in ("int8-static-pc", "int8-dynamic-pc"):
            if choice in self.default_choices and keep:
                out.append(self.params(choice, backend, **keep))
        return [p for i, p in enumerate(out) if p not in out[:i]]

    def gpu_baselines(self) -> list[dict[str, Any]]:
        """On a GPU: fp32 compiled, then through max-autotune each of fp16, bf16, fp8 (where
        offered) and int8 weight-only (pgc's Triton kernel), the fastest kinds first."""
        backend = MAX_AUTOTUNE if MAX_AUTOTUNE in self.backends else self.backends[0]
        out = [self.params(SAFE, "inductor")] if "inductor" in self.backends else []
        for choice in ("fp16", "bf16", "fp8", "int8-weight_only-pc"):
            if choice in self.default_choices:
                out.append(self.params(choice, backend))
        return [p for i, p in enumerate(out) if p not in out[:i]]

    def _pools(self) -> list[tuple[str, Sequence[str]]]:
        pools: list[tuple[str, Sequence[str]]] = [("default", self.default_choices)]
        pools += [(f"{LAYER_PREFIX}{n}", self.choices_of(n)) for n in self.hot_layers]
        pools.append(("backend", self.backends))
        if self.graph_choices:
            pools.append(("graph", self.graph_choices))
        if self.bucket_sizes:
            pools.append(("buckets", self.shape_choices))
        return pools

    def distributions(self) -> dict[str, tuple[str, ...]]:
        """The choices of every parameter :meth:`suggest` asks for (what Optuna records as the
        parameter's distribution, and refuses to see changed later in the same study)."""
        return {name: tuple(choices) for name, choices in self._pools()}

    def reconciled(self, recorded: Mapping[str, Sequence[Any]]) -> Space:
        """This space, with the choices a study already ``recorded`` for a parameter wherever
        they differ from this space's: a resumed study whose space moved since (another set
        of layers covered by the default, a choice pruned or not) keeps searching with the
        choices its parameters were first given, since Optuna refuses to change them."""

        def kept(name: str, mine: Sequence[str]) -> tuple[str, ...]:
            theirs = recorded.get(name)
            return tuple(theirs) if theirs is not None else tuple(mine)

        per_layer = dict(self.per_layer)
        for layer in self.hot_layers:
            choices = kept(f"{LAYER_PREFIX}{layer}", self.choices_of(layer))
            if choices != self.layer_choices:
                per_layer[layer] = choices
            else:
                per_layer.pop(layer, None)
        graph = kept("graph", self.graph_choices) if self.graph_choices else ()
        shapes = kept("buckets", self.shape_choices) if self.bucket_sizes else self.shape_choices
        out = replace(
            self,
            shape_choices=shapes,
            default_choices=kept("default", self.default_choices),
            backends=kept("backend", self.backends),
            per_layer=tuple((n, per_layer[n]) for n in self.hot_layers if n in per_layer),
            graph_choices=graph,
        )
        return self if out == self else out

    @property
    def size(self) -> int:
        return math.prod(len(choices) for _, choices in self._pools())

    def grid(self) -> Iterator[dict[str, Any]]:
        pools = self._pools()
        for combo in itertools.product(*(choices for _, choices in pools)):
            yield dict(zip((key for key, _ in pools), combo))

    def to_dict(self) -> dict[str, Any]:
        return {
            "hot_layers": list(self.hot_layers),
            "layer_choices": list(self.layer_choices),
            "default_choices": list(self.default_choices),
            "per_layer": {k: list(v) for k, v in self.per_layer},
            "backends": list(self.backends),
            "graph_choices": list(self.graph_choices),
            "bucket_sizes": list(self.bucket_sizes),
            "shape_choices": list(self.shape_choices) if self.bucket_sizes else [],
            "sibling_linears": self.sibling_linears,
            "gpu": self.gpu,
            "pruned": [list(p) for p in self.pruned],
            "size": self.size,
        }


def prune(
    layers: Sequence[str],
    choices: Sequence[str],
    sensitivity: SensitivityReport | None,
    max_drop: float,
) -> tuple[dict[str, tuple[str, ...]], list[tuple[str, str, str]]]:
    """Per layer, the choices that do not break the budget on their own; and what was taken
    out, with why. A layer that cannot take a choice loses it too; fp32 always stays. A
    choice breaks the budget when even the least drop its measured one makes likely does
    (``SensitivityReport.floor``): on 8 rows of logits, one row changed (0.125) prunes
    nothing under a budget of 0.01, two do."""
    kept: dict[str, tuple[str, ...]] = {}
    removed: list[tuple[str, str, str]] = []
    for layer in layers:
        ok = []
        for choice in choices:
            row = sensitivity.get(layer, choice) if sensitivity is not None else None
            if sensitivity is None or row is None or choice == SAFE:
                ok.append(choice)
            elif row.status != "ok":
                removed.append((layer, choice, row.status))
            elif row.drop is not None and (floor := sensitivity.floor(row) or 0.0) > max_drop:
                likely = f" (at least {floor:.4f} likely)" if floor < row.drop else ""
                removed.append((layer, choice,
                                f"drop {row.drop:.4f}{likely} alone > budget {max_drop}"))
            else:
                ok.append(choice)
        kept[layer] = tuple(ok)
    return kept, removed


def build_space(
    model: nn.Module,
    profile: Sequence[dict[str, Any]],
    hardware: Hardware,
    *,
    coverage: float = 0.8,
    max_hot: int = 6,
    backends: Sequence[str] | None = None,
    sensitivity: SensitivityReport | None = None,
    max_drop: float = 1.0,
    choices: Sequence[str] | None = None,
    shapes: dict[str, int] | None = None,
) -> Space:
    """The space for ``model`` on this machine. ``shapes`` is the live traffic's calls per
    shape bucket: two or more sequence-length buckets offer shape bucketing."""
    gpu = on_gpu(model)
    choices = tuple(choices or choices_for(hardware, gpu=gpu))
    backends = tuple(backends or backends_for(hardware))
    if gpu:
        backends = tuple(b for b in backends if b in GPU_BACKENDS) or GPU_BACKENDS[:1]
    hot = hot_layers(model, profile, coverage=coverage, max_hot=max_hot, sensitivity=sensitivity)
    per_layer, removed = prune(hot, choices, sensitivity, max_drop)
    # the default covers every other layer: prune what breaks the budget on any measured one
    measured = sorted({r.layer for r in sensitivity.rows}) if sensitivity is not None else []
    covered = [n for n in measured if n not in hot]
    default_ok, default_removed = prune(covered, choices, sensitivity, max_drop)
    default = tuple(c for c in choices if all(c in v for v in default_ok.values()))
    removed += [("_default", c, f"breaks the budget on {layer}: {why}") for layer, c, why in default_removed
                if c not in default and not any(r[0] == "_default" and r[1] == c for r in removed)]
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    graph = GRAPH_CHOICES if has_conv else ()
    if has_eligible_convs(model):  # a Conv1d model: as written, or as GEMMs
        graph = (graph or ("as_is",)) + (CONV_GEMM,)
    return Space(
        hot_layers=tuple(hot),
        layer_choices=choices,
        default_choices=default or (SAFE,),
        backends=backends,
        per_layer=tuple((n, per_layer[n]) for n in hot if per_layer[n] != choices),
        pruned=tuple(_dedupe(removed)),
        graph_choices=graph,
        bucket_sizes=live_buckets(shapes or {}),
        sibling_linears=may_have_sibling_linears(model),
        gpu=gpu,
    )



def live_buckets(shapes: dict[str, int], *, min_share: float = 0.02) -> tuple[int, ...]:
    """Sequence-length buckets that live traffic really uses (each at least ``min_share`` of
    calls), when there are two or more of them; else none."""
    total = sum(shapes.values())
    seqs: set[int] = set()
    for key, n in shapes.items():
        seq = parse_key(key).get("seq")
        if isinstance(seq, int) and total and n / total >= min_share:
            seqs.add(seq)
    return tuple(sorted(seqs)) if len(seqs) >= 2 else ()


def _dedupe(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    seen: set[tuple[str, str]] = set()
    out = []
    for layer, choice, why in rows:
        if (layer, choice) not in seen:
            seen.add((layer, choice))
            out.append((layer, choice, why))
    return out
