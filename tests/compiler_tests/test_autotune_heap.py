"""max-autotune with float linears beside pt2e int8 static ones: Inductor's C++ GEMM template
fused the int8 layer's input quantize into the float linear's epilogue, and that kernel
corrupted the heap (``malloc(): invalid size (unsorted)`` on the first calls, every time).
It ended two searches (``nn.TransformerEncoder``, a dataclass-output MLP) and could have ended
a serving process that loaded such a variant. The build now turns epilogue fusion off for
that mix (``compiler._backend.NO_QUANT_EPILOGUE``); the build runs in a child process, so a
heap corruption fails this test instead of ending the test run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.cache import SHARED_INDUCTOR_ENV

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import torch
from torch import nn
from compiler import Backend, Quantization, Recipe, build, fidelity
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 128), nn.Tanh(),
                      nn.Linear(128, 10)).eval()
rules = {"_default": "fp32", "4": "int8-static-pc"}
recipe = Recipe(quantization=Quantization.of(rules), backend=Backend("inductor", "max-autotune"))
inputs = [((torch.rand(8, 64),), {}) for _ in range(16)]
built = build(model, recipe, calibration=inputs, example=inputs[0])
assert built.report.applied == {"4": "int8-static-pc"}, built.report.applied
with torch.inference_mode():
    outs = [built.module(*a) for _ in range(20) for a, _ in inputs][-16:]
    refs = [model(*a) for a, _ in inputs]
print("cosine", fidelity("cosine", refs, outs))
"""


@pytest.mark.slow
def test_a_float_linear_beside_an_int8_one_under_max_autotune_keeps_the_heap_whole(
        tmp_path: Path) -> None:
    # the tests' kernel cache where there is one: Inductor's ISA probes compile once a session
    kernels = os.environ.get(SHARED_INDUCTOR_ENV) or str(tmp_path / "inductor")
    env = {"TORCHINDUCTOR_CACHE_DIR": kernels, "PYTHONPATH": str(ROOT),
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cosine = float(out.stdout.split("cosine")[-1])
    assert cosine > 0.99
