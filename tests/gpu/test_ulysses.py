"""The packed Ulysses exchanges: eager, captured (torch.cuda.graph and graphar.graph) and compiled
with mode="reduce-overhead", bitwise against the separate NCCL exchanges and the spec. Each runs on
both transports: NCCL (no graphar communicator) and CUDA IPC (after `graphar.init`), pulled and pushed.

Every rank draws the same full tensors from a seeded generator and keeps its shard, so the expected
result on each rank is a slice of a tensor it holds. Outputs land in memory that was filled with NaN
just before (`_poison_allocator`), so an element the exchange fails to write cannot pass.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from _dist import WORLD_SIZES, assert_timed_out_for_good, integer_valued, run_workers, skip_where_nccl_is_captured
from torch._dynamo.utils import counters

import graphar
from graphar import ulysses
from graphar.ulysses import pool, transport
from graphar.ulysses.shapes import packed_heads
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked
from tests._ulysses import UlyssesBlock

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Whether the pool can tell which graph is being captured; without it capture memory is transient.
TRACKED = hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph")
TRANSPORTS = ("nccl", "ipc", "ipc-push")


def _here() -> torch.device:
    """This rank's GPU (each rank's own, or the one every rank shares: GRAPHAR_TEST_SHARE_GPU)."""
    return torch.device("cuda", torch.cuda.current_device())


def _set_transport(kind: str) -> transport.IpcTransport | None:
    """For "ipc" and "ipc-push", set up the world's graphar communicator, whose IPC transport the ops
    then take (pulled, or pushed: GRAPHAR_ALLTOALL_ALGO is read when the transport is made)."""
    if kind == "nccl":
        return None
    os.environ["GRAPHAR_ALLTOALL_ALGO"] = "push" if kind == "ipc-push" else "pull"
    comm = graphar.init()
    assert comm is not None, "no graphar communicator on this machine"
    assert transport.of(comm).push == (kind == "ipc-push")
    return transport.of(comm)


def _full(seed: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """The same random tensor on every rank."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


def _poison_allocator(nbytes: int) -> None:
    """Fill cached allocator blocks with NaN, so the next allocations start as NaN, not as old results."""
    torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def _shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size, dim=dim)[rank].contiguous()


def _check_seq_to_heads(
    rank: int, world_size: int, dtype: torch.dtype, b: int, s: int, heads: tuple[int, int], d: int, seed: int
) -> None:
    hq, hk = heads
    full = [_full(seed + i, b, world_size * s, h, d, dtype=dtype) for i, h in enumerate((hq, hk, hk))]
    mine = [_shard(t, 1, rank, world_size) for t in full]
    spec = [_shard(t, 2, rank, world_size) for t in full]
    what = f"{dtype} b={b} s={s} heads={heads}"
    _poison_allocator(sum(t.numel() * t.element_size() for t in full))
    packed = ulysses.seq_to_heads(*mine, dist.group.WORLD.group_name)
    separate = [seq_to_heads_unpacked(x) for x in mine]
    heads_first = ulysses.seq_to_heads(
        *(x.transpose(1, 2).contiguous() for x in mine), dist.group.WORLD.group_name, heads_dim=1
    )
    for c in range(3):
        assert torch.equal(separate[c], spec[c]), f"{what}: NCCL reference != spec"
        assert torch.equal(packed[c], spec[c]), f"{what}: tensor {c} packed != spec"
        assert torch.equal(heads_first[c].transpose(1, 2), spec[c]), f"{what}: tensor {c} heads at dim 1"


def _check_heads_to_seq(
    rank: int, world_size: int, dtype: torch.dtype, b: int, s: int, h: int, d: int, seed: int
) -> None:
    full = _full(seed, b, world_size * s, h, d, dtype=dtype)
    spec = _shard(full, 1, rank, world_size)
    o = _shard(full, 2, rank, world_size)
    for what, x in (("contiguous", o), ("transposed", o.transpose(1, 2).contiguous().transpose(1, 2))):
        _poison_allocator(full.numel() * full.element_size())
        out = ulysses.heads_to_seq(x, dist.group.WORLD.group_name)
        assert torch.equal(heads_to_seq_unpacked(x), spec), f"{dtype} b={b}: NCCL reference != spec"
        assert torch.equal(out, spec), f"{dtype} b={b} {what}: heads_to_seq != spec"


def _eager(rank: int, world_size: int, transport: str) -> None:
    ex = _set_transport(transport)
    seed = 0
    for dtype in DTYPES:
        for b, s in ((1, 128), (2, 37)):
            for heads in ((2 * world_size, 2 * world_size), (4 * world_size, world_size)):  # MHA, GQA
                seed += 10
                _check_seq_to_heads(rank, world_size, dtype, b, s, heads, 64, seed)
            _check_heads_to_seq(rank, world_size, dtype, b, s, 2 * world_size, 128, seed + 5)  # 2 heads a rank
    xs = [torch.randn(world_size * n, 3, device="cuda") for n in (1, 4, 7)]
    packed = torch.ops.graphar.packed_all_to_all_single(xs, dist.group.WORLD.group_name)
    for x, out in zip(xs, packed):
        ref = torch.empty_like(x)
        dist.all_to_all_single(ref, x)
        assert torch.equal(out, ref), "packed_all_to_all_single != all_to_all_single"
    assert ex is None or ex.capacity > 0, "the IPC exchange was never used"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_eager_exchanges_equal_nccl_and_spec(world_size: int, transport: str) -> None:
    run_workers(_eager, world_size, transport)


class _Static:
    """Static inputs of a captured Ulysses step and the outputs the capture recorded."""

    def __init__(self, world_size: int, b: int, s: int, heads: int, d: int, dtype: torch.dtype) -> None:
        self.shape = (b, s, heads, d)
        self.inputs = [torch.empty(b, s, heads, d, dtype=dtype, device="cuda") for _ in range(3)]
        self.o = torch.empty(b, world_size * s, heads // world_size, d, dtype=dtype, device="cuda")
        self.outputs: tuple[torch.Tensor, ...] = ()

    def step(self) -> tuple[torch.Tensor, ...]:
        name = dist.group.WORLD.group_name
        return (*ulysses.seq_to_heads(*self.inputs, name), ulysses.heads_to_seq(self.o, name))

    def refill(self, seed: int) -> list[torch.Tensor]:
        """New values in the static inputs; returns what each output must then be."""
        for i, t in enumerate([*self.inputs, self.o]):
            t.copy_(_full(seed + 1000 * dist.get_rank() + i, *t.shape, dtype=t.dtype))
        expected = [seq_to_heads_unpacked(x) for x in self.inputs]
        return [*expected, heads_to_seq_unpacked(self.o)]


def _assert_graph_buffers_private(graph: torch.cuda.CUDAGraph) -> None:
    """The staging memory `graph` captured is graphar's, and eager calls on any stream get other memory."""
    if not TRACKED:
        return
    staging = pool.pool()
    owned = staging._owned.get(id(graph))
    assert owned is not None and owned.backings, "the captured graph owns no staging buffers"
    captured = set()
    for (device, role), backing in owned.backings.items():
        assert pool._lies_in(backing, staging.runtime.mempool(device)), f"{role}: not in graphar's pool"
        captured.add(backing.data_ptr())
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            for device, role in owned.backings:
                assert staging.get(role, 16, device).data_ptr() not in captured, f"{role}: eager reuses it"


def _captured(rank: int, world_size: int, use_graphar_graph: bool, transport: str) -> None:
    ex = _set_transport(transport)
    capture = graphar.graph if use_graphar_graph else torch.cuda.graph
    before = pool.pool().stats()
    for b in (1, 2):
        static = _Static(world_size, b, 64, 2 * world_size, 64, torch.bfloat16)
        static.refill(seed=b)
        static.step()  # warm-up: Triton compiles and NCCL connects outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        capacity = ex.capacity if ex is not None else 0
        with capture(graph):
            static.outputs = static.step()
        if ex is None:
            _assert_graph_buffers_private(graph)
        else:
            assert ex.capacity == capacity > 0, "the capture did not use the exchange buffer of the warm-up"
        side = torch.cuda.Stream()
        for replay in range(3):
            expected = static.refill(seed=10 * replay + b)
            # Eager exchanges of the same roles and shapes, on this stream and another, before the replay:
            # had they shared the graph's staging buffers, the replay would read their data.
            other = _Static(world_size, b, 64, 2 * world_size, 64, torch.bfloat16)
            other_expected = other.refill(seed=77 + replay)
            assert all(torch.equal(x, e) for x, e in zip(other.step(), other_expected)), "eager on this stream"
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                side_out = other.step()
            torch.cuda.current_stream().wait_stream(side)
            assert all(torch.equal(x, e) for x, e in zip(side_out, other_expected)), "eager on another stream"
            for out in static.outputs:
                out.fill_(float("nan"))
            graph.replay()
            for i, (out, want) in enumerate(zip(static.outputs, expected)):
                assert torch.equal(out, want), f"b={b} replay {replay}: output {i} after eager calls"
    if ex is not None:
        return
    stats = pool.pool().stats()
    if TRACKED:
        assert stats["graph_buffers"] > before["graph_buffers"], stats
        assert stats["transient"] == before["transient"], f"capture memory did not land in graphar's pool: {stats}"
    else:
        assert stats["transient"] > before["transient"], stats


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("use_graphar_graph", [False, True], ids=["torch.cuda.graph", "graphar.graph"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_capture_then_eager_then_replay(world_size: int, use_graphar_graph: bool, transport: str) -> None:
    if transport == "nccl":
        skip_where_nccl_is_captured()
    run_workers(_captured, world_size, use_graphar_graph, transport)


def _ipc_buffer_growth(rank: int, world_size: int) -> None:
    """A graph keeps its exchange buffer when a larger eager call grows it; a capture that does not fit
    the buffer falls back to NCCL; reserve() makes it fit."""
    ex = _set_transport("ipc")
    name = dist.group.WORLD.group_name
    small = _Static(world_size, 1, 64, 2 * world_size, 64, torch.bfloat16)
    small.refill(seed=1)
    small.step()
    torch.cuda.synchronize()
    first = ex.capacity
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small.outputs = small.step()
    big = _Static(world_size, 2, 64 * 1024, 2 * world_size, 64, torch.bfloat16)  # 64 MiB per tensor and rank at ws 2
    expected = big.refill(seed=2)
    assert all(torch.equal(x, e) for x, e in zip(big.step(), expected)), "eager call that grew the buffer"
    assert ex.capacity > first, "the exchange buffer did not grow"
    for replay in range(2):
        expected = small.refill(seed=10 + replay)
        graph.replay()
        assert all(torch.equal(x, e) for x, e in zip(small.outputs, expected)), "replay after the buffer grew"
    huge = _Static(world_size, 4, 64 * 1024, 2 * world_size, 64, torch.bfloat16)
    grown = ex.capacity
    huge_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(huge_graph):  # too large for the buffer: NCCL inside the capture
        huge.outputs = huge.step()
    assert ex.capacity == grown
    expected = huge.refill(seed=3)
    huge_graph.replay()
    assert all(torch.equal(x, e) for x, e in zip(huge.outputs, expected)), "capture that fell back to NCCL"
    ulysses.reserve([huge.shape] * 3, torch.bfloat16, _here(), name)
    assert ex.capacity >= 3 * math.prod(huge.shape) * 2, "reserve did not size the exchange buffer"
    # Now it fits: the capture takes the pipelined IPC path (8 stages of pack and pull, a side stream).
    capacity = ex.capacity
    piped_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(piped_graph):
        huge.outputs = huge.step()
    assert ex.capacity == capacity
    for replay in range(2):
        expected = huge.refill(seed=20 + replay)
        for out in huge.outputs:
            out.fill_(float("nan"))
        piped_graph.replay()
        assert all(torch.equal(x, e) for x, e in zip(huge.outputs, expected)), "pipelined capture"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ipc_buffer_growth_capture_fallback_and_reserve(world_size: int) -> None:
    skip_where_nccl_is_captured()  # the capture too large for the buffer falls back to NCCL
    run_workers(_ipc_buffer_growth, world_size)


def _reserved(rank: int, world_size: int) -> None:
    static = _Static(world_size, 2, 48, 2 * world_size, 64, torch.float16)
    ulysses.reserve([static.shape] * 3, torch.float16, _here(), dist.group.WORLD.group_name)
    spares = pool.pool().stats()["spares"]
    expected = static.refill(seed=3)
    static.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.outputs = static.step()
    if TRACKED:
        assert pool.pool().stats()["spares"] < spares, "the capture did not take the reserved buffers"
    graph.replay()
    assert all(torch.equal(out, want) for out, want in zip(static.outputs, expected))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reserve_before_capture(world_size: int) -> None:
    skip_where_nccl_is_captured()  # the default group, which has no communicator, is the NCCL transport
    run_workers(_reserved, world_size)


def _block(heads: int, kv_heads: int, d: int, dtype: torch.dtype, exact: bool) -> UlyssesBlock:
    """The shared Ulysses block (tests/_ulysses.py) on this GPU; `exact` swaps softmax for integer arithmetic."""

    def weight(rows: int, cols: int) -> torch.Tensor:
        if exact:
            return integer_valued(rows * cols, dtype, -1, 1).view(rows, cols)
        return torch.randn(rows, cols, device="cuda", dtype=dtype) / rows**0.5

    return UlyssesBlock(heads, kv_heads, d, weight, exact)


def _peer_stops_exchanging(rank: int, world_size: int) -> None:
    """A rank alone in an IPC exchange gets an error naming the barrier and the peer, not a hang."""
    comm = graphar.init(timeout_s=0.5)
    try:
        ex = transport.of(comm)
        static = _Static(world_size, 1, 64, 2 * world_size, 64, torch.bfloat16)
        expected = static.refill(seed=5)
        assert all(torch.equal(x, e) for x, e in zip(static.step(), expected))  # sizes the buffer on every rank
        capacity = ex.capacity
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            start = time.monotonic()
            outputs = static.step()  # the second exchange finds the group failed: no wait, poison at once
            torch.cuda.synchronize()
            assert time.monotonic() - start < 5, "the pull returned only after its peers' timeout"
            assert all(torch.isnan(t).all() for t in outputs), "a timed-out exchange wrote something other than NaN"
            assert ex.capacity == capacity  # no growth: the only collective left is the kernel's barrier
            assert_timed_out_for_good(static.step, comm.group_name, "all_to_all entry")
        dist.barrier()  # NCCL is unaffected
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_peer_that_stops_exchanging_times_out(world_size: int) -> None:
    run_workers(_peer_stops_exchanging, world_size, timeout_s=120)


def _reduce_overhead(rank: int, world_size: int, transport: str) -> None:
    from torch._inductor.utils import run_and_get_code

    ex = _set_transport(transport)
    heads, kv_heads, d, s = 4 * world_size, 2 * world_size, 64, 32
    for exact in (True, False):
        block = _block(heads, kv_heads, d, torch.float32, exact)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(block, backend="graphar", mode="reduce-overhead", fullgraph=True)
        for step in range(6):  # warm-up, recording, then replays
            x = (
                integer_valued(2 * s * heads * d, torch.float32, -2, 2)
                if exact
                else torch.randn(2 * s * heads * d, device="cuda")
            ).view(2, s, heads * d)
            if step == 0:
                out, code = run_and_get_code(compiled, x)
                assert "graphar.qkv_all_to_all" in "\n".join(code), "the pass did not pack Q/K/V"
            else:
                out = compiled(x)
            out = out.clone()
            if exact:
                assert torch.equal(out, block(x)), f"step {step}: compiled != eager"
            else:
                torch.testing.assert_close(out, block(x), rtol=1e-4, atol=1e-4, msg=f"step {step}")
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert ex is None or ex.capacity > 0, "the IPC exchange was never used"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_overhead_equals_eager(world_size: int, transport: str) -> None:
    if transport == "nccl":
        skip_where_nccl_is_captured()
    run_workers(_reduce_overhead, world_size, transport)


def _compiled_variants(kernel: object) -> int | None:
    caches = getattr(kernel, "device_caches", None)  # Triton 3.x internals; None where they differ
    if caches is None:
        return None
    return sum(len(entry[0]) for entry in caches.values())


def test_pack_kernel_64bit_offsets_and_no_recompile_per_sequence_length() -> None:
    from graphar.triton_common import triton_available
    from graphar.ulysses import pack

    if not torch.cuda.is_available() or not triton_available():
        pytest.skip("needs a CUDA GPU and Triton")
    p, heads, d = 2, 16, 128
    xs = [torch.randn(1, 8, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty(p, 1, 8, packed_heads([heads] * 3, p), d, device="cuda", dtype=torch.bfloat16)
    assert pack.pack_heads(xs, p, out)
    variants = _compiled_variants(pack._relayout_kernel)
    for s in (5, 6, 100, 1001):
        xs = [torch.randn(1, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        out = torch.empty(p, 1, s, packed_heads([heads] * 3, p), d, device="cuda", dtype=torch.bfloat16)
        assert pack.pack_heads(xs, p, out)
        reference = torch.cat([x.view(1, s, p, heads // p, d).permute(2, 0, 1, 3, 4) for x in xs], dim=3)
        assert torch.equal(out, reference), f"s={s}"
    if variants is not None:
        assert _compiled_variants(pack._relayout_kernel) == variants, "a new sequence length recompiled"
    # 2**31 elements and more in the packed buffer: offsets need 64 bits.
    s = (2**31) // (p * packed_heads([heads] * 3, p) * d) + 1
    xs = [torch.randn(1, s, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty(p, 1, s, packed_heads([heads] * 3, p), d, device="cuda", dtype=torch.bfloat16)
    out.fill_(float("nan"))
    assert pack.pack_heads(xs, p, out)
    for c, x in enumerate(xs):
        h = heads // p
        assert torch.equal(out[:, :, :, c * h : (c + 1) * h], x.view(1, s, p, h, d).permute(2, 0, 1, 3, 4)), c
