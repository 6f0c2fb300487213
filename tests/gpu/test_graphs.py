"""CUDA graphs: zero-copy capture in graphar.graph, copy-in in foreign captures, the decode helper."""

from __future__ import annotations

import ctypes
import gc
import random

import pytest
import testing_library
import torch
from _dist import WORLD_SIZES, assert_equal_across_ranks, integer_valued, nccl_sum, repetitions, run_workers

import graphar
from graphar import _cuda

pytestmark = pytest.mark.gpu

KB, MB = 1 << 10, 1 << 20


def _refill(x: torch.Tensor) -> torch.Tensor:
    """New integer values in the static input; returns a copy of them."""
    x.copy_(integer_valued(x.numel(), x.dtype).view_as(x))
    return x.clone()


def _capture_then_replay(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        for algo in ("1stage", "2stage"):
            for dtype, nbytes in ((torch.bfloat16, 16), (torch.float32, 64 * KB + 16), (torch.float16, MB + 48)):
                x = integer_valued(nbytes // dtype.itemsize, dtype)
                graph = torch.cuda.CUDAGraph()
                slots_before = comm.kernels.graph_calls
                with graphar.graph(graph):
                    y = comm.all_reduce(x, algo=algo)
                assert comm.kernels.graph_calls == slots_before + 1, "the call did not take the zero-copy path"
                for _ in range(3):
                    values = _refill(x)
                    y.fill_(float("nan"))
                    graph.replay()
                    assert torch.equal(y, nccl_sum(values)), f"{algo}, {nbytes} B {dtype}"
                    assert torch.equal(x, values), "input modified"
                    assert_equal_across_ranks(y, f"{algo}, {nbytes} B {dtype}")
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_capture_then_replay(world_size: int) -> None:
    run_workers(_capture_then_replay, world_size)


def _slots_come_back(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        ar = comm.kernels
        keep = torch.cuda.CUDAGraph()  # a live graph whose slots must stay valid throughout
        kept_x = integer_valued(4 * KB, torch.float32)
        with graphar.graph(keep):
            kept_y = comm.all_reduce(kept_x, algo="1stage")
        held = ar.slots_in_use
        for i in range(20):  # recaptures, as a server that rebuilds its graphs does
            x = integer_valued(8 * KB, torch.bfloat16)
            graph = torch.cuda.CUDAGraph()
            with graphar.graph(graph):
                ys = [comm.all_reduce(x * k, algo=("1stage", "2stage")[k % 2]) for k in (1, 2, 3)]
            assert ar.slots_in_use == held + 3, f"recapture {i}: slots not handed back"
            values = _refill(x)
            graph.replay()
            for k, y in zip((1, 2, 3), ys):
                assert torch.equal(y, nccl_sum(values * k)), f"recapture {i}, call {k}"
            del graph, ys
            gc.collect()
        assert ar.slots_in_use == held
        values = _refill(kept_x)
        keep.replay()
        assert torch.equal(kept_y, nccl_sum(values)), "the live graph's slot was overwritten"
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_slots_of_freed_graphs_are_reused(world_size: int) -> None:
    run_workers(_slots_come_back, world_size)


def _write_after_read(rank: int, world_size: int, graphar_capture: bool) -> None:
    comm = graphar.init()
    capture = graphar.graph if graphar_capture else torch.cuda.graph
    try:
        for algo in ("1stage", "2stage"):
            x = integer_valued(2 * MB, torch.bfloat16)
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            slots_before = comm.kernels.graph_calls
            with capture(graph):
                y = comm.all_reduce(x, algo=algo)
                x.mul_(-1)  # overwrites the input while slow peers might still read it
                z = comm.all_reduce(x, algo=algo)
                x.add_(3)
            assert comm.kernels.graph_calls - slots_before == (2 if graphar_capture else 0)
            graph.instantiate()
            total, programmatic = testing_library.graph_edges(graph)  # the mul_ -> all-reduce edge: PDL kept
            assert programmatic >= 1, f"{algo}: PDL edge lost in capture ({total} edges)"
            for i in range(20):
                values = _refill(x)
                graph.replay()
                assert torch.equal(y, nccl_sum(values)), f"{algo}, replay {i}: first all-reduce"
                assert torch.equal(z, nccl_sum(-values)), f"{algo}, replay {i}: second all-reduce"
                assert torch.equal(x, 3 - values)
    finally:
        comm.close()


@pytest.mark.parametrize("graphar_capture", [True, False], ids=["graphar.graph", "torch.cuda.graph"])
@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_write_after_read(world_size: int, graphar_capture: bool) -> None:
    run_workers(_write_after_read, world_size, graphar_capture)


HIDDEN = 256


def _decode_loop(rank: int, world_size: int) -> None:
    comm = graphar.init()
    w1 = integer_valued(HIDDEN * HIDDEN, torch.float32, -2, 2).view(HIDDEN, HIDDEN)
    w2 = integer_valued(HIDDEN * HIDDEN, torch.float32, -2, 2).view(HIDDEN, HIDDEN)

    def step(h: torch.Tensor) -> torch.Tensor:  # a TP block: two all-reduces
        y = comm.all_reduce(h @ w1)
        return comm.all_reduce((y - 3) @ w2)

    def reference(h: torch.Tensor) -> torch.Tensor:
        return nccl_sum((nccl_sum(h @ w1) - 3) @ w2)

    try:
        graphs = graphar.BatchGraphs(step, lambda b: (torch.zeros(b, HIDDEN, device="cuda"),), batch_sizes=[8, 1, 4, 2])
        assert graphs.batch_sizes == (1, 2, 4, 8)
        order = random.Random(0).choices(range(1, 9), k=60)  # same order on every rank
        for i, b in enumerate(order):
            h = integer_valued(b * HIDDEN, torch.float32, -2, 2).view(b, HIDDEN)
            out = graphs(h)
            assert out.shape == (b, HIDDEN)
            assert torch.equal(out, reference(h)), f"call {i}, batch {b}"
            if i % 3 == 0:  # eager calls between replays use the same buffers and barriers
                x = integer_valued(HIDDEN * (i + 1), torch.bfloat16)
                assert torch.equal(comm.all_reduce(x), nccl_sum(x))
        with pytest.raises(ValueError, match="captured sizes"):
            graphs(torch.zeros(9, HIDDEN, device="cuda"))
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_batch_graphs_replayed_in_any_order(world_size: int) -> None:
    run_workers(_decode_loop, world_size)


def _capture_eager_replay(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        xs = [integer_valued(n, torch.bfloat16) for n in (8, 8 * KB, 256 * KB)]
        graph = torch.cuda.CUDAGraph()
        with graphar.graph(graph):
            ys = [comm.all_reduce(x) for x in xs]
        for n, algo in ((8 * KB, "2stage"), (MB, "1stage"), (16, None)):  # eager, between capture and replay
            x = integer_valued(n, torch.float32)
            assert torch.equal(comm.all_reduce(x, algo=algo), nccl_sum(x))
        values = [_refill(x) for x in xs]
        graph.replay()
        for y, v in zip(ys, values):
            assert torch.equal(y, nccl_sum(v))
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_capture_eager_replay(world_size: int) -> None:
    run_workers(_capture_eager_replay, world_size)


def _many_replays(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        xs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (4 * KB, 32 * KB) * 50]
        graph = torch.cuda.CUDAGraph()
        with graphar.graph(graph):  # 100 all-reduces, alternating algorithms
            ys = [comm.all_reduce(x, algo=("1stage", "2stage")[i % 2]) for i, x in enumerate(xs)]
        graph.replay()
        first = torch.cat(ys).clone()
        assert_equal_across_ranks(first, "first replay")
        n = repetitions(1000)  # 10^5 all-reduces
        for i in range(n):
            graph.replay()
            if (i + 1) % (n // 4) == 0:
                now = torch.cat(ys)
                assert torch.equal(now.view(torch.int16), first.view(torch.int16)), f"replay {i} changed"
                assert_equal_across_ranks(now, f"replay {i}")
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hundred_thousand_replays_stay_bitwise_equal(world_size: int) -> None:
    run_workers(_many_replays, world_size)


def _expandable_segments(rank: int, world_size: int, ranks_expandable: tuple[int, ...]) -> None:
    if rank in ranks_expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        torch.cuda.empty_cache()
    comm = graphar.init()
    assert comm is not None, "expandable segments must not stop graphar.init"
    try:
        xs = [integer_valued(n, torch.bfloat16) for n in (7 * KB, 300 * KB)]
        info = [_pointer_info(x) for x in xs]
        if rank in ranks_expandable:
            assert not any(capable for capable in info), "the premise: legacy IPC cannot share these"
        graph = torch.cuda.CUDAGraph()
        with graphar.graph(graph):  # staged on the expandable ranks, zero copy on the others
            ys = [comm.all_reduce(x, algo=algo) for x in xs for algo in ("1stage", "2stage")]
        # A staged input is copied in by the kernel after its claim: no copy node of its own, which an eager
        # call on another stream could overtake, so every rank's graph has the same edges.
        edges = comm.all_gather(testing_library.graph_edges(graph)[0], "graph edges")
        assert len(set(edges)) == 1, f"graph edges by rank: {edges} (a staged rank has a copy node of its own)"
        for _ in range(3):
            values = [_refill(x) for x in xs]
            graph.replay()
            for i, y in enumerate(ys):
                assert torch.equal(y, nccl_sum(values[i // 2])), f"call {i}"
            x = integer_valued(64 * KB, torch.float32)
            assert torch.equal(comm.all_reduce(x), nccl_sum(x))
    finally:
        comm.close()


def _pointer_info(x: torch.Tensor) -> bool:
    """Whether legacy IPC can share x's allocation, as graphar sees it at capture time."""
    base, size, capable = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
    lib = _cuda.library()
    _cuda.check(lib.graphar_pointer_info(x.data_ptr(), *map(ctypes.byref, (base, size, capable))), "pointer info")
    assert base.value <= x.data_ptr() < base.value + size.value
    return bool(capable.value)


@pytest.mark.parametrize("ranks_expandable", [(0,), (0, 1)], ids=["rank 0", "ranks 0 and 1"])
@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_expandable_segments_take_the_staged_path(world_size: int, ranks_expandable: tuple[int, ...]) -> None:
    run_workers(_expandable_segments, world_size, ranks_expandable)


def _captured_input_outlives_its_name(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        x = integer_valued(64 * KB, torch.bfloat16)
        expected = nccl_sum(x)
        graph = torch.cuda.CUDAGraph()
        with graphar.graph(graph):
            y = comm.all_reduce(x)
        del x  # the graph reads it in place: graphar.graph must keep it
        torch.cuda.synchronize()
        junk = [torch.full((64 * KB,), 7, dtype=torch.bfloat16, device="cuda") for _ in range(64)]
        for _ in range(3):
            y.fill_(float("nan"))
            graph.replay()
            assert torch.equal(y, expected), "a replay read memory the caller had dropped"
        del junk
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_captured_input_outlives_its_name(world_size: int) -> None:
    run_workers(_captured_input_outlives_its_name, world_size)


def _replayed_after_shutdown(rank: int, world_size: int) -> None:
    """A graph may outlive the communicator it captured: replayed after graphar.shutdown() and a new
    graphar.init(), every kernel in it writes NaN (the old buffers stay allocated, marked failed)
    instead of touching freed memory, and the new communicator is unaffected."""
    comm = graphar.init()
    x = integer_valued(64 * KB, torch.bfloat16)
    algos = ("1stage", "2stage", "push-oneshot", "push-twoshot")
    captured = []
    for capture in (graphar.graph, torch.cuda.graph):
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            outputs = [comm.all_reduce(x, algo=algo) for algo in algos]
        graph.replay()
        for algo, y in zip(algos, outputs):
            assert torch.equal(y, nccl_sum(x)), f"{capture.__name__} {algo}: wrong before the shutdown"
        captured.append((capture.__name__, graph, outputs))
    graphar.shutdown()
    fresh = graphar.init()
    try:
        assert fresh is not comm
        for name, graph, outputs in captured:
            for y in outputs:
                y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            for algo, y in zip(algos, outputs):
                assert torch.isnan(y).all(), (
                    f"{name} {algo}: replayed after the shutdown, wrote something other than NaN"
                )
        for algo in algos:
            y = fresh.all_reduce(x, algo=algo)
            assert torch.equal(y, nccl_sum(x)), f"{algo}: the new communicator differs from NCCL"
    finally:
        fresh.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_graph_replayed_after_shutdown_writes_nan(world_size: int) -> None:
    run_workers(_replayed_after_shutdown, world_size)
