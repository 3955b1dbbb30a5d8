"""Backends that trace the model (ONNX Runtime, OpenVINO) take tensor arguments only and give
tensors only. A model called with a list of tensors had 7 of its 12 trials fail on them
(bench/foreign.py's ``list_in``), a GPT-2 returning its key-value cache 4 (``hf_gpt2``); now
the space leaves them out and says why."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from compiler import untraceable
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
    assert untraceable(model, listed) == "input 'views' is a list, not a tensor"
    with caplog.at_level(logging.WARNING, logger="pgc.search"):
        space = shape_space(model, [], Policy(), sensitivity=None, example=listed)
    assert "inductor" in space.backends
    assert not [b for b in space.backends if b.startswith(("onnxruntime", "openvino"))]
    assert "onnxruntime" in caplog.text and "'views' is a list" in caplog.text


def test_tensor_arguments_keep_every_installed_backend() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    example = ((torch.rand(2, 4),), {})
    assert untraceable(model, example) is None
    space = shape_space(model, [], Policy(), sensitivity=None, example=example)
    assert "onnxruntime" in space.backends  # installed with the test extras
    # an optional argument given as None is not in the way either
    views = [torch.rand(2, 4), torch.rand(2, 4)]
    assert untraceable(ListIn(), ((), {"views": views[0], "scale": None})) is None


def test_a_model_served_in_bfloat16_leaves_the_traced_backends_out() -> None:
    """ONNX Runtime's CPU session rejected the bf16 graph and OpenVINO's input conversion the
    bf16 tensors: 5 of 12 trials failed on bench/foreign.py's ``half``."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    example = ((torch.rand(2, 4),), {})
    half = ((torch.rand(2, 4, dtype=torch.bfloat16),), {})
    assert untraceable(model, half) == "input 'input' is torch.bfloat16, not torch.float32"
    model.to(torch.bfloat16)
    assert untraceable(model, example) == (
        "the model's weights are torch.bfloat16, not torch.float32")
    space = shape_space(model, [], Policy(), sensitivity=None, example=half)
    assert not [b for b in space.backends if b.startswith(("onnxruntime", "openvino"))]


def test_an_output_holding_more_than_tensors_leaves_the_traced_backends_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """transformers' GPT-2 returns its key-value cache beside the logits unless told not to:
    ONNX Runtime failed on the cache object, OpenVINO's tracer on the whole output."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=20,
                        num_labels=3, pad_token_id=19)
    model = GPT2ForSequenceClassification(config).eval()
    example = ((), {"input_ids": torch.randint(0, 19, (1, 16))})
    assert untraceable(model, example) == (
        "the output holds a value of type DynamicCache, not only tensors")
    with caplog.at_level(logging.WARNING, logger="pgc.search"):
        space = shape_space(model, [], Policy(), sensitivity=None, example=example)
    assert "inductor" in space.backends
    assert not [b for b in space.backends if b.startswith(("onnxruntime", "openvino"))]
    assert "DynamicCache" in caplog.text
    # the same model told not to keep a cache gives tensors only: every backend stays
    config.use_cache = False
    assert untraceable(model, example) is None


@dataclasses.dataclass
class Scores:
    logits: torch.Tensor
    extra: dict[str, torch.Tensor]


class ScoresOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Scores:
        y = self.net(x)
        return Scores(y, {"soft": y.softmax(-1)})


def test_tensors_in_dataclasses_and_hub_outputs_are_tensors_only() -> None:
    """A dataclass the build has not registered with torch's pytree yet is opened field by
    field; a Python number beside the tensors is not a tensor."""
    example = ((torch.rand(2, 4),), {})
    assert untraceable(ScoresOut(), example) is None

    class WithCount(ScoresOut):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:  # type: ignore[override]
            return self.net(x), 3

    assert untraceable(WithCount(), example) == (
        "the output holds a value of type int, not only tensors")
