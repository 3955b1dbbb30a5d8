"""Kernel paths chosen by measurement on this machine, remembered so rebuilds agree, and
reported per layer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from compiler import Backend, Quantization, Recipe, _measure, build, probe
from tests.compiler_tests.conftest import examples


@pytest.fixture(autouse=True)
def _fresh_choices() -> Any:
    _measure.forget()
    yield
    _measure.set_store(None)
    _measure.forget()


def test_choose_keeps_the_faster_candidate_and_remembers_it_on_disk(tmp_path: Path) -> None:
    _measure.set_store(tmp_path)
    calls = {"slow": 0, "fast": 0}

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(0.002)

    def fast() -> None:
        calls["fast"] += 1

    best, ms = _measure.choose("op x(1,)", {"slow": slow, "fast": fast}, reps=3, rounds=2)
    assert best == "fast" and ms["slow"] > ms["fast"]
    assert (tmp_path / "kernel_choices.json").exists()
    _measure.forget()
    _measure.set_store(tmp_path)  # another process reading the same folder
    before = dict(calls)
    again, _ = _measure.choose("op x(1,)", {"slow": slow, "fast": fast})
    assert again == "fast" and calls == before  # nothing timed again


def test_int8_dynamic_path_is_timed_on_the_model_and_reported(mlp_spec: dict[str, Any]) -> None:
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor"))
    built = build(mlp_spec["model"], recipe, example=examples(mlp_spec, 1)[0])
    paths = built.report.kernel_paths
    assert all("chosen by measurement on net.3" in paths[n] for n in ("net.1", "net.3", "net.5"))
    if "pt2e path chosen" in paths["net.1"]:
        assert "oneDNN int8 linear" in paths["<compiled>"]
    else:
        assert "oneDNN int8 linear" not in paths["<compiled>"]
    again = build(mlp_spec["model"], recipe, example=examples(mlp_spec, 1)[0])
    assert again.report.kernel_paths["net.1"] == paths["net.1"]  # remembered, not re-timed


def test_half_precision_paths_name_the_units_the_probe_found(mlp_spec: dict[str, Any]) -> None:
    built = build(mlp_spec["model"], Recipe(quantization=Quantization.of({"net.3": "bf16"})))
    path = built.report.kernel_paths["net.3"]
    if probe().bf16_fast:
        assert "BF16" in path
    else:
        assert "no bf16 units" in path


_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16

processor\t: 1
cpu family\t: 99
model name\t: Other
"""


def test_the_probe_names_the_cpu_generation_that_flags_alone_do_not_tell() -> None:
    from compiler.hardware import Hardware, parse_cpuinfo

    name, flags, generation = parse_cpuinfo(_CPUINFO)
    assert (name, generation) == ("AMD EPYC", "family 25 model 17")  # the first processor's
    assert {"avx512_vnni", "avx512_bf16"} <= flags and "avx512_fp16" not in flags
    assert parse_cpuinfo("model name\t: X\nflags\t: sse2\n") == ("X", {"sse2"}, "")
    hw = Hardware(cpu=name, arch="x86_64", cores=2, features={"avx2": True}, generation=generation)
    assert hw.summary() == "AMD EPYC, family 25 model 17 (2 cores; avx2)"
    # the generation does not change cache keys or study names
    assert hw.key() == Hardware(cpu=name, arch="x86_64", cores=2, features={"avx2": True}).key()
