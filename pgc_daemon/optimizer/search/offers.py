"""What the search may offer on this machine: layer choices and backends, for a model on
its CPU or on its GPU. (The space itself, shaped by the profile and sensitivity, is
:mod:`pgc_daemon.optimizer.search.space`.)"""

from __future__ import annotations

from torch import nn

from compiler import Hardware, openvino_backends, probe

BASE_CHOICES = ("fp32", "int8-static-pc", "int8-dynamic-pc", "int8-dynamic-pt",
                "int8-weight_only-pc")
#: a model on a GPU: no static int8 (pt2e's quantizer is x86's), the half precisions, and fp8
#: where the GPU has float8 tensor cores; int8 weight-only runs pgc's Triton kernel there
GPU_CHOICES = ("fp32", "fp16", "bf16", "int8-weight_only-pc", "int8-dynamic-pc")
#: the backends that run a model on a GPU (ONNX Runtime and OpenVINO are searched on CPU)
GPU_BACKENDS = ("inductor", "inductor-max", "eager")
#: Inductor's C++ GEMM templates for int8 linears (MiniLM int8 at batch 1, AVX-512 EPYC, head
#: to head: 4.08 against 4.39 ms a call; bf16 gained nothing); chosen by measurement
MAX_AUTOTUNE = "inductor-max"
#: Inductor under bf16 autocast (``compiler._autocast``): int8 kernels with bf16 between them,
#: offered where the CPU has AMX (MiniLM int8 static at batch 1: 1.08-1.10x faster with it on
#: a Xeon with AMX, 0.96x on an AVX-512-BF16 EPYC without)
AUTOCAST_BACKENDS = ("inductor+bf16", "inductor-max+bf16")


def choices_for(hardware: Hardware, *, gpu: bool = False) -> tuple[str, ...]:
    """Layer choices worth trying for a model on this machine's CPU (bf16 only where there
    are bf16 units) or, ``gpu``, on its GPU (:data:`GPU_CHOICES`, and fp8 where the GPU has
    float8 tensor cores: compute capability 8.9 on); the search measures which are fast."""
    if gpu:
        return GPU_CHOICES + (("fp8",) if hardware.fp8_fast else ())
    return BASE_CHOICES + (("bf16",) if hardware.bf16_fast else ())


def backends_for(hardware: Hardware | None = None) -> tuple[str, ...]:
    """Inductor (also :data:`MAX_AUTOTUNE`) and eager everywhere, Inductor under bf16
    autocast where the CPU has AMX (:data:`AUTOCAST_BACKENDS`); ONNX Runtime and OpenVINO
    where installed (OpenVINO as ``openvino`` and, where its default precision is not f32,
    ``openvino-f32``). Each is a :meth:`Backend.label`, which :meth:`Space.recipe` parses."""
    out = ["inductor", MAX_AUTOTUNE]
    if (hardware or probe()).features.get("amx_bf16"):
        out += AUTOCAST_BACKENDS
    out.append("eager")
    try:
        import onnxruntime  # noqa: F401, PLC0415
    except ImportError:
        pass
    else:
        out.append("onnxruntime")
    out += [b.label() for b in openvino_backends()]
    return tuple(out)


def on_gpu(model: nn.Module) -> bool:
    """Whether ``model``'s parameters live on a CUDA device."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"
