"""Plain dataclasses in a model's outputs, as pytree nodes.

A model may return its own ``@dataclass`` (logits and hidden states, say). Torch's pytree
does not know such a class, so ``torch.export`` refuses it (no AOTInductor package: every
process compiled the variant itself) and the TorchScript tracer that ONNX Runtime's and
OpenVINO's converters use cannot return it. :func:`register_dataclasses` registers each such
class with pytree (``torch.export.register_dataclass``) under its import path, in the process
that builds; :func:`loads_spec` registers the classes a stored output spec names before it is
read, in a process that loads what another built (the class is found among the modules it
has imported: the model's own module defines it; nothing is imported for it).
:func:`flat_forward` has a tracer see the output as a tuple of its tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def _unknown_dataclass(value: object) -> bool:
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and type(value) not in pytree.SUPPORTED_NODES)


def _register(cls: type) -> None:
    torch.export.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def register_dataclasses(output: object) -> list[type]:
    """Register every plain dataclass in ``output`` (nested ones too) with pytree; returns
    the classes registered now."""
    registered: list[type] = []
    while found := {type(x) for x in pytree.tree_leaves(output) if _unknown_dataclass(x)}:
        for cls in sorted(found, key=lambda c: c.__qualname__):
            _register(cls)
            registered.append(cls)
    return registered


def _type_names(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            yield node["type"]
        for child in node.get("children_spec") or ():
            yield from _type_names(child)
    elif isinstance(node, list):
        for child in node:
            yield from _type_names(child)


def _imported_class(name: str) -> type | None:
    """The class ``name`` (``module.Qual.Name``) from a module this process has imported."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        obj: Any = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj if isinstance(obj, type) and dataclasses.is_dataclass(obj) else None
    return None


def loads_spec(text: str) -> pytree.TreeSpec:
    """``treespec_loads``, once the dataclasses ``text`` names are registered here."""
    for name in set(_type_names(json.loads(text))):
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            cls = _imported_class(name)
            if cls is not None and cls not in pytree.SUPPORTED_NODES:
                _register(cls)
    return pytree.treespec_loads(text)


@contextlib.contextmanager
def flat_forward(module: nn.Module, output: object) -> Iterator[None]:
    """While in the block, ``module`` returns the tensors of an output like ``output`` as one
    tuple, in pytree's order (a tracer cannot return a dataclass; the caller unflattens with
    the output's spec). The same module is traced: its layers keep their names, its forward
    its signature."""
    if isinstance(output, torch.Tensor):
        yield
        return
    forward = module.forward

    @functools.wraps(forward)
    def flat(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return tuple(pytree.tree_leaves(forward(*args, **kwargs)))

    with forward_replaced(module, flat):
        yield


@contextlib.contextmanager
def forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module.forward`` is ``forward`` in the block (on the instance: the module itself is
    traced, so its layers keep their names), and what it was after."""
    own = module.__dict__.get("forward")
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own  # type: ignore[method-assign]
