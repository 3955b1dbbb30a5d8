"""The compile cache: a documented key, hits and misses counted, the same key rebuilds
bit-identical outputs (in this process, from the stored artifact or the saved graph, and in
another process), any change of the key misses."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from compiler import (
    Backend, CompileCache, Quantization, Recipe, UnsafeFolderError, build, cache_key,
)
from compiler.cache import SHARED_INDUCTOR_ENV
from tests.compiler_tests.conftest import examples, outputs

STATIC = Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}), backend=Backend("inductor"))


def test_key_has_every_documented_part(mlp_spec: dict[str, Any]) -> None:
    key = cache_key(mlp_spec["model"], STATIC, examples(mlp_spec, 2))
    d = key.to_dict()
    assert set(d) == {"graph", "recipe", "calibration", "versions", "device", "env"}
    assert d["recipe"] == STATIC.hash and len(d["graph"]) == 64
    assert {"torch", "torchao", "triton"} <= set(d["versions"])
    assert "torch.threads" in d["env"]


@pytest.mark.parametrize(
    "change",
    ["weights", "recipe", "calibration", "torch", "triton", "device", "env"],
)
def test_changing_any_part_of_the_key_misses(mlp_spec: dict[str, Any], tmp_path: Path, change: str) -> None:
    model = mlp_spec["model"]
    cal = examples(mlp_spec, 2)
    base = dict(graph=None, versions=None, device=None, environ=dict(os.environ))
    key = cache_key(model, STATIC, cal, **base)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(base)
    recipe, calibration = STATIC, cal
    if change == "weights":
        kwargs["graph"] = "0" * 64
    elif change == "recipe":
        recipe = Recipe(quantization=Quantization.of({"_default": "int8-static-pt"}), backend=Backend("inductor"))
    elif change == "calibration":
        calibration = examples(mlp_spec, 3)
    elif change in ("torch", "triton"):
        versions = dict(key.versions)
        versions[change] = versions[change] + "+other"
        kwargs["versions"] = versions
    elif change == "device":
        kwargs["device"] = "cuda-0123456789|sm_90"
    else:
        kwargs["environ"] = {**os.environ, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
    other = cache_key(model, recipe, calibration, **kwargs)
    assert other.digest != key.digest
    cache = CompileCache(tmp_path)
    cache.put(key, object())
    assert cache.get(other) is None and cache.get(key) is not None


def test_cache_locations_are_not_part_of_the_key(mlp_spec: dict[str, Any]) -> None:
    a = cache_key(mlp_spec["model"], STATIC, (), environ={"TORCHINDUCTOR_CACHE_DIR": "/a"})
    b = cache_key(mlp_spec["model"], STATIC, (), environ={"TORCHINDUCTOR_CACHE_DIR": "/b"})
    assert a == b
    c = cache_key(mlp_spec["model"], Recipe(), examples(mlp_spec, 2))
    assert c.calibration == "-"  # a recipe that does not calibrate does not depend on inputs


def test_same_key_rebuilds_bit_identical_outputs_from_memory_and_disk(
    cnn_spec: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SHARED_INDUCTOR_ENV, raising=False)  # Inductor's kernels: pgc's folder
    cal = examples(cnn_spec, 8)
    test = examples(cnn_spec, 4)
    cache = CompileCache(tmp_path)
    first = build(cnn_spec["model"], STATIC, calibration=cal, cache=cache)
    assert first.report.cache == "miss" and cache.stats.misses == 1 and cache.stats.stored == 1
    again = build(cnn_spec["model"], STATIC, calibration=cal, cache=cache)
    assert again.module is first.module and cache.stats.memory_hits == 1
    assert again.report.cache == "hit" and first.report.cache == "miss"
    fresh = CompileCache(tmp_path)  # a restarted process: nothing in memory, the disk remains
    third = build(cnn_spec["model"], STATIC, calibration=cal, cache=fresh)
    # the packages built the first time are loaded whole: nothing calibrated or compiled
    assert third.report.cache == "artifact" and fresh.stats.artifact_loads == 1 and fresh.stats.misses == 0
    assert third.artifact == first.artifact is not None
    assert third.report.applied == first.report.applied
    assert third.report.kernel_paths["<compiled>"] == first.report.kernel_paths["<compiled>"]
    for a, b in zip(outputs(first.module, test), outputs(third.module, test)):
        assert torch.equal(a, b)
    shutil.rmtree(tmp_path / "artifacts")  # without the artifact: the quantized graph saved on disk
    again_fresh = CompileCache(tmp_path)
    fourth = build(cnn_spec["model"], STATIC, calibration=cal, cache=again_fresh)
    assert fourth.report.cache == "hit" and again_fresh.stats.disk_hits == 1 and again_fresh.stats.misses == 0
    assert fourth.report.kernel_paths["<compiled>"] == first.report.kernel_paths["<compiled>"]
    for a, b in zip(outputs(first.module, test), outputs(fourth.module, test)):
        assert torch.equal(a, b)
    assert any(p.name.startswith("variants") for p in tmp_path.iterdir())
    assert any((tmp_path / "inductor").iterdir())  # Inductor's kernels went to pgc's folder


@pytest.mark.slow
def test_another_process_rebuilds_the_same_variant_bit_identically(cnn_spec: dict[str, Any], tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {os.getcwd()!r})
        torch.set_num_threads({torch.get_num_threads()})
        from pgc_daemon.examples import digits
        from compiler import CompileCache, build
        from tests.compiler_tests.test_cache import STATIC
        spec = digits.cnn()
        cal = [(a, {{}}) for a in spec["example_inputs"][:8]]
        cache = CompileCache(sys.argv[1])
        v = build(spec["model"], STATIC, calibration=cal, cache=cache)
        with torch.inference_mode():
            out = torch.cat([v.module(*a) for a, _ in cal[:4]])
        torch.save(out, sys.argv[2])
        print(v.report.cache, cache.stats.to_dict(), v.report.kernel_paths["<compiled>"])
        """
    )
    outs = []
    for i in range(2):
        path = tmp_path / f"out{i}.pt"
        proc = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "cache"), str(path)],
            capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append((proc.stdout.strip().splitlines()[-1], torch.load(path)))
    assert outs[0][0].startswith("miss") and outs[1][0].startswith("artifact")
    assert "'artifact_loads': 1" in outs[1][0] and "'misses': 0" in outs[1][0]
    assert outs[0][0].split("}")[1] == outs[1][0].split("}")[1]  # the same kernels
    assert torch.equal(outs[0][1], outs[1][1])


def test_a_corrupt_disk_entry_is_a_miss_not_an_error(mlp_spec: dict[str, Any], tmp_path: Path) -> None:
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}))
    cal = examples(mlp_spec, 2)
    cache = CompileCache(tmp_path)
    build(mlp_spec["model"], recipe, calibration=cal, cache=cache)
    entry = next((tmp_path / "variants").iterdir())
    (entry / "graph.pt2").write_bytes(b"not a program")
    fresh = CompileCache(tmp_path)
    rebuilt = build(mlp_spec["model"], recipe, calibration=cal, cache=fresh)
    assert rebuilt.report.cache == "miss" and fresh.stats.misses == 1
    assert len(rebuilt.report.applied) == 3


def test_a_shared_kernel_cache_is_used_only_when_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PGC_INDUCTOR_CACHE_DIR``: one Inductor cache for every work dir, made private like
    pgc's own folders; a folder others may write to is refused (pgc loads code from it)."""
    cache = CompileCache(tmp_path / "work")
    shared = tmp_path / "kernels"
    monkeypatch.setenv(SHARED_INDUCTOR_ENV, str(shared))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with cache.inductor_dir():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(shared)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # put back
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700
    shared.chmod(0o777)
    with pytest.raises(UnsafeFolderError, match="writable by group or others"):
        with cache.inductor_dir():
            pass
    monkeypatch.delenv(SHARED_INDUCTOR_ENV)
    with cache.inductor_dir():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "work" / "inductor")
