"""The Triton residual add + RMSNorm (the fused norm's fallback) under TRITON_INTERPRET=1, against
`unfused_add_rms_norm`: the sum exact, the normed output within the GPU tests' bound, its bits
deterministic and the same for a row whatever shares its launch.

The interpreter is chosen when Triton decorates a kernel, i.e. when graphar.allreduce.rms_norm is first
imported, so the cases run in a subprocess with TRITON_INTERPRET=1 set from the start:
`test_under_interpreter` starts it, and the cases skip themselves in the parent process.

Inputs are small integers, as on the GPUs: their sums are exact in every dtype, so the sum plus the
residual must be bitwise torch's. The interpreter casts float32 to bfloat16 by truncation where a GPU
rounds to nearest even, so bfloat16 outputs here get one more unit of the last place than on a GPU
(tests/gpu/test_norm.py holds the kernel to the bound itself).
"""

from __future__ import annotations

import itertools
import unittest
from unittest import mock

import torch

from graphar.ops import add_rms_norm_dtypes, unfused_add_rms_norm
from tests._interpreted import INTERPRETED, run_interpreted
from tests._norm import ULP, assert_close_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-6


def _bound(normed: torch.Tensor, h: torch.Tensor) -> float:
    """The GPU tests' bound, of the coarser of the output's dtype and the sum's (HF's order rounds the
    norm to the sum's dtype before the weight); where that rounding is to bfloat16, one more unit, which
    the interpreter's truncation may cost."""
    return max(ULP[normed.dtype], ULP[h.dtype]) + (2.0**-7 if h.dtype == torch.bfloat16 else 0.0)


def test_under_interpreter() -> None:
    run_interpreted(__file__, "not test_under_interpreter")


def _integers(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-8, 9, shape).to(dtype)


def _weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(hidden) + 0.5).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@unittest.skipUnless(INTERPRETED, "runs in the TRITON_INTERPRET=1 subprocess of test_under_interpreter")
class NormKernelTest(unittest.TestCase):
    def setUp(self) -> None:
        from graphar.allreduce import rms_norm

        self.kernel = rms_norm
        torch.manual_seed(0)

    def norm(
        self,
        summed: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        weight_first: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's results, which it must give (not hand back to torch)."""
        norm = self.kernel.Norm(residual, weight, EPS, weight_first)
        out = self.kernel.add_rms_norm(summed, norm, add_rms_norm_dtypes(summed, residual, weight, weight_first))
        self.assertIsNotNone(out, "the kernel must take these tensors")
        return out

    def check(
        self,
        summed: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        weight_first: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel against torch's ops: the same dtypes and shapes, the sum exact, the norm within the bound."""
        normed, h = self.norm(summed, residual, weight, weight_first)
        want_normed, want_h = unfused_add_rms_norm(summed, residual, weight, EPS, weight_first)
        self.assertEqual(
            (normed.dtype, normed.shape, h.dtype, h.shape),
            (want_normed.dtype, want_normed.shape, want_h.dtype, want_h.shape),
        )
        self.assertTrue(torch.equal(h, want_h), "sum + residual differs")
        assert_close_to(normed, want_normed, "normed", _bound(normed, h))
        return normed, h

    def test_against_torch_dtypes_weight_orders_residual_weight_sizes_rows(self) -> None:
        cases = itertools.product(DTYPES, (1, 7, 64, 1000, 4104), (1, 37), (True, False), (None, False, True))
        for dtype, hidden, rows, with_residual, weight_first in cases:
            with self.subTest(dtype=dtype, hidden=hidden, rows=rows, residual=with_residual, weight_first=weight_first):
                residual = _integers(rows, hidden, dtype=dtype) if with_residual else None
                weight = None if weight_first is None else _weight(hidden, dtype)
                self.check(_integers(rows, hidden, dtype=dtype), residual, weight, bool(weight_first))

    def test_mixed_dtypes_round_as_type_promotion_says(self) -> None:
        hidden = 96
        x = _integers(3, hidden, dtype=torch.bfloat16)
        for weight_first in (False, True):
            with self.subTest("a float32 residual: the sum and the norm in float32", weight_first=weight_first):
                self.check(x, _integers(3, hidden, dtype=torch.float32), _weight(hidden, torch.bfloat16), weight_first)
            with self.subTest("a float32 weight: HF's product in float32, F.rms_norm's cast back", first=weight_first):
                self.check(x, _integers(3, hidden, dtype=torch.bfloat16), _weight(hidden, torch.float32), weight_first)
            with self.subTest("float16 + bfloat16: the sum in float32", weight_first=weight_first):
                self.check(x, _integers(3, hidden, dtype=torch.float16), _weight(hidden, torch.float16), weight_first)

    def test_rows_of_any_leading_shape_and_the_longest_row(self) -> None:
        self.check(
            _integers(2, 3, 40, dtype=torch.bfloat16),
            _integers(2, 3, 40, dtype=torch.bfloat16),
            _weight(40, torch.bfloat16),
        )
        hidden = self.kernel.MAX_HIDDEN
        self.check(_integers(2, hidden, dtype=torch.float32), None, _weight(hidden, torch.float32), True)

    def test_same_bits_every_call_and_whatever_shares_the_launch(self) -> None:
        """Ranks compare the normed output bitwise: a row's bits must depend on its inputs alone."""
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                summed, residual = _integers(37, 1000, dtype=dtype), _integers(37, 1000, dtype=dtype)
                weight = _weight(1000, dtype)
                normed, h = self.norm(summed, residual, weight)
                again, h_again = self.norm(summed, residual, weight)
                self.assertTrue(torch.equal(_bits(normed), _bits(again)) and torch.equal(_bits(h), _bits(h_again)))
                alone, _ = self.norm(summed[5:6], residual[5:6], weight)
                self.assertTrue(torch.equal(_bits(alone), _bits(normed[5:6])))

    def test_no_residual_returns_the_sum_itself(self) -> None:
        summed = _integers(4, 64, dtype=torch.bfloat16)
        self.assertIs(self.norm(summed, None, None)[1], summed)

    def test_no_rows(self) -> None:
        empty = torch.empty(0, 64, dtype=torch.float16)
        normed, h = self.norm(empty, empty, None)
        self.assertEqual((normed.shape, h.shape), ((0, 64), (0, 64)))

    def test_what_it_hands_back_to_torch(self) -> None:
        def refused(summed, residual=None, weight=None) -> bool:
            dtypes = add_rms_norm_dtypes(summed, residual, weight)
            return self.kernel.add_rms_norm(summed, self.kernel.Norm(residual, weight, EPS), dtypes) is None

        x = _integers(2, 64, dtype=torch.bfloat16)
        self.assertTrue(refused(_integers(2, self.kernel.MAX_HIDDEN + 8, dtype=torch.bfloat16)), "a longer row")
        self.assertTrue(refused(x.double()), "float64")
        self.assertTrue(refused(x, _integers(64, 2, dtype=torch.bfloat16).t()), "a transposed residual")
        self.assertTrue(refused(x, _integers(1, 64, dtype=torch.bfloat16)), "a broadcast residual")
        self.assertTrue(refused(torch.empty(2, 0)), "empty rows")
        with mock.patch.object(self.kernel, "interpreting", lambda: False):
            self.assertTrue(refused(x), "CPU tensors, but under the interpreter")
        with mock.patch.object(self.kernel, "triton", None):
            self.assertTrue(refused(x), "no Triton")

    def test_the_ops_fallback_runs_the_kernel(self) -> None:
        from graphar import ops

        x, residual, weight = (
            _integers(5, 72, dtype=torch.bfloat16),
            _integers(5, 72, dtype=torch.bfloat16),
            _weight(72, torch.bfloat16),
        )
        for weight_first in (False, True):
            with self.subTest(weight_first=weight_first):
                got = ops.add_rms_norm(x, self.kernel.Norm(residual, weight, EPS, weight_first))
                want = self.norm(x, residual, weight, weight_first)
                self.assertTrue(all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want)))
        long = _integers(2, self.kernel.MAX_HIDDEN + 8, dtype=torch.bfloat16)  # torch's ops, the same results
        norm = self.kernel.Norm(None, None, EPS)
        got, want = ops.add_rms_norm(long, norm), unfused_add_rms_norm(long, *norm)
        self.assertTrue(all(torch.equal(g, w) for g, w in zip(got, want)))


if __name__ == "__main__":
    unittest.main()
