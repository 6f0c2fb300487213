"""How close a norm must come to `graphar.ops.unfused_add_rms_norm`: the bound every norm test holds
graphar's kernels to (the fused kernel and the fallback's Triton kernel; tests/gpu/test_norm.py,
tests/test_norm_kernel.py)."""

from __future__ import annotations

import torch

# The norm's only differences from PyTorch are the summation order of the mean square (fp32) and
# rsqrt's rounding; after the cast and the weight's multiply, at most two units in the last place of
# the output dtype, relative to the value (fp32: a few ulps of a long sum).
ULP = {torch.float32: 2.0**-20, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}


def assert_close_to(got: torch.Tensor, want: torch.Tensor, what: str, bound: float | None = None) -> float:
    """`got` within `bound` (default: ULP of its dtype) of `want`, relative to `want`'s magnitude
    (clamped at 1e-3); returns the largest relative error."""
    bound = ULP[got.dtype] if bound is None else bound
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item()
    assert err <= bound, f"{what}: relative error {err:.3g} over the bound ({bound:.3g})"
    return err
