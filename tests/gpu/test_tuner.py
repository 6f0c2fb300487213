"""The tuner on real GPUs: it measures at set-up, every rank gets one table, the next set-up reads it
from the cache, and every kernel it may pick gives a row the same bits (the determinism guarantee)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist import WORLD_SIZES, assert_equal_across_ranks, check_exact, integer_valued, run_workers

import graphar
from graphar.allreduce import tuner

pytestmark = pytest.mark.gpu

KB, MB = 1 << 10, 1 << 20


def _tunes_agrees_and_caches(rank: int, world_size: int) -> None:
    started = time.monotonic()
    comm = graphar.init(max_bytes=4 * MB)
    first = time.monotonic() - started
    table = comm.kernels.tuned
    assert table is not None and table.source == "tuned"
    tables = comm.all_gather(table.rows, "tuned rows")
    assert all(t == tables[0] for t in tables), tables
    assert comm.kernels.policy.tuned_rows == table.rows
    for nbytes in (1 * KB, 48 * KB, 256 * KB + 16, 4 * MB):  # whatever the table picked serves them exactly
        check_exact(comm, integer_valued(nbytes // 2, torch.bfloat16), None)
    graphar.shutdown()

    started = time.monotonic()
    again = graphar.init(max_bytes=4 * MB)
    second = time.monotonic() - started
    assert again.kernels.tuned.source == "cache" and again.kernels.tuned.rows == table.rows
    if rank == 0:
        print(f"\nws {world_size}: set-up with tuning {first:.2f} s, from the cache {second:.2f} s")
        print("\n".join(table.describe()))
    graphar.shutdown()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_tuner_measures_agrees_and_caches(world_size: int, tmp_path) -> None:
    run_workers(_tunes_agrees_and_caches, world_size, env={"GRAPHAR_TUNE": "1", "GRAPHAR_CACHE_DIR": str(tmp_path)})


def _a_row_s_bits(rank: int, world_size: int) -> None:
    comm = graphar.init(max_bytes=4 * MB)
    hidden = 4096
    batch = torch.randn(16, hidden, device="cuda", dtype=torch.bfloat16)  # fresh random, never integers here
    alone = {}
    for algo in tuner.GRAPHAR_CANDIDATES:
        for rows in (1, 3, 16):  # the row's sum must not depend on the batch it came in
            out = comm.all_reduce(batch[:rows].contiguous(), algo=algo)
            if comm.kernels.policy.pick(out.nbytes, "eager", algo) is None:
                continue
            alone.setdefault(0, out[0].clone())
            assert torch.equal(out[0].view(torch.int16), alone[0].view(torch.int16)), (algo, rows)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = comm.all_reduce(batch, algo=algo)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed[0].view(torch.int16), alone[0].view(torch.int16)), (algo, "replayed")
    assert_equal_across_ranks(alone[0], "row 0")
    dist.barrier()
    comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_row_s_bits_do_not_depend_on_kernel_batch_or_replay(world_size: int) -> None:
    run_workers(_a_row_s_bits, world_size)
