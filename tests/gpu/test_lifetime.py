"""Nothing grows with re-captures: device memory, the peers' mappings and the graph slots after 200
capture/discard cycles equal what one cycle left (docs/design.md, decision 13).

Each cycle captures on fresh inputs, replays, frees the graph and empties torch's cache, as a serving
process does when it re-captures for new shapes, a LoRA swap or a rebuilt BatchGraphs. Every mode's
figures are printed (pytest -s shows them); growth must stay within 1 MB and 0 mappings.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest
import testing_library
import torch
import torch.distributed as dist
from _dist import SHARED_GPU, integer_valued, nccl_sum, run_workers
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce

import graphar
from graphar.allreduce.communicator import Communicator

pytestmark = pytest.mark.gpu

MB = 1 << 20
CYCLES = 200
# A compile per cycle: on a shared GPU, where the ranks also take turns at every barrier, fewer
# unless GRAPHAR_TEST_COMPILED_CYCLES asks for more (with a deadline to match, see _dist.py).
COMPILED_CYCLES = int(os.environ.get("GRAPHAR_TEST_COMPILED_CYCLES", 20 if SHARED_GPU else CYCLES))
MODES = ("graphar.graph", "torch.cuda.graph", "reduce-overhead", "BatchGraphs")


def _two_all_reduces(comm: Communicator) -> Callable[[torch.Tensor], torch.Tensor]:
    """1stage: the kernel that reads its inputs in place through graph slots (graphar.graph)."""
    return lambda x: comm.all_reduce(comm.all_reduce(x, algo="1stage") * 2, algo="1stage")


def _graph_cycle(comm: Communicator, capture: Callable[[torch.cuda.CUDAGraph], object]) -> None:
    x = integer_valued(64 * 1024, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        y = _two_all_reduces(comm)(x)
    for _ in range(3):
        graph.replay()
    assert torch.equal(y, nccl_sum(nccl_sum(x) * 2)), "a replay differs from NCCL"


def _compiled_cycle(comm: Communicator, cycle: int) -> None:
    torch._dynamo.reset()
    step = torch.compile(
        lambda x: functional_all_reduce(x * 2, "sum", comm.group_name) + 1, backend="graphar", mode="reduce-overhead"
    )
    x = integer_valued(4096 + 16 * (cycle % 7), torch.float32)  # a new shape now and then
    for _ in range(4):  # warm-up, record, replays
        y = step(x)
    assert torch.equal(y, nccl_sum(x * 2) + 1), "a compiled replay differs from NCCL"


def _batch_graphs_cycle(comm: Communicator) -> None:
    graphs = graphar.BatchGraphs(
        _two_all_reduces(comm), lambda b: (integer_valued(b * 1024, torch.float32).view(b, -1),), [1, 4], warmup=1
    )
    x = integer_valued(3 * 1024, torch.float32).view(3, -1)
    assert torch.equal(graphs(x), nccl_sum(nccl_sum(x) * 2)), "a BatchGraphs replay differs from NCCL"


def _state(comm: Communicator) -> tuple[float, int, int]:
    """(device memory in use in MB, peers' mappings open or waiting to close, graph slots held), after
    every rank let its graphs go."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / MB, sum(testing_library.graph_mappings(comm)), comm.kernels.slots_in_use


def _cycles(rank: int, world_size: int, mode: str) -> None:
    comm = graphar.init()
    cycle: Callable[[int], None] = {
        "graphar.graph": lambda i: _graph_cycle(comm, graphar.graph),
        "torch.cuda.graph": lambda i: _graph_cycle(comm, torch.cuda.graph),
        "reduce-overhead": lambda i: _compiled_cycle(comm, i),
        "BatchGraphs": lambda i: _batch_graphs_cycle(comm),
    }[mode]
    n = COMPILED_CYCLES if mode == "reduce-overhead" else CYCLES
    for i in range(2):  # warm-up: the cycle's own buffers, and one cycle of inputs held for the peers
        cycle(i)
    before = _state(comm)
    for i in range(n):
        cycle(i)
    after = _state(comm)
    grown = after[0] - before[0]
    print(
        f"rank {rank}, {mode}: {n} cycles: device memory {before[0]:.0f} -> {after[0]:.0f} MB ({grown:+.1f}), "
        f"peers' mappings {before[1]} -> {after[1]}, graph slots {before[2]} -> {after[2]}"
    )
    assert grown <= 1.0, f"{mode}: device memory grew by {grown:.1f} MB over {n} cycles"
    assert after[1:] == before[1:], f"{mode}: mappings or slots grew: {before[1:]} -> {after[1:]}"
    comm.close()


@pytest.mark.parametrize("mode", MODES)
def test_recaptures_grow_nothing(mode: str) -> None:
    # A compile takes up to about 2 s a cycle.
    run_workers(_cycles, 2, mode, timeout_s=max(300.0, 3.0 * COMPILED_CYCLES))


def _pool_reserved(rank: int, world_size: int) -> None:
    """BatchGraphs' sizes share one pool: graphar's zero-copy all-reduces must let the activations they
    read be reused like any other (by later ops of the capture and by the next size), so the pool
    holds what the same step with local ops holds."""
    comm = graphar.init()
    sizes, row = [64, 48, 32, 16, 8], 16384  # 64 KB a row in float32: 0.5 to 4 MB per activation

    def reduced(x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = comm.all_reduce(x * 1, algo="1stage")  # a fresh activation per layer, read in place
        return x

    def local(x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = (x * 1).add(0)  # the same allocations (a temporary, then the output), no collective
        return x

    held = {}
    for name, fn in (("local", local), ("graphar", reduced)):
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        graphs = graphar.BatchGraphs(
            fn, lambda b: (integer_valued(b * row, torch.float32).view(b, -1),), sizes, warmup=1
        )
        x = integer_valued(48 * row, torch.float32).view(48, -1)
        expected = x.clone()
        for _ in range(8):
            expected = nccl_sum(expected) if name == "graphar" else expected
        assert torch.equal(graphs(x), expected), f"{name}: a replay differs"
        held[name] = (torch.cuda.memory_reserved() - before) / MB
        del graphs
    print(
        f"rank {rank}: BatchGraphs over {sizes} rows hold {held['graphar']:.1f} MB with graphar's all-reduces, "
        f"{held['local']:.1f} MB with local ops"
    )
    # Holding each input instead would add 8 layers x 168 rows x 64 KB = 84 MB; one large segment is 20 MB.
    assert held["graphar"] <= held["local"] + 20.0, f"graphar's graphs hold more of their pool: {held}"
    comm.close()


def test_batch_graphs_reuse_their_activations() -> None:
    run_workers(_pool_reserved, 2)
