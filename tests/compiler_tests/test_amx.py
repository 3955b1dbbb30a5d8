"""A process that never compiled runs a package whose kernels use AMX.

Linux kills a process at its first AMX instruction (SIGILL) unless it asked for the tile
registers first. Inductor asks while it compiles and oneDNN before its own AMX primitives,
so the building process and any process that ran an int8 layer were fine; a serving replica
that loads a bf16 max-autotune artifact (Inductor's AMX GEMM template) and calls it first was
killed. Build and load run in child processes, as a worker and a replica do, so the fault
fails this test instead of ending the test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiler._aoti import package_code
from compiler.cache import SHARED_INDUCTOR_ENV

ROOT = Path(__file__).resolve().parents[2]

MODEL = """
import sys, torch
from torch import nn
from compiler import Backend, CompileCache, Recipe
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).eval()
recipe = Recipe(backend=Backend("inductor", "max-autotune", autocast="bf16"))
cache = CompileCache(sys.argv[1])
"""

BUILD = MODEL + """
from compiler import build
inputs = [((torch.rand(32, 256),), {}) for _ in range(4)]
built = build(model, recipe, calibration=inputs, example=inputs[0], cache=cache)
print(built.artifact)
"""

LOAD = MODEL + """
from compiler import fidelity, load_artifact
variant = load_artifact(model, recipe, sys.argv[2], cache=cache)
x = torch.rand(32, 256)
with torch.inference_mode():  # the first thing this process runs: the package
    got = variant.module(x)
    print(fidelity("cosine", [model(x)], [got]))
"""


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def _child(code: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(ROOT),
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    if SHARED_INDUCTOR_ENV in os.environ:  # the tests' kernel cache: Inductor's ISA probes
        env[SHARED_INDUCTOR_ENV] = os.environ[SHARED_INDUCTOR_ENV]  # compile once a session
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not _has_amx(), reason="needs a CPU with AMX")
def test_a_replica_that_never_compiled_runs_an_amx_package(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    built = _child(BUILD, cache, tmp_path=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    digest = built.stdout.split()[-1]
    packages = list((tmp_path / "cache" / "artifacts" / digest).glob("*.pt2"))
    assert packages
    if "_tile_loadconfig" not in "".join(package_code(p)[1] for p in packages):
        pytest.skip("max-autotune chose no AMX kernel on this machine today")
    loaded = _child(LOAD, cache, digest, tmp_path=tmp_path)
    assert loaded.returncode == 0, f"rc {loaded.returncode}: {loaded.stderr[-2000:]}"
    assert json.loads(loaded.stdout.split()[-1]) > 0.99
