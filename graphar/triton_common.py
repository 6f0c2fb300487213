"""graphar's Triton kernels. Triton is optional: without it, `pack` copies and `rms_norm` normalises
through torch."""

from __future__ import annotations

import contextlib
import os

import torch


def triton_available() -> bool:
    """Whether Triton imports here (ranks must agree: their Ulysses packs differ without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs its kernels through the interpreter (TRITON_INTERPRET=1: CPU tensors, tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Where a launch must run: Triton launches on the current CUDA device, which need not be the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
