"""graphar's Ulysses exchanges for every rank of a world in one process, bitwise against the spec.

`all_to_all_single` is emulated: a first pass runs every rank and records what each sends, a second
pass runs them again and hands each rank what the collective would deliver (chunk j of rank i's send
buffer becomes chunk i of rank j's receive buffer). The packed exchange, three separate exchanges
written the way Ulysses code does them, and the mathematical definition must agree bit for bit.
Every `torch.empty` is poisoned with NaN, so an output the exchange fails to write cannot pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from expecttest import TestCase

from graphar.comm import ulysses

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_empty = torch.empty


def _poisoned_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)


class EmulatedWorld:
    """Runs fn(rank) for each rank with graphar's all_to_all_single routed through the emulation."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        sends: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        deliveries: list[list[torch.Tensor]] = []
        rank = 0

        def record(recv: torch.Tensor, send: torch.Tensor, group_name: str, op: str) -> None:
            sends[rank].append(send.detach().clone().reshape(self.world_size, -1))

        def deliver(recv: torch.Tensor, send: torch.Tensor, group_name: str, op: str) -> None:
            call = done[rank]
            assert torch.equal(send.reshape(self.world_size, -1), sends[rank][call]), "a rank sent different data"
            recv.view(-1).copy_(deliveries[rank][call])
            done[rank] += 1

        patches = [mock.patch.object(ulysses, "_world_size", lambda name: self.world_size),
                   mock.patch.object(torch, "empty", _poisoned_empty)]
        with patches[0], patches[1], mock.patch.object(ulysses, "_all_to_all", record):
            for rank in range(self.world_size):
                fn(rank)
        calls = self.calls = len(sends[0])
        for j in range(self.world_size):
            deliveries.append([torch.cat([sends[i][c][j] for i in range(self.world_size)]) for c in range(calls)])
        done = [0] * self.world_size
        results = []
        with patches[0], patches[1], mock.patch.object(ulysses, "_all_to_all", deliver):
            for rank in range(self.world_size):
                results.append(fn(rank))
        assert done == [calls] * self.world_size, "a rank made different exchanges in the second pass"
        return results


def _exchange(x: torch.Tensor) -> torch.Tensor:
    """One emulated all_to_all_single through the same hook graphar uses."""
    recv = torch.empty_like(x)
    ulysses._all_to_all(recv, x, "emulated", "reference")
    return recv


def _three_collectives(x: torch.Tensor, world: int) -> torch.Tensor:
    """The usual Ulysses input exchange for one tensor (yunchang's all_to_all_4D layout)."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, world, h // world, d).transpose(0, 2).contiguous()  # [P, S, b, h/P, d]
    recv = _exchange(send)
    return recv.reshape(world * s, b, h // world, d).transpose(0, 1).contiguous()


def _full(b: int, s: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(b, s, h, d).to(dtype)


class SeqToHeadsTest(TestCase):
    def check(self, world: int, b: int, s_local: int, heads: tuple[int, int, int], d: int, dtype: torch.dtype,
              heads_dim: int = 2) -> None:
        full = [_full(b, world * s_local, h, d, dtype) for h in heads]  # every rank's tokens, all heads
        shard = lambda r, t: t[:, r * s_local:(r + 1) * s_local]  # noqa: E731
        inputs = [[shard(r, t) for t in full] for r in range(world)]
        if heads_dim == 1:
            inputs = [[x.transpose(1, 2).contiguous() for x in xs] for xs in inputs]

        emulated = EmulatedWorld(world)
        packed = emulated.run(lambda r: ulysses.seq_to_heads(*inputs[r], "g", heads_dim=heads_dim))
        self.assertEqual(emulated.calls, 1, "Q, K and V must move in one exchange")
        if heads_dim == 1:
            packed = [[x.transpose(1, 2) for x in out] for out in packed]
        unpacked = EmulatedWorld(world).run(lambda r: [_three_collectives(shard(r, t), world) for t in full])
        for j in range(world):
            for c, t in enumerate(full):
                h_local = t.shape[2] // world
                spec = t[:, :, j * h_local:(j + 1) * h_local]
                self.assertTrue(torch.equal(packed[j][c], spec), f"rank {j} tensor {c}: packed != spec")
                self.assertTrue(torch.equal(unpacked[j][c], spec), f"rank {j} tensor {c}: unpacked != spec")

    def test_worlds_batches_dtypes(self) -> None:
        for world in (2, 4):
            for b in (1, 2):
                for dtype in DTYPES:
                    with self.subTest(world=world, b=b, dtype=dtype):
                        self.check(world, b, 8, (8, 8, 8), 16, dtype)

    def test_gqa(self) -> None:
        for world in (2, 4):
            with self.subTest(world=world):
                self.check(world, 2, 4, (8, 4, 4), 16, torch.bfloat16)

    def test_heads_at_dim_1(self) -> None:
        for world, b in ((2, 1), (4, 2)):
            with self.subTest(world=world, b=b):
                self.check(world, b, 4, (8, 8, 8), 16, torch.float16, heads_dim=1)

    def test_result_is_one_new_tensor(self) -> None:
        q, k, v = (_full(1, 4, 4, 8, torch.float32) for _ in range(3))
        out = EmulatedWorld(2).run(lambda r: ulysses.seq_to_heads(q, k, v, "g"))[0]
        base = out[0].untyped_storage().data_ptr()
        self.assertTrue(all(x.untyped_storage().data_ptr() == base for x in out))
        self.assertTrue(all(x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x in out
                            for y in (q, k, v)))


class HeadsToSeqTest(TestCase):
    def test_worlds_batches_dtypes_layouts(self) -> None:
        for world in (2, 4):
            for b in (1, 2):
                for dtype in DTYPES:
                    for transposed in (False, True):
                        with self.subTest(world=world, b=b, dtype=dtype, transposed=transposed):
                            self.check(world, b, 4, 8, 16, dtype, transposed)

    def check(self, world: int, b: int, s_local: int, heads: int, d: int, dtype: torch.dtype,
              transposed: bool) -> None:
        full = _full(b, world * s_local, heads, d, dtype)
        h_local = heads // world
        # Rank j holds all tokens of head block j, as attention leaves them ([b, h, s, d] transposed or not).
        inputs = [full[:, :, j * h_local:(j + 1) * h_local] for j in range(world)]
        inputs = [x.transpose(1, 2).contiguous().transpose(1, 2) if transposed else x.contiguous() for x in inputs]
        outs = EmulatedWorld(world).run(lambda r: ulysses.heads_to_seq(inputs[r], "g"))
        for r in range(world):
            self.assertTrue(torch.equal(outs[r], full[:, r * s_local:(r + 1) * s_local]), f"rank {r}")
            self.assertTrue(outs[r].is_contiguous())


class PackedAllToAllSingleTest(TestCase):
    def test_packed_equals_separate_exchanges(self) -> None:
        for world in (2, 4):
            for dtype in DTYPES:
                with self.subTest(world=world, dtype=dtype):
                    shapes = [(world * 3, 5), (world * 2, 4, 3), (world,)]
                    xs = [[torch.randn(s).to(dtype) for s in shapes] for _ in range(world)]
                    packed = EmulatedWorld(world).run(
                        lambda r: torch.ops.graphar.packed_all_to_all_single(xs[r], "g"))
                    separate = EmulatedWorld(world).run(lambda r: [_exchange(x) for x in xs[r]])
                    for j in range(world):
                        for t, shape in enumerate(shapes):
                            rows = shape[0] // world
                            spec = torch.cat([xs[i][t][j * rows:(j + 1) * rows] for i in range(world)])
                            self.assertTrue(torch.equal(packed[j][t], spec))
                            self.assertTrue(torch.equal(separate[j][t], spec))


class ValidationTest(TestCase):
    def test_clear_errors(self) -> None:
        with mock.patch.object(ulysses, "_world_size", lambda name: 4):
            q = torch.randn(1, 4, 6, 8)
            with self.assertRaisesRegex(ValueError, "6 heads do not split over 4 ranks"):
                torch.ops.graphar.qkv_all_to_all(q, q, q, "g")
            with self.assertRaisesRegex(ValueError, "share dtype"):
                x = torch.randn(1, 4, 8, 8)
                torch.ops.graphar.qkv_all_to_all(x, x.half(), x, "g")
            with self.assertRaisesRegex(ValueError, "s divisible by 4"):
                torch.ops.graphar.heads_to_seq_all_to_all(torch.randn(1, 6, 2, 8), "g")
            with self.assertRaisesRegex(ValueError, "does not split equally"):
                torch.ops.graphar.packed_all_to_all_single([torch.randn(6, 2)], "g")

    def test_fake_shapes(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with mock.patch.object(ulysses, "_world_size", lambda name: 2), FakeTensorMode():
            q, kv = torch.empty(2, 8, 8, 16), torch.empty(2, 8, 4, 16)
            self.assertEqual(torch.ops.graphar.qkv_all_to_all(q, kv, kv, "g").shape, (2, 16, 8, 16))
            self.assertEqual(torch.ops.graphar.heads_to_seq_all_to_all(q, "g").shape, (2, 4, 16, 16))
            outs = torch.ops.graphar.packed_all_to_all_single([q, kv], "g")
            self.assertEqual([o.shape for o in outs], [q.shape, kv.shape])
