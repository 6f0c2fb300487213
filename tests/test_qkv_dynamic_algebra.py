"""The Q/K/V ops' fakes on symbolic sizes, with no compile (the layout algebra: tests/test_layout.py).

Sizes are made as Dynamo makes them for a dynamic dim (a symbol >= 2, hint 8 unless said). The fakes
must give the real op's sizes, strides and dtype, and add no guard when their checks are provable.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

import graphar  # noqa: F401  (registers the ops)
from tests._graphs import init_fake_world
from tests.test_layout import SymbolicTestCase

WORLD = 2


class SymbolicFakeTest(SymbolicTestCase):
    """The ops' fakes on symbolic inputs against the real ops at the hints (the fake process group
    moves no data, so the real ops run here for their results' metadata)."""

    def setUp(self) -> None:
        super().setUp()
        init_fake_world(WORLD)
        self.group = dist.group.WORLD.group_name

    def tearDown(self) -> None:
        dist.destroy_process_group()
        super().tearDown()

    def assert_like_real(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        self.assertTrue(any(isinstance(n, torch.SymInt) for n in fake.shape), fake.shape)
        at_hints = [
            tuple(n.node.hint if isinstance(n, torch.SymInt) else n for n in sizes)
            for sizes in (fake.shape, fake.stride())
        ]
        self.assertEqual(at_hints, [tuple(real.shape), real.stride()])
        self.assertEqual(fake.dtype, real.dtype)

    def qkv(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """GQA Q, K, V `[1, S, h, 8]` sharing one symbolic S, and real ones at the hint S = 8."""
        shapes = [(1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 2, 8)]
        return (
            tuple(self.fake(*shape, dynamic=(1,), duck=True) for shape in shapes),
            tuple(torch.randn(shape) for shape in shapes),
        )

    def test_qkv_and_output_fakes(self) -> None:
        fakes, reals = self.qkv()
        with self.mode:
            packed = torch.ops.graphar.qkv_all_to_all(*fakes, self.group)
            out = torch.ops.graphar.heads_to_seq_all_to_all(packed[:, :, :2], self.group)
        real_packed = torch.ops.graphar.qkv_all_to_all(*reals, self.group)
        self.assert_like_real(packed, real_packed)
        self.assert_like_real(out, torch.ops.graphar.heads_to_seq_all_to_all(real_packed[:, :, :2], self.group))

    def test_packed_fake(self) -> None:
        def inputs(q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:  # dim 0: 2*S and 2
            return [torch.cat([q.flatten(0, 1)] * 2), torch.cat([k, k])]

        (q, k, _), (real_q, real_k, _) = self.qkv()
        with self.mode:
            outs = torch.ops.graphar.packed_all_to_all_single(inputs(q, k), self.group)
        real = torch.ops.graphar.packed_all_to_all_single(inputs(real_q, real_k), self.group)
        for fake, r in zip(outs, real):
            self.assert_like_real(fake, r)


class FakeCheckGuardTest(SymbolicFakeTest):
    """What the checks need but cannot prove becomes a guard on a relation, never on a value."""

    def tearDown(self) -> None:
        dist.destroy_process_group()
        guards = [str(g.expr) for g in self.env.guards]
        self.assertTrue(
            guards and all(re.fullmatch(r"Eq\(s\d+, s\d+\)|Eq\(Mod\(s\d+, 2\), 0\)", g) for g in guards), guards
        )

    def test_qkv_of_separate_symbols_guards_them_equal(self) -> None:
        q, k, v = (self.fake(1, 8, 4, 8, dynamic=(1,)) for _ in range(3))
        with self.mode:
            torch.ops.graphar.qkv_all_to_all(q, k, v, self.group)

    def test_output_of_an_unproved_length_guards_its_parity(self) -> None:
        with self.mode:
            torch.ops.graphar.heads_to_seq_all_to_all(self.fake(1, 8, 2, 8, dynamic=(1,)), self.group)

    test_qkv_and_output_fakes = test_packed_fake = None  # inherited: run once, in SymbolicFakeTest
