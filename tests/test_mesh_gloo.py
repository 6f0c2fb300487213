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
import os

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from graphar.processes import end_worker, free_port

WAIT = datetime.timedelta(seconds=60)


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GRAPHAR_EXCHANGE_TIMEOUT_S="20")
    from graphar.allreduce import set_up

    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=WAIT)
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
    end_worker()


def test_a_tensor_parallel_group_sets_up_over_its_own_ranks_alone() -> None:
    # Forked from one process that imported torch and graphar: four imports of their own take a minute here.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "graphar"])
    mp.start_processes(_worker, args=(free_port(),), nprocs=4, join=True, start_method="forkserver")
