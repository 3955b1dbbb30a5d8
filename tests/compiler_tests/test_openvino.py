"""The OpenVINO backend: f32 mode matches fp32 eager, the default precision and NNCF int8 keep
fidelity (layers kept fp32 by name stay out of int8), the IR artifact loads in another process
without converting or quantizing, a missing OpenVINO is a BuildError that says what to
install, and recipes with the backend round-trip through JSON, labels and the search space."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from compiler import (
    Backend,
    BuildError,
    Quantization,
    Recipe,
    RecipeError,
    build,
    compare,
    fidelity,
)
from tests.compiler_tests.conftest import examples, outputs, token_batch

needs_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino") is None or importlib.util.find_spec("nncf") is None,
    reason="needs the openvino extra",
)
F32 = Backend("openvino", "f32")
DEFAULT = Backend("openvino")
INT8 = Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}), backend=DEFAULT)


@needs_openvino
@pytest.mark.parametrize("spec_name", ["mlp_spec", "cnn_spec"])
def test_f32_mode_matches_fp32_eager(spec_name: str, request: pytest.FixtureRequest) -> None:
    spec = request.getfixturevalue(spec_name)
    test = examples(spec, 6)
    built = build(spec["model"], Recipe(backend=F32), example=test[0])
    assert type(built.module).__name__ == "OvModule" and built.report.compiled
    assert built.module.precision == "f32"
    for ref, out in zip(outputs(spec["model"], test), outputs(built.module, test)):
        assert compare(ref, out)["max_abs"] < 1e-4
    odd = test[0][0][0][:3]  # another batch size: the converted model's shapes are dynamic
    with torch.inference_mode():
        assert compare(spec["model"](odd), built.module(odd))["max_abs"] < 1e-4
    note = next(n for n in built.report.notes if n.startswith("openvino "))
    assert "inference precision f32 (asked)" in note


@needs_openvino
def test_a_variant_made_again_for_one_thread_computes_the_same_on_the_calling_thread(
    mlp_spec: dict[str, Any],
) -> None:
    """A search times a peer with a pool of the timing count (``compiler.at_threads``): the
    same model compiled again, same precision and outputs, on the caller's thread."""
    import time

    from compiler import at_threads

    test = examples(mlp_spec, 4)
    built = build(mlp_spec["model"], Recipe(backend=F32), example=test[0])
    one = at_threads(built.module, 1)
    assert one is not None and one.threads == 1 and one.precision == built.module.precision
    assert built.module.threads == torch.get_num_threads()
    for a, b in zip(outputs(built.module, test), outputs(one, test)):
        assert compare(a, b)["max_abs"] == 0.0
    x = test[0][0][0]
    t0, p0 = time.thread_time(), time.process_time()
    for _ in range(300):
        one(x)
    assert time.thread_time() - t0 >= 0.9 * (time.process_time() - p0)


@needs_openvino
def test_default_mode_runs_in_the_devices_precision(cnn_spec: dict[str, Any]) -> None:
    from compiler._openvino import default_precision

    test = examples(cnn_spec, 10)
    built = build(cnn_spec["model"], Recipe(backend=DEFAULT), example=test[0])
    assert built.module.precision == default_precision()
    assert Recipe(backend=DEFAULT).label() == "fp32 · openvino"
    refs, outs = outputs(cnn_spec["model"], test), outputs(built.module, test)
    assert fidelity("top1", refs, outs) >= 0.99
    assert fidelity("sqnr", refs, outs) >= 0.99  # SQNR >= 20 dB, bf16 or not


@needs_openvino
@pytest.mark.parametrize("rule", ["int8-static-pc", "int8-dynamic-pt"])
def test_nncf_quantizes_the_recipes_int8_layers_and_keeps_named_layers_out(
    cnn_spec: dict[str, Any], rule: str
) -> None:
    recipe = Recipe(quantization=Quantization.of({"_default": rule, "head.3": "fp32"}), backend=DEFAULT)
    built = build(cnn_spec["model"], recipe, calibration=examples(cnn_spec, 8))
    # OpenVINO folds each BatchNorm into its convolution and drops the conv's name: the convs
    # are still found (as the modules their BatchNorms took their input from)
    assert set(built.report.applied) == {"features.0", "features.3", "features.7", "head.1"}
    assert all("NNCF" in built.report.kernel_paths[n] for n in built.report.applied)
    assert ("asked dynamic" in built.report.kernel_paths["head.1"]) == (rule == "int8-dynamic-pt")
    note = next(n for n in built.report.notes if n.startswith("NNCF "))
    assert "on 4 of 5 MatMul/Convolution nodes, 1 kept out by name" in note
    assert "calibrated on 8 inputs" in note
    test = examples(cnn_spec, 10)
    assert fidelity("top1", outputs(cnn_spec["model"], test), outputs(built.module, test)) >= 0.97


def test_a_node_belongs_to_the_module_it_ran_in_or_the_nearest_one_that_is_a_module() -> None:
    from compiler._openvino_layers import module_path

    modules = {"features", "features.0", "head.1"}
    conv = "__module.features.0/aten::_convolution/Convolution"
    assert module_path(conv, modules) == "features.0"
    assert module_path("__module.features.0.inner/aten::add/Add", modules) == "features.0"
    linear = "__module.head.1/aten::linear/MatMul/DequantizationMultiply"
    assert module_path(linear, modules) == "head.1"
    assert module_path("input/fq_output_0", modules) == ""  # the input's quantization
    assert module_path("__module.other/aten::relu/Relu", modules) == ""


@needs_openvino
def test_each_node_of_an_int8_variant_maps_to_the_layers_it_was_made_from(
    cnn_spec: dict[str, Any],
) -> None:
    """OpenVINO fuses each convolution with its BatchNorm and ReLU, and NNCF renames the
    convolutions it quantizes: the node still names all three, convolution first."""
    from compiler._openvino_layers import ROOT, node_layers

    test = examples(cnn_spec, 8)
    built = build(cnn_spec["model"], INT8, calibration=test)
    counted = built.module.with_counters()
    nodes = node_layers(counted.compiled, cnn_spec["model"], test[0])
    by_first = {layers[0][0]: layers[0] for layers in nodes.values()}
    for conv in (0, 3, 7):
        assert by_first[f"features.{conv}"] == [f"features.{conv + i}" for i in range(3)]
    assert {"features.6", "head.1", "head.3"} <= set(by_first)
    assert all(len(calls) == 1 for calls in nodes.values())
    assert ROOT in by_first  # the input's quantization and layout reorders
    with torch.inference_mode():
        counted(*test[0][0])
    timed = counted.node_times()
    assert timed and {name for name, _ns, _label in timed} <= set(nodes)
    assert any(label.startswith("Convolution (") for _name, _ns, label in timed)
    assert built.module.counters is False  # what serves is compiled without the counters


@needs_openvino
def test_a_node_naming_only_its_activation_is_given_its_batchnorm_and_convolution() -> None:
    """A convolution without a bias (a ResNet's) has its BatchNorm folded away entirely: its
    node names only the ReLU, and the two modules before it are walked back to."""
    from compiler._openvino_layers import node_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 10)).eval()
    test = [((torch.randn(1, 3, 8, 8),), {}) for _ in range(4)]
    built = build(model, INT8, calibration=test)
    counted = built.module.with_counters()
    runtime = counted.compiled.get_runtime_model().get_ordered_ops()
    conv = next(op for op in runtime if op.get_rt_info()["layerType"].astype(str) == "Convolution")
    assert "__module.1/" not in conv.get_rt_info()["originalLayersNames"].astype(str)
    nodes = node_layers(counted.compiled, model, test[0])
    assert nodes[conv.get_friendly_name()] == [["0", "1", "2"]]
    assert [["4"]] in nodes.values()


class _Residual(torch.nn.Module):
    """A ResNet block's shape: conv-BN beside a 1x1 shortcut conv-BN, added, then ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.short, self.sbn = torch.nn.Conv2d(8, 8, 1, bias=False), torch.nn.BatchNorm2d(8)
        self.act = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)) + self.sbn(self.short(x)))


@needs_openvino
def test_convolutions_whose_nodes_name_none_of_their_modules_are_found_by_weight_shape() -> None:
    """Fused into an addition, a block's convolutions name the block (or nothing, the
    shortcut): each is the one unnamed module of its weight shape."""
    from compiler._openvino_layers import ROOT, node_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), _Residual(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)).eval()
    test = [((torch.randn(1, 3, 8, 8),), {}) for _ in range(4)]
    counted = build(model, INT8, calibration=test).module.with_counters()
    without = node_layers(counted.compiled, model, test[0])  # names only
    nodes = node_layers(counted.compiled, model, test[0], counted.model)
    assert [["2", "2.act"]] in without.values()  # the block's addition and ReLU, no conv
    assert [["2.conv", "2.bn", "2", "2.act"]] in nodes.values()
    shortcut = [node for node, calls in nodes.items() if calls == [["2.short", "2.sbn"]]]
    assert len(shortcut) == 1 and without[shortcut[0]] == [[ROOT]]  # named nothing
    assert [["0", "1"]] in nodes.values() and [["4"]] in nodes.values()


@needs_openvino
@pytest.mark.serial  # compares two nodes' times: another worker beside it preempts either
def test_an_openvino_variants_rows_split_its_call_as_its_nodes_ran() -> None:
    """A known split: the first linear (its node, whose time its ReLU shares) has 32 times
    the second's arithmetic, and the rows of the call (each node's time on its layers, the
    rest between kernels) add up to it."""
    from compiler._openvino_layers import node_layers
    from profiler import NodeKernels, profile_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 16)).eval()
    test = [((torch.randn(32, 512),), {}) for _ in range(4)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on the calling thread: no wait for a preempted worker's part
    try:
        built = build(model, Recipe(backend=F32), example=test[0])
    finally:
        torch.set_num_threads(threads)
    counted = built.module.with_counters()
    assert counted.threads == 1
    nodes = NodeKernels(node_layers(counted.compiled, model, test[0]), counted.node_times)
    report = profile_model(counted, test, rounds=10, counters=False, kernels=nodes)
    rows = {r["layer"]: r for r in report.layers}
    assert {"0", "2", "(between kernels)"} <= set(rows)
    assert rows["0"]["op_type"].startswith("FullyConnected")
    assert rows["0"]["p50_ms"] + rows["1"]["p50_ms"] > 4 * rows["2"]["p50_ms"]
    rows_ms = sum(r["mean_ms"] for r in report.layers)
    assert rows_ms == pytest.approx(report.call["mean_ms"], rel=0.15)


@needs_openvino
def test_node_times_are_openvinos_means_and_can_leave_out_the_first_calls() -> None:
    """OpenVINO's counters give each node's mean over every call of the compiled model, not
    the last call's: after three calls at batch 4096 and twenty at batch 1, its own figures
    still carry the large calls, while the times counted from the small calls do not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256)).eval()
    small, big = torch.randn(1, 256), torch.randn(4096, 256)  # 4096x the work: CI's load
    # slows a call a few times, not a thousand
    built = build(model, Recipe(backend=F32), example=((small,), {}))
    counted = built.module.with_counters()

    def total_us() -> float:
        return sum(ns for _, ns, _ in counted.node_times()) / 1e3

    with torch.inference_mode():
        for _ in range(3):
            counted(big)
        large = total_us()
        counted.count_from_here()
        for _ in range(20):
            counted(small)
        since = total_us()
        counted._since = (0, {})  # OpenVINO's own means, over all 23 calls
        means = total_us()
    assert counted.calls == 23
    assert means == pytest.approx((3 * large + 20 * since) / 23, rel=0.1, abs=5)
    assert large > 20 * since and means > 3 * since


@needs_openvino
def test_transformer_layers_are_named_to_nncf(tiny_bert: dict[str, Any]) -> None:
    model = tiny_bert["model"]
    rules = {"_default": "int8-static-pc", r"re:.*\.output\.dense": "fp32", "encoder.pooler.dense": "fp32"}
    built = build(model, Recipe(quantization=Quantization.of(rules), backend=F32),
                  calibration=tiny_bert["inputs"])
    applied = set(built.report.applied)
    assert "encoder.encoder.layer.1.intermediate.dense" in applied
    assert "encoder.encoder.layer.0.attention.self.query" in applied
    assert not any(n.endswith("output.dense") and "attention" not in n for n in applied)
    assert any("transformer preset" in n for n in built.report.notes)
    # the pooler never runs (sentence embeddings do not use it): nothing to match it to
    assert "not honoured" in built.report.skipped["encoder.pooler.dense"]
    g = torch.Generator().manual_seed(3)
    ids, mask = token_batch(g, 2, 24)
    with torch.inference_mode():
        assert compare(model(ids, mask), built.module(ids, mask))["cosine"] > 0.99


def test_a_missing_openvino_is_a_build_error_that_says_what_to_install(
    mlp_spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from compiler import openvino_backends
    from pgc_daemon.optimizer.search.offers import backends_for

    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    with pytest.raises(BuildError, match=r"pip install pgc\[openvino\]"):
        build(mlp_spec["model"], INT8, calibration=examples(mlp_spec, 2))
    assert openvino_backends() == ()
    assert not any(b.startswith("openvino") for b in backends_for())


def test_recipes_with_openvino_round_trip_and_the_space_parses_their_labels() -> None:
    from pgc_daemon.optimizer.search.space import Space

    recipe = Recipe(quantization=Quantization.of({"_default": "int8-static-pc", "net.3": "fp32"}), backend=F32)
    assert Recipe.from_dict(recipe.to_dict()) == recipe and Recipe.from_json(recipe.to_json()).hash == recipe.hash
    assert recipe.to_dict()["backend"] == {"kind": "openvino", "mode": "f32"}
    assert recipe.label() == "int8-static-pc+1 fp32 · openvino-f32"
    for backend in (DEFAULT, F32, Backend("inductor", "max-autotune"), Backend("onnxruntime")):
        assert Backend.parse(backend.label()) == backend
    for bad in (lambda: Backend("openvino", "max-autotune"), lambda: Backend("inductor", "f32"),
                lambda: Backend.parse("openvino-f16")):
        with pytest.raises(RecipeError):
            bad()
    space = Space(hot_layers=("net.3",), layer_choices=("fp32", "int8-static-pc"),
                  default_choices=("fp32", "int8-static-pc"), backends=("inductor", "openvino", "openvino-f32"))
    params = space.params("int8-static-pc", "openvino-f32", **{"net.3": "fp32"})
    assert space.recipe(params) == recipe
    assert space.params_for(recipe) == params
    assert space.params_for(Recipe(backend=Backend("inductor", "max-autotune"))) is None


_SCRIPT = f"""
import json, sys, torch
sys.path.insert(0, {os.getcwd()!r})
torch.set_num_threads({torch.get_num_threads()})
from compiler import CompileCache, build, load_artifact
from tests.compiler_tests.test_artifacts import inputs, make_model
from tests.compiler_tests.test_openvino import INT8
cache = CompileCache(sys.argv[2], artifacts=sys.argv[3])
if sys.argv[1] == "build":
    v = build(make_model(), INT8, calibration=inputs(), cache=cache)
else:
    v = load_artifact(make_model(), INT8, sys.argv[5], cache=cache)
with torch.inference_mode():
    torch.save([v.module(*a, **k) for a, k in inputs()], sys.argv[4])
print(json.dumps({{"artifact": v.artifact, "cache": v.report.cache, "type": type(v.module).__name__,
                  "applied": sorted(v.report.applied), "load_s": v.report.build_s,
                  "nncf": "nncf" in sys.modules,
                  "converter": "openvino.frontend.pytorch.ts_decoder" in sys.modules}}))
"""


def _run(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_openvino
def test_another_process_loads_the_ir_without_converting_or_quantizing(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    built = _run("build", str(tmp_path / "worker"), str(shared), str(tmp_path / "built.pt"))
    assert built["type"] == "OvModule" and built["cache"] == "miss" and built["artifact"]
    assert built["nncf"] and built["converter"]  # the builder converted and quantized
    assert built["applied"] == ["0", "2", "4"]
    folder = shared / built["artifact"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["kind"] == "openvino" and set(manifest["files"]) == {"model.xml", "model.bin"}
    assert manifest["key"]["versions"]["openvino"] != "-" and manifest["key"]["versions"]["nncf"] != "-"
    assert Recipe.from_dict(manifest["recipe"]) == INT8
    loaded = _run("load", str(tmp_path / "serving"), str(shared), str(tmp_path / "loaded.pt"), built["artifact"])
    assert loaded["cache"] == "artifact" and loaded["type"] == "OvModule"
    assert not loaded["nncf"] and not loaded["converter"]  # nothing converted, nothing quantized
    assert loaded["applied"] == built["applied"] and loaded["load_s"] < 5
    for a, b in zip(torch.load(tmp_path / "built.pt"), torch.load(tmp_path / "loaded.pt")):
        assert compare(a, b)["max_abs"] < 1e-6


@needs_openvino
@pytest.mark.slow
def test_minilm_int8_with_the_transformer_preset_keeps_cosine() -> None:
    from pgc_daemon.examples import minilm as ml

    model = ml.load_model()
    texts = list(ml.sentences())
    calib = [(ml.encode([t]), {}) for t in texts[:32]]
    held = [(ml.encode([t]), {}) for t in texts[200:216]]
    refs = outputs(model, held)
    for recipe, floor in ((Recipe(backend=F32), 0.99999), (Recipe(backend=DEFAULT), 0.999), (INT8, 0.99)):
        built = build(model, recipe, calibration=calib)
        assert fidelity("cosine", refs, outputs(built.module, held)) >= floor, recipe.label()
    assert any("transformer preset" in n and "36 of 36" in n for n in built.report.notes)
