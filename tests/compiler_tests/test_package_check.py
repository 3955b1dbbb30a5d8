"""A package is kept when it computes what its module computes, or when it is as close to
the fp32 model as its module is: an int8 static, bf16 MiniLM package read a relative error
of 0.102 from its module (both about cosine 0.995 from fp32, rounded differently) and its
variant fell back to ``torch.compile``, which a serving process must compile itself."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from compiler._aoti import MAX_REL_ERROR, _check_package, relative_error


def _perturbed(model: nn.Linear, scale: float, seed: int) -> nn.Linear:
    """``model`` with its weights moved by ``scale`` of their norm, as rounding would."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        noise = torch.randn(other.weight.shape, generator=g)
        other.weight += noise * scale * other.weight.norm() / noise.norm()
    return other


@pytest.fixture
def setting() -> tuple[nn.Linear, nn.Linear, tuple]:
    torch.manual_seed(0)
    original = nn.Linear(256, 256, bias=False).eval()
    module = _perturbed(original, 0.08, seed=1)  # the module's own rounding
    return original, module, ((torch.randn(32, 256),), {})


def test_a_package_rounding_otherwise_than_its_module_is_kept(setting) -> None:
    original, module, example = setting
    package = _perturbed(original, 0.08, seed=2)  # as far from fp32, elsewhere
    with torch.no_grad():
        got = package(*example[0])
        assert relative_error(module(*example[0]), got) > MAX_REL_ERROR  # the old check failed it
        _check_package(got, module, original, example)


def test_a_package_far_from_fp32_is_refused(setting) -> None:
    original, module, example = setting
    with torch.no_grad():
        for got in (torch.zeros(32, 256), _perturbed(original, 0.3, seed=3)(*example[0]),
                    -module(*example[0])):
            with pytest.raises(ValueError, match="differ from the module's"):
                _check_package(got, module, original, example)


def test_a_package_equal_to_its_module_is_kept_without_the_fp32_model(setting) -> None:
    original, module, example = setting
    calls = []
    original.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        _check_package(module(*example[0]) * 1.01, module, original, example)
    assert calls == []  # within MAX_REL_ERROR of the module: fp32 is not run
