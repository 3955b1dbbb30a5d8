"""Running an AOTInductor package through its shared library's C interface, without the GIL.

torch's package loader (``torch._C._aoti.AOTIModelPackageLoader``, torch 2.13) holds the GIL
for a whole call. In a serving process that starves every other Python thread for as long
as a call lasts: measured on 2 cores, an fp32 eager model in a second thread went from 7 ms
to 283 ms a call beside a package called back to back, which is what a canary (the fp32
control beside the compiled candidate) and the user's own request threads live through.

Every package's library exports the AOTInductor C ABI (``aoti_runtime/interface.h``):
``AOTInductorModelContainerCreateWithDevice``, ``...Run``, ``...GetCallSpec``,
``...GetNumOutputs``, ``...Delete``. :class:`NativePackage` calls them through ``ctypes``,
which releases the GIL for the call; tensors cross as ``AtenTensorHandle`` made by
``torch._C._aoti`` (inputs are stolen by the run, outputs are stolen back into tensors),
the same exchange the loader does in C++. Same outputs, same speed, and the other threads
run (the eager model beside it: 7.0 ms a call).

Only a *plain* package is run this way: one library in the model's folder with its weights
inside it, no ops for the proxy executor (their ``.json`` would be there) and no separate
weights folder. Anything else goes to the loader (:func:`plain_package` says which).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import tempfile
import threading
import weakref
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch

_MODEL_DIR = "data/aotinductor/model/"
#: files of a package's model folder that are its own (``kernel_information.json``: the
#: generated kernels' source lines, which a profiling twin carries), not proxy-executor ops
_OWN_JSON = ("_metadata.json", "_compile_flags.json", "_linker_flags.json",
             "kernel_information.json")

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]



class _ConstantEntry(ctypes.Structure):
    """``AOTInductorConstantMapEntry``: a constant's name and its ``AtenTensorHandle``."""

    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_torch_lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
_torch_lib.aoti_torch_new_tensor_handle.argtypes = [
    ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
_torch_lib.aoti_torch_new_tensor_handle.restype = ctypes.c_int

_EXTRACT_LOCK = threading.Lock()
_extract_root: tuple[int, str] | None = None


def extract_folder() -> str:
    """This process's folder for extracted packages, removed when it exits. A package is
    extracted to run it (60 MB per MiniLM package, per process); folders of processes that
    are gone (killed) are removed here too."""
    global _extract_root
    with _EXTRACT_LOCK:
        pid = os.getpid()
        if _extract_root is None or _extract_root[0] != pid:  # first use, or a forked child
            base = Path(tempfile.gettempdir())
            for old in base.glob("pgc-aoti-loaded-*"):
                try:
                    os.kill(int(old.name.split("-")[3]), 0)
                except ProcessLookupError:
                    shutil.rmtree(old, ignore_errors=True)
                except (ValueError, IndexError, OSError):
                    continue
            root = tempfile.mkdtemp(prefix=f"pgc-aoti-loaded-{pid}-")
            atexit.register(lambda: os.getpid() == pid and shutil.rmtree(root, ignore_errors=True))
            _extract_root = (pid, root)
        return _extract_root[1]


def _model_entries(z: zipfile.ZipFile) -> list[str]:
    return [n for n in z.namelist() if n.split("/", 1)[-1].startswith(_MODEL_DIR) and not n.endswith("/")]


def plain_package(path: str | Path) -> bool:
    """Whether :class:`NativePackage` can run the package: one library holding its weights,
    for the CPU (its metadata's ``AOTI_DEVICE_KEY``: the container is made for the CPU, so a
    CUDA package goes to the loader), no proxy-executor ops, no weights beside it."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        model = _model_entries(z)
        devices = {_device_of(z, n) for n in model if n.endswith("wrapper_metadata.json")}
    libraries = [n for n in model if n.endswith(".so")]
    extern = [n for n in model if n.endswith(".json") and not n.endswith(_OWN_JSON)]
    weights = [n for n in names if "/data/weights/" in n or "/data/constants/" in n]
    compiled = [n for n in model if n.endswith(".o")]
    return (len(libraries) == 1 and devices == {"cpu"} and not extern and not weights
            and not compiled)


def _device_of(z: zipfile.ZipFile, name: str) -> str | None:
    """The device a package's wrapper was compiled for, from its metadata (None: unreadable)."""
    try:
        return str(json.loads(z.read(name))["AOTI_DEVICE_KEY"])
    except (KeyError, ValueError, TypeError):
        return None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"AOTInductor {what} failed (error {code}; the library printed why on stderr)")


class NativePackage:
    """One plain package: extracted into this process's folder, its library opened and one
    model container made (CPU). :meth:`run` takes and returns flat tensor lists, as the
    loader's ``boxed_run`` does; calls from several threads wait for the one model."""

    def __init__(self, path: str | Path) -> None:
        self.folder = folder = Path(tempfile.mkdtemp(prefix="pkg-", dir=extract_folder()))
        with zipfile.ZipFile(path) as z:
            entries = _model_entries(z)
            z.extractall(folder, members=entries)
        library = next(folder / n for n in entries if n.endswith(".so"))
        self._lib = lib = ctypes.CDLL(str(library))
        for name, args in (
            ("AOTInductorModelContainerCreateWithDevice",
             [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p]),
            ("AOTInductorModelContainerRun",
             [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
              ctypes.c_void_p, ctypes.c_void_p]),
            ("AOTInductorModelContainerGetNumOutputs", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
            ("AOTInductorModelContainerGetCallSpec",
             [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]),
            ("AOTInductorModelContainerDelete", [ctypes.c_void_p]),
        ):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        handle = ctypes.c_void_p()
        cubin_dir = str(library.parent).encode()
        _check(lib.AOTInductorModelContainerCreateWithDevice(ctypes.byref(handle), 1, b"cpu", cubin_dir),
               "model container creation")
        self._handle = handle.value
        self._borrowed: list[tuple[object, list[torch.Tensor], list[object]]] = []
        self._aligned = False
        self._finalizer = weakref.finalize(self, _release, lib, self._handle, folder)
        outputs = ctypes.c_size_t()
        _check(lib.AOTInductorModelContainerGetNumOutputs(self._handle, ctypes.byref(outputs)), "GetNumOutputs")
        self.num_outputs = outputs.value
        in_spec, out_spec = ctypes.c_char_p(), ctypes.c_char_p()
        _check(lib.AOTInductorModelContainerGetCallSpec(self._handle, ctypes.byref(in_spec), ctypes.byref(out_spec)),
               "GetCallSpec")
        self.call_spec = [(in_spec.value or b"").decode(), (out_spec.value or b"").decode()]

    def run(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        capsules = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(flat)
        inputs = (ctypes.c_void_p * len(capsules))(*(_api.PyCapsule_GetPointer(c, None) for c in capsules))
        outputs = (ctypes.c_void_p * self.num_outputs)()
        # a ctypes call releases the GIL until the library returns
        _check(self._lib.AOTInductorModelContainerRun(
            self._handle, inputs, len(capsules), outputs, self.num_outputs, None, None), "run")
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_api.PyCapsule_New(p, None, None) for p in outputs])

    def constants(self) -> dict[str, tuple[str, torch.Tensor]]:
        """The container's constants, by original name (FQN) -> (its name in the library,
        a tensor aliasing it), for the FQNs only one constant has (generated ones, such as
        a quantized layer's zero points, can share one) and not folded at run time. The
        tensors alias memory this package owns: keep the package while they are used."""
        lib, h = self._lib, self._handle
        _set_types(lib)
        n = ctypes.c_size_t()
        _check(lib.AOTInductorModelContainerGetNumConstants(h, ctypes.byref(n)), "GetNumConstants")
        names: dict[str, list[str]] = {}
        for i in range(n.value):
            name, fqn, folded = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_bool()
            _check(lib.AOTInductorModelContainerGetConstantName(h, i, ctypes.byref(name)), "name")
            _check(lib.AOTInductorModelContainerGetConstantOriginalFQN(h, i, ctypes.byref(fqn)),
                   "FQN")
            _check(lib.AOTInductorModelContainerGetConstantFromFolded(h, i, ctypes.byref(folded)),
                   "FromFolded")
            if not folded.value:
                own = (name.value or b"").decode()
                names.setdefault((fqn.value or b"").decode(), []).append(own)
        return {fqn: (names[fqn][0], tensor) for fqn, tensor in self._entries()
                if len(names.get(fqn, ())) == 1}

    def _entries(self) -> list[tuple[str, torch.Tensor]]:
        """Every entry of the container's constant map: (FQN, a tensor aliasing it)."""
        lib, h = self._lib, self._handle
        _set_types(lib)
        entries, count = ctypes.POINTER(_ConstantEntry)(), ctypes.c_size_t()
        _check(lib.AOTInductorModelContainerExtractConstantsMapEntries(
            h, ctypes.byref(entries), ctypes.byref(count), False), "ExtractConstantsMapEntries")
        out = []
        for i in range(count.value):
            alias = ctypes.c_void_p()
            _check(_torch_lib.aoti_torch_new_tensor_handle(entries[i].handle, ctypes.byref(alias)),
                   "new tensor handle")
            out.append(((entries[i].name or b"").decode(),
                        torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(
                            _api.PyCapsule_New(alias.value, None, None))))
        return out

    def use_constants(self, tensors: dict[str, torch.Tensor], owner: object) -> None:
        """Run on ``tensors`` (by name in the library) instead of the package's own copies,
        in place, without copying them; ``owner`` (whatever keeps their memory) is kept as
        long as this package is."""
        capsules = [torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(t) for t in tensors.values()]
        pairs = (_ConstantEntry * len(tensors))(*(
            _ConstantEntry(name.encode(), _api.PyCapsule_GetPointer(c, None))
            for name, c in zip(tensors, capsules, strict=True)))
        _set_types(self._lib)
        _check(self._lib.AOTInductorModelContainerUpdateUserManagedConstantBufferPairs(
            self._handle, pairs, len(tensors), False, False), "UpdateUserManagedConstantBuffer")
        # every set given lives as long as this package (a twin aligns its own weights, then
        # reads some of its variant's): what the library reads must not rest on whether its
        # handles keep references
        self._borrowed.append((owner, list(tensors.values()), capsules))

    def align_constants(self) -> tuple[int, int]:
        """Give the library copies at :data:`ALIGNMENT` of the constants that sit off it;
        returns (constants moved, their bytes). Once per package (later calls move nothing).

        The library copies its constants into one ``malloc``'d block when the container is
        made, and glibc returns a block that large 16 bytes past a page: every weight then
        sat 16 bytes off a cache line (all 83 of a ResNet-18 int8 package, torch 2.13), each
        of oneDNN's 64-byte weight loads spanned two lines, and the package ran 2.30-2.37 ms
        a call where the same package with its weights copied aligned ran 1.80-1.86 (2-core
        Xeon with AMX). The originals' pages are given back (:func:`free_pages`: whole pages
        of moved constants that no constant the library still reads touches), so the copies
        cost no memory (MiniLM int8 static: 58 MB of constants)."""
        if self._aligned:
            return 0, 0
        self._aligned = True
        old = {name: t for name, t in self.constants().values()
               if constant_address(t) % ALIGNMENT}
        if not old:
            return 0, 0
        moved = {name: t.clone() for name, t in old.items()}
        self.use_constants(moved, owner=moved)
        spans = [(constant_address(t), constant_nbytes(t)) for t in old.values()]
        del old  # the library's tensors over its block: what it reads now is in _entries
        keep = [(constant_address(t), constant_nbytes(t)) for _, t in self._entries()]
        for start, end in free_pages(spans, keep, _PAGE):
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
        return len(moved), sum(constant_nbytes(t) for t in moved.values())

    def close(self) -> None:
        self._finalizer()


#: the alignment a package's constants get (a cache line; oneDNN allocates its own at 64)
ALIGNMENT = 64
#: ``madvise`` advice: free these pages (read again as zeros; see :func:`free_pages`)
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")


def free_pages(spans: Sequence[tuple[int, int]], keep: Sequence[tuple[int, int]],
               page: int) -> list[tuple[int, int]]:
    """The page ranges ``[start, end)`` wholly inside the ``(address, size)`` spans that no
    span of ``keep`` touches (a constant the library still reads, aliasing or beside a moved
    one), merged: what can be given back without changing what anything reads."""
    kept = sorted((a // page * page, -(-(a + n) // page) * page) for a, n in keep if n > 0)
    out: list[tuple[int, int]] = []
    for address, size in sorted(spans):
        start, end = -(-address // page) * page, (address + size) // page * page
        for k0, k1 in kept:
            if k1 <= start or k0 >= end:
                continue
            if k0 > start:
                out.append((start, k0))
            start = max(start, k1)
        if end > start:
            out.append((start, end))
    merged: list[tuple[int, int]] = []
    for start, end in out:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def constant_address(t: torch.Tensor) -> int:
    """Where a constant's data starts (oneDNN's opaque tensors through ``mkldnn.data_ptr``)."""
    if t.layout == torch._mkldnn:  # type: ignore[attr-defined]
        return int(torch.ops.mkldnn.data_ptr(t))
    return t.data_ptr()


def constant_nbytes(t: torch.Tensor) -> int:
    """The bytes a constant's data takes (oneDNN's opaque tensors: their packed layout's)."""
    if t.layout == torch._mkldnn:  # type: ignore[attr-defined]
        return int(torch.ops.mkldnn._nbytes(t))
    return t.untyped_storage().nbytes()


def _set_types(lib: ctypes.CDLL) -> None:
    """Argument types of the constant functions (:meth:`NativePackage.constants`)."""
    if getattr(lib, "_pgc_constant_types", False):
        return
    handle, size, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p)
    for name, args in (
        ("AOTInductorModelContainerGetNumConstants", [handle, ctypes.POINTER(size)]),
        ("AOTInductorModelContainerGetConstantName", [handle, size, text]),
        ("AOTInductorModelContainerGetConstantOriginalFQN", [handle, size, text]),
        ("AOTInductorModelContainerGetConstantFromFolded",
         [handle, size, ctypes.POINTER(ctypes.c_bool)]),
        ("AOTInductorModelContainerExtractConstantsMapEntries",
         [handle, ctypes.POINTER(ctypes.POINTER(_ConstantEntry)), ctypes.POINTER(size),
          ctypes.c_bool]),
        ("AOTInductorModelContainerUpdateUserManagedConstantBufferPairs",
         [handle, ctypes.POINTER(_ConstantEntry), size, ctypes.c_bool, ctypes.c_bool]),
    ):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    lib._pgc_constant_types = True


def _release(lib: ctypes.CDLL, handle: int, folder: Path) -> None:
    """Delete the container, close the library (as torch's loader does) and remove the
    extracted files: nothing of the package is left mapped or on disk."""
    import _ctypes

    lib.AOTInductorModelContainerDelete(handle)
    _ctypes.dlclose(lib._handle)
    shutil.rmtree(folder, ignore_errors=True)
