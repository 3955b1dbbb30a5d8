"""A profiling twin that reads its variant's weights.

A twin (:func:`compiler.build_profiling_twin`) is the variant's package built again with
kernel events; loaded, it holds its own copy of every weight. The serving process calls it
for one sampled call in hundreds, by which time the variant's calls have pushed the twin's
weights out of the caches, and its kernels read them from memory: measured on MiniLM int8
static, max-autotune + bf16 (a 2-core Xeon with AMX, one thread), the twin ran 0.75 ms over
the variant one call after it and 3.1 ms over it a hundred calls after, and its per-layer
rows added up to 1.48x the live latency when one call in 150 was sampled. With the
variant's weights (the same tensors, not a copy) the gap stayed at 0.8-1.0 ms at every
distance: the cost of the kernel events, which the profiler calibrates and takes out.

Only weights that are equal are shared: same original name (one constant of that name in
each package), layout, dtype, shape, strides and contents. Others stay the twin's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compiler._aoti_native import NativePackage, constant_nbytes


@dataclass(frozen=True)
class SharedWeights:
    """What :func:`share_weights` did: constants the twin now reads from the variant, and
    those it keeps (different, or not comparable), with their sizes."""

    shared: int = 0
    shared_bytes: int = 0
    kept: int = 0
    packages: int = 0
    """Package pairs (one per input signature) that were matched."""

    def describe(self) -> str:
        if not self.packages:
            return "no weights shared (the twin's packages do not run natively)"
        return (f"{self.shared} weights shared with the variant ({self.shared_bytes / 1e6:.1f} "
                f"MB), {self.kept} kept its own, over {self.packages} package(s)")


def share_weights(twin: nn.Module, variant: nn.Module) -> SharedWeights:
    """Point the twin's packages at the variant's weights where they are equal (see the
    module's docstring). Both are ``AotiModule``s of the same recipe; packages are paired by
    input signature (dynamic ones by position). Anything else shares nothing."""
    pairs = _package_pairs(twin, variant)
    shared = shared_bytes = kept = 0
    for twin_pkg, variant_pkg in pairs:
        theirs = variant_pkg.constants()
        use: dict[str, torch.Tensor] = {}
        for fqn, (name, own) in twin_pkg.constants().items():
            other = theirs.get(fqn)
            if other is not None and _equal(own, other[1]):
                use[name] = other[1]
                shared_bytes += constant_nbytes(own)
            else:
                kept += 1
        if use:
            twin_pkg.use_constants(use, owner=variant_pkg)
        shared += len(use)
    return SharedWeights(shared, shared_bytes, kept, len(pairs))


def _package_pairs(
    twin: nn.Module, variant: nn.Module
) -> list[tuple[NativePackage, NativePackage]]:
    runners_t, runners_v = getattr(twin, "runners", None), getattr(variant, "runners", None)
    if not isinstance(runners_t, dict) or not isinstance(runners_v, dict):
        return []
    pairs = [(r, runners_v.get(sig)) for sig, r in runners_t.items()]
    pairs += list(zip([r for _, r in getattr(twin, "dynamic", ())],
                      [r for _, r in getattr(variant, "dynamic", ())], strict=False))
    return [(t.native, v.native) for t, v in pairs
            if v is not None and t.native is not None and v.native is not None]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.layout, a.dtype, a.shape) != (b.layout, b.dtype, b.shape):
        return False
    if a.layout == torch.strided:
        return a.stride() == b.stride() and bool(torch.equal(a, b))
    try:  # oneDNN's packed weights compare as dense tensors
        return bool(torch.equal(a.to_dense(), b.to_dense()))
    except (RuntimeError, NotImplementedError):
        return False

