"""The custom all-reduce on real GPUs: exact against NCCL, bitwise equal across ranks, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from _dist import (
    WORLD_SIZES,
    assert_equal_across_ranks,
    assert_timed_out_for_good,
    check_exact,
    init_world,
    integer_valued,
    nccl_sum,
    run_workers,
    set_barrier_counters,
)

import graphar
from graphar import GrapharCommError
from graphar.allreduce.registry import communicator

pytestmark = pytest.mark.gpu

KB, MB = 1 << 10, 1 << 20
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALGOS = (None, "1stage", "2stage", "push-oneshot", "push-twoshot")
MAX_BYTES = 8 * MB
# 16 B up to the limit, odd multiples of 16 B included (shards with remainders for 2stage).
SIZES = (16, 48, 16 * 33, 16 * 1001, 64 * KB, 256 * KB + 16 * 3, MB + 16 * 7, 4 * MB - 16, MAX_BYTES)


def _exact_against_nccl(rank: int, world_size: int) -> None:
    comm = graphar.init(max_bytes=MAX_BYTES)
    assert comm is not None and comm.world_size == world_size and comm.rank == rank
    try:
        for dtype in DTYPES:
            for nbytes in SIZES:
                for algo in ALGOS:
                    x = integer_valued(nbytes // dtype.itemsize, dtype)
                    assert comm.eligible(x)
                    if comm.kernels.policy.pick(nbytes, "eager", algo) is None:  # past the one-shot's room
                        with pytest.raises(ValueError, match="forced kernel"):
                            comm.all_reduce(x, algo=algo)
                        continue
                    check_exact(comm, x, algo)
        # Non-integer data: no exact reference, but the ranks must agree bit for bit.
        for algo in ALGOS:
            x = torch.randn(MB // 2, device="cuda", dtype=torch.bfloat16)
            y = comm.all_reduce(x, algo=algo)
            assert_equal_across_ranks(y, f"random normal bf16, algo {algo}")
            torch.testing.assert_close(y, nccl_sum(x), rtol=2e-2, atol=2e-2)
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_exact_against_nccl(world_size: int) -> None:
    run_workers(_exact_against_nccl, world_size)


def _repeated_calls(rank: int, world_size: int) -> None:
    comm = graphar.init(max_bytes=MAX_BYTES)
    try:
        # Grid size, algorithm and dtype change from call to call; every barrier slot phase is hit.
        cases = [
            (16, "1stage"),
            (32 * KB, "2stage"),
            (MB + 16, None),
            (MAX_BYTES, "2stage"),
            (4 * KB, "1stage"),
            (48, "push-oneshot"),
            (MB + 16 * 5, "push-twoshot"),
            (64 * KB, "push-oneshot"),
        ]
        inputs = [integer_valued(n // 2, torch.bfloat16) for n, _ in cases]
        refs = [nccl_sum(x) for x in inputs]
        mismatches = []
        for i in range(3000):
            k = i % len(cases)
            if not torch.equal(comm.all_reduce(inputs[k], algo=cases[k][1]), refs[k]):
                mismatches.append(i)
        assert not mismatches, f"calls {mismatches[:20]} differ from NCCL"
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_thousands_of_calls_stay_exact(world_size: int) -> None:
    run_workers(_repeated_calls, world_size)


def _two_streams_back_to_back(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        xs = [integer_valued(64 * KB, torch.float32) for _ in range(300)]
        ys = []
        torch.cuda.synchronize()
        for i, x in enumerate(xs):  # no ordering between a and b from the caller
            with torch.cuda.stream(a if i % 2 else b):
                ys.append(comm.all_reduce(x, algo=(None, "push-oneshot", "push-twoshot")[i % 3]))
        torch.cuda.synchronize()
        for x, y in zip(xs, ys):
            assert torch.equal(y, nccl_sum(x))
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_two_streams_are_serialized(world_size: int) -> None:
    run_workers(_two_streams_back_to_back, world_size)


def _two_groups(rank: int, world_size: int) -> None:
    whole = dist.new_group(list(range(world_size)))
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world_size, 2)]  # every rank creates every group
    groups = [None, whole, pairs[rank // 2]]
    comms = [graphar.init(g) for g in groups]
    assert all(c is not None for c in comms)
    assert len({c.group_name for c in comms}) == len(comms)
    assert graphar.init(whole) is comms[1]
    try:
        for i in range(50):
            # Different numbers of calls per group per round: the groups must stay independent.
            for k, (group, comm) in enumerate(zip(groups, comms)):
                for _ in range(1 + (i + k) % 3):
                    check_exact(comm, integer_valued(4 * KB * (k + 1), torch.float16), None, group)
    finally:
        graphar.shutdown()
    assert all(communicator(c.group_name) is None for c in comms)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_two_groups_in_one_process(world_size: int) -> None:
    run_workers(_two_groups, world_size)


def _ineligible_inputs_fall_back(rank: int, world_size: int) -> None:
    comm = graphar.init(max_bytes=MB)
    try:
        name = comm.group_name
        cases = {  # what the CUDA library's plan says of each (csrc/plan.cu), and the input
            "dtype": torch.ones(64, dtype=torch.int32, device="cuda"),
            "24 bytes is not a positive multiple of 16": torch.ones(12, dtype=torch.float16, device="cuda"),
            "0 bytes": torch.ones(0, device="cuda"),
            "not contiguous": integer_valued(64 * 64, torch.float32).view(64, 64).t(),
            "not 16-byte aligned": integer_valued(65, torch.float32)[1:],
            "over the limit": integer_valued(MB // 4 + 4, torch.float32),
            "not on a GPU": torch.ones(64, dtype=torch.float32),
        }
        for reason, x in cases.items():
            assert not comm.eligible(x), reason
            with pytest.raises(ValueError, match=name):
                comm.all_reduce(x)
            assert reason in comm.kernels.refusal, (reason, comm.kernels.refusal)
            if x.is_cuda:  # the op sums them all the same: NCCL, or the kernels from a copy (strided, misaligned)
                assert torch.equal(torch.ops.graphar.all_reduce(x, name), nccl_sum(x.contiguous())), reason
        with pytest.raises(ValueError, match="push-oneshot"):
            comm.all_reduce(integer_valued(64, torch.float32), algo="3stage")
    finally:
        comm.close()
    with pytest.raises(GrapharCommError, match="closed"):
        comm.all_reduce(integer_valued(64, torch.float32))
    assert not comm.eligible(integer_valued(64, torch.float32))


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_ineligible_inputs(world_size: int) -> None:
    run_workers(_ineligible_inputs_fall_back, world_size)


def _native_op_serves_eager_calls(rank: int, world_size: int) -> None:
    """graphar::all_reduce's C++ kernel serves eager calls, bit for bit as the Python kernel, and
    hands captures and strided inputs to it; a changed policy reaches it."""
    from graphar.allreduce import native_op

    comm = graphar.init(max_bytes=MAX_BYTES)
    try:
        assert native_op.library() is not None, "the op library was not built (see the log)"
        op, name = torch.ops.graphar.all_reduce, comm.group_name
        for algo in ALGOS:
            comm.kernels.policy = comm.kernels.policy.forcing(algo)
            for dtype in DTYPES:
                for nbytes in (16, 16 * 1001, 256 * KB + 48, MAX_BYTES):
                    x = integer_valued(nbytes // dtype.itemsize, dtype)
                    before = comm.native_calls()
                    y = op(x, name)
                    served = comm.native_calls() - before
                    assert served == (comm.kernels.policy.pick(nbytes, "eager") is not None), (algo, dtype, nbytes)
                    assert torch.equal(y, nccl_sum(x)), (algo, dtype, nbytes)
        comm.kernels.policy = comm.kernels.policy.forcing(None)
        x = integer_valued(64 * 64, torch.bfloat16).view(64, 64)
        before, calls = comm.native_calls(), comm.kernels.calls
        assert torch.equal(op(x.t(), name), nccl_sum(x.t().contiguous()))  # strided: the Python kernel's
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op(x, name)  # captured: the Python kernel's too
        assert comm.native_calls() == before and comm.kernels.calls == calls + 2
        x.copy_(integer_valued(64 * 64, torch.bfloat16).view(64, 64))
        y.fill_(float("nan"))
        graph.replay()
        assert torch.equal(y, nccl_sum(x))
    finally:
        comm.close()
    x = integer_valued(64, torch.float32)
    assert torch.equal(torch.ops.graphar.all_reduce(x, comm.group_name), nccl_sum(x))  # closed: NCCL


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_native_op_serves_eager_calls(world_size: int) -> None:
    run_workers(_native_op_serves_eager_calls, world_size)


def _destroyed_without_shutdown(rank: int, world_size: int) -> None:
    """A group destroyed with no graphar.shutdown(): torch gives its name to the next group it makes,
    here rank 0 alone. Neither kernel of graphar::all_reduce may serve that name with the old
    communicator (which would sum over every rank, or wait for them until its timeout)."""
    from graphar.allreduce import native_op
    from graphar.processes import free_port

    comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=20)
    name, x = comm.group_name, integer_valued(4 * KB, torch.bfloat16)
    assert torch.equal(torch.ops.graphar.all_reduce(x, name), nccl_sum(x))
    served = native_op.calls(name)
    assert served == 1 or native_op.library() is None
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port)
    dist.destroy_process_group()  # every group
    init_world(rank, world_size, port[0])
    mine = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank makes every group
    assert rank != 0 or mine.group_name == name, "the premise: torch reuses the name"
    for _ in range(2):  # the C++ kernel declines the name; the Python kernel closes the old communicator
        x = integer_valued(4 * KB, torch.bfloat16)
        assert torch.equal(torch.ops.graphar.all_reduce(x, mine.group_name), x), "a group of one sums to x"
    assert native_op.calls(name) == served, "the C++ kernel served the reused name"
    if rank == 0:
        assert communicator(name) is None and comm.handle is None, "the old communicator is still open"
    graphar.shutdown()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_a_destroyed_group_name_is_not_served_by_its_old_communicator(world_size: int) -> None:
    run_workers(_destroyed_without_shutdown, world_size)


def _ranks_that_differ_in_a_setting(rank: int, world_size: int) -> None:
    """GRAPHAR_BLOCK_LIMIT on the last rank only (its all-reduces would launch fewer blocks than its
    peers', whose spare blocks would wait for it until the timeout), then GRAPHAR_PULL_BLOCKS: the set-up
    raises on every rank naming the variable and each rank's value, by graphar.init and at a group's
    first collective alike; set alike, the group sets up."""
    from graphar.allreduce.kernels import block_limit

    last = world_size - 1
    os.environ["GRAPHAR_BLOCK_LIMIT"] = ""  # the architecture's, whatever the harness set
    default = block_limit(torch.cuda.get_device_capability()[0])
    os.environ["GRAPHAR_BLOCK_LIMIT"] = "16" if rank == last else ""
    with pytest.raises(GrapharCommError) as refused:
        graphar.init()
    values = ", ".join(f"rank {r}: {16 if r == last else default}" for r in range(world_size))
    assert f"({values}): set GRAPHAR_BLOCK_LIMIT alike on every rank" in str(refused.value), refused.value
    os.environ["GRAPHAR_BLOCK_LIMIT"] = ""
    comm = graphar.init()
    assert comm is not None, "set alike, the group sets up"
    check_exact(comm, integer_valued(64 * KB, torch.bfloat16), None)

    os.environ.update(GRAPHAR_AUTO_INIT="1", GRAPHAR_PULL_BLOCKS="32" if rank == last else "")
    group = dist.new_group(list(range(world_size)))
    x = integer_valued(4 * KB, torch.bfloat16)
    with pytest.raises(GrapharCommError, match=f"GRAPHAR_PULL_BLOCKS .*rank {last}: 32"):
        torch.ops.graphar.all_reduce(x, group.group_name)  # its first collective sets it up
    assert torch.equal(torch.ops.graphar.all_reduce(x, group.group_name), nccl_sum(x, group)), "then NCCL serves"
    os.environ["GRAPHAR_PULL_BLOCKS"] = ""
    graphar.shutdown()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_ranks_that_differ_in_a_setting_all_raise(world_size: int) -> None:
    run_workers(_ranks_that_differ_in_a_setting, world_size)


TIMEOUT_S = 0.5


def _peer_stops_calling(rank: int, world_size: int) -> None:
    comm = graphar.init(timeout_s=TIMEOUT_S)
    try:
        x = integer_valued(MB // 2, torch.bfloat16)
        check_exact(comm, x, None)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:  # the only rank that calls: its kernel must give up, not spin forever
            start = time.monotonic()
            y = comm.all_reduce(x, algo="1stage")
            torch.cuda.synchronize()
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT_S + 5, f"the kernel returned only after {elapsed:.1f} s"
            assert torch.isnan(y).all(), "the call that timed out wrote something other than NaN"
            assert_timed_out_for_good(lambda: comm.all_reduce(x), comm.group_name, "all_reduce 1stage entry")
            # The op too: its C++ kernel sees the error record and raises itself (an error raised behind
            # the stable ABI's dispatcher call would lose its type); without it, the Python kernel raises.
            op = torch.ops.graphar.all_reduce
            for _ in range(2):
                with pytest.raises(RuntimeError, match=f"group {comm.group_name!r}.*timed out"):
                    op(x, comm.group_name)
        dist.barrier()  # NCCL is unaffected
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_peer_that_stops_calling_times_out(world_size: int) -> None:
    run_workers(_peer_stops_calling, world_size, timeout_s=120)


def _counters_wrap(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        set_barrier_counters(comm, 2**32 - 5)
        for i in range(12):  # each call passes 2 or 3 barriers: well past the wrap
            algo = "1stage" if i % 2 else "2stage"
            check_exact(comm, integer_valued(16 * KB * (i + 1), torch.bfloat16), algo)
        x = integer_valued(32 * KB, torch.float32)
        graph = torch.cuda.CUDAGraph()
        with graphar.graph(graph):
            y = comm.all_reduce(x)
        set_barrier_counters(comm, 2**32 - 1)
        for _ in range(4):
            x.copy_(integer_valued(x.numel(), x.dtype))
            graph.replay()
            assert torch.equal(y, nccl_sum(x))
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier_counters_wrap(world_size: int) -> None:
    run_workers(_counters_wrap, world_size)
