"""An int8 convnet with a max-pool compiles to a plain package, so it serves with the GIL
released.

Annotated as int8, the max-pool becomes ``quantized::max_pool2d``, which Inductor calls through
its proxy executor: such a package runs through torch's loader, which holds the GIL for the
whole call. Beside an int8 ResNet-18 called back to back, a thread waking every millisecond got
1 207 turns in 3 s, against 2 627 beside the same network with the max-pool left float
(2026-12-07, 2-core Xeon with AMX). Left float between a dequantize and a quantize, Inductor
fuses it into one generated kernel, as fast (ResNet-18 at batch 1: 1.01x the int8 pool's
time, interval 0.95-1.08).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import compiler._pt2e as pt2e
from compiler import Backend, CompileCache, Quantization, Recipe, build
from compiler._aoti_native import plain_package

RECIPE = Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}),
                backend=Backend("inductor"))


class PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(self.pool(self.stem(x))))


def _build(tmp_path: Path):
    torch.manual_seed(0)
    model = PoolNet().eval()
    examples = [((torch.randn(1, 3, 32, 32),), {}) for _ in range(4)]
    built = build(model, RECIPE, calibration=examples, cache=CompileCache(tmp_path / "cache"))
    assert built.artifact is not None, built.report.notes
    packages = list((tmp_path / "cache" / "artifacts" / built.artifact).glob("*.pt2"))
    assert len(packages) == 1
    return model, examples, built, packages[0]


def _proxy_ops(package: Path) -> list[str]:
    with zipfile.ZipFile(package) as z:
        return [n for n in z.namelist() if n.endswith(".wrapper.json")]


def test_an_int8_convnet_with_a_max_pool_serves_with_the_gil_released(tmp_path: Path) -> None:
    model, examples, built, package = _build(tmp_path)
    assert "int8 conv x2" in built.report.kernel_paths["<compiled>"]  # int8 around the pool
    assert plain_package(package) and not _proxy_ops(package)
    runner = next(iter(built.module.runners.values()))
    assert runner.native is not None  # the C interface, GIL released
    with torch.inference_mode():
        for args, _ in examples:
            got, want = built.module(*args), model(*args)
            assert torch.nn.functional.cosine_similarity(got, want).item() > 0.99


def test_an_int8_max_pool_would_need_the_loader(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same network with the max-pool annotated as int8 has an op for the
    proxy executor, so it is not plain (what the test above would see without the fix)."""
    monkeypatch.setattr(pt2e, "INT8_MAX_POOL", True)
    _, _, built, package = _build(tmp_path)
    assert not plain_package(package) and _proxy_ops(package)
    assert next(iter(built.module.runners.values())).native is None
