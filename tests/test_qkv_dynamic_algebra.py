"""The Q/K/V pass's layout algebra and the ops' fakes on symbolic sizes, with no compile.

Sizes are made as Dynamo makes them for a dynamic dim (a symbol >= 2, hint 8 unless said). Every
decision of the algebra must hold for every value of the symbols and add no guard: a division it
cannot prove exact, or two symbols that merely happen to be equal now, make it say no. The fakes
must give the real op's sizes, strides and dtype, and add no guard when their checks are provable.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from expecttest import TestCase
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import graphar  # noqa: F401  (registers the ops)
from graphar.passes.qkv import (
    _canonical, _contiguous, _expected, _flat, _reshape, _same, _same_modes, _tieable, _viewable,
)
from tests._graphs import init_fake_world

WORLD = 2


class _Symbolic(TestCase):
    """A fresh shape environment per test, which must end the test without a guard."""

    def setUp(self) -> None:
        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env)

    def tearDown(self) -> None:
        self.assertEqual(self.env.guards, [])
        self.assertEqual(self.env.deferred_runtime_asserts, {})

    def fake(self, *shape: int, dynamic: tuple[int, ...] = (), duck: bool = False) -> torch.Tensor:
        """A fake tensor of `shape` whose `dynamic` dims are symbols (DUCK: one symbol per value)."""
        kind = DimDynamic.DUCK if duck else DimDynamic.DYNAMIC
        sizes = [kind if k in dynamic else DimDynamic.STATIC for k in range(len(shape))]
        with unset_fake_temporarily():  # a real tensor to start from, even inside the fake mode
            real = torch.empty(shape)
        return self.mode.from_tensor(real, symbolic_context=StatelessSymbolicContext(sizes))

    def symbols(self, *hints: int) -> tuple[torch.SymInt, ...]:
        """One symbol of its own per hint."""
        return tuple(self.fake(*hints, dynamic=tuple(range(len(hints)))).shape)

    def assert_layout(self, actual, expected) -> None:
        self.assertIsNotNone(actual)
        self.assertEqual(len(actual), len(expected))
        for a, e in zip(actual, expected):
            self.assertTrue(_same_modes(a, e), f"{a} != {e}")


class SymbolicAlgebraTest(_Symbolic):
    def test_reshape_splits_a_symbolic_mode(self) -> None:
        (s,) = self.symbols(8)
        layout = _reshape(_flat(_contiguous((2 * s, 8))), (2, s, 8))  # the receive side's view
        self.assert_layout(layout, (((2, 8 * s),), ((s, 8),), ((8, 1),)))

    def test_reshape_refuses_a_division_it_cannot_prove(self) -> None:
        (s,) = self.symbols(8)
        self.assertIsNone(_reshape(_flat(_contiguous((s, 8))), (2, s // 2, 8)))  # s may be odd

    def test_two_symbols_equal_now_are_not_confused(self) -> None:
        s, t = self.symbols(8, 8)
        self.assertIsNone(_reshape(_flat(_contiguous((s, t))), (t, s)))
        self.assertFalse(_same((s,), (t,)))

    def test_canonical_merges_proved_runs_only(self) -> None:
        s, t = self.symbols(8, 8)
        self.assert_layout((_canonical([(s, 8), (8, 1)]),), (((8 * s, 1),),))
        self.assertEqual(len(_canonical([(s, t), (8, 1)])), 2)  # t == 8 is not proved

    def test_expected_relayout_of_a_symbolic_sequence(self) -> None:
        (s,) = self.symbols(8)
        shape, modes = _expected((1, s, 4, 8), WORLD, 2)  # [b, S, h, d] -> [b, P*S, h/P, d]
        self.assertTrue(_same(shape, (1, 2 * s, 2, 8)))
        # The rank blocks and the local sequence are one run over the global tensor: [P*S] tokens.
        self.assert_layout((modes,), (((2 * s, 32), (16, 1)),))

    def test_viewable_decides_by_strides_for_every_size(self) -> None:
        with self.mode:
            heads = self.fake(1, 8, 6, 8, dynamic=(1,))[:, :, 0:2]  # Q's heads in a packed result
        s = heads.shape[1]
        self.assertIsInstance(s, torch.SymInt)
        self.assertTrue(_viewable(heads, (1, s, 16)))  # heads and d merge
        self.assertFalse(_viewable(heads, (1, 2 * s, 8)))  # sequence and heads do not
        self.assertRaises(RuntimeError, lambda: torch.empty(1, 8, 6, 8)[:, :, 0:2].view(1, 16, 8))

    def test_only_symbols_of_their_own_equal_now_are_tieable(self) -> None:
        s, t, u = self.symbols(8, 8, 6)
        self.assertTrue(_tieable(s, t))
        self.assertFalse(_tieable(s, u))  # unequal now: cross-attention, say
        self.assertFalse(_tieable(s, 8))  # a guard s == 8 would recompile per length
        self.assertFalse(_tieable(2 * s, 2 * t))


class SymbolicFakeTest(_Symbolic):
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
        at_hints = [tuple(n.node.hint if isinstance(n, torch.SymInt) else n for n in sizes)
                    for sizes in (fake.shape, fake.stride())]
        self.assertEqual(at_hints, [tuple(real.shape), real.stride()])
        self.assertEqual(fake.dtype, real.dtype)

    def qkv(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """GQA Q, K, V `[1, S, h, 8]` sharing one symbolic S, and real ones at the hint S = 8."""
        shapes = [(1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 2, 8)]
        return (tuple(self.fake(*shape, dynamic=(1,), duck=True) for shape in shapes),
                tuple(torch.randn(shape) for shape in shapes))

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
        self.assertTrue(guards and all(re.fullmatch(r"Eq\(s\d+, s\d+\)|Eq\(Mod\(s\d+, 2\), 0\)", g)
                                       for g in guards), guards)

    def test_qkv_of_separate_symbols_guards_them_equal(self) -> None:
        q, k, v = (self.fake(1, 8, 4, 8, dynamic=(1,)) for _ in range(3))
        with self.mode:
            torch.ops.graphar.qkv_all_to_all(q, k, v, self.group)

    def test_output_of_an_unproved_length_guards_its_parity(self) -> None:
        with self.mode:
            torch.ops.graphar.heads_to_seq_all_to_all(self.fake(1, 8, 2, 8, dynamic=(1,)), self.group)

    test_qkv_and_output_fakes = test_packed_fake = None  # inherited: run once, in SymbolicFakeTest
