"""An int8 convnet with a max-pool compiles to a plain package, so it serves with the GIL
released, and pools as fast as before.

pt2e gives a max-pool between int8 layers its input's scale; Inductor then makes
``dequantize → max_pool2d → quantize`` the op ``quantized::max_pool2d``, which it calls through
its proxy executor. Such a package runs through torch's loader, which holds the GIL for the
whole call: beside an int8 ResNet-18 called back to back, a thread waking every millisecond
got 1 183-1 224 turns in 3 s, against 2 612-2 616 beside the plain package pgc builds now
(2026-12-07, 2-core Xeon with AMX). ``compiler._pt2e.pool_uint8`` pools the uint8 tensor
itself, which Inductor generates code for. Leaving the max-pool float instead (a dequantize,
the pool, a quantize) made the digits CNN at batch 256 19% slower; pooling uint8 made it
1.11x faster than the library op.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import compiler._pt2e as pt2e
from compiler import Backend, CompileCache, Layout, Quantization, Recipe, build
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


def _build(folder: Path, recipe: Recipe = RECIPE):
    torch.manual_seed(0)
    model = PoolNet().eval()
    examples = [((torch.randn(1, 3, 32, 32),), {}) for _ in range(4)]
    built = build(model, recipe, calibration=examples, cache=CompileCache(folder))
    assert built.artifact is not None, built.report.notes
    packages = list((folder / "artifacts" / built.artifact).glob("*.pt2"))
    assert len(packages) == 1
    return examples, built, packages[0]


def _proxy_ops(package: Path) -> list[str]:
    with zipfile.ZipFile(package) as z:
        return [n for n in z.namelist() if n.endswith(".wrapper.json")]


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory):
    """The network built as pgc builds it, and with the int8 max-pool left to Inductor."""
    ours = _build(tmp_path_factory.mktemp("uint8"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pt2e, "POOL_UINT8", False)
        library = _build(tmp_path_factory.mktemp("library"))
    return ours, library


def test_an_int8_convnet_with_a_max_pool_serves_with_the_gil_released(both) -> None:
    (_, built, package), _ = both
    assert "int8 conv x2" in built.report.kernel_paths["<compiled>"]  # int8 around the pool
    assert plain_package(package) and not _proxy_ops(package)
    assert next(iter(built.module.runners.values())).native is not None  # GIL released


def test_the_library_max_pool_is_what_needed_the_loader(both) -> None:
    """The control: without the rewrite the package has an op for the proxy executor."""
    _, (_, built, package) = both
    assert not plain_package(package) and _proxy_ops(package)
    assert next(iter(built.module.runners.values())).native is None


def test_pooling_uint8_computes_what_the_int8_max_pool_computes(both) -> None:
    (examples, ours, _), (_, library, _) = both
    with torch.inference_mode():
        for args, _ in examples:
            assert torch.equal(ours.module(*args), library.module(*args))


def test_a_channels_last_max_pool_keeps_the_library_op(tmp_path: Path) -> None:
    """ATen's uint8 max-pool refuses channels-last input (torch 2.13), and the graph runs
    eagerly while it is built: such a pool is left as it was, and the package is built."""
    x = torch.zeros(1, 16, 32, 32, dtype=torch.uint8).to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="integer_t"):
        nn.functional.max_pool2d(x, 3, 2, 1)
    recipe = Recipe(quantization=RECIPE.quantization, backend=RECIPE.backend,
                    layout=Layout("channels_last"))
    _, built, package = _build(tmp_path, recipe)  # a package, not torch.compile's fallback
    assert _proxy_ops(package) and next(iter(built.module.runners.values())).native is None
