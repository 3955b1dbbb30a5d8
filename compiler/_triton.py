"""pgc's hand-written Triton kernel: int8 weight-only linear with the dequantization, bias and
activation fused.

``y = act((x @ (W_int8 * s)^T) + b)`` with one fp32 scale per output channel. The int8 weight
tile is loaded (a quarter of fp32's bytes, half of fp16's) and converted in registers, the
per-channel scale is applied once to the accumulator instead of to every weight, and bias and
ReLU/GELU run in the epilogue before the single store. At small batch a linear layer is bound
by reading its weights, which is where this pays.

Imported only when a GPU recipe asks for it (``Kernels(linear="triton")``) or by its tests,
which run it on CPU under ``TRITON_INTERPRET=1`` (the variable must be set before Triton is
imported). It is the operator ``torch.ops.pgc.int8_weight_only_linear`` (a
``torch.library.triton_op``), so compiled models launch it from generated code. Block sizes are
Triton's autotuner's choice among a few candidates per shape (rows by powers of two), timed
replayed in a CUDA graph so that launch overhead does not drown the difference; Inductor
tunes the same candidates when it compiles a model that calls the operator.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch import nn

ACTS = {"none": 0, "relu": 1, "gelu": 2}
#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_CONFIGS = [
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
#: the one configuration run under ``TRITON_INTERPRET=1`` (on CPU, nothing to time)
_INTERPRETED = (16, 32, 32, 1, 1)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _prune(configs: list[Any], named_args: dict[str, Any], **_: Any) -> list[Any]:
    """The block sizes worth timing for this batch: none taller than twice its rows (at least
    16); under the interpreter only :data:`_INTERPRETED` (one config: nothing is timed)."""
    if _interpreting():
        return [c for c in configs if _shape(c) == _INTERPRETED] or configs[:1]
    rows = named_args["M_BUCKET"]
    if not isinstance(rows, int):  # symbolic (a traced dynamic batch): an int() would pin it
        return configs
    cap = max(16, 2 * triton.next_power_of_2(rows))
    return [c for c in configs if c.kwargs["BLOCK_M"] <= cap] or configs[:1]


def _shape(c: Any) -> tuple[int, int, int, int, int]:
    k = c.kwargs
    return (k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], c.num_warps, c.num_stages)


def _bench(kernel_call: Any, quantiles: Any) -> Any:
    """The kernel's own time, replayed in a CUDA graph: at small shapes a plain loop of
    launches times Python and the launcher (tens of microseconds), not the block sizes."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return do_bench_cudagraph(kernel_call, rep=10, quantiles=quantiles)
    except Exception:  # noqa: BLE001 - capture refused (e.g. inside another capture)
        return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


@triton.autotune(  # type: ignore[misc]
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w,
                           num_stages=st)
             for bm, bn, bk, w, st in [*_CONFIGS, _INTERPRETED]],
    key=["M_BUCKET", "N", "K"],  # rows by powers of two: a new batch size tunes rarely
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
)
@triton.jit  # type: ignore[misc]
def _int8_weight_only_linear(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, M_BUCKET,
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


@torch.library.triton_op("pgc::int8_weight_only_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, act: int) -> torch.Tensor:
    """The kernel as a PyTorch operator: eagerly it launches the kernel; ``torch.compile``,
    export and AOTInductor see the Triton kernel itself (``wrap_triton``) and call it from
    their generated code, inside CUDA graphs where those are on, without the Python
    launcher (which is what cost the kernel its lead over cuBLAS fp16 eagerly)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

    torch.library.wrap_triton(_int8_weight_only_linear)[grid](
        x2, weight, scale, bias if bias is not None else scale, y, m, n, k,
        triton.next_power_of_2(m), x2.stride(0), x2.stride(1), weight.stride(0),
        weight.stride(1), y.stride(0), y.stride(1), HAS_BIAS=bias is not None, ACT=act,
    )
    return y.reshape(*x.shape[:-1], n)


def int8_weight_only_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    act: str = "none",
) -> torch.Tensor:
    """``act(x @ (weight * scale[:, None]).T + bias)``: ``weight`` int8 ``[N, K]``, ``scale``
    fp32 ``[N]``, ``x`` float ``[..., K]``; the output has ``x``'s dtype. Runs the operator
    ``torch.ops.pgc.int8_weight_only_linear``."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)}, not {act!r}")
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError("weight must be a 2-D int8 tensor")
    return torch.ops.pgc.int8_weight_only_linear(x, weight, scale, bias, ACTS[act])


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
