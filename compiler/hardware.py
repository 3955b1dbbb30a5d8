"""One probe of what this machine can do, shared by kernel-path choices and ``pgc doctor``."""

from __future__ import annotations

import functools
import hashlib
import platform
from dataclasses import asdict, dataclass, field

import torch

_FEATURES = {
    "avx2": "avx2",
    "avx512": "avx512f",
    "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
    "avx512_bf16": "avx512_bf16",
    "amx_int8": "amx_int8",
    "amx_bf16": "amx_bf16",
    "avx512_fp16": "avx512_fp16",
}


#: the GPUs whose tensor cores take float8 (Ada and Hopper on)
FP8_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Hardware:
    cpu: str
    arch: str
    cores: int
    features: dict[str, bool] = field(default_factory=dict)
    torch_cpu_capability: str = ""
    cuda: bool = False
    gpu: str | None = None
    gpu_capability: tuple[int, int] | None = None
    generation: str = ""
    """The CPU's family and model numbers (``family 25 model 17``): machines whose name and
    flags are the same can differ (a 2-core "AMD EPYC" with AVX-512 VNNI and bf16 ran
    MiniLM's int8 package at 4.6 ms a call one day and 6.8 ms on another, fp32 eager the
    same), so every figure reports it. Not part of :meth:`key`."""

    @property
    def int8_fast(self) -> bool:
        """VNNI or AMX: int8 dot products in hardware, where int8 matmuls beat fp32."""
        f = self.features
        return bool(f.get("avx512_vnni") or f.get("avx_vnni") or f.get("amx_int8"))

    @property
    def bf16_fast(self) -> bool:
        f = self.features
        return bool(f.get("avx512_bf16") or f.get("amx_bf16"))

    @property
    def fp8_fast(self) -> bool:
        """A GPU with float8 tensor cores (compute capability 8.9 on: Ada, Hopper)."""
        return self.cuda and (self.gpu_capability or (0, 0)) >= FP8_CAPABILITY

    def key(self) -> str:
        """A short stable id for study names and cache keys."""
        parts = [self.arch, self.cpu, ",".join(k for k, v in sorted(self.features.items()) if v)]
        if self.gpu:
            parts.append(f"{self.gpu}:{self.gpu_capability}")
        digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:10]
        return f"{'cuda' if self.gpu else 'cpu'}-{digest}"

    def summary(self) -> str:
        feats = [k for k, v in self.features.items() if v]
        name = f"{self.cpu}, {self.generation}" if self.generation else self.cpu
        base = f"{name} ({self.cores} cores; {', '.join(feats) or 'no SIMD extensions'})"
        return base + (f" + {self.gpu}" if self.gpu else "")

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["int8_fast"] = self.int8_fast
        d["bf16_fast"] = self.bf16_fast
        d["fp8_fast"] = self.fp8_fast
        d["key"] = self.key()
        return d


def parse_cpuinfo(text: str) -> tuple[str, set[str], str]:
    """The first processor's model name, flags and generation (``family 25 model 17``) in
    ``/proc/cpuinfo``'s text; empty where a field is missing."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block ends
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    generation = f"family {family} model {model}" if family and model else ""
    return fields.get("model name", ""), set(fields.get("flags", "").split()), generation


def cpu_flags() -> set[str]:
    """Every flag ``/proc/cpuinfo`` lists for this CPU (empty where it cannot be read)."""
    return _cpuinfo()[1]


def _cpuinfo() -> tuple[str, set[str], str]:
    try:
        with open("/proc/cpuinfo") as fh:
            name, flags, generation = parse_cpuinfo(fh.read())
    except OSError:
        name, flags, generation = "", set(), ""
    return name or platform.processor() or platform.machine(), flags, generation


@functools.lru_cache(maxsize=1)
def probe() -> Hardware:
    import os

    name, flags, generation = _cpuinfo()
    features = {k: flag in flags for k, flag in _FEATURES.items()}
    cuda = torch.cuda.is_available()
    gpu = cap = None
    if cuda:
        gpu = torch.cuda.get_device_name(0)
        cap = torch.cuda.get_device_capability(0)
    return Hardware(
        cpu=name,
        arch=platform.machine(),
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        features=features,
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cuda=cuda,
        gpu=gpu,
        gpu_capability=cap,
        generation=generation,
    )
