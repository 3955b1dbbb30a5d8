"""A converter that traces (ONNX Runtime's exporter, OpenVINO's converter) records one path
through Python control flow on a tensor's value. Before the check, such a model became a
variant that ran the example's path on every input (bench/foreign.py's ``branchy`` was chosen
at 2.56x through ONNX Runtime under a labels metric). Now the build fails and says why; a
model whose only branches are on shapes (a GRU's input checks) still builds."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

from compiler import Backend, BuildError, Quantization, Recipe, build

needs_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino") is None or importlib.util.find_spec("nncf") is None,
    reason="needs the openvino extra",
)
BACKENDS = [Backend("onnxruntime"), pytest.param(Backend("openvino", "f32"), marks=needs_openvino)]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return self.up(x)
        return self.down(x)


class Recurrent(nn.Module):
    """``nn.GRU`` checks its input's shapes in Python: tracer warnings, and one right path."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gru = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


def _inputs(shape: tuple[int, ...], signs: tuple[float, ...]) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    return [((torch.rand(shape, generator=g) * s,), {}) for s in signs]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.label() if hasattr(b, "label") else b)
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_a_branch_on_input_values_fails_the_build_that_would_fix_it(
        backend: Backend, quantized: bool) -> None:
    model = Branchy().eval()
    calibration = _inputs((4, 16), (1.0, 1.0, -1.0, 1.0))  # the example takes the `up` path
    quant = Quantization.of({"_default": "int8-dynamic-pc"}) if quantized else Quantization()
    with pytest.raises(BuildError, match="traced graph differs from the model on calibration "
                                         "input 3 of 4"):
        build(model, Recipe(quantization=quant, backend=backend), calibration=calibration,
              example=calibration[0])
    # the same model through Inductor keeps both paths (guards, not a trace)
    built = build(model, Recipe(backend=Backend("inductor")), example=calibration[0])
    with torch.no_grad():
        for (x,), _ in calibration:
            torch.testing.assert_close(built.module(x), model(x))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.label() if hasattr(b, "label") else b)
def test_branches_on_shapes_alone_still_build(backend: Backend) -> None:
    model = Recurrent().eval()
    calibration = _inputs((3, 5, 8), (1.0, -1.0, 0.5))
    built = build(model, Recipe(backend=backend), calibration=calibration, example=calibration[0])
    with torch.no_grad():
        for (x,), _ in calibration:
            torch.testing.assert_close(built.module(x), model(x), rtol=1e-4, atol=1e-5)
