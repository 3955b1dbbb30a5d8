"""The compile cache: the same key always rebuilds the same variant, and a rebuild in another
process (or after a restart) skips the slow steps.

**The key** (:class:`CacheKey`) is everything that decides a variant's code and numbers:

- ``graph``: ``compiler.fingerprint(model)`` (module tree, parameter shapes, dtypes, weights);
- ``recipe``: ``Recipe.hash``;
- ``calibration``: a digest of the calibration inputs, for recipes that calibrate (static
  int8); ``-`` otherwise;
- ``versions``: torch, torchao, triton (and onnxruntime for that backend);
- ``device``: ``probe().key()`` (CPU model and ISA features, GPU name and capability) and the
  torch CPU capability;
- ``env``: the environment variables that change code generation (``TORCHINDUCTOR_*``,
  ``TORCH_COMPILE_*``, ``TORCHDYNAMO_*``, ``TRITON_*``, ``ATEN_CPU_CAPABILITY``,
  ``DNNL_*``/``ONEDNN_*``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``; cache locations excluded)
  and torch's thread count.

**What is reused**, measured on all-MiniLM-L6-v2 static int8 (2 busy cores): a fresh build
spends most of its time calibrating (histogram observers) and compiling. In a second process,
Inductor's FX graph cache does not help (it refuses graphs with prepacked oneDNN weights), and
AOTInductor packages of pt2e graphs came out wrong with dynamic shapes and slow with static
ones, so neither is used. What helps is (1) the quantized graph saved as a ``torch.export``
program (calibration and export skipped; loading takes a second) and (2) Inductor's on-disk
kernel cache kept in pgc's folder (``inductor/``), which cut the compile of the same graph in a
new process from ~60 s to ~20 s. Within a process, built variants are kept (a small LRU), so the
same key returns the very same compiled module.

Layout of ``folder``: ``variants/<key digest>/{graph.pt2,meta.json}``, ``inductor/``,
``kernel_choices.json`` (kernel paths chosen by measurement, ``compiler._measure``). Variant
folders beyond ``max_disk_bytes`` are removed oldest first. Files are read with
``weights_only=False`` semantics (a pickled graph), so the folder is private to pgc: created
0700, refused when another user owns it or others may write to it (``compiler.private``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from compiler._registry import Example
from compiler.fingerprint import fingerprint
from compiler.hardware import probe
from compiler.private import private_dir
from compiler.recipe import Recipe

ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_", "DNNL_", "ONEDNN_")
ENV_NAMES = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
ENV_IGNORED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE_DIR")


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return "-"


def codegen_env(environ: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    env = os.environ if environ is None else environ
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and k not in ENV_IGNORED
        )
    )


def calibration_digest(inputs: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for args, kwargs in inputs:
        leaves, spec = tree_flatten((args, kwargs))
        h.update(str(spec).encode())
        for t in leaves:
            if torch.is_tensor(t):
                data = t.detach().cpu().contiguous()
                h.update(f"{tuple(data.shape)}{data.dtype}".encode())
                if data.dtype == torch.bfloat16:
                    data = data.view(torch.int16)
                h.update(data.numpy().tobytes())
            else:
                h.update(repr(t).encode())
    return h.hexdigest()


def _calibrates(recipe: Recipe) -> bool:
    return any(c.scheme == "static" for _, c in recipe.quantization.rules)


@dataclass(frozen=True)
class CacheKey:
    graph: str
    recipe: str
    calibration: str
    versions: tuple[tuple[str, str], ...]
    device: str
    env: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "recipe": self.recipe,
            "calibration": self.calibration,
            "versions": dict(self.versions),
            "device": self.device,
            "env": dict(self.env),
        }


def cache_key(
    model: nn.Module,
    recipe: Recipe,
    calibration: Sequence[Example] = (),
    *,
    graph: str | None = None,
    versions: dict[str, str] | None = None,
    device: str | None = None,
    environ: dict[str, str] | None = None,
) -> CacheKey:
    """The key of building ``recipe`` on ``model``. Every keyword overrides one part (tests,
    or a caller that already has the model's fingerprint)."""
    from compiler._pt2e import MAX_CALIBRATION

    vers = versions or {
        "torch": torch.__version__,
        "torchao": _version("torchao"),
        "triton": _version("triton"),
        "onnxruntime": _version("onnxruntime") if recipe.backend.kind == "onnxruntime" else "-",
    }
    hw = probe()
    dev = device or f"{hw.key()}|{hw.torch_cpu_capability}|{hw.gpu_capability}"
    env = codegen_env(environ) + (("torch.threads", str(torch.get_num_threads())),)
    calib = calibration_digest(list(calibration)[:MAX_CALIBRATION]) if _calibrates(recipe) else "-"
    return CacheKey(
        graph=graph or fingerprint(model),
        recipe=recipe.hash,
        calibration=calib,
        versions=tuple(sorted(vers.items())),
        device=dev,
        env=env,
    )


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    stored: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class CompileCache:
    """Built variants by :class:`CacheKey`, in memory (LRU of ``max_memory``) and on disk.

    Thread-safe; pass one instance to every ``compiler.build(..., cache=...)`` of a process.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str] | None = None,
        *,
        max_memory: int = 2,
        max_disk_bytes: int = 2 << 30,
    ) -> None:
        self.folder = Path(folder).expanduser().resolve() if folder is not None else None
        self.max_memory = max_memory
        self.max_disk_bytes = max_disk_bytes
        self.stats = CacheStats()
        self._memory: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        if self.folder is not None:
            for sub in (self.folder, self.folder / "variants", self.folder / "inductor"):
                private_dir(sub)
            from compiler import _measure

            _measure.set_store(self.folder)

    # ------------------------------------------------------------------ memory

    def get(self, key: CacheKey) -> Any | None:
        with self._lock:
            variant = self._memory.get(key.digest)
            if variant is not None:
                self._memory.move_to_end(key.digest)
                self.stats.memory_hits += 1
            return variant

    def put(self, key: CacheKey, variant: Any) -> None:
        if self.max_memory <= 0:
            return
        with self._lock:
            self._memory[key.digest] = variant
            self._memory.move_to_end(key.digest)
            while len(self._memory) > self.max_memory:
                self._memory.popitem(last=False)

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    # ------------------------------------------------------------------ disk

    def _dir(self, key: CacheKey) -> Path | None:
        return None if self.folder is None else self.folder / "variants" / key.digest

    def load(self, key: CacheKey) -> tuple[nn.Module, dict[str, Any]] | None:
        """The saved quantized graph and its build metadata, or None."""
        path = self._dir(key)
        if path is None or not (path / "meta.json").exists():
            return None
        try:
            meta = json.loads((path / "meta.json").read_text())
            if meta.get("key") != key.to_dict():
                return None
            # the graph's quantize/dequantize ops and Inductor's int8 lowerings are registered
            # by torchao's x86 quantizer module: a fresh process must import it first
            from compiler._pt2e import _xiq

            _xiq()
            program = torch.export.load(str(path / "graph.pt2"))
            module = program.module()
            os.utime(path)
        except Exception:  # noqa: BLE001 - a broken entry is a miss; rebuild over it
            return None
        with self._lock:
            self.stats.disk_hits += 1
        return module, meta

    def save(self, key: CacheKey, program: Any, meta: dict[str, Any]) -> None:
        path = self._dir(key)
        if path is None:
            return
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            torch.export.save(program, str(tmp / "graph.pt2"))
            (tmp / "meta.json").write_text(json.dumps({**meta, "key": key.to_dict()}))
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        except Exception:  # noqa: BLE001 - a cache that cannot write is only slower
            shutil.rmtree(tmp, ignore_errors=True)
            return
        with self._lock:
            self.stats.stored += 1
        self._prune()

    def _prune(self) -> None:
        assert self.folder is not None
        entries = []
        for p in (self.folder / "variants").iterdir():
            if p.is_dir() and not p.name.endswith(".tmp"):
                size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                entries.append((p.stat().st_mtime, size, p))
        total = sum(s for _, s, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_disk_bytes:
                break
            shutil.rmtree(p, ignore_errors=True)
            total -= size

    def miss(self) -> None:
        with self._lock:
            self.stats.misses += 1

    @contextlib.contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """Inductor writes and reads its kernel cache in pgc's folder while inside (the
        variable is restored after; kernels already loaded stay loaded)."""
        if self.folder is None:
            yield
            return
        name = "TORCHINDUCTOR_CACHE_DIR"
        before = os.environ.get(name)
        os.environ[name] = str(self.folder / "inductor")
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before

    def describe(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder) if self.folder else None,
            "memory_entries": len(self._memory),
            **self.stats.to_dict(),
            "at": time.time(),
        }
