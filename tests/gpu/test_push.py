"""The push all-reduce kernels on real GPUs: what sets them apart from v1 (test_allreduce.py runs them
through the shared checks too): arrival read from the data, epochs, in-place inputs in every capture
mode, PDL edges, and timeouts."""

from __future__ import annotations

import time

import pytest
import testing_library
import torch
import torch.distributed as dist
from _dist import (
    WORLD_SIZES,
    assert_equal_across_ranks,
    assert_timed_out_for_good,
    check_exact,
    integer_valued,
    nccl_sum,
    repetitions,
    run_workers,
    set_barrier_counters,
)

import graphar

pytestmark = pytest.mark.gpu

KB, MB = 1 << 10, 1 << 20
PUSH = ("push-oneshot", "push-twoshot")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _special_values(numel: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """-0.0, +-Inf, NaNs of several payloads (the empty-slot pattern 0xFFFF.. among them) and
    integers, shuffled differently on every rank."""
    bits = BITS[dtype]
    width = torch.iinfo(bits).bits
    nans = [-1, (1 << (width - 1)) - 1, (1 << (width - 1)) - 2]  # 0xFF..FF, 0x7F..FF, 0x7F..FE: all NaN
    pool = torch.cat(
        [
            torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), 1.0, -2.0], dtype=dtype),
            torch.tensor(nans, dtype=bits).view(dtype),
        ]
    )
    gen = torch.Generator().manual_seed(1000 + rank)
    x = pool[torch.randint(len(pool), (numel,), generator=gen)]
    x[: numel // 4] = -0.0  # long runs of -0.0 on every rank: the sum must stay -0.0
    return x.cuda()


def _assert_like_nccl(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bitwise equal to NCCL's sum, except that a NaN's payload may differ (both are NaN)."""
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y), nan), f"{what}: NaN where NCCL has none or the reverse"
    bits = BITS[y.dtype]
    assert torch.equal(y.view(bits)[~nan], ref.view(bits)[~nan]), f"{what}: differs from NCCL"


def _special_values_like_nccl(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        for dtype in DTYPES:
            for algo in PUSH:
                for nbytes in (16, 16 * 1001, 256 * KB):
                    x = _special_values(nbytes // dtype.itemsize, dtype, rank)
                    y = comm.all_reduce(x, algo=algo)
                    what = f"{algo} {dtype} {nbytes} B"
                    _assert_like_nccl(y, nccl_sum(x), what)
                    assert_equal_across_ranks(y, what)
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_special_values_sum_as_nccl_sums_them(world_size: int) -> None:
    run_workers(_special_values_like_nccl, world_size)


def _replays_across_the_epoch_wrap(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        x = integer_valued(48 * KB, torch.bfloat16)
        values = [integer_valued(x.numel(), x.dtype) for _ in range(3)]
        refs = [nccl_sum(v) for v in values]
        torch.cuda.synchronize()
        set_barrier_counters(comm, 2**32 - 7)  # the push epoch too: the wrap comes within 4 replays
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y1 = comm.all_reduce(x, algo="push-oneshot")
            y2 = comm.all_reduce(torch.neg(x), algo="push-twoshot")
            y3 = comm.all_reduce(x, algo="push-oneshot")
        bad = []
        n = repetitions(10_000)
        for i in range(n):
            x.copy_(values[i % 3])
            graph.replay()
            ref = refs[i % 3]
            if not (torch.equal(y1, ref) and torch.equal(y2, -ref) and torch.equal(y3, ref)):
                bad.append(i)
        assert not bad, f"replays {bad[:20]} differ from NCCL"
        assert_equal_across_ranks(torch.cat([y1, y2, y3]), f"after {n} replays")
        check_exact(comm, integer_valued(16 * KB, torch.float16), "push-oneshot")  # eager after replays
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_ten_thousand_replays_across_the_epoch_wrap(world_size: int) -> None:
    run_workers(_replays_across_the_epoch_wrap, world_size)


def _three_capture_modes(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:

        def body(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = comm.all_reduce(x)
            x.mul_(-1)  # written right after the push read it in place
            return y, comm.all_reduce(x[: x.numel() // 2])

        for capture in (torch.cuda.graph, graphar.graph):
            x = integer_valued(64 * KB, torch.float32)
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            before = comm.kernels.graph_calls
            with capture(graph):
                y, z = body(x)
            graph.instantiate()
            assert comm.kernels.graph_calls == before, f"{capture.__name__}: a push call took a graph slot"
            total, programmatic = testing_library.graph_edges(graph)
            assert programmatic >= 1, f"{capture.__name__}: PDL edge lost in capture ({total} edges)"
            for _ in range(3):
                values = integer_valued(x.numel(), x.dtype)
                x.copy_(values)
                y.fill_(float("nan"))
                z.fill_(float("nan"))
                graph.replay()
                assert torch.equal(y, nccl_sum(values)), capture.__name__
                assert torch.equal(z, nccl_sum(-values[: x.numel() // 2])), capture.__name__
        _reduce_overhead(comm)
    finally:
        comm.close()


def _reduce_overhead(comm) -> None:
    name = comm.group_name
    calls = comm.kernels.calls

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x * 2, "sum", name)) + 1

    compiled = torch.compile(step, backend="graphar", mode="reduce-overhead")
    for _ in range(4):
        x = integer_valued(8 * KB, torch.bfloat16)
        assert torch.equal(compiled(x), nccl_sum(x * 2) + 1)
    assert comm.kernels.calls > calls, "the compiled step never reached graphar's kernels"


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_three_capture_modes_read_inputs_in_place(world_size: int) -> None:
    run_workers(_three_capture_modes, world_size, env={"GRAPHAR_ALLREDUCE_ALGO": "push-oneshot"})


def _mixed_with_v1(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        algos = ("push-oneshot", "1stage", "push-twoshot", "2stage", "push-oneshot")
        for i in range(2000):
            nbytes = (16, 4 * KB + 16 * 3, 256 * KB, MB + 16)[i % 4]
            check_exact(comm, integer_valued(nbytes // 2, torch.bfloat16), algos[i % len(algos)])
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_push_and_v1_calls_interleave(world_size: int) -> None:
    run_workers(_mixed_with_v1, world_size)


TIMEOUT_S = 0.5


def _peer_stops_pushing(rank: int, world_size: int, algo: str, where: str) -> None:
    comm = graphar.init(timeout_s=TIMEOUT_S)
    try:
        x = integer_valued(MB // 2, torch.bfloat16)
        check_exact(comm, x, algo)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            start = time.monotonic()
            comm.all_reduce(x, algo=algo)
            torch.cuda.synchronize()
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT_S + 5, f"the kernel returned only after {elapsed:.1f} s"
            assert_timed_out_for_good(lambda: comm.all_reduce(x, algo=algo), comm.group_name, where)
        dist.barrier()
    finally:
        comm.close()


def _poison_after_a_timeout(rank: int, world_size: int) -> None:
    """A graph captured before a timeout replays with no host check: every kernel in it, each all-reduce
    and the fused norm, then writes NaN at once instead of spinning on peers that are out of step."""
    comm = graphar.init(timeout_s=TIMEOUT_S)
    try:
        x = integer_valued(64 * KB, torch.bfloat16)
        rows, residual = x.view(16, -1), integer_valued(x.numel(), torch.bfloat16).view(16, -1)
        weight = integer_valued(rows.shape[1], torch.bfloat16)
        algos = ("1stage", "2stage", *PUSH)

        def body() -> list[torch.Tensor]:
            fused = comm.kernels.try_all_reduce_norm(rows, residual, weight, 1e-6, False)
            assert fused is not None, "the fused norm refused its shapes"
            return [comm.all_reduce(x, algo=algo) for algo in algos] + list(fused)

        body()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = body()
        graph.replay()
        for algo, y in zip(algos, outputs):
            assert torch.equal(y, nccl_sum(x)), f"{algo}: the replay before the timeout differs from NCCL"
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:  # alone: the eager call times out and marks the group failed
            y = comm.all_reduce(x, algo="push-oneshot")
            torch.cuda.synchronize()
            assert torch.isnan(y).all(), "the call that timed out wrote something other than NaN"
            for out in outputs:
                out.zero_()
            start = time.monotonic()
            graph.replay()
            torch.cuda.synchronize()
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT_S, f"the replay after the timeout took {elapsed:.2f} s: it waited on peers"
            for what, out in zip([*algos, "fused normed", "fused residual"], outputs):
                assert torch.isnan(out).all(), f"{what}: replayed after the timeout, wrote something other than NaN"
            assert_timed_out_for_good(lambda: comm.all_reduce(x), comm.group_name, "all_reduce push-oneshot receive")
        dist.barrier()
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_kernels_after_a_timeout_write_nan_without_waiting(world_size: int) -> None:
    run_workers(_poison_after_a_timeout, world_size, timeout_s=120)


@pytest.mark.parametrize(
    "algo, where",
    [("push-oneshot", "all_reduce push-oneshot receive"), ("push-twoshot", "all_reduce push-twoshot scatter")],
)
def test_peer_that_stops_pushing_times_out(algo: str, where: str) -> None:
    run_workers(_peer_stops_pushing, WORLD_SIZES[0], algo, where, timeout_s=120)
