"""The offline profile behind ``pgc profile``: shares that add up, repeated roles grouped,
layout conversions found where they happen."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from profiler import group_name, layout_conversions, profile_model


def test_profile_of_the_digits_cnn(cnn_spec: dict[str, Any]) -> None:
    model = cnn_spec["model"]
    examples = [(args, {}) for args in cnn_spec["example_inputs"][:6]]
    seen: list[tuple[int, int]] = []
    report = profile_model(model, examples, rounds=2, progress=lambda d, t: seen.append((d, t)))
    assert report.calls == 12 and seen[-1] == (12, 12)
    assert sum(r["latency_ratio"] for r in report.layers) == pytest.approx(1.0, abs=1e-6)
    ratios = [r["latency_ratio"] for r in report.layers]
    assert ratios == sorted(ratios, reverse=True)  # hottest first
    top = {r["op_type"] for r in report.layers[:3]}
    assert top & {"Conv2d", "MaxPool2d"}, report.layers[:3]  # the convolutions carry the time
    for r in report.layers:
        assert r["p95_ms"] >= r["p50_ms"] > 0
        if r["op_type"].endswith("(self)"):
            # a container's own time (a few microseconds here) counts the calls where it
            # came out positive once its children and the hooks' cost are taken off
            assert 1 <= r["count"] <= 12, r
        else:
            assert r["count"] == 12, r  # every layer, every call
    assert {r["layer"] for r in report.layers} >= {"features.0", "features.6", "head.3"}
    assert report.shapes == {"b16 1x8x8": 12}
    assert report.device == "cpu" and report.overhead > 0


def test_group_names_fold_repeated_blocks() -> None:
    assert group_name("encoder.layer.3.output.dense") == "encoder.layer.*.output.dense"
    assert group_name("features.10") == "features.*"
    assert group_name("head") == "head"


class Transposer(nn.Module):
    """Makes a transposed copy contiguous on every call: pure layout work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).contiguous()


def test_layout_conversions_are_measured_and_placed() -> None:
    model = nn.Sequential(nn.Linear(512, 512), Transposer(), nn.ReLU()).eval()
    examples = [((torch.randn(8, 512, 512),), {})]
    found = layout_conversions(model, examples, calls=2)
    assert found["ms_per_call"] > 0 and 0 < found["ratio"] < 1
    assert next(iter(found["layers"])) == "1"  # the Transposer
    assert any("contiguous" in op for op in found["ops"])


def test_no_layout_conversions_in_a_plain_mlp() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    found = layout_conversions(model, [((torch.randn(4, 64),), {})])
    assert found["ratio"] < 0.05
