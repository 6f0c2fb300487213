"""The residual add and RMSNorm as one Triton kernel: the fused norm's fallback after its all-reduce.

Where the fused all-reduce + norm kernel cannot take a call, `graphar::all_reduce_add_rms_norm` runs
the all-reduce and then the norm (graphar.ops). In torch's ops the norm is about nine launches (add,
casts, pow, mean, eps, rsqrt, multiplies); here it is one, as in the graph Inductor would have
compiled. It computes what `graphar.ops.unfused_add_rms_norm` computes, rounding where it rounds: the
sum plus the residual in float32, rounded once to the sum's dtype; the mean square and the scaling in
float32; the weight after the cast back (HF's order) or before it (`F.rms_norm`'s, `weight_first`).
Only the mean square's summation order and rsqrt's last bit may differ from torch's.

One program normalises one row, held whole in registers, and its reduction tree depends on the row's
length alone: a row's bits depend on nothing but its inputs, neither on how many rows share the launch
nor on the run, so ranks that hold the same sum get the same bits. Rows of up to MAX_HIDDEN elements;
longer rows, other dtypes, CPU tensors (but under TRITON_INTERPRET=1) and a missing Triton stay with
torch's ops (`add_rms_norm` returns None).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphar.triton_common import interpreting, on_device

try:
    import triton
    import triton.language as tl
except ImportError:  # graphar works without Triton; the norm then runs as torch's ops
    triton = None

# The longest row, in elements: a row lives in registers, at most 32 float32 values a thread at 16 warps.
# Hidden sizes of today's models (up to 16384) fit.
MAX_HIDDEN = 16384
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_ROWS = 2**31 - 1  # one program a row: the grid's first dimension


class Norm(NamedTuple):
    """The residual add and RMSNorm after a sum, in the order the norm's functions take them
    (graphar.ops.unfused_add_rms_norm): `residual` (of the sum's shape) and `weight` (its last dim)
    may be None; `weight_first`: the weight multiplies before the cast back to the sum's dtype
    (`F.rms_norm`'s order), else after (HF's)."""

    residual: torch.Tensor | None
    weight: torch.Tensor | None
    eps: float
    weight_first: bool = False


if triton is not None:
    # Every constexpr comes from the hidden size, the dtypes and which operands there are, all fixed
    # in a model: a new batch never recompiles (its first call may be inside a CUDA-graph capture).
    # There is no runtime integer to specialise on, and the tensors are fresh or aligned (graphar.ops),
    # so the pointers' alignment does not change either.
    @triton.jit
    def _add_rms_norm_kernel(
        x,
        residual,
        weight,
        normed,
        h_out,
        eps,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        WEIGHT_FIRST: tl.constexpr,
    ):
        start = tl.program_id(0).to(tl.int64) * N
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        h = tl.load(x + start + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # as torch adds: both in float32, the sum rounded once to its dtype
            r = tl.load(residual + start + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h_out.dtype.element_ty)
            tl.store(h_out + start + cols, h, mask=mask)
        v = h.to(tl.float32)
        out = v * tl.math.rsqrt(tl.sum(v * v, axis=0) * (1.0 / N) + eps)
        if HAS_WEIGHT:
            w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
            if WEIGHT_FIRST:
                out = out * w
            else:
                out = out.to(h_out.dtype.element_ty).to(tl.float32) * w
        tl.store(normed + start + cols, out.to(normed.dtype.element_ty), mask=mask)


def serves(
    summed: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> bool:
    """Whether `add_rms_norm` runs the kernel for these tensors (else it returns None)."""
    if triton is None or summed.dim() == 0 or not 0 < summed.shape[-1] <= MAX_HIDDEN:
        return False
    if summed.numel() // summed.shape[-1] > _MAX_ROWS or not all(d in DTYPES for d in dtypes):
        return False
    if (residual is not None and residual.shape != summed.shape) or (
        weight is not None and weight.shape != summed.shape[-1:]
    ):
        return False
    return all(
        t.dtype in DTYPES and t.is_contiguous() and t.device == summed.device and (t.is_cuda or interpreting())
        for t in (summed, residual, weight)
        if t is not None
    )


def add_rms_norm(
    summed: torch.Tensor, norm: Norm, dtypes: tuple[torch.dtype, torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(summed + residual) * weight, summed + residual) in one launch, as
    `graphar.ops.unfused_add_rms_norm` computes them; None when the kernel cannot take these tensors
    (the caller then runs torch's ops). `dtypes`: the outputs' (graphar.ops.add_rms_norm_dtypes).
    Without a residual the second result is `summed` itself. Safe inside a CUDA-graph capture: no
    sync, and no memory allocated but the outputs."""
    residual, weight, eps, weight_first = norm
    if not serves(summed, residual, weight, dtypes):
        return None
    hidden = summed.shape[-1]
    normed = torch.empty(summed.shape, dtype=dtypes[0], device=summed.device)
    h = summed if residual is None else torch.empty(summed.shape, dtype=dtypes[1], device=summed.device)
    rows = summed.numel() // hidden
    if rows:
        block = triton.next_power_of_2(hidden)
        with on_device(summed.device):
            # No fused multiply-adds: each product and sum rounds where torch's ops round it, whatever
            # Triton's default (which changes in Triton 3.10).
            _add_rms_norm_kernel[(rows,)](
                summed,
                summed if residual is None else residual,
                summed if weight is None else weight,
                normed,
                h,
                float(eps),
                N=hidden,
                BLOCK=block,
                HAS_RESIDUAL=residual is not None,
                HAS_WEIGHT=weight is not None,
                WEIGHT_FIRST=weight is not None and weight_first,
                num_warps=min(16, max(1, block // 512)),
                enable_fp_fusion=False,
            )
    return normed, h
