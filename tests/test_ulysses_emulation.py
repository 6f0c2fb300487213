"""graphar's Ulysses exchanges for every rank of a world in one process, bitwise against the spec.

`all_to_all_single` is emulated: a first pass runs every rank and records what each sends, a second
pass runs them again and hands each rank what the collective would deliver (chunk j of rank i's send
buffer becomes chunk i of rank j's receive buffer). The packed exchange, three separate exchanges
written the way Ulysses code does them, and the mathematical definition must agree bit for bit.
Every `torch.empty` is poisoned with NaN, so an output the exchange fails to write cannot pass.

The IPC exchange is emulated both ways: pulled (a rank's pack fills its own buffer) and pushed (the
pack kernel stores chunk j into "rank j's buffer", here a host buffer per rank, through the same
shifts it uses across GPUs); with the pack kernel, a rank's own chunk goes straight into its result
where it is one run of bytes there. Those cases need the Triton kernel, so they run under the
interpreter in a subprocess (`test_kernel_packs_under_interpreter`) and skip themselves elsewhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from expecttest import TestCase

from graphar import ulysses
from graphar.ulysses import exchanges as bodies
from graphar.ulysses import pack, shapes, stages, transport
from tests._interpreted import INTERPRETED, run_interpreted

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_empty = torch.empty


def _poisoned_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _FakeIpc:
    """graphar.ulysses.transport.IpcTransport for one emulated rank: host buffers, no GPU."""

    def __init__(
        self,
        exchange_bytes: Callable[[torch.Tensor, Callable[[list[torch.Tensor]], None]], None],
        world_size: int,
        push: bool,
    ) -> None:
        self._exchange_bytes = exchange_bytes
        self.world_size = world_size
        self.push = push
        self.pushes = 0
        self.own_placed = 0  # stages whose pack put this rank's own chunk straight into the output
        self.rank = 0  # set by EmulatedWorld for the rank it runs

    def run(self, out: torch.Tensor, plan: stages.Plan) -> bool:
        steps, nbytes = plan.stages, plan.nbytes
        if not all(transport.copyable(stage.placement) for stage in steps):
            return False
        rank, world = self.rank, self.world_size
        # Without the kernel (no interpreter here) the pull still runs, its packs torch's copies.
        kernel = pack.kernel_serves([src for stage in steps for src in stage.sources])
        push = self.push and kernel
        self.pushes += push
        # Pushed: what this rank stores into every rank's buffer (rank j receives row j of every
        # rank's block); pulled: this rank's own buffer, which every rank reads.
        block = torch.full((world if push else 1, nbytes), 0x7F, dtype=torch.uint8)
        addresses = [row.data_ptr() for row in block] if push else ()
        owns = [transport.own_chunk(out, stage, rank) if kernel else None for stage in steps]
        self.own_placed += sum(own is not None for own in owns)
        for stage, own in zip(steps, owns):
            transport.Destination(block[rank if push else 0], stage.src_offset, rank, addresses, own).fill(stage)

        def receive(blocks: list[torch.Tensor]) -> None:
            for stage, own in zip(steps, owns):
                skip = rank if own is not None else None
                if push:
                    _place(lambda i: (blocks[i].view(world, nbytes)[rank], i), world, out, stage, skip)
                else:
                    _place(lambda i: (blocks[i], rank), world, out, stage, skip)

        self._exchange_bytes(block.view(-1), receive)
        return True


class EmulatedWorld:
    """Runs fn(rank) for each rank with graphar's exchanges routed through the emulation.

    transport "nccl": no communicator, so `all_to_all_single` (graphar's `_all_to_all` hook);
    "ipc": a communicator's IPC exchange, whose pull places each chunk by its `Placement`; "push":
    the same, pushed. The references (`_exchange`) always take the `all_to_all_single` hook.
    """

    def __init__(self, world_size: int, transport: str = "nccl") -> None:
        self.world_size = world_size
        self.transport = transport
        self.ipc_calls = 0

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        world = self.world_size
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        done = [0] * world
        state = {"rank": 0, "deliver": False}

        def exchange_bytes(send: torch.Tensor, receive: Callable[[list[torch.Tensor]], None]) -> None:
            rank = state["rank"]
            if not state["deliver"]:
                sends[rank].append(send.clone())
                return
            call = done[rank]
            assert torch.equal(send, sends[rank][call]), "a rank sent different data"
            receive([sends[i][call] for i in range(world)])
            done[rank] += 1

        def all_to_all_single(recv: torch.Tensor, send: torch.Tensor, group_name: str, op: str) -> None:
            rank = state["rank"]
            exchange_bytes(
                _bytes(send),
                lambda all_sends: _bytes(recv).copy_(torch.cat([s.view(world, -1)[rank] for s in all_sends])),
            )

        def ipc(send: torch.Tensor, receive: Callable[[list[torch.Tensor]], None]) -> None:
            self.ipc_calls += not state["deliver"] and state["rank"] == 0
            exchange_bytes(send, receive)

        fake = _FakeIpc(ipc, world, push=self.transport == "push")
        self.fake = fake
        patches = (
            mock.patch.object(shapes, "world_size", lambda name: world),
            mock.patch.object(torch, "empty", _poisoned_empty),
            mock.patch.object(bodies, "_all_to_all", all_to_all_single),
            mock.patch.object(
                bodies, "_ipc_transport", lambda name, device: None if self.transport == "nccl" else fake
            ),
        )
        results = []
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            for deliver in (False, True):
                state["deliver"] = deliver
                for rank in range(world):
                    state["rank"] = fake.rank = rank
                    result = fn(rank)
                    if deliver:
                        results.append(result)
                if not deliver:
                    self.calls = len(sends[0])
        assert done == [self.calls] * world, "a rank made different exchanges in the second pass"
        return results


def _place(
    source: Callable[[int], tuple[torch.Tensor, int]],
    world: int,
    out: torch.Tensor,
    stage: stages.Stage,
    skip: int | None,
) -> None:
    """What the copy kernel does for one stage on this rank: the chunk from rank i becomes rows of
    row_bytes at the placement's strides from byte out_offset of the output. `source(i)` is the
    buffer holding that chunk and its slot there: rank i's buffer, slot `rank` (pulled), or this
    rank's buffer, slot i (pushed). Chunk `skip` is in the output already (the pack placed it)."""
    p = stage.placement
    rows = p.chunk_bytes // p.row_bytes
    for i in range(world):
        if i == skip:
            continue
        buffer, slot = source(i)
        start = stage.src_offset + slot * p.chunk_bytes
        first = transport.memory_from(out, stage.out_offset + i * p.dst_chunk_stride, 0)
        first.as_strided((rows, p.row_bytes), (p.dst_row_stride, 1)).copy_(
            buffer[start : start + p.chunk_bytes].view(rows, p.row_bytes)
        )


def _exchange(x: torch.Tensor) -> torch.Tensor:
    """One emulated all_to_all_single through the same hook graphar uses."""
    recv = torch.empty_like(x)
    bodies._all_to_all(recv, x, "emulated", "reference")
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
    transport = "nccl"
    dtypes = DTYPES

    def check(
        self,
        world: int,
        b: int,
        s_local: int,
        heads: tuple[int, int, int],
        d: int,
        dtype: torch.dtype,
        heads_dim: int = 2,
    ) -> None:
        full = [_full(b, world * s_local, h, d, dtype) for h in heads]  # every rank's tokens, all heads
        shard = lambda r, t: t[:, r * s_local : (r + 1) * s_local]  # noqa: E731
        inputs = [[shard(r, t) for t in full] for r in range(world)]
        if heads_dim == 1:
            inputs = [[x.transpose(1, 2).contiguous() for x in xs] for xs in inputs]

        emulated = EmulatedWorld(world, self.transport)
        packed = emulated.run(lambda r: ulysses.seq_to_heads(*inputs[r], "g", heads_dim=heads_dim))
        self.assertEqual(emulated.calls, 1, "Q, K and V must move in one exchange")
        self.assertEqual(emulated.ipc_calls, int(self.transport != "nccl"))
        self.assertEqual(emulated.fake.pushes > 0, self.transport == "push")
        # With the pack kernel, b == 1 places each rank's own chunk straight into its result.
        self.assertEqual(emulated.fake.own_placed > 0, INTERPRETED and self.transport != "nccl" and b == 1)
        if heads_dim == 1:
            packed = [[x.transpose(1, 2) for x in out] for out in packed]
        unpacked = EmulatedWorld(world).run(lambda r: [_three_collectives(shard(r, t), world) for t in full])
        for j in range(world):
            for c, t in enumerate(full):
                h_local = t.shape[2] // world
                spec = t[:, :, j * h_local : (j + 1) * h_local]
                self.assertTrue(torch.equal(packed[j][c], spec), f"rank {j} tensor {c}: packed != spec")
                self.assertTrue(torch.equal(unpacked[j][c], spec), f"rank {j} tensor {c}: unpacked != spec")

    def test_worlds_batches_dtypes(self) -> None:
        for world in (2, 4):
            for b in (1, 2):
                for dtype in self.dtypes:
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
        out = EmulatedWorld(2, self.transport).run(lambda r: ulysses.seq_to_heads(q, k, v, "g"))[0]
        base = out[0].untyped_storage().data_ptr()
        self.assertTrue(all(x.untyped_storage().data_ptr() == base for x in out))
        self.assertTrue(
            all(x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x in out for y in (q, k, v))
        )


class HeadsToSeqTest(TestCase):
    transport = "nccl"
    dtypes = DTYPES

    def test_worlds_batches_dtypes_layouts(self) -> None:
        for world in (2, 4):
            for b in (1, 2):
                for dtype in self.dtypes:
                    for transposed in (False, True):
                        with self.subTest(world=world, b=b, dtype=dtype, transposed=transposed):
                            self.check(world, b, 4, 8, 16, dtype, transposed)

    def check(self, world: int, b: int, s_local: int, heads: int, d: int, dtype: torch.dtype, transposed: bool) -> None:
        full = _full(b, world * s_local, heads, d, dtype)
        h_local = heads // world
        # Rank j holds all tokens of head block j, as attention leaves them ([b, h, s, d] transposed or not).
        inputs = [full[:, :, j * h_local : (j + 1) * h_local] for j in range(world)]
        inputs = [x.transpose(1, 2).contiguous().transpose(1, 2) if transposed else x.contiguous() for x in inputs]
        emulated = EmulatedWorld(world, self.transport)
        outs = emulated.run(lambda r: ulysses.heads_to_seq(inputs[r], "g"))
        self.assertEqual(emulated.ipc_calls, int(self.transport != "nccl"))
        self.assertEqual(emulated.fake.pushes > 0, self.transport == "push")
        for r in range(world):
            self.assertTrue(torch.equal(outs[r], full[:, r * s_local : (r + 1) * s_local]), f"rank {r}")
            self.assertTrue(outs[r].is_contiguous())

    def test_into_a_run_of_heads(self) -> None:
        """`out=` a run of heads of a larger tensor (the pipelined attention's chunks): the exchange lands
        there and nowhere else."""
        world, s_local, heads, d = 2, 4, 8, 16
        for b in (1, 2):
            with self.subTest(b=b):
                full = _full(b, world * s_local, heads, d, self.dtypes[0])
                h_local = heads // world
                inputs = [full[:, :, j * h_local : (j + 1) * h_local].contiguous() for j in range(world)]
                bigs = [torch.full((b, s_local, 3 * heads, d), float("nan"), dtype=full.dtype) for _ in range(world)]
                emulated = EmulatedWorld(world, self.transport)
                emulated.run(lambda r: bodies.output_exchange(inputs[r], "g", out=bigs[r][:, :, heads : 2 * heads]))
                for r in range(world):
                    got = bigs[r][:, :, heads : 2 * heads]
                    self.assertTrue(torch.equal(got, full[:, r * s_local : (r + 1) * s_local]), f"rank {r}")
                    rest = torch.cat([bigs[r][:, :, :heads], bigs[r][:, :, 2 * heads :]], dim=2)
                    self.assertTrue(rest.isnan().all(), f"rank {r} wrote outside its run of heads")


class PackedAllToAllSingleTest(TestCase):
    transport = "nccl"
    dtypes = DTYPES

    def test_packed_equals_separate_exchanges(self) -> None:
        for world in (2, 4):
            for dtype in self.dtypes:
                with self.subTest(world=world, dtype=dtype):
                    shapes = [(world * 3, 5), (world * 2, 4, 3), (world,)]
                    xs = [[torch.randn(s).to(dtype) for s in shapes] for _ in range(world)]
                    emulated = EmulatedWorld(world, self.transport)
                    packed = emulated.run(lambda r: torch.ops.graphar.packed_all_to_all_single(xs[r], "g"))
                    self.assertEqual(emulated.calls, 1)
                    # The words of the packed rows go through the pack kernel, which can push them.
                    self.assertEqual(emulated.fake.pushes > 0, self.transport == "push" and INTERPRETED)
                    separate = EmulatedWorld(world).run(lambda r: [_exchange(x) for x in xs[r]])
                    for j in range(world):
                        for t, shape in enumerate(shapes):
                            rows = shape[0] // world
                            spec = torch.cat([xs[i][t][j * rows : (j + 1) * rows] for i in range(world)])
                            self.assertTrue(torch.equal(packed[j][t], spec))
                            self.assertTrue(torch.equal(separate[j][t], spec))


# The same checks through a communicator's IPC exchange: the pull's placements instead of a receive relayout.
class SeqToHeadsIpcTest(SeqToHeadsTest):
    transport = "ipc"


class HeadsToSeqIpcTest(HeadsToSeqTest):
    transport = "ipc"


class PackedAllToAllSingleIpcTest(PackedAllToAllSingleTest):
    transport = "ipc"


class _Interpreted:
    """Checks that need the pack kernel (shifted chunks): they run under the interpreter only."""

    dtypes = (torch.bfloat16,)  # the kernel moves bits; tests/test_pack_kernels.py covers every dtype

    def setUp(self) -> None:
        if not INTERPRETED:
            self.skipTest("needs the Triton pack kernel: test_kernel_packs_under_interpreter runs it")
        super().setUp()


class _Pushed(_Interpreted):
    """The IPC checks pushed: the pack kernel stores chunk j into rank j's buffer."""

    transport = "push"


class SeqToHeadsKernelTest(_Interpreted, SeqToHeadsIpcTest):
    """Pulled, with the pack kernel placing each rank's own chunk in its result (b == 1)."""


class SeqToHeadsPushTest(_Pushed, SeqToHeadsTest):
    pass


class HeadsToSeqPushTest(_Pushed, HeadsToSeqTest):
    pass


class PackedAllToAllSinglePushTest(_Pushed, PackedAllToAllSingleTest):
    pass


def test_kernel_packs_under_interpreter() -> None:
    """The cases that need the pack kernel, in a subprocess where Triton interprets (it decides when a
    kernel is defined)."""
    run_interpreted(__file__, "PushTest or KernelTest")


class _Staged:
    """Stages of a few hundred bytes: the small test shapes pipeline over several sequence slices."""

    def setUp(self) -> None:
        super().setUp()
        patch = mock.patch.object(stages, "_STAGE_BYTES", 256)
        patch.start()
        self.addCleanup(patch.stop)


class SeqToHeadsStagedIpcTest(_Staged, SeqToHeadsIpcTest):
    pass


class HeadsToSeqStagedIpcTest(_Staged, HeadsToSeqIpcTest):
    pass


class SeqToHeadsStagedPushTest(_Staged, SeqToHeadsPushTest):
    pass


class HeadsToSeqStagedPushTest(_Staged, HeadsToSeqPushTest):
    pass


class SeqToHeadsStagedKernelTest(_Staged, SeqToHeadsKernelTest):
    pass


class PullBlocksTest(TestCase):
    def test_default_and_bounds(self) -> None:
        with mock.patch.dict(os.environ, {"GRAPHAR_PULL_BLOCKS": ""}):
            self.assertEqual(transport.pull_blocks(), 64)
        with mock.patch.dict(os.environ, {"GRAPHAR_PULL_BLOCKS": "32"}):
            self.assertEqual(transport.pull_blocks(), 32)
        for bad in ("0", "65"):
            with mock.patch.dict(os.environ, {"GRAPHAR_PULL_BLOCKS": bad}), self.assertRaisesRegex(ValueError, "PULL"):
                transport.pull_blocks()


class SlicesTest(TestCase):
    def test_slices_cover_the_sequence(self) -> None:
        self.assertEqual(stages._slices(10, 1 << 20), [(0, 10)])
        self.assertEqual(stages._slices(10, 3 * stages._STAGE_BYTES), [(0, 3), (3, 6), (6, 10)])
        self.assertEqual(len(stages._slices(1000, 1 << 40)), stages._MAX_STAGES)
        self.assertEqual(stages._slices(2, 1 << 40), [(0, 1), (1, 2)])


class PlacementTest(TestCase):
    def test_only_whole_packs(self) -> None:
        self.assertTrue(transport.copyable(stages.Placement(64, 32, 96, 32)))
        self.assertFalse(transport.copyable(stages.Placement(48, 24, 48, 24)))  # 24-byte rows
        self.assertFalse(transport.copyable(stages.Placement(64, 48, 96, 48)))  # rows do not tile the chunk
        self.assertFalse(transport.copyable(stages.Placement(0, 16, 16, 16)))


class ValidationTest(TestCase):
    def test_clear_errors(self) -> None:
        with mock.patch.object(shapes, "world_size", lambda name: 4):
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

        with mock.patch.object(shapes, "world_size", lambda name: 2), FakeTensorMode():
            q, kv = torch.empty(2, 8, 8, 16), torch.empty(2, 8, 4, 16)
            self.assertEqual(torch.ops.graphar.qkv_all_to_all(q, kv, kv, "g").shape, (2, 16, 8, 16))
            self.assertEqual(torch.ops.graphar.heads_to_seq_all_to_all(q, "g").shape, (2, 4, 16, 16))
            outs = torch.ops.graphar.packed_all_to_all_single([q, kv], "g")
            self.assertEqual([o.shape for o in outs], [q.shape, kv.shape])
