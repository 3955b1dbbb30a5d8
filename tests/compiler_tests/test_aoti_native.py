"""An AOTInductor package runs through its library's C interface with the GIL released, so the
serving process's other threads (request handlers, the fp32 control of a canary) keep running
while a compiled variant computes. torch's own loader holds the GIL for the whole call: the
same package through it is the control that shows the difference is measured, not assumed."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from compiler._aoti import PackageRunner, _package_loader, compile_package
from compiler._aoti_native import (
    ALIGNMENT,
    NativePackage,
    constant_address,
    free_pages,
    plain_package,
)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, nn.Module, torch.Tensor]]:
    """A package whose one call takes tens of milliseconds on one thread."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048)).eval()
    x = torch.randn(256, 2048)
    path = tmp_path_factory.mktemp("native") / "mlp.pt2"
    compile_package(model, ((x,), {}), path, {"freezing": True})
    yield path, model, x


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The package computes on one core, the spinning thread has the other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _spins_per_s(call: Callable[[], Any], rounds: int) -> tuple[float, float]:
    """How fast a pure-Python thread counts while ``call`` runs back to back in this one,
    and how long a call takes (s)."""
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    time.sleep(0.05)
    c0, t0 = count[0], time.perf_counter()
    for _ in range(rounds):
        call()
    elapsed = time.perf_counter() - t0
    spins = count[0] - c0
    stop.set()
    thread.join()
    return spins / elapsed, elapsed / rounds


def test_a_plain_package_runs_natively_with_the_loaders_outputs(package: tuple[Path, nn.Module, torch.Tensor]) -> None:
    path, model, x = package
    assert plain_package(path)
    runner = PackageRunner(path)
    assert runner.native is not None and runner.loader is None
    loader = _package_loader(path)
    with torch.inference_mode():
        native_out = runner((x,), {})
        loader_out = loader.boxed_run([x])[0]
        expected = model(x)
    assert torch.equal(native_out, loader_out)
    torch.testing.assert_close(native_out, expected, rtol=1e-4, atol=1e-4)


def test_only_a_cpu_package_runs_natively(package: tuple[Path, nn.Module, torch.Tensor],
                                         tmp_path: Path) -> None:
    """The native container is made for the CPU: a package compiled for CUDA (its metadata
    says so) goes to torch's loader, which makes it for its device. Before, the check looked
    at the files only, and a CUDA package would have been run on a CPU container."""
    import json
    import zipfile

    path, _, _ = package
    cuda = tmp_path / "cuda.pt2"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(cuda, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("wrapper_metadata.json"):
                meta = json.loads(data)
                assert meta["AOTI_DEVICE_KEY"] == "cpu"
                data = json.dumps(dict(meta, AOTI_DEVICE_KEY="cuda")).encode()
            dst.writestr(item, data)
    assert plain_package(path) and not plain_package(cuda)


@pytest.mark.serial  # a spinner's pace beside the call
def test_other_threads_run_while_a_package_computes(
    package: tuple[Path, nn.Module, torch.Tensor], one_thread: None
) -> None:
    path, _, x = package
    native = NativePackage(path)
    loader = _package_loader(path)
    with torch.inference_mode():
        alone, _ = _spins_per_s(lambda: time.sleep(0.02), 10)  # the spinner with the GIL to itself
        beside_native, call_s = _spins_per_s(lambda: native.run([x]), 8)
        beside_loader, _ = _spins_per_s(lambda: loader.boxed_run([x]), 8)
    assert call_s > 0.005, "the call must be long enough to tell holding from releasing"
    # released: the spinner keeps most of its pace; held: it runs only between calls
    assert beside_native > 0.4 * alone, (beside_native, alone)
    assert beside_native > 2.5 * beside_loader, (beside_native, beside_loader)


def test_a_released_package_leaves_nothing_extracted(package: tuple[Path, nn.Module, torch.Tensor]) -> None:
    path, _, x = package
    native = NativePackage(path)
    extracted = next(native.folder.rglob("*.so"))
    assert extracted.exists()
    with torch.inference_mode():
        native.run([x])
    del native
    gc.collect()
    assert not extracted.exists()


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon")) / 1024


def test_a_loaded_packages_weights_are_moved_onto_cache_lines(
        package: tuple[Path, nn.Module, torch.Tensor]) -> None:
    """The library copies its weights into one heap block when it loads, and glibc returns
    a large block 16 bytes past a page: every weight then sits 16 bytes off a cache line
    (a ResNet-18 int8 package ran 1.27x slower so). The runner moves them onto cache lines,
    computing the same outputs."""
    path, _, x = package
    raw = NativePackage(path)
    off = {fqn for fqn, (_, t) in raw.constants().items() if constant_address(t) % ALIGNMENT}
    assert off  # the weights as the library leaves them
    runner = PackageRunner(path)
    assert runner.aligned[0] == len(off)
    assert runner.aligned[1] >= 2 * 2048 * 2048 * 4
    assert not [fqn for fqn, (_, t) in runner.native.constants().items()
                if constant_address(t) % ALIGNMENT]
    with torch.inference_mode():
        assert torch.equal(runner((x,), {}), raw.run([x])[0])


def test_the_aligned_copies_cost_no_memory(package: tuple[Path, nn.Module, torch.Tensor]) -> None:
    """The library's own copies are given back once the aligned ones serve: without that,
    every loaded package held its weights twice (MiniLM: 58 MB more)."""
    path, _, x = package
    pkg = NativePackage(path)
    before = _rss_anon_mb()
    moved, nbytes = pkg.align_constants()
    assert moved and nbytes >= 32 * 2**20
    assert _rss_anon_mb() - before < 0.25 * nbytes / 2**20
    with torch.inference_mode():
        assert torch.equal(pkg.run([x])[0], PackageRunner(path)((x,), {}))


def test_weights_shared_after_alignment_keep_the_other_copies_alive(
        package: tuple[Path, nn.Module, torch.Tensor]) -> None:
    """A profiling twin aligns its weights when it loads and then reads some of its variant's
    instead: it computes what the variant computes, its other copies still in place after
    the second exchange (the package keeps every set it was given)."""
    path, _, x = package
    twin, variant = PackageRunner(path).native, PackageRunner(path).native
    name, theirs = next(iter(variant.constants().values()))
    twin.use_constants({name: theirs}, owner=variant)
    gc.collect()
    junk = [torch.full((2048, 2048), float("nan")) for _ in range(4)]  # reuse freed memory
    with torch.inference_mode():
        assert torch.equal(twin.run([x])[0], variant.run([x])[0])
    del junk


def test_only_pages_no_kept_constant_touches_are_given_back() -> None:
    page = 4096
    moved = [(16, 3 * page), (5 * page + 16, 4 * page)]  # 16 bytes past a page, as glibc does
    # nothing kept: the whole pages inside each moved span
    assert free_pages(moved, [], page) == [(page, 3 * page), (6 * page, 9 * page)]
    # a kept constant inside the second span (an alias, or a neighbour the library still
    # reads) keeps the pages it touches
    kept = [(7 * page + 100, 200)]
    assert free_pages(moved, kept, page) == [(page, 3 * page), (6 * page, 7 * page),
                                             (8 * page, 9 * page)]
    # adjacent spans merge; a span under a page frees nothing
    assert free_pages([(0, page), (page, page)], [], page) == [(0, 2 * page)]
    assert free_pages([(100, page - 200)], [], page) == []

