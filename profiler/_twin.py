"""A hook twin: a model's module tree copied shallowly, so a sampled call runs through
per-module hooks that no other call sees.

Process-wide hooks (torch's ``register_module_forward_pre_hook``) make every module call in
the process take torch's hooked path while one call is sampled: the other threads serving
the same model, and every other model and library. The twin avoids that. Each module of the
model gets a twin object whose ``__dict__`` holds the same values (parameters, buffers,
packed weights and every plain attribute are the same objects, so nothing is copied but the
module objects themselves), except three entries of its own: ``_modules`` (the children's
twins) and the two forward-hook dicts, which carry the timer's hooks besides any the user
registered on the original. Only the sampled call runs the twin; every other call runs the
original, which has no hooks.

The original stays the source of truth. Before each sampled call :meth:`HookTwin.refresh`
copies every original's attributes into its twin (``model.eval()`` or a swapped weight
reach the twin), and after it :meth:`HookTwin.write_back` copies back what the call itself
assigned (a module that keeps state between calls keeps it). A changed module structure
(a child replaced or added after the twin was built) makes :meth:`refresh` answer False:
the caller then times the call another way, as the twin would run stale modules.

A model whose modules cannot be copied this way (TorchScript modules, classes that need
arguments to be created) raises :class:`TwinUnavailable` at construction.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Hook = Callable[..., Any]
#: what a twin keeps as its own: its children, and forward-hook dicts carrying the timer's hooks
_OWN = ("_modules", "_forward_pre_hooks", "_forward_hooks")
#: dict keys for the timer's hooks: torch numbers hooks from 0 up, so these never collide
_PRE_KEY, _POST_KEY = -1, -2


class TwinUnavailable(Exception):
    """The model's modules cannot be twinned: time it with process-wide hooks."""


class _Pair:
    __slots__ = ("orig", "twin", "kids", "own", "snap")

    def __init__(self, orig: nn.Module, twin: nn.Module) -> None:
        self.orig = orig
        self.twin = twin
        self.kids: dict[str, Any] = {}
        self.own: dict[str, Any] = {}
        self.snap: dict[str, Any] = {}


class HookTwin:
    """The twin of ``model``'s module tree, with ``pre`` and ``post`` as forward hooks on
    every twin module (called as ``pre(module, args)`` and ``post(module, args, output)``,
    ``module`` being the twin)."""

    def __init__(self, model: nn.Module, pre: Hook, post: Hook) -> None:
        self._pre = {_PRE_KEY: pre}
        self._post = {_POST_KEY: post}
        self._pairs: dict[int, _Pair] = {}
        self.root = self._copy(model)

    def _copy(self, mod: nn.Module) -> nn.Module:
        pair = self._pairs.get(id(mod))
        if pair is not None:  # a module shared in the tree stays one module in the twin
            return pair.twin
        if isinstance(mod, torch.jit.ScriptModule):
            raise TwinUnavailable(f"{type(mod).__name__} is a TorchScript module")
        try:  # the same class, not a fresh one: fx's GraphModule.__new__ makes one per call
            twin = object.__new__(type(mod))
            twin.__dict__.update(mod.__dict__)
        except Exception as exc:  # noqa: BLE001 - any class that cannot be copied so
            raise TwinUnavailable(f"{type(mod).__name__}: {exc}") from exc
        pair = self._pairs[id(mod)] = _Pair(mod, twin)
        children = {name: None if c is None else self._copy(c)
                    for name, c in mod._modules.items()}
        pair.kids = dict(mod._modules)
        pair.own["_modules"] = children
        self._hooks(pair)
        twin.__dict__.update(pair.own)
        return twin

    def _hooks(self, pair: _Pair) -> None:
        """The twin's hook dicts: the timer's pre-hook first and post-hook last, around any
        the user registered on the original (their kwargs/always-called flags are read from
        the original's dicts, which the twin shares)."""
        d = pair.orig.__dict__
        user_pre, user_post = d.get("_forward_pre_hooks"), d.get("_forward_hooks")
        pair.own["_forward_pre_hooks"] = {**self._pre, **user_pre} if user_pre else self._pre
        pair.own["_forward_hooks"] = {**user_post, **self._post} if user_post else self._post

    def twin_of(self, mod: nn.Module) -> nn.Module | None:
        pair = self._pairs.get(id(mod))
        return pair.twin if pair is not None else None

    def refresh(self) -> bool:
        """Bring every twin up to date with its original before a sampled call; False if
        the model's structure changed since the twin was built (then the twin must not run)."""
        for pair in self._pairs.values():
            od = pair.orig.__dict__
            if od["_modules"] != pair.kids:  # modules compare by identity
                return False
            if od.get("_forward_pre_hooks") or od.get("_forward_hooks"):
                self._hooks(pair)  # the user's hooks, as they are now
            td = pair.twin.__dict__
            td.update(od)
            td.update(pair.own)
            pair.snap = dict(td)
        return True

    def close(self) -> None:
        """Take the hooks off every twin module and let go of the originals."""
        for pair in self._pairs.values():
            pair.twin.__dict__.update(_forward_pre_hooks={}, _forward_hooks={})
            pair.own.clear()
            pair.snap = {}
        self._pairs = {}

    def write_back(self) -> None:
        """Copy to each original what the sampled call assigned on its twin (and only that:
        an attribute another thread changed on the original meanwhile is kept)."""
        for pair in self._pairs.values():
            snap, td = pair.snap, pair.twin.__dict__
            # the common case, in C: the same keys in the same order, each the same object
            if len(td) == len(snap) and not any(map(operator.is_not, td.values(),
                                                    snap.values())):
                continue
            od = pair.orig.__dict__
            for key, value in td.items():
                if snap.get(key, _MISSING) is not value and key not in _OWN:
                    od[key] = value


_MISSING = object()
