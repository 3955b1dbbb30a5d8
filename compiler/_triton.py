"""pgc's hand-written Triton kernel: int8 weight-only linear with the dequantization, bias and
activation fused.

``y = act((x @ (W_int8 * s)^T) + b)`` with one fp32 scale per output channel. The int8 weight
tile is loaded (a quarter of fp32's bytes, half of fp16's) and converted in registers, the
per-channel scale is applied once to the accumulator instead of to every weight, and bias and
ReLU/GELU run in the epilogue before the single store. At small batch a linear layer is bound
by reading its weights, which is where this pays.

Imported only when a GPU recipe asks for it (``Kernels(linear="triton")``) or by its tests,
which run it on CPU under ``TRITON_INTERPRET=1`` (the variable must be set before Triton is
imported). Block sizes are chosen by timing a few candidates per shape on the GPU, once,
replayed in a CUDA graph so that launch overhead does not drown the difference.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch import nn

ACTS = {"none": 0, "relu": 1, "gelu": 2}
_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    # small batches are bound by reading the weights: many narrow column blocks with long
    # K tiles keep every SM streaming (N=4096 in blocks of 16-32 is 128-256 programs)
    (16, 16, 256, 2, 4),
    (16, 32, 128, 4, 4),
    (16, 32, 256, 4, 3),
    (16, 64, 128, 4, 4),
    (16, 64, 64, 4, 3),
    (16, 128, 64, 4, 3),
    (32, 64, 64, 4, 3),
    # larger batches are bound by the math: wider tiles reuse each loaded weight more
    (64, 64, 32, 4, 3),
    (64, 128, 32, 8, 3),
    (128, 128, 32, 8, 3),
]
_CHOSEN: dict[tuple[Any, ...], tuple[int, int, int, int, int]] = {}


@triton.jit  # type: ignore[misc]
def _int8_weight_only_linear(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=(rn[None, :] < N) & (kk[:, None] < K), other=0,
        )
        acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACT == 2:
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _launch(x2: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None,
            y: torch.Tensor, act: int, cfg: tuple[int, int, int, int, int]) -> None:
    bm, bn, bk, warps, stages = cfg
    m, k = x2.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int8_weight_only_linear[grid](
        x2, w, s, b if b is not None else s, y, m, n, k,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=b is not None, ACT=act, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages,
    )


def _config(x2: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None,
            y: torch.Tensor, act: int) -> tuple[int, int, int, int, int]:
    m, k = x2.shape
    n = w.shape[0]
    if _interpreting() or x2.device.type != "cuda":
        return (16, 32, 32, 1, 1)
    key = (triton.next_power_of_2(m), n, k, x2.dtype, act)
    if key not in _CHOSEN:
        timings = {}
        for cfg in _CONFIGS:
            if cfg[0] > max(16, 2 * triton.next_power_of_2(m)):
                continue
            try:
                timings[cfg] = _kernel_ms(lambda cfg=cfg: _launch(x2, w, s, b, y, act, cfg))
            except Exception:  # noqa: BLE001 - a config the GPU cannot run (shared memory)
                continue
        _CHOSEN[key] = min(timings, key=timings.__getitem__)
    return _CHOSEN[key]


def _kernel_ms(fn: Any) -> float:
    """The kernel's own time, replayed in a CUDA graph: at small shapes a plain loop of
    launches times Python and the launcher (tens of microseconds), not the block sizes."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=10))
    except Exception:  # noqa: BLE001 - capture refused (e.g. inside another capture)
        return float(do_bench(fn, warmup=5, rep=20))


@torch.compiler.disable  # Python-side block choice; a compiled model calls it as one op
def int8_weight_only_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    act: str = "none",
) -> torch.Tensor:
    """``act(x @ (weight * scale[:, None]).T + bias)``: ``weight`` int8 ``[N, K]``, ``scale``
    fp32 ``[N]``, ``x`` float ``[..., K]``; the output has ``x``'s dtype."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)}, not {act!r}")
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError("weight must be a 2-D int8 tensor")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    y = torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    cfg = _config(x2, weight, scale, bias, y, ACTS[act])
    _launch(x2, weight, scale, bias, y, ACTS[act], cfg)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(int8 weight, fp32 scale)``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class TritonInt8Linear(nn.Module):
    """A drop-in for ``nn.Linear`` (same name in the model) running the fused Triton kernel."""

    def __init__(self, linear: nn.Linear, act: str = "none") -> None:
        super().__init__()
        q, scale = quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(linear.weight.device))
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_weight_only_linear(x, self.weight_int8, self.scale, self.bias, self.act)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, act={self.act}, int8 weight-only (Triton)"
