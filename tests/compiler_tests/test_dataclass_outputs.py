"""A model that returns its own dataclass: every backend builds it, stores an artifact, and
another process loads that artifact (compiling nothing) and returns the same dataclass.
Before, torch.export refused the output (no AOTInductor package: every process compiled the
variant itself) and ONNX Runtime's and OpenVINO's tracers failed on it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiler import Backend, CompileCache, Recipe, build
from compiler._outputs import loads_spec, register_dataclasses


@dataclasses.dataclass
class Hidden:
    state: torch.Tensor
    mask: torch.Tensor | None = None


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: Hidden


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encode = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> Output:
        h = torch.relu(self.encode(x))
        return Output(self.head(h), Hidden(h))


RECIPES = [Recipe(backend=Backend("inductor")), Recipe(backend=Backend("onnxruntime")),
           Recipe(backend=Backend("openvino", "f32"))]
CALIBRATION = [((torch.randn(2, 16, generator=torch.Generator().manual_seed(i)),), {})
               for i in range(4)]

# another process: the model's module imported (as a server imports its model), nothing else
_LOADER = """
import importlib, json, sys, torch
from compiler import CompileCache, build
sys.path.insert(0, sys.argv[3])
test = importlib.import_module(sys.argv[4])  # under the name the test's process gave it
cache = CompileCache(sys.argv[1], artifacts=sys.argv[2])
model, (args, _), RECIPES = test.TwoHeads().eval(), test.CALIBRATION[0], test.RECIPES
CALIBRATION = test.CALIBRATION
out = []
for recipe in RECIPES:
    got, want = build(model, recipe, calibration=CALIBRATION, cache=cache), model(*args)
    y = got.module(*args)
    out.append({"label": recipe.label(), "notes": got.report.notes, "type": type(y).__name__,
                "hidden": type(y.hidden).__name__, "mask": y.hidden.mask is None,
                "close": torch.allclose(y.logits, want.logits, atol=1e-4)
                         and torch.allclose(y.hidden.state, want.hidden.state, atol=1e-4)})
print(json.dumps(out))
"""


def test_every_backend_stores_and_another_process_loads_a_dataclass_output(tmp_path: Path) -> None:
    model = TwoHeads().eval()
    cache = CompileCache(tmp_path / "cache", artifacts=tmp_path / "artifacts")
    (args, _) = CALIBRATION[0]
    want = model(*args)
    for recipe in RECIPES:
        built = build(model, recipe, calibration=CALIBRATION, cache=cache)
        assert built.artifact is not None, (recipe.label(), built.report.notes)
        got = built.module(*args)
        assert type(got) is Output and type(got.hidden) is Hidden and got.hidden.mask is None
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.hidden.state, want.hidden.state, atol=1e-4, rtol=1e-4)
    assert "AOTInductor package" in " ".join(
        build(model, RECIPES[0], calibration=CALIBRATION, cache=cache).report.notes)
    proc = subprocess.run([sys.executable, "-c", _LOADER, str(tmp_path / "cache"),
                           str(tmp_path / "artifacts"), str(Path(__file__).parent), __name__],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [x["label"] for x in loaded] == [r.label() for r in RECIPES]
    for x in loaded:
        assert any("loaded from artifact" in n and "nothing compiled" in n for n in x["notes"]), x
        assert (x["type"], x["hidden"], x["mask"], x["close"]) == ("Output", "Hidden", True, True)


@dataclasses.dataclass
class NeverImported:
    value: torch.Tensor


def test_a_spec_naming_a_class_this_process_has_not_imported_is_refused_not_imported() -> None:
    assert register_dataclasses({"a": NeverImported(torch.zeros(1))}) == [NeverImported]
    assert register_dataclasses(NeverImported(torch.zeros(1))) == []  # once is enough
    text = json.dumps([1, {"type": "pgc_no_such_module.Output", "context": "[[\"v\"], []]",
                           "children_spec": [{"type": None, "context": None,
                                              "children_spec": []}]}])
    with pytest.raises(Exception, match="pgc_no_such_module.Output"):
        loads_spec(text)
    assert "pgc_no_such_module" not in sys.modules
