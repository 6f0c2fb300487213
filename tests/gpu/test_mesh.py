"""A (dp=2, tp=2) device mesh on four ranks: each tensor-parallel group sets its communicator up over
its own ranks, at its own time, and the data-parallel groups' collectives stay torch's.

TP group 0 sets up at its first all-reduce (no graphar.init) and runs ten while TP group 1's ranks
wait for it on the default store, in no collective; then TP group 1 sets up (graphar.init of its
group) and runs ten while group 0's ranks wait. A set-up that touched the world (a world collective,
an exchange over the world's store or ranks) would wait for ranks that wait for it, and fail. Then
both groups at once: eager calls between DP all-reduces, a torch.cuda.graph replay and a step
compiled with backend="graphar", each exact against a sum that every rank computes alone (a rank's
input is a function of its global rank and the step) and bitwise equal across the group. graphar
has no communicator for the DP groups or the world at the end.

On four GPUs init_device_mesh splits NCCL groups from the world; GRAPHAR_TEST_SHARE_GPU=1 puts the
four ranks on cuda:0, where it makes gloo groups with new_group (tests/gpu/_dist.py relaxes the
set-up for them): the same proof, a dry run of it.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from _dist import assert_equal_across_ranks, run_workers
from torch._inductor import config as inductor_config
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

import graphar
from graphar.allreduce.registry import communicator

pytestmark = pytest.mark.gpu

NUMEL = 4096  # 8 KB of bf16
WAIT = datetime.timedelta(seconds=240)  # the other TP group's turn, its set-up included


def _input(step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s input at `step`, on the CPU: integers in [-8, 8], which any rank can make."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-8, 9, (NUMEL,), generator=gen).to(torch.bfloat16)


def _sum(step: int, ranks: list[int]) -> torch.Tensor:
    """The exact sum of `ranks`' inputs at `step`, on this rank's GPU."""
    return sum(_input(step, r).float() for r in ranks).to(torch.bfloat16).cuda()


def _mesh(rank: int, world_size: int) -> None:
    inductor_config.compile_threads = 1  # four ranks compile one small graph each: no worker pools
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    index = mesh.get_coordinate()[0]  # which TP group: a row of the mesh
    tp_ranks, dp_ranks = dist.get_process_group_ranks(tp), dist.get_process_group_ranks(dp)
    assert tp_ranks == mesh.mesh[index].tolist() and len(dp_ranks) == 2
    op, name = torch.ops.graphar.all_reduce, tp.group_name
    store = dist.distributed_c10d._get_default_store()  # only to order the turns: no collective
    step = 0
    try:
        for turn in (0, 1):
            if turn != index:
                store.wait([f"test_mesh/turn{turn}/{r}" for r in mesh.mesh[turn].tolist()], WAIT)
                continue
            assert communicator(name) is None
            if turn == 1:
                assert graphar.init(tp) is not None
            for _ in range(10):
                step += 1
                y = op(_input(step, rank).cuda(), name)
                assert torch.equal(y, _sum(step, tp_ranks)), f"TP group {index}, eager, step {step}"
            assert_equal_across_ranks(y, f"TP group {index}, eager", tp)
            comm = communicator(name)
            assert comm is not None and (comm.rank, comm.world_size) == (tp_ranks.index(rank), 2)
            assert comm.kernels.calls == 10, "graphar's kernels did not serve the TP all-reduces"
            store.set(f"test_mesh/turn{turn}/{rank}", b"done")

        # Both TP groups at once, DP all-reduces between their calls.
        before = comm.kernels.calls
        for _ in range(5):
            step += 1
            y = op(_input(step, rank).cuda(), name)
            z = _input(step, rank).float().cuda()
            dist.all_reduce(z, group=dp)
            assert torch.equal(y, _sum(step, tp_ranks)), f"TP group {index} beside DP, step {step}"
            assert torch.equal(z, _sum(step, dp_ranks).float()), f"DP all-reduce, step {step}"
        assert comm.kernels.calls == before + 5, "graphar's kernels did not serve the TP all-reduces"

        x = _input(step, rank).cuda()
        torch.cuda.synchronize()
        graph, before = torch.cuda.CUDAGraph(), comm.kernels.calls
        with torch.cuda.graph(graph):
            y = op(x, name)
        assert comm.kernels.calls == before + 1, "the captured all-reduce is not graphar's"
        for _ in range(3):
            step += 1
            x.copy_(_input(step, rank))
            y.fill_(float("nan"))
            graph.replay()
            assert torch.equal(y, _sum(step, tp_ranks)), f"TP group {index}, graph replay, step {step}"
        assert_equal_across_ranks(y, f"TP group {index}, graph replay", tp)

        compiled = torch.compile(lambda x: funcol.all_reduce(x, "sum", tp) + 1, backend="graphar", fullgraph=True)
        for _ in range(2):
            step += 1
            before = comm.kernels.calls
            y = compiled(_input(step, rank).cuda())
            assert comm.kernels.calls == before + 1, "the compiled all-reduce is not graphar's"
            assert torch.equal(y, _sum(step, tp_ranks) + 1), f"TP group {index}, compiled, step {step}"
        assert_equal_across_ranks(y, f"TP group {index}, compiled", tp)

        assert communicator(dp.group_name) is None and communicator(dist.group.WORLD.group_name) is None
    finally:
        graphar.shutdown()


def test_tensor_parallel_groups_of_a_mesh_set_up_apart() -> None:
    # Set up at the first all-reduce; a set-up that waits on a rank out of its group fails in a minute.
    run_workers(_mesh, 4, env={"GRAPHAR_AUTO_INIT": "1", "GRAPHAR_EXCHANGE_TIMEOUT_S": "60"})
