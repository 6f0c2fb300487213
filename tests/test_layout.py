"""The Q/K/V pass's layout algebra (`graphar.passes.layout`), on its own: no compile, no process group.

A layout is checked against what it claims to be: materialised as a tensor of offsets (`offsets`), it
must equal the chain of ops it was read from applied to `arange` (whose values are their own offsets).
An all-to-all is emulated on such tensors, each rank's X holding its offsets in the global tensor.

Symbolic sizes are made as Dynamo makes them for a dynamic dim (a symbol >= 2, hint 8 unless said).
Every decision must hold for every value of the symbols and add no guard: a division the algebra
cannot prove exact, or two symbols that merely happen to be equal now, make it say no.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from expecttest import TestCase
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from graphar.passes.layout import (
    Layout,
    accepts_strides,
    all_to_all_received,
    apply,
    canonical,
    compose,
    contiguous,
    flat,
    is_layout_op,
    is_ulysses_relayout,
    reshape,
    same,
    same_modes,
    tieable,
    ulysses_relayout,
    viewable,
)

P = 2


def offsets(layout: Layout) -> torch.Tensor:
    """The layout as a tensor: at each logical index, the offset in the source it maps to."""
    total = torch.zeros((), dtype=torch.long)
    for dim in layout:
        along = torch.zeros(1, dtype=torch.long)  # the dim's offsets, its modes row-major
        for size, stride in dim:
            along = (along[:, None] + torch.arange(size) * stride).flatten()
        total = total[..., None] + along
    return total


def layout_ops(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[torch.fx.Node]:
    """The aten ops `fn` runs on x, in order, with their fake values (as the post-grad graph has them)."""
    graph = make_fx(fn, tracing_mode="fake")(x).graph
    return [n for n in graph.nodes if n.op == "call_function"]


def read(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, layout: Layout | None = None) -> Layout | None:
    """The layout of fn(x), given x's (contiguous by default)."""
    return compose(contiguous(x.shape) if layout is None else layout, layout_ops(fn, x))


def seq_to_heads(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Ulysses `[b, S, h, d] -> [b, P*S, h/P, d]` (graphar.ulysses.unpacked.seq_to_heads_unpacked), split at
    its all-to-all: what it sends, and the receive side."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, P, h // P, d).transpose(0, 2).contiguous()  # [P, S, b, h/P, d]
    return send, lambda w: w.reshape(P * s, b, h // P, d).transpose(0, 1).contiguous().reshape(b, P * s, h // P, d)


def seq_to_heads_rank_minor(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Like `seq_to_heads`, but token s of rank i lands at s*P + i: an all-to-all, no Ulysses relayout."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, P, h // P, d).permute(2, 1, 0, 3, 4).contiguous()  # [P, S, b, h/P, d]
    return send, lambda w: w.permute(2, 1, 0, 3, 4).reshape(b, s * P, h // P, d)


class LayoutTest(TestCase):
    def assert_reads(self, fn: Callable[[torch.Tensor], torch.Tensor], *shape: int) -> Layout:
        x = torch.arange(math.prod(shape)).view(shape)
        layout = read(fn, x)
        self.assertIsNotNone(layout)
        torch.testing.assert_close(offsets(layout), fn(x), rtol=0, atol=0)
        return layout

    def test_chains_of_layout_ops_compose_into_their_index_map(self) -> None:
        chains = {
            "permute, reshape": (lambda x: x.permute(2, 0, 1).reshape(4, 6), (2, 3, 4)),
            "t, unsqueeze, flatten, unflatten, squeeze": (
                lambda x: x.t().unsqueeze(0).flatten(1).unflatten(1, (2, 12)).squeeze(0),
                (6, 4),
            ),
            "transpose, contiguous, view": (lambda x: x.transpose(0, 2).contiguous().view(4, 6), (2, 3, 4)),
            "seq_to_heads, send side": (lambda x: seq_to_heads(x)[0], (1, 3, 4, 2)),
        }
        for name, (fn, shape) in chains.items():
            with self.subTest(name):
                self.assert_reads(fn, *shape)

    def test_a_permuted_dim_keeps_its_modes(self) -> None:
        layout = self.assert_reads(lambda x: x.t().reshape(6), 2, 3)
        self.assertEqual(layout, (((3, 1), (2, 3)),))
        self.assertEqual(canonical(flat(layout)), ((3, 1), (2, 3)))  # no one run: no view of x

    def test_canonical_drops_ones_and_merges_runs(self) -> None:
        self.assertEqual(canonical([(2, 3), (1, 7), (3, 1)]), ((6, 1),))
        self.assertEqual(canonical([(2, 12), (3, 4), (4, 1)]), ((24, 1),))
        self.assertEqual(canonical([(2, 1), (3, 2)]), ((2, 1), (3, 2)))  # strides 1, 2: no run
        self.assertEqual(canonical(flat(contiguous((2, 1, 3)))), ((6, 1),))

    def test_splits_that_fail(self) -> None:
        x = torch.arange(6).view(2, 3)
        self.assertIsNone(read(lambda x: x.t().reshape(2, 3), x))  # 3 and 2 do not divide each other
        self.assertIsNone(read(lambda x: x.transpose(0, 2).reshape(8, 3), torch.empty(2, 3, 4)))  # 8 = 4 * (2 of 3)
        self.assertIsNone(reshape([(6, 1)], (4,)))
        self.assertIsNone(reshape([(6, 1)], (2,)))  # modes left over
        self.assertIsNone(reshape([(2, 1)], (2, 2)))  # modes run out
        (add,) = layout_ops(lambda x: x + 1, x)
        self.assertFalse(is_layout_op(add))
        self.assertIsNone(apply(contiguous((2, 3)), add))
        self.assertIsNone(compose(None, layout_ops(lambda x: x.t(), x)))

    def test_all_to_all_of_a_ulysses_relayout(self) -> None:
        shape = (2, 3, 4, 2)  # [b, S, h, d]
        self.assertEqual(self.relayout_dims(seq_to_heads, shape), {2})

    def test_all_to_all_of_heads_at_dim_1(self) -> None:
        def heads_first(x: torch.Tensor):  # [b, h, S, d] -> [b, h/P, P*S, d], as xDiT writes it
            b, h, s, d = x.shape
            send = x.reshape(b, P, h // P, s, d).transpose(0, 1).contiguous()
            return send, lambda w: w.reshape(P, b, h // P, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // P, P * s, d)

        self.assertEqual(self.relayout_dims(heads_first, (2, 4, 3, 2)), {1})

    def test_all_to_all_that_is_no_relayout(self) -> None:
        self.assertEqual(self.relayout_dims(seq_to_heads_rank_minor, (1, 3, 4, 2)), set())

    def relayout_dims(self, exchange: Callable, shape: tuple[int, ...]) -> set[int]:
        """Emulates `exchange` on P ranks, checks the algebra's reading of its result on each rank, and
        returns the dims of X it reads as scattered by a Ulysses relayout."""
        numel = math.prod(shape)
        xs = [torch.arange(numel).view(shape) + rank * numel for rank in range(P)]  # offsets in the global X
        sent = [exchange(x)[0] for x in xs]
        sent_layout = read(lambda x: exchange(x)[0], xs[0])
        for j in range(P):
            recv = torch.cat([t.chunk(P)[j] for t in sent])  # all_to_all_single: block j of every rank
            received, block_stride = all_to_all_received(flat(sent_layout), numel, P, recv.shape)
            torch.testing.assert_close(offsets(received) + j * block_stride, recv, rtol=0, atol=0)
            receive = exchange(xs[j])[1]
            y = receive(recv)
            result = read(receive, recv, received)
            torch.testing.assert_close(offsets(result) + j * block_stride, y, rtol=0, atol=0)
        return {dim for dim in (1, 2) if is_ulysses_relayout(result, y.shape, shape, P, dim, block_stride)}

    def test_ulysses_relayout(self) -> None:
        shape, modes = ulysses_relayout((1, 3, 4, 2), P, 2)  # heads split, sequence gathered
        self.assertEqual((shape, modes), ((1, 6, 2, 2), ((6, 8), (4, 1))))  # P*S tokens: one run

    def test_viewable(self) -> None:
        t = torch.empty(4, 6)
        self.assertTrue(viewable(t, (2, 12)))
        self.assertFalse(viewable(t.t(), (24,)))
        self.assertTrue(viewable(t.t(), (3, 2, 4)))  # splits need no run
        self.assertTrue(viewable(t[:, :0], (0, 5)))  # nothing to view
        view, clone = layout_ops(lambda x: x.view(24), t), layout_ops(lambda x: x.contiguous().view(24), t.t())
        self.assertTrue(accepts_strides(view[0], t))
        self.assertFalse(accepts_strides(view[0], t.t().contiguous().t()))  # t's shape, t.t()'s strides
        self.assertTrue(accepts_strides(clone[0], t.t()))  # not a view


class SymbolicTestCase(TestCase):
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
            self.assertTrue(same_modes(a, e), f"{a} != {e}")


class SymbolicLayoutTest(SymbolicTestCase):
    def test_reshape_splits_a_symbolic_mode(self) -> None:
        (s,) = self.symbols(8)
        layout = reshape(flat(contiguous((2 * s, 8))), (2, s, 8))  # the receive side's view
        self.assert_layout(layout, (((2, 8 * s),), ((s, 8),), ((8, 1),)))

    def test_reshape_refuses_a_division_it_cannot_prove(self) -> None:
        (s,) = self.symbols(8)
        self.assertIsNone(reshape(flat(contiguous((s, 8))), (2, s // 2, 8)))  # s may be odd

    def test_two_symbols_equal_now_are_not_confused(self) -> None:
        s, t = self.symbols(8, 8)
        self.assertIsNone(reshape(flat(contiguous((s, t))), (t, s)))
        self.assertFalse(same((s,), (t,)))

    def test_canonical_merges_proved_runs_only(self) -> None:
        s, t = self.symbols(8, 8)
        self.assert_layout((canonical([(s, 8), (8, 1)]),), (((8 * s, 1),),))
        self.assertEqual(len(canonical([(s, t), (8, 1)])), 2)  # t == 8 is not proved

    def test_ulysses_relayout_of_a_symbolic_sequence(self) -> None:
        (s,) = self.symbols(8)
        shape, modes = ulysses_relayout((1, s, 4, 8), P, 2)  # [b, S, h, d] -> [b, P*S, h/P, d]
        self.assertTrue(same(shape, (1, 2 * s, 2, 8)))
        # The rank blocks and the local sequence are one run over the global tensor: [P*S] tokens.
        self.assert_layout((modes,), (((2 * s, 32), (16, 1)),))

    def test_viewable_decides_by_strides_for_every_size(self) -> None:
        with self.mode:
            heads = self.fake(1, 8, 6, 8, dynamic=(1,))[:, :, 0:2]  # Q's heads in a packed result
        s = heads.shape[1]
        self.assertIsInstance(s, torch.SymInt)
        self.assertTrue(viewable(heads, (1, s, 16)))  # heads and d merge
        self.assertFalse(viewable(heads, (1, 2 * s, 8)))  # sequence and heads do not
        self.assertRaises(RuntimeError, lambda: torch.empty(1, 8, 6, 8)[:, :, 0:2].view(1, 16, 8))

    def test_only_symbols_of_their_own_equal_now_are_tieable(self) -> None:
        s, t, u = self.symbols(8, 8, 6)
        self.assertTrue(tieable(s, t))
        self.assertFalse(tieable(s, u))  # unequal now: cross-attention, say
        self.assertFalse(tieable(s, 8))  # a guard s == 8 would recompile per length
        self.assertFalse(tieable(2 * s, 2 * t))
