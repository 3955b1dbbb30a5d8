"""Backends that trace the model (ONNX Runtime, OpenVINO) take tensor arguments only. A model
called with a list of tensors had 7 of its 12 trials fail on them (bench/foreign.py's
``list_in``); now the space leaves them out and says why."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from compiler import untraceable_inputs
from pgc_daemon.optimizer.search.prepare import shape_space
from pgc_daemon.policy import Policy


class ListIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, views: list[torch.Tensor], scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.a(views[0]) + self.b(views[1])


def test_a_list_argument_leaves_the_traced_backends_out(caplog: pytest.LogCaptureFixture) -> None:
    model = ListIn()
    listed = (([torch.rand(2, 4), torch.rand(2, 4)],), {})
    assert untraceable_inputs(model, listed) == "input 'views' is a list, not a tensor"
    with caplog.at_level(logging.WARNING, logger="pgc.search"):
        space = shape_space(model, [], Policy(), sensitivity=None, example=listed)
    assert "inductor" in space.backends
    assert not [b for b in space.backends if b.startswith(("onnxruntime", "openvino"))]
    assert "onnxruntime" in caplog.text and "'views' is a list" in caplog.text


def test_tensor_arguments_keep_every_installed_backend() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    example = ((torch.rand(2, 4),), {})
    assert untraceable_inputs(model, example) is None
    space = shape_space(model, [], Policy(), sensitivity=None, example=example)
    assert "onnxruntime" in space.backends  # installed with the test extras
    # an optional argument given as None is not in the way either
    views = [torch.rand(2, 4), torch.rand(2, 4)]
    assert untraceable_inputs(ListIn(), ((), {"views": views[0], "scale": None})) is None


def test_a_model_served_in_bfloat16_leaves_the_traced_backends_out() -> None:
    """ONNX Runtime's CPU session rejected the bf16 graph and OpenVINO's input conversion the
    bf16 tensors: 5 of 12 trials failed on bench/foreign.py's ``half``."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    example = ((torch.rand(2, 4),), {})
    half = ((torch.rand(2, 4, dtype=torch.bfloat16),), {})
    assert untraceable_inputs(model, half) == "input 'input' is torch.bfloat16, not torch.float32"
    model.to(torch.bfloat16)
    assert untraceable_inputs(model, example) == (
        "the model's weights are torch.bfloat16, not torch.float32")
    space = shape_space(model, [], Policy(), sensitivity=None, example=half)
    assert not [b for b in space.backends if b.startswith(("onnxruntime", "openvino"))]
