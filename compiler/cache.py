"""The compile cache: the same key always rebuilds the same variant, and a rebuild in another
process (or after a restart) skips the slow steps.

**The key** (:class:`CacheKey`) is everything that decides a variant's code and numbers:

- ``graph``: ``compiler.fingerprint(model)`` (module tree, parameter shapes, dtypes, weights);
- ``recipe``: ``Recipe.hash``;
- ``calibration``: a digest of the calibration inputs, for recipes that calibrate (static
  int8; any int8 on OpenVINO); ``-`` otherwise;
- ``versions``: torch, torchao, triton (and onnxruntime, or openvino and nncf, for those
  backends), and ``pgc.graph_passes``, the version of pgc's rewrites of quantized graphs;
- ``device``: ``probe().key()`` (CPU model and ISA features, GPU name and capability) and the
  torch CPU capability;
- ``env``: the environment variables that change code generation (``TORCHINDUCTOR_*``,
  ``TORCH_COMPILE_*``, ``TORCHDYNAMO_*``, ``TRITON_*``, ``ATEN_CPU_CAPABILITY``,
  ``DNNL_*``/``ONEDNN_*``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``; cache locations excluded)
  and torch's thread count.

**What is reused**, measured on all-MiniLM-L6-v2 static int8 (2 busy cores): a fresh build
spends most of its time calibrating (histogram observers) and compiling. In a second process,
Inductor's FX graph cache does not help (it refuses graphs with prepacked oneDNN weights).
AOTInductor packages of pt2e graphs came out wrong with dynamic shapes and slow without
freezing; compiled with static shapes and freezing they are the fastest variant, and are kept
whole (artifacts, below). For variants ``torch.compile`` builds, what helps is (1) the
quantized graph saved as a ``torch.export`` program (calibration and export skipped; loading
takes a second) and (2) Inductor's on-disk kernel cache kept in pgc's folder (``inductor/``),
which cut the compile of the same graph in a new process from ~60 s to ~20 s. Within a
process, built variants are kept (a small LRU), so the same key returns the very same module.

**Artifacts: build once, load everywhere.** A variant built as AOTInductor packages (or an
ONNX Runtime model, or OpenVINO IR) is also saved whole, as an *artifact*: ``artifacts/<key digest>/`` holds
its files and ``manifest.json`` (the key, the kind, every file's SHA-256, the input signatures
it was compiled for, the recipe, the build report, its size and age). Another process loads it
in seconds with ``compiler.load_artifact``, nothing compiled, after checking every checksum and
that the key fits this process (same graph, recipe, device, versions and code-generation
environment; the calibration may differ, the artifact carries its own). ``build`` itself
returns the artifact stored for its exact key. Artifacts are written to a temporary folder
and renamed into place, and removed oldest first beyond ``max_artifact_bytes``; their folder
may be set apart (``artifacts=``), e.g. on a path every host of a fleet mounts.

Layout of ``folder``: ``variants/<key digest>/{graph.pt2,meta.json}``, ``inductor/``,
``artifacts/`` (unless set apart), ``kernel_choices.json`` (kernel paths chosen by
measurement, ``compiler._measure``). Variant folders beyond ``max_disk_bytes`` are removed
oldest first. Files are read with ``weights_only=False`` semantics (a pickled graph) and
artifacts hold shared libraries that are loaded into the process, so every folder is private
to pgc: created 0700, refused when another user owns it or others may write to it
(``compiler.private``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from compiler._errors import ArtifactUnavailable, UnsafeFolderError
from compiler._kernel_map import ENV as KERNEL_ENV
from compiler._kernel_map import kernel_profiling, with_kernel_events
from compiler._registry import Example
from compiler.fingerprint import fingerprint
from compiler.hardware import probe
from compiler.private import private_dir
from compiler.recipe import Recipe

ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_", "DNNL_", "ONEDNN_")
ENV_NAMES = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", KERNEL_ENV)
#: a folder for Inductor's kernel cache shared by every pgc work dir (unset: each its own)
SHARED_INDUCTOR_ENV = "PGC_INDUCTOR_CACHE_DIR"
ENV_IGNORED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE_DIR")


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return "-"


def codegen_env(environ: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """The environment that changes generated code: ``environ``, or this process's as this
    thread builds (inside ``kernel_events``, with :data:`KERNEL_ENV` at 1)."""
    env = (with_kernel_events() if kernel_profiling() else os.environ) if environ is None \
        else environ
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
    """Static int8 calibrates; on OpenVINO, NNCF calibrates dynamic int8 layers too."""
    schemes = ("static", "dynamic") if recipe.backend.kind == "openvino" else ("static",)
    return any(c.scheme in schemes for _, c in recipe.quantization.rules)


@dataclass(frozen=True)
class CacheKey:
    graph: str
    recipe: str
    calibration: str
    versions: tuple[tuple[str, str], ...]
    device: str
    env: tuple[tuple[str, str], ...]
    picks: str = "-"
    """The GEMM picks a profiling twin replays (``compiler._autotune_picks.replay_digest``;
    ``-``: none). Part of the digest only when set, so other keys read as before; not a
    compatibility check (:func:`incompatible`): a serving process loads whichever twin its
    variant's row names."""

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def for_graph(self) -> CacheKey:
        """The key of the saved quantized graph: kernel events change the code generated
        from that graph, not the graph, so a profiling twin starts from its variant's."""
        return dataclasses.replace(self, env=tuple(kv for kv in self.env if kv[0] != KERNEL_ENV),
                                   picks="-")

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "recipe": self.recipe,
            "calibration": self.calibration,
            "versions": dict(self.versions),
            "device": self.device,
            "env": dict(self.env),
        } | ({"picks": self.picks} if self.picks != "-" else {})


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
    from compiler._autotune_picks import replay_digest
    from compiler._pt2e import GRAPH_PASSES, MAX_CALIBRATION

    vers = versions or {
        "pgc.graph_passes": GRAPH_PASSES,
        "torch": torch.__version__,
        "torchao": _version("torchao"),
        "triton": _version("triton"),
        "onnxruntime": _version("onnxruntime") if recipe.backend.kind == "onnxruntime" else "-",
    }
    if versions is None and recipe.backend.kind == "openvino":
        vers.update(openvino=_version("openvino"), nncf=_version("nncf"))
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
        picks=replay_digest(),
    )


def incompatible(stored: dict[str, Any], here: CacheKey) -> str | None:
    """Why an artifact built under the ``stored`` key cannot serve in this process (None: it
    can). Every part of the key must match except the calibration digest."""
    mine = here.to_dict()
    for part in ("graph", "recipe", "device", "versions", "env"):
        if stored.get(part) != mine[part]:
            if isinstance(mine[part], dict) and isinstance(stored.get(part), dict):
                names = sorted(
                    k for k in set(mine[part]) | set(stored[part])
                    if mine[part].get(k) != stored[part].get(k)
                )
                return f"{part} differs ({', '.join(names)})"
            return f"{part} differs"
    return None


ARTIFACT_FORMAT = 1
_DIGEST = re.compile(r"[0-9a-f]{64}")


def checked_path(path: Path, expected: str) -> Callable[[], str]:
    """``path`` (a file of an artifact opened earlier) for a library to read, once it is checked
    again: refused (:class:`ArtifactUnavailable`) when gone or when its checksum is no longer
    the one the artifact was opened with. A variant that keeps this, rather than the file's
    bytes, reads again what was verified, not whatever is there now."""

    def check() -> str:
        try:
            same = sha256_file(path) == expected
        except OSError as exc:
            raise ArtifactUnavailable(f"{path.name} of an artifact is gone ({exc})") from None
        if not same:
            raise ArtifactUnavailable(f"{path.name} changed since its artifact was opened")
        return str(path)

    return check


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    stored: int = 0
    artifact_loads: int = 0
    artifacts_stored: int = 0

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
        artifacts: str | os.PathLike[str] | None = None,
        max_memory: int = 2,
        max_disk_bytes: int = 2 << 30,
        max_artifact_bytes: int = 4 << 30,
    ) -> None:
        self.folder = Path(folder).expanduser().resolve() if folder is not None else None
        if artifacts is None and self.folder is not None:
            artifacts = self.folder / "artifacts"
        self.artifacts = Path(artifacts).expanduser().resolve() if artifacts is not None else None
        self.max_memory = max_memory
        self.max_disk_bytes = max_disk_bytes
        self.max_artifact_bytes = max_artifact_bytes
        self.stats = CacheStats()
        self._memory: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        if self.folder is not None:
            for sub in (self.folder, self.folder / "variants", self.folder / "inductor"):
                private_dir(sub)
            from compiler import _measure

            _measure.set_store(self.folder)
        if self.artifacts is not None:
            private_dir(self.artifacts)

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

    # ------------------------------------------------------------------ artifacts

    def artifact_dir(self, digest: str) -> Path | None:
        if self.artifacts is None or not _DIGEST.fullmatch(digest):
            return None
        return self.artifacts / digest

    def has_artifact(self, digest: str) -> bool:
        path = self.artifact_dir(digest)
        return path is not None and (path / "manifest.json").is_file()

    def save_artifact(
        self, key: CacheKey, kind: str, files: dict[str, Path | bytes], meta: dict[str, Any]
    ) -> str | None:
        """Store an artifact under ``key``'s digest: ``files`` (copied from a path or written
        from bytes) and a manifest of ``meta`` plus the key, kind, checksums, size and time.
        Written in a temporary folder and renamed into place; returns the digest, or None when
        there is no artifacts folder or it cannot be written (the variant is only not kept)."""
        final = self.artifact_dir(key.digest)
        if final is None:
            return None
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            private_dir(tmp)
            sums: dict[str, str] = {}
            for name, src in files.items():
                if isinstance(src, bytes):
                    (tmp / name).write_bytes(src)
                else:
                    shutil.copyfile(src, tmp / name)
                sums[name] = sha256_file(tmp / name)
            manifest = {
                **meta,
                "format": ARTIFACT_FORMAT,
                "key": key.to_dict(),
                "kind": kind,
                "files": sums,
                "size_bytes": sum((tmp / n).stat().st_size for n in sums),
                "created_at": time.time(),
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            old = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.old")
            if final.exists():  # a corrupt or older copy: move it aside, then swap
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        except Exception:  # noqa: BLE001 - an artifact that cannot be written is only not kept
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        with self._lock:
            self.stats.artifacts_stored += 1
        self._prune_artifacts(keep=key.digest)
        return key.digest

    def open_artifact(self, digest: str) -> tuple[Path, dict[str, Any]]:
        """The folder and manifest of a stored artifact whose every file has the checksum its
        manifest names. Raises :class:`ArtifactUnavailable` (missing, unsafe or corrupt)."""
        path = self.artifact_dir(digest)
        if path is None:
            where = "no artifacts folder" if self.artifacts is None else "not a key digest"
            raise ArtifactUnavailable(f"artifact {digest[:16]!r} is missing ({where})")
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except FileNotFoundError:
            raise ArtifactUnavailable(
                f"artifact {digest[:12]} is missing from {self.artifacts}"
            ) from None
        except (OSError, ValueError) as exc:
            raise ArtifactUnavailable(
                f"artifact {digest[:12]} is corrupt: unreadable manifest ({exc})"
            ) from None
        try:
            private_dir(path)
        except UnsafeFolderError as exc:
            raise ArtifactUnavailable(f"artifact {digest[:12]} is unsafe to load: {exc}") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not files or manifest.get("format") != ARTIFACT_FORMAT:
            raise ArtifactUnavailable(
                f"artifact {digest[:12]} is corrupt: manifest of another format"
            )
        for name, expected in files.items():
            file = path / name
            if "/" in name or name.startswith(".") or not file.is_file() or file.is_symlink():
                raise ArtifactUnavailable(f"artifact {digest[:12]} is corrupt: {name} is missing")
            if sha256_file(file) != expected:
                raise ArtifactUnavailable(
                    f"artifact {digest[:12]} is corrupt: checksum of {name} differs"
                )
        with contextlib.suppress(OSError):  # recently used: pruned last (a read-only mount is fine)
            os.utime(path)
        return path, manifest

    def artifact_loaded(self) -> None:
        with self._lock:
            self.stats.artifact_loads += 1

    def _prune_artifacts(self, keep: str) -> None:
        """Remove artifacts oldest first (last saved or loaded) while the total is over
        ``max_artifact_bytes``, never ``keep``; and leftovers of interrupted writes."""
        assert self.artifacts is not None
        entries = []
        for p in self.artifacts.iterdir():
            try:
                if p.name.startswith("."):
                    if time.time() - p.stat().st_mtime > 3600:
                        shutil.rmtree(p, ignore_errors=True)
                    continue
                if p.is_dir():
                    size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                    entries.append((p.stat().st_mtime, size, p))
            except OSError:  # removed by another process meanwhile
                continue
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_artifact_bytes:
                break
            if p.name == keep:
                continue
            shutil.rmtree(p, ignore_errors=True)
            total -= size

    def miss(self) -> None:
        with self._lock:
            self.stats.misses += 1

    @contextlib.contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """Inductor writes and reads its kernel cache in pgc's folder while inside (the
        variable is restored after; kernels already loaded stay loaded): the cache folder's
        ``inductor``, or :data:`SHARED_INDUCTOR_ENV`'s folder where that is set (one kernel
        cache for every pgc work dir of a user on the machine; private like the rest)."""
        if self.folder is None:
            yield
            return
        name = "TORCHINDUCTOR_CACHE_DIR"
        shared = os.environ.get(SHARED_INDUCTOR_ENV)
        before = os.environ.get(name)
        os.environ[name] = str(private_dir(shared) if shared else self.folder / "inductor")
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
            "artifacts": str(self.artifacts) if self.artifacts else None,
            "memory_entries": len(self._memory),
            **self.stats.to_dict(),
            "at": time.time(),
        }
