"""The Triton relayout kernels under TRITON_INTERPRET=1, bitwise against permute references.

The interpreter is chosen when Triton decorates a kernel, i.e. when graphar.ulysses.pack is first
imported, so the cases run in a subprocess with TRITON_INTERPRET=1 set from the start:
`test_under_interpreter` starts it, and the cases skip themselves in the parent process.
"""

from __future__ import annotations

import unittest
from unittest import mock

import torch

from graphar.ulysses.shapes import packed_heads
from tests._interpreted import INTERPRETED, run_interpreted

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def test_under_interpreter() -> None:
    run_interpreted(__file__, "not test_under_interpreter")


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _heads_reference(xs: list[torch.Tensor], p: int) -> torch.Tensor:
    """[P, b, S, sum h/P, d]: rank j's head block of every tensor, side by side."""
    return torch.cat(
        [x.reshape(x.shape[0], x.shape[1], p, x.shape[2] // p, x.shape[3]).permute(2, 0, 1, 3, 4) for x in xs], dim=3
    )


@unittest.skipUnless(INTERPRETED, "runs in the TRITON_INTERPRET=1 subprocess of test_under_interpreter")
class PackKernelTest(unittest.TestCase):
    def setUp(self) -> None:
        from graphar.ulysses import pack

        self.pack = pack
        torch.manual_seed(0)

    def check_pack_heads(self, xs: list[torch.Tensor], p: int) -> None:
        b, s, _, d = xs[0].shape
        out = _poisoned(p, b, s, packed_heads([x.shape[2] for x in xs], p), d, dtype=xs[0].dtype)
        self.assertTrue(self.pack.pack_heads(xs, p, out), "the Triton kernel must do the copy")
        self.assertTrue(torch.equal(out, _heads_reference(xs, p)))

    def test_pack_heads_dtypes_batches_worlds(self) -> None:
        for dtype in DTYPES:
            for p, b in ((2, 1), (2, 3), (4, 1), (4, 2)):
                with self.subTest(dtype=dtype, p=p, b=b):
                    self.check_pack_heads([_randn(b, 5, 4 * p // 2, 16, dtype=dtype) for _ in range(3)], p)

    def test_pack_heads_gqa(self) -> None:
        for dtype in DTYPES:
            q = _randn(2, 6, 8, 32, dtype=dtype)
            k, v = _randn(2, 6, 4, 32, dtype=dtype), _randn(2, 6, 4, 32, dtype=dtype)
            for p in (2, 4):
                with self.subTest(dtype=dtype, p=p):
                    self.check_pack_heads([q, k, v], p)

    def test_pack_heads_strided_inputs(self) -> None:
        b, s, h, d, p = 2, 5, 4, 16, 2
        for dtype in DTYPES:
            with self.subTest(dtype=dtype, layout="chunks of a fused QKV projection"):
                fused = _randn(b, s, 3 * h * d, dtype=dtype)
                self.check_pack_heads([c.view(b, s, h, d) for c in fused.chunk(3, dim=-1)], p)
            with self.subTest(dtype=dtype, layout="heads at dim 1, transposed"):
                self.check_pack_heads([_randn(b, h, s, d, dtype=dtype).transpose(1, 2) for _ in range(3)], p)
            with self.subTest(dtype=dtype, layout="padded head stride"):
                padded = _randn(b, s, h, 2 * d, dtype=dtype)
                self.check_pack_heads([padded[..., :d], padded[..., d:], _randn(b, s, h, d, dtype=dtype)], p)

    def test_pack_heads_odd_sizes(self) -> None:
        # d not a power of two (masked lanes), 3 heads per rank (one head per program), many row blocks.
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                self.check_pack_heads([_randn(1, 300, 6, 24, dtype=dtype) for _ in range(3)], 2)

    def test_64bit_indexing_gives_the_same_bits(self) -> None:
        # Offsets past 2**31 need gigabytes; lowering the limit runs the 64-bit path on small tensors.
        with mock.patch.object(self.pack, "_INT32_MAX", 0):
            self.check_pack_heads([_randn(2, 5, 4, 16, dtype=torch.bfloat16) for _ in range(3)], 2)

    def test_gather_sequence(self) -> None:
        for dtype in DTYPES:
            for p, b in ((2, 2), (4, 3)):
                with self.subTest(dtype=dtype, p=p, b=b):
                    recv = _randn(p, b, 5, 6, 16, dtype=dtype)
                    out = _poisoned(b, p * 5, 6, 16, dtype=dtype)
                    self.assertTrue(self.pack.gather_sequence(recv, out))
                    self.assertTrue(torch.equal(out, recv.permute(1, 0, 2, 3, 4).reshape(b, p * 5, 6, 16)))

    def test_pack_sequence(self) -> None:
        for dtype in DTYPES:
            for p, b in ((2, 1), (4, 2)):
                with self.subTest(dtype=dtype, p=p, b=b):
                    o = _randn(b, p * 5, 3, 16, dtype=dtype)
                    out = _poisoned(p, b, 5, 3, 16, dtype=dtype)
                    self.assertTrue(self.pack.pack_sequence(o, p, out))
                    self.assertTrue(torch.equal(out, o.reshape(b, p, 5, 3, 16).permute(1, 0, 2, 3, 4)))
                with self.subTest(dtype=dtype, p=p, b=b, layout="attention output transposed"):
                    o = _randn(b, 3, p * 5, 16, dtype=dtype).transpose(1, 2)
                    out = _poisoned(p, b, 5, 3, 16, dtype=dtype)
                    self.assertTrue(self.pack.pack_sequence(o, p, out))
                    self.assertTrue(torch.equal(out, o.reshape(b, p, 5, 3, 16).permute(1, 0, 2, 3, 4)))

    def test_gather_heads(self) -> None:
        for dtype in DTYPES:
            for p, b in ((2, 1), (4, 2)):
                with self.subTest(dtype=dtype, p=p, b=b):
                    recv = _randn(p, b, 5, 3, 16, dtype=dtype)
                    out = _poisoned(b, 5, p * 3, 16, dtype=dtype)
                    self.assertTrue(self.pack.gather_heads(recv, out))
                    self.assertTrue(torch.equal(out, recv.permute(1, 2, 0, 3, 4).reshape(b, 5, p * 3, 16)))

    def test_a_set_guard_stores_nothing(self) -> None:
        # An exchange's pack reads its communicator's failed flag: once set, nothing shared is written.
        xs = [_randn(1, 5, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
        for flag in (0, 1):
            with self.subTest(flag=flag):
                out = _poisoned(2, 1, 5, 6, 16, dtype=torch.bfloat16)
                self.assertTrue(self.pack.pack_heads(xs, 2, out, torch.tensor([flag], dtype=torch.int32)))
                if flag:
                    self.assertTrue(torch.isnan(out).all(), "a guarded pack stored after the flag was set")
                else:
                    self.assertTrue(torch.equal(out, _heads_reference(xs, 2)))

    def test_pack_heads_into_shifted_chunks(self) -> None:
        # A push: chunk j lands in "rank j's buffer" (a separate allocation), at this rank's slot, by the
        # shifts between the buffers; the rest of every buffer stays as it was.
        for dtype in DTYPES:
            for p, rank in ((2, 1), (4, 2)):
                with self.subTest(dtype=dtype, p=p, rank=rank):
                    xs = [_randn(2, 5, 2 * p, 16, dtype=dtype), *(_randn(2, 5, p, 16, dtype=dtype) for _ in range(2))]
                    heads = packed_heads([x.shape[2] for x in xs], p)
                    buffers = [_poisoned(p, 2, 5, heads, 16, dtype=dtype) for _ in range(p)]
                    own = buffers[rank]
                    shifts = tuple((b.data_ptr() - own.data_ptr()) // dtype.itemsize for b in buffers)
                    self.assertTrue(self.pack.pack_heads(xs, p, self.pack.Shifted(own[rank], shifts)))
                    reference = _heads_reference(xs, p)
                    for j, buffer in enumerate(buffers):
                        self.assertTrue(torch.equal(buffer[rank], reference[j]), f"chunk {j}")
                        others = torch.cat([buffer[:rank], buffer[rank + 1 :]])
                        self.assertTrue(torch.isnan(others).all(), f"rank {j}'s other slots were written")

    def test_shifted_chunks_need_the_kernel(self) -> None:
        xs = [_randn(1, 4, 2, 16, dtype=torch.float64) for _ in range(3)]  # float64: no kernel
        out = self.pack.Shifted(torch.empty(1, 4, 3, 16, dtype=torch.float64), (0, 0))
        self.assertFalse(self.pack.kernel_serves(xs))
        with self.assertRaisesRegex(ValueError, "only the Triton kernel"):
            self.pack.pack_heads(xs, 2, out)

    def test_non_contiguous_last_dim_falls_back_to_torch(self) -> None:
        xs = [_randn(1, 4, 16, 2, dtype=torch.float32).transpose(2, 3) for _ in range(3)]
        out = _poisoned(2, 1, 4, 3, 16, dtype=torch.float32)
        self.assertFalse(self.pack.pack_heads(xs, 2, out))
        self.assertTrue(torch.equal(out, _heads_reference(xs, 2)))


if __name__ == "__main__":
    unittest.main()
