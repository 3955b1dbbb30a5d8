"""Static int8 through pt2e: calibration on given inputs, per-layer choices through the
quantizer's module-name configs, the kernels it really runs, and what it leaves alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler import Backend, Quantization, Recipe, build, compare, fidelity, probe, warm
from tests.compiler_tests.conftest import examples, outputs, token_batch

STATIC = Quantization.of({"_default": "int8-static-pc"})


def _x86_onednn() -> bool:
    return probe().arch in ("x86_64", "AMD64") and torch.backends.mkldnn.is_available()


def test_static_cnn_compiles_to_onednn_int8_kernels_and_keeps_accuracy(cnn_spec: dict[str, Any]) -> None:
    from torch._inductor import config

    cal = examples(cnn_spec, 8)
    built = build(cnn_spec["model"], Recipe(quantization=STATIC, backend=Backend("inductor")), calibration=cal)
    assert set(built.report.applied) == {"features.0", "features.3", "features.7", "head.1", "head.3"}
    assert built.report.compiled and built.report.skipped == {}
    if _x86_onednn():
        kernels = built.report.kernel_paths["<compiled>"]
        assert "oneDNN int8 conv" in kernels and "oneDNN int8 linear" in kernels
    assert config.freezing is False  # set only while the variant's own calls ran
    test = examples(cnn_spec, 20)
    ref, out = outputs(cnn_spec["model"], test), outputs(built.module, test)
    assert config.freezing is False
    assert fidelity("top1", ref, out) >= 0.97
    acc = cnn_spec["accuracy"]
    labels = cnn_spec["labels"][:20]
    assert acc(out, labels) >= acc(ref, labels) - 0.01


def test_static_dynamic_and_fp32_layers_mix_in_one_graph(cnn_spec: dict[str, Any]) -> None:
    rules = {"_default": "int8-static-pt", "head.3": "int8-dynamic-pc", "features.0": "fp32"}
    built = build(cnn_spec["model"], Recipe(quantization=Quantization.of(rules)), calibration=examples(cnn_spec))
    applied = built.report.applied
    assert "features.0" not in applied
    assert applied["head.3"] == "int8-dynamic-pc"
    assert applied["features.3"] == applied["head.1"] == "int8-static-pt"
    assert isinstance(built.module, torch.fx.GraphModule)
    test = examples(cnn_spec, 10)
    assert fidelity("top1", outputs(cnn_spec["model"], test), outputs(built.module, test)) >= 0.97


def test_per_tensor_static_shares_one_scale_per_weight(mlp_spec: dict[str, Any]) -> None:
    built = build(mlp_spec["model"], Recipe(quantization=Quantization.of({"net.3": "int8-static-pt"})),
                  calibration=examples(mlp_spec, 4))
    assert built.report.applied == {"net.3": "int8-static-pt"}
    scales = [
        getattr(built.module, n.args[1].target) for n in built.module.graph.nodes
        if n.op == "call_function" and "dequantize_per_channel" in str(n.target)
    ]
    assert len(scales) == 1 and scales[0].numel() == 1024
    assert torch.allclose(scales[0], scales[0][0].expand_as(scales[0]))


def test_per_tensor_static_gets_the_int8_kernel_when_compiled(mlp_spec: dict[str, Any]) -> None:
    if not _x86_onednn():
        pytest.skip("oneDNN int8 kernels are x86 only")
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-static-pt"}), backend=Backend("inductor"))
    built = build(mlp_spec["model"], recipe, calibration=examples(mlp_spec, 4))
    assert "oneDNN int8 linear x3" in built.report.kernel_paths["<compiled>"]
    assert "MKL fp32" not in built.report.kernel_paths["<compiled>"]


def test_a_variant_compiled_while_another_thread_runs_one_still_gets_int8_kernels(
    mlp_spec: dict[str, Any],
) -> None:
    """The serving process builds a variant while its request threads run the active pt2e
    variant. Inductor's settings are per thread: the build must set the freezing flag for its
    own thread even while another thread is inside a variant call, or it compiles to fp32
    matmuls on dequantized weights (what happened in the hot-swap benchmark)."""
    import threading

    from compiler._backend import freezing_enabled
    from torch._inductor import config

    if not _x86_onednn():
        pytest.skip("oneDNN int8 kernels are x86 only")
    inside, leave = threading.Event(), threading.Event()

    def serving_thread() -> None:
        with freezing_enabled():  # what a request in a pt2e variant's call does
            inside.set()
            leave.wait(timeout=300)

    other = threading.Thread(target=serving_thread, daemon=True)
    other.start()
    try:
        assert inside.wait(timeout=30)
        recipe = Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}), backend=Backend("inductor"))
        built = build(mlp_spec["model"], recipe, calibration=examples(mlp_spec, 4))
    finally:
        leave.set()
        other.join(timeout=30)
    assert "oneDNN int8 linear x3" in built.report.kernel_paths["<compiled>"]
    assert config.freezing is False  # nothing left set in this thread either


def test_layers_the_quantizer_cannot_take_stay_fp32_with_a_reason(mlp_spec: dict[str, Any]) -> None:
    rules = {"_default": "int8-static-pc", "net.3": "bf16", "net.5": "int8-weight_only-pc"}
    built = build(mlp_spec["model"], Recipe(quantization=Quantization.of(rules)), calibration=examples(mlp_spec, 4))
    # bf16 is cast inside the graph (test_graph_cast.py); weight-only has no place in it
    assert built.report.applied == {"net.1": "int8-static-pc", "net.3": "bf16"}
    assert set(built.report.skipped) == {"net.5"} and "kept fp32" in built.report.skipped["net.5"]


def test_static_without_calibration_inputs_is_skipped_not_guessed(mlp_spec: dict[str, Any]) -> None:
    built = build(mlp_spec["model"], Recipe(quantization=STATIC), example=examples(mlp_spec, 1)[0])
    assert built.report.applied == {}
    assert all("calibrates on live inputs" in why for why in built.report.skipped.values())
    assert set(built.report.skipped) == {"net.1", "net.3", "net.5"}


def test_bert_with_an_unused_pooler_exports_and_serves_any_batch(tiny_bert: dict[str, Any]) -> None:
    model = tiny_bert["model"]
    built = build(model, Recipe(quantization=STATIC), calibration=tiny_bert["inputs"])
    assert "encoder.pooler.dense" in built.report.skipped  # dead code, removed before prepare
    assert "dead code" in built.report.skipped["encoder.pooler.dense"]
    assert len(built.report.applied) == 12
    # calibrated on batch 1, serves batch 3 and another length
    g = torch.Generator().manual_seed(5)
    for batch, length in ((3, 32), (2, 20)):
        ids, mask = token_batch(g, batch, length)
        with torch.inference_mode():
            assert compare(model(ids, mask), built.module(ids, mask))["cosine"] > 0.999


def test_data_dependent_control_flow_quantizes_the_exportable_parts(branchy: dict[str, Any]) -> None:
    model, inputs = branchy["model"], branchy["inputs"]
    built = build(model, Recipe(quantization=STATIC), calibration=inputs)
    assert set(built.report.applied) == {"a.0", "b", "c"}
    assert any("whole-model export failed" in n for n in built.report.notes)
    for args, _ in inputs[:2]:  # one input on each side of the branch
        with torch.inference_mode():
            c = compare(model(*args), built.module(*args))
        assert c["sqnr_db"] > 25 and c["top1"] == 1.0


def test_control_flow_model_compiled_with_graph_breaks_is_still_correct(branchy: dict[str, Any]) -> None:
    model, inputs = branchy["model"], branchy["inputs"]
    built = build(model, Recipe(quantization=STATIC, backend=Backend("inductor")), calibration=inputs)
    warm(built, inputs[:2])
    for args, _ in inputs[:2]:
        with torch.inference_mode():
            assert compare(model(*args), built.module(*args))["sqnr_db"] > 25


def test_a_second_quantization_of_the_same_model_reuses_its_export_and_matches_a_fresh_one(
    cnn_spec: dict[str, Any]
) -> None:
    """A search quantizes one model many ways; the export is kept for the next build (and
    the next build's quantization must not see what the previous one did to its copy)."""
    from compiler import _pt2e

    cal = examples(cnn_spec, 8)
    test = examples(cnn_spec, 6)
    rules = [{"_default": "int8-static-pc"}, {"_default": "int8-static-pc", "head.3": "fp32"}]
    _pt2e._EXPORTS.clear()
    first = [outputs(build(cnn_spec["model"], Recipe(quantization=Quantization.of(r)),
                           calibration=cal).module, test) for r in rules]
    assert len(_pt2e._EXPORTS) == 1  # one export, reused by the second recipe
    calls = []
    real = _pt2e.export_program
    _pt2e.export_program = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        again = outputs(build(cnn_spec["model"], Recipe(quantization=Quantization.of(rules[0])),
                              calibration=cal).module, test)
    finally:
        _pt2e.export_program = real
    assert calls == []  # served from the kept graph
    _pt2e._EXPORTS.clear()
    fresh = outputs(build(cnn_spec["model"], Recipe(quantization=Quantization.of(rules[1])),
                          calibration=cal).module, test)
    for a, b in zip(first[0], again):
        assert torch.equal(a, b)
    for a, b in zip(first[1], fresh):
        assert torch.equal(a, b)
    # another model (other weights) is exported anew
    other = type(cnn_spec["model"])()
    other.load_state_dict({k: v + 0.01 for k, v in cnn_spec["model"].state_dict().items()})
    build(other.eval(), Recipe(quantization=STATIC), calibration=cal)
    assert len(_pt2e._EXPORTS) == 2


@pytest.mark.skipif(not _x86_onednn(), reason="Inductor's int8 kernels are oneDNN's, on x86")
def test_reduce_range_int8_layers_in_a_row_compile_to_what_their_graph_computes(tmp_path: Any) -> None:
    """reduce_range (what pgc quantizes with on CPUs without VNNI) in two int8 linears in a
    row: Inductor fuses the quantize between them into the first kernel, which writes the full
    0..255, and without VNNI the second then saturates (relative error 0.11 against the q/dq
    graph on an AVX2-only EPYC, on inputs past the calibrated range).
    ``clamp_narrow_quantize`` keeps the package to its graph."""
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torch._inductor import aoti_compile_and_package, aoti_load_package, config
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from compiler._pt2e import clamp_narrow_quantize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(384, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 384))
    x = torch.randn(1, 128, 384)
    cfg = xiq.get_default_x86_inductor_quantization_config(reduce_range=True)
    prepared = prepare_pt2e(torch.export.export(model.eval(), (x,)).module(),
                            xiq.X86InductorQuantizer().set_global(cfg))
    prepared(x)
    graph = convert_pt2e(prepared)
    x = 2 * x  # past the calibrated range, as live inputs go: unclamped, 0.11 off (0.002 at 1x)
    with torch.no_grad():
        before = graph(x)
        assert clamp_narrow_quantize(graph) == 2  # the input's quantize and the one between
        want = graph(x)
        assert torch.equal(before, want)  # clamping to the range changes nothing in the graph
        with config.patch(freezing=True):  # as pgc builds packages
            path = aoti_compile_and_package(torch.export.export(graph, (x,)),
                                            package_path=str(tmp_path / "m.pt2"))
        got = aoti_load_package(path)(x)
    assert float((got - want).norm() / want.norm()) < 1e-3


@pytest.mark.skipif(not _x86_onednn(), reason="Inductor's int8 GEMM templates are for x86")
def test_max_autotune_int8_across_two_transformer_layers_computes_what_the_model_does(
    tiny_bert: dict[str, Any],
) -> None:
    """Inductor's max-autotune (C++ GEMM templates) on a pt2e int8 graph of two transformer
    layers: a residual add fused as an in-place sum into one layer's last linear leaves an
    alias the buffer planner lost track of, and the next layer read a reused buffer (cosine
    -0.04 against fp32 here, -0.09 on MiniLM). ``compile_options`` turns the planning off for
    max-autotune. Built through ``torch.compile`` (the memory partition keeps a pt2e graph
    whole) so the build checks nothing itself; a package build would only refuse it."""
    from compiler.parts import Partition

    model, inputs = tiny_bert["model"], tiny_bert["inputs"]
    recipe = Recipe(quantization=STATIC, backend=Backend("inductor", "max-autotune"),
                    partition=Partition("memory"))
    built = build(model, recipe, calibration=inputs)
    assert "max-autotune" in " ".join(built.report.notes)
    with torch.inference_mode():
        worst = min(compare(model(*a, **k), built.module(*a, **k))["cosine"] for a, k in inputs)
    assert worst > 0.99


@pytest.mark.parametrize("rules", [
    {"_default": "int8-dynamic-pc"},
    {"_default": "int8-dynamic-pt"},
    {"_default": "int8-static-pc", "encoder.encoder.layer.0.output.dense": "int8-dynamic-pc"},
])
def test_int8_dynamic_through_max_autotune_is_refused_before_anything_is_built(
    tiny_bert: dict[str, Any], rules: dict[str, str]
) -> None:
    """max-autotune's GEMM autotuning ended the process on dynamically quantized linears
    (MiniLM: a segfault per-channel, heap corruption per-tensor), which in a search is a
    worker gone. It is refused up front, in a moment; the default mode builds the same."""
    import time

    from compiler import BuildError

    model, inputs = tiny_bert["model"], tiny_bert["inputs"]
    started = time.monotonic()
    with pytest.raises(BuildError, match="not built through max-autotune"):
        build(model, Recipe(quantization=Quantization.of(rules),
                            backend=Backend("inductor", "max-autotune")), calibration=inputs)
    assert time.monotonic() - started < 5


class _Residual(torch.nn.Module):
    """``proj(x) + x`` on the model's own input: the add becomes an in-place sum on ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + x


@pytest.mark.skipif(not _x86_onednn(), reason="Inductor's int8 kernels are oneDNN's, on x86")
@pytest.mark.parametrize("partition", ["latency", "memory"])
def test_a_compiled_int8_variant_never_writes_into_the_callers_input(partition: str, tmp_path: Any) -> None:
    """Inductor fuses ``proj(x) + x`` into the int8 linear as an in-place sum on ``x``, a
    tensor the caller owns: unguarded, every call of the package (``latency``) or of
    ``torch.compile`` (``memory``) added the projection into the request's input. The build
    finds it and the variant is called on copies, also when loaded from its artifact."""
    from compiler import CompileCache, load_artifact
    from compiler.parts import Partition

    torch.manual_seed(0)
    model = _Residual().eval()
    cal = [((torch.randn(1, 16, 64),), {}) for _ in range(8)]
    recipe = Recipe(quantization=STATIC, backend=Backend("inductor"), partition=Partition(partition))
    cache = CompileCache(tmp_path / "cache", artifacts=tmp_path / "artifacts")
    built = build(model, recipe, calibration=cal, example=cal[0], cache=cache)
    assert any("writes into its inputs" in n for n in built.report.notes), built.report.notes
    served = [built.module]
    if built.artifact is not None:
        served.append(load_artifact(model, recipe, built.artifact, cache=cache).module)
    assert len(served) == (2 if partition == "latency" else 1)  # a package, stored and loaded
    for module in served:
        x = torch.randn(1, 16, 64)
        kept = x.clone()
        with torch.inference_mode():
            first, second = module(x), module(x)
        assert torch.equal(x, kept)
        assert torch.equal(first, second)
        assert compare(model(x), first)["cosine"] > 0.999
