"""Four gloo processes on the CPU as a (dp=2, tp=2) device mesh: the set-up exchange of graphar.init
(`set_up._exchange`) of a tensor-parallel group runs over that group alone.

TP group 0 runs its exchange while TP group 1's ranks wait for it to finish, then the reverse: an
exchange that needed any rank outside its group (the world's store, a world collective) would wait
for ranks that wait for it, and time out (so would one that used global ranks). Then both groups
exchange at once, each at its second set-up: each gathers its own ranks' values only. The whole
set-up, on GPUs, is tests/gpu/test_mesh.py's.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from graphar import processes

WAIT = datetime.timedelta(seconds=60)


def _worker(rank: int, world_size: int) -> None:
    from graphar.allreduce import set_up

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, index = mesh.get_group("tp"), mesh.get_coordinate()[0]  # TP group 0: ranks 0 and 1; 1: 2 and 3
    ranks = dist.get_process_group_ranks(tp)
    assert ranks == [2 * index, 2 * index + 1], ranks
    store = dist.distributed_c10d._get_default_store()  # only to order the turns: no collective
    for turn in (0, 1):
        if turn == index:
            exchange = set_up._exchange(tp)
            for step in range(3):
                assert exchange.all_gather((rank, step), "turn") == [(r, step) for r in ranks], (rank, step)
            store.set(f"test/turn{turn}/{rank}", b"done")
        else:
            store.wait([f"test/turn{turn}/{r}" for r in range(2 * turn, 2 * turn + 2)], WAIT)
    # Both groups at once: each group's keys are its own.
    exchange = set_up._exchange(tp)
    for step in range(3):
        assert exchange.all_gather((rank, step), "both") == [(r, step) for r in ranks], (rank, step)
    dist.destroy_process_group()


def test_a_tensor_parallel_group_sets_up_over_its_own_ranks_alone() -> None:
    processes.run(_worker, 4, env={"GRAPHAR_EXCHANGE_TIMEOUT_S": "20"}, collective_timeout_s=WAIT.total_seconds())
