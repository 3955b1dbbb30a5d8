"""MODEL_SPEC: how pgc gets a model it did not build itself.

A MODEL_SPEC is ``package.module:function``. The function takes no arguments and returns
either a tuple ``(model, example_inputs)`` / ``(model, example_inputs, accuracy)`` or a dict
with the keys ``model``, ``example_inputs`` and optionally ``accuracy``, ``labels`` and
``metric``:

- ``example_inputs``: a list of inputs; each input is a tensor (one positional argument), a
  tuple (positional arguments) or a dict (keyword arguments). A single tensor, tuple or dict
  is taken as a list of one.
- ``accuracy(outputs, targets) -> float``: higher is better. With ``labels`` the targets are
  the labels and the drop is ``accuracy(fp32) - accuracy(variant)``; without, the targets are
  the fp32 outputs and the drop is ``1 - accuracy(variant)``.
- ``metric``: ``cosine``, ``top1`` or ``sqnr`` to override pgc's choice from the outputs.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compiler import METRICS, Example
from pgc_daemon.errors import SpecError


@dataclass
class ModelSpec:
    path: str
    model: nn.Module
    examples: list[Example]
    accuracy: Callable[[Sequence[Any], Sequence[Any]], float] | None = None
    labels: list[Any] | None = None
    metric: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def as_example(item: Any) -> Example:
    if torch.is_tensor(item):
        return (item,), {}
    if isinstance(item, tuple):
        return tuple(item), {}
    if isinstance(item, dict):
        return (), dict(item)
    raise SpecError(f"an example input must be a tensor, tuple or dict, not {type(item).__name__}")


def as_examples(value: Any) -> list[Example]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise SpecError("example_inputs is empty")
    return [as_example(i) for i in items]


@dataclass(frozen=True)
class SpecOrigin:
    """Where a spec's module was found in the serving process: the ``sys.path`` root it was
    imported from, its file, and the file's SHA-256."""

    root: str
    file: str
    sha256: str

    def to_json(self) -> dict[str, str]:
        return {"root": self.root, "file": self.file, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpecOrigin:
        return cls(str(data["root"]), str(data["file"]), str(data["sha256"]))


def _split(path: str) -> tuple[str, str]:
    if ":" not in path:
        raise SpecError(f"MODEL_SPEC must look like package.module:function, not {path!r}")
    mod_name, _, attr = path.partition(":")
    return mod_name, attr


def _digest(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def spec_origin(path: str) -> SpecOrigin | None:
    """The origin of a spec's module as this process sees it, without importing anything not
    already imported (``importlib.util.find_spec`` of the top package runs nothing); None when
    the module has no source file (a namespace or a built-in) or cannot be found, or the spec
    is malformed (the worker then refuses it with the reason)."""
    if ":" not in path:
        return None
    mod_name, _ = _split(path)
    module = sys.modules.get(mod_name)
    file = getattr(module, "__file__", None) if module is not None else None
    if file is None:
        cwd = str(Path.cwd())
        search = [cwd, *sys.path] if cwd not in sys.path else list(sys.path)
        parts = mod_name.split(".")
        for entry in search:
            base = Path(entry or ".").resolve()
            for candidate in (base.joinpath(*parts).with_suffix(".py"),
                              base.joinpath(*parts, "__init__.py")):
                if candidate.is_file():
                    file = str(candidate)
                    break
            if file is not None:
                break
    if file is None or not Path(file).is_file():
        return None
    source = Path(file).resolve()
    depth = len(mod_name.split(".")) + (1 if source.name == "__init__.py" else 0)
    root = source.parents[depth - 1]
    return SpecOrigin(str(root), str(source), _digest(source))


def resolve(path: str, origin: SpecOrigin | None = None) -> Callable[[], Any]:
    """Import ``package.module:function``.

    With ``origin`` (what the serving process recorded), the module is imported only from
    ``origin.root`` and only when ``origin.file`` still has the recorded digest, checked
    before anything is imported; nothing else is added to ``sys.path``. Without it (the CLI's
    ``pgc profile`` / ``pgc optimize`` on a spec the user typed), the current directory is
    importable, as for ``python -m``."""
    mod_name, attr = _split(path)
    if origin is not None:
        file = Path(origin.file)
        try:
            digest = _digest(file)
        except OSError as exc:
            raise SpecError(f"refused {path}: its module {file} cannot be read ({exc})") from None
        if digest != origin.sha256:
            raise SpecError(
                f"refused {path}: {file} changed since the serving process registered it "
                "(digest differs); attach the model again to register the new code"
            )
        root = origin.root
    else:
        root = str(Path.cwd())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the spec's problem
        raise SpecError(f"cannot import {mod_name!r}: {type(exc).__name__}: {exc}") from None
    if origin is not None and Path(getattr(module, "__file__", "") or "").resolve() != Path(origin.file):
        raise SpecError(
            f"refused {path}: {mod_name} was imported from {module.__file__}, not from the "
            f"recorded {origin.file}"
        )
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SpecError(f"{mod_name!r} has no function {attr!r}")
    return fn


def load_spec(path: str, origin: SpecOrigin | None = None) -> ModelSpec:
    factory = resolve(path, origin)
    try:
        result = factory()
    except Exception as exc:  # noqa: BLE001
        raise SpecError(f"{path} raised {type(exc).__name__}: {exc}") from None
    if isinstance(result, dict):
        data = dict(result)
    elif isinstance(result, tuple) and len(result) in (2, 3):
        data = {"model": result[0], "example_inputs": result[1]}
        if len(result) == 3:
            data["accuracy"] = result[2]
    else:
        raise SpecError(
            f"{path} must return (model, example_inputs[, accuracy]) or a dict, "
            f"not {type(result).__name__}"
        )
    model = data.pop("model", None)
    if not isinstance(model, nn.Module):
        raise SpecError(f"{path} returned no nn.Module as its model")
    if "example_inputs" not in data:
        raise SpecError(f"{path} returned no example_inputs")
    examples = as_examples(data.pop("example_inputs"))
    accuracy = data.pop("accuracy", None)
    if accuracy is not None and not callable(accuracy):
        raise SpecError(f"{path}: accuracy must be callable")
    labels = data.pop("labels", None)
    if labels is not None and len(labels) != len(examples):
        raise SpecError(f"{path}: {len(labels)} labels for {len(examples)} example inputs")
    metric = data.pop("metric", None)
    if metric is not None and metric not in METRICS:
        raise SpecError(f"{path}: metric must be one of {METRICS}")
    return ModelSpec(
        path=path,
        model=model.eval(),
        examples=examples,
        accuracy=accuracy,
        labels=list(labels) if labels is not None else None,
        metric=metric,
        extras=data,
    )
