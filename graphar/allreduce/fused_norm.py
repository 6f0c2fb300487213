"""What the fused all-reduce + residual add + RMSNorm kernel takes, by dtypes and sizes, as the norm pass
applies it to a graph's symbolic shapes (passes/norm.py), to leave alone a norm that no call could ever
fuse. Each call is judged by the CUDA library's plan (csrc/plan.cu, graphar_comm_plan_norm) by the
same rule on its real sizes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphar import _cuda


def refusal(
    dtype: torch.dtype,
    residual: torch.dtype | None,
    weight: torch.dtype | None,
    row_bytes: int | torch.SymInt,
    nbytes: int | torch.SymInt,
    max_bytes: int,
    proven: Callable[[object], bool] = bool,
) -> str | None:
    """Why the fused kernel cannot take an input of `dtype` with rows of `row_bytes`, `nbytes` in all,
    beside a residual and a weight of the dtypes given (None: absent), where messages are bounded by
    `max_bytes`; None when it can. `proven` judges each bound: `bool` for a call's sizes,
    `statically_known_true` for a graph's symbolic ones (a bound not proven is no refusal)."""
    for what, other in (("residual", residual), ("weight", weight)):
        if other is not None and other != dtype:
            return f"the {what} is {other}, the kernel takes only the input's dtype ({dtype})"
    if proven(row_bytes % 16 != 0):
        return f"rows of {row_bytes} bytes are not a multiple of 16"
    if proven(row_bytes > _cuda.NORM_MAX_ROW_BYTES):
        return f"rows of {row_bytes} bytes are over the kernel's {_cuda.NORM_MAX_ROW_BYTES}"
    if proven(nbytes > max_bytes):
        return f"{nbytes} bytes are over the fused norm's {max_bytes}"
    return None
