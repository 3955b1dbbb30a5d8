"""``pgc profile`` and ``pgc doctor``: their reports, their JSON, and one readable line with
exit code 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from compiler import probe
from compiler._kernel_map import ENV, kernel_profiling
from pgc_daemon.cli import run
from pgc_daemon.cli.doctor import compatibility

FFN = (".intermediate.dense", ".output.dense")


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def test_profile_puts_minilms_feed_forward_layers_at_the_top(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["profile", "pgc_daemon.examples.minilm:build", "--rounds", "2", "--inputs", "6",
                "--threads", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = _last_json(out)
    top = [r["layer"] for r in report["layers"][:6]]
    assert all(name.endswith(FFN) and "attention" not in name for name in top), top
    groups = [g["group"] for g in report["groups"][:2]]
    assert sorted(groups) == ["encoder.encoder.layer.*.intermediate.dense",
                              "encoder.encoder.layer.*.output.dense"]
    hot = [s for s in report["suggestions"] if s["kind"] in ("hot_group", "hot_layer")]
    assert hot and all(s["target"].endswith(FFN) for s in hot)
    assert sum(r["latency_ratio"] for r in report["layers"]) == pytest.approx(1.0, abs=1e-6)
    first = report["layers"][0]
    assert first["p95_ms"] >= first["p50_ms"] > 0 and first["mean_ms"] > 0
    assert report["shapes"] == {"b1 s128": 12} and report["calls"] == 12
    assert "latency_ratio" in out and "suggestions" in out  # the table came first


def test_profile_of_the_cnn_with_counters_and_hardware_suggestions(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["profile", "pgc_daemon.examples.digits:cnn", "--rounds", "2", "--inputs", "4", "--json"])
    report = _last_json(capsys.readouterr().out)
    assert code == 0 and report["device"] == "cpu"
    layers = {r["layer"]: r for r in report["layers"]}
    assert {"features.0", "features.3", "head.1"} <= set(layers)
    from profiler import counter_availability

    events = set(counter_availability().events)
    assert set(layers["features.3"]["counters"] or {}) == events  # perf counters per layer
    kinds = {s["kind"] for s in report["suggestions"]}
    assert "layout" in kinds and report["layout"]["ratio"] >= 0
    assert ("int8_path" in kinds) == any(r["op_type"] in ("Conv2d", "Linear") for r in report["layers"])
    int8 = next(s for s in report["suggestions"] if s["kind"] == "int8_path")
    assert ("fast path" in int8["message"]) == probe().int8_fast


@pytest.fixture
def broken_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "pgc_broken_spec.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Linear(3, 3), [torch.zeros(2, 5)]  # inputs of the wrong width\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "pgc_broken_spec:build"


@pytest.mark.parametrize(
    "argv,says",
    [
        (["profile", "no_such_module_here:build"], "cannot import"),
        (["profile", "not-a-spec"], "package.module:function"),
        (["profile", "pgc_daemon.examples.digits:nothing"], "has no function"),
        (["profile", "pgc_daemon.examples.digits:cnn", "--rounds", "0"], "must be positive"),
        (["profile", "pgc_daemon.examples.digits:cnn", "--threads", "0"], "must be positive"),
        (["profile", "BROKEN"], "failed on its example inputs"),
        (["profile", "pgc_daemon.examples.digits:cnn", "--recipe", "{not json"], "not a recipe"),
        (["profile", "pgc_daemon.examples.digits:cnn", "--recipe", '{"backend": {"kind": "onnxruntime"}}'],
         "no per-layer view"),
    ],
)
def test_profile_bad_input_is_one_line_and_exit_2(
    argv: list[str], says: str, broken_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [broken_spec if a == "BROKEN" else a for a in argv]
    code = run(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("pgc profile: error") and says in lines[0], err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_profile_on_cuda_without_a_gpu_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["profile", "pgc_daemon.examples.digits:cnn", "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("pgc profile: error: --device cuda:")
    assert "CPU-only build" in err or "no CUDA device" in err


def test_the_real_command_line_exits_2_with_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "pgc_daemon.cli", "profile", "nope"],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr


def test_doctor_reports_versions_features_and_what_pgc_uses(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["doctor", "--json"])
    out = capsys.readouterr().out
    report = _last_json(out)
    assert code == 0
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_build"] == torch.version.cuda
    hw = probe()
    cpu = report["cpu"]
    assert cpu["avx2"] == hw.features["avx2"] and cpu["avx512"] == hw.features["avx512"]
    assert cpu["vnni"] == bool(hw.features["avx512_vnni"] or hw.features["avx_vnni"])
    assert cpu["amx"] == bool(hw.features["amx_int8"] or hw.features["amx_bf16"])
    assert cpu["bf16"] == bool(hw.features["avx512_bf16"] or hw.features["amx_bf16"])
    assert cpu["int8_fast"] == hw.int8_fast
    assert cpu["generation"] == hw.generation  # machines with the same flags differ
    from profiler import counter_availability

    assert report["perf_counters"]["mode"] == counter_availability().mode
    assert report["perf_counters"]["events"] == list(counter_availability().events)
    assert report["triton"]["version"] is not None  # installed with pgc
    assert any(u.startswith("per-layer CPU counters") for u in report["uses"])
    assert any(u.startswith("int8") for u in report["uses"])
    # the autocast backends are named where the search offers them: with AMX only
    assert any(u.startswith("AMX: int8 kernels with bf16") for u in report["uses"]) == bool(
        hw.features.get("amx_bf16"))
    if not torch.cuda.is_available():
        assert report["cupti"]["available"] is False and report["cupti"]["detail"]
        assert report["cuda"]["devices"] == [] and report["cuda"]["compatible"] is None
        assert any(u.startswith("GPU profiling: off") for u in report["uses"])
    for label in ("torch", "CUPTI", "Triton", "perf counters", "CPU", "pgc will use"):
        assert label in out


@pytest.mark.parametrize(
    "runtime,driver,ok,says",
    [
        (None, None, None, "CPU-only"),
        ("12.4", "12.8", True, "supports CUDA 12.8 >= 12.4"),
        ("12.8", "12.4", True, "minor-version compatibility"),
        ("13.0", "12.8", False, "torch needs 13.0"),
        ("12.4", None, False, "none was found"),
    ],
)
def test_cuda_compatibility(runtime: str | None, driver: str | None, ok: bool | None, says: str) -> None:
    got, why = compatibility(runtime, driver)
    assert got is ok and says in why


def test_profile_sensitivity_is_shown_and_saved_for_the_served_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import store as st
    from compiler import fingerprint
    from pgc_daemon.examples import digits

    url = f"sqlite:///{tmp_path / 'pgc.db'}"
    store = st.open_store(url)
    digest = fingerprint(digits.mlp()["model"])
    with store.session() as s:
        st.repo.upsert_model(s, "mlp", spec="pgc_daemon.examples.digits:mlp", graph_hash=digest)
    code = run(["profile", "pgc_daemon.examples.digits:mlp", "--rounds", "1", "--sensitivity",
                "--store", url, "--json"])
    out = capsys.readouterr().out
    assert code == 0
    sens = _last_json(out)["sensitivity"]
    assert sens["saved_for"] == ["mlp"]
    measured = [r for r in sens["rows"] if r["status"] == "ok"]
    assert measured and all(0.0 <= r["fidelity"] <= 1.0 for r in measured)
    assert {r["choice"] for r in measured} >= {"int8-dynamic-pc", "int8-dynamic-pt"}
    with store.session() as s:
        rows = st.repo.load_sensitivity(s, st.repo.get_model(s, "mlp").id, digest)
    assert {(r.layer, r.choice) for r in rows} == {(r["layer"], r["choice"]) for r in sens["rows"]}
    assert run(["profile", "pgc_daemon.examples.digits:mlp", "--store", url]) == 2  # --store needs --sensitivity


def test_profile_of_a_compiled_recipe_splits_its_kernels_over_the_layers(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--recipe``: the digits MLP compiled (an AOTInductor package), profiled through its
    kernels: every linear has a row, the ReLUs fused into them say so, the rows add up to
    the calls. The kernel events stay with that build: the process's environment is left as
    it was (it used to keep ``PGC_KERNEL_PROFILE=1``, and a later build in the same process
    was keyed as a profiling twin)."""
    monkeypatch.delenv(ENV, raising=False)
    recipe = '{"backend": {"kind": "inductor"}}'
    code = run(["profile", "pgc_daemon.examples.digits:mlp", "--recipe", recipe, "--rounds", "3",
                "--inputs", "4", "--threads", "1", "--no-counters", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = _last_json(out)
    assert report["variant"] == "fp32 · inductor"
    rows = {r["layer"]: r for r in report["layers"]}
    assert {"net.1", "net.3", "net.5", "(between kernels)"} <= set(rows)
    assert "fused with" in rows["net.2"]["op_type"]  # a ReLU inside its linear's kernel
    assert sum(r["latency_ratio"] for r in report["layers"]) == pytest.approx(1.0, abs=1e-6)
    assert report["calls"] == 12
    assert ENV not in os.environ and not kernel_profiling()


def test_profile_of_an_openvino_recipe_reads_its_nodes_counters(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An OpenVINO variant (the search's choice where OpenVINO is fastest) profiled through
    OpenVINO's per-node counters: each int8 convolution's node gives its time to the
    convolution, its BatchNorm and its ReLU, and the rows add up to the calls."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    recipe = ('{"quantization": {"_default": {"precision": "int8", "scheme": "static"}}, '
              '"backend": {"kind": "openvino"}}')
    code = run(["profile", "pgc_daemon.examples.digits:cnn", "--recipe", recipe, "--rounds", "3",
                "--inputs", "4", "--threads", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = _last_json(out)
    assert report["variant"].endswith("openvino")
    rows = {r["layer"]: r for r in report["layers"]}
    assert {"features.0", "features.3", "features.7", "head.1", "(between kernels)"} <= set(rows)
    assert rows["features.0"]["op_type"].startswith("Convolution (")
    assert "fused with features.1, features.2" in rows["features.0"]["op_type"]
    assert sum(r["latency_ratio"] for r in report["layers"]) == pytest.approx(1.0, abs=1e-6)
    assert report["calls"] == 12
    assert report["counters"].startswith("not used")  # read per hooked layer, not per node


def test_doctor_says_which_gpus_get_fp8_searched() -> None:
    """On a machine with GPUs the doctor says what a model on them is searched with: fp8
    only on GPUs with float8 tensor cores (compute capability 8.9 on). The report of this
    machine, with GPUs put in (a CPU machine has none to show)."""
    from pgc_daemon.cli.doctor import collect, uses

    report = collect()
    report["cuda"] = dict(report["cuda"], compatible=True, devices=[
        {"index": 0, "name": "H100", "capability": "9.0", "fp8": True},
        {"index": 1, "name": "A100", "capability": "8.0", "fp8": False}])
    line = next(u for u in uses(report) if u.startswith("GPU models"))
    assert "and fp8 (H100)" in line and "A100" not in line
    report["cuda"]["devices"] = report["cuda"]["devices"][1:]
    line = next(u for u in uses(report) if u.startswith("GPU models"))
    assert "no fp8" in line
