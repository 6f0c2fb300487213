"""End to end: a TP block compiled with backend="graphar" under Inductor's CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import WORLD_SIZES, integer_valued, run_workers
from torch._dynamo.utils import counters

import graphar
from graphar.allreduce.registry import communicator

pytestmark = pytest.mark.gpu

HIDDEN, FFN = 256, 512


def _reduce_overhead(rank: int, world_size: int, explicit_init: bool) -> None:
    if explicit_init:
        graphar.init()  # else the compiled step's first (warm-up) call sets the group up
    # Integer-valued fp32 weights and inputs: every sum is exact, so compiled must equal eager.
    w1 = integer_valued(HIDDEN * FFN, torch.float32, -2, 2).view(HIDDEN, FFN)
    w2 = integer_valued(FFN * HIDDEN, torch.float32, -2, 2).view(FFN, HIDDEN)

    def block(x: torch.Tensor) -> torch.Tensor:  # column- then row-parallel, one all-reduce
        y = torch.relu(x @ w1) @ w2
        dist.all_reduce(y)
        return y + x

    try:
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(block, backend="graphar", mode="reduce-overhead")
        calls = []  # the custom kernels' calls after each step
        for step in range(6):  # warm-up, recording, then replays
            x = integer_valued(8 * HIDDEN, torch.float32, -2, 2).view(8, HIDDEN)
            out = compiled(x).clone()
            assert torch.equal(out, block(x)), f"step {step}"
            comm = communicator(dist.group.WORLD.group_name)
            calls.append(comm.kernels.calls if comm is not None else 0)
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert calls[1] > calls[0] >= 1, f"the recorded graph's all-reduce is not graphar's: {calls}"
    finally:
        graphar.shutdown()


@pytest.mark.parametrize("explicit_init", [True, False], ids=["graphar.init", "set up at the first call"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_overhead_has_no_cudagraph_skip_and_equals_eager(world_size: int, explicit_init: bool) -> None:
    run_workers(_reduce_overhead, world_size, explicit_init, env={"GRAPHAR_AUTO_INIT": "1"})


def _dynamic_and_strided(rank: int, world_size: int) -> None:
    comm = graphar.init()
    w = integer_valued(HIDDEN * HIDDEN, torch.float32, -2, 2).view(HIDDEN, HIDDEN)

    def block(x: torch.Tensor) -> torch.Tensor:
        y = x @ w
        dist.all_reduce(y)
        return torch.relu(y)

    def einsum(x: torch.Tensor) -> torch.Tensor:  # a permuted, non-contiguous all-reduce input
        y = torch.einsum("bsh,hd->bds", x, w)
        dist.all_reduce(y)
        return y

    def transposed(x: torch.Tensor) -> torch.Tensor:
        return dist._functional_collectives.all_reduce((x[0] @ w).t(), "sum", dist.group.WORLD) + 1

    def reference(fn, x: torch.Tensor) -> torch.Tensor:  # eager NCCL refuses non-contiguous tensors
        y = torch.einsum("bsh,hd->bds", x, w) if fn is einsum else (x[0] @ w).t()
        y = y.contiguous()
        dist.all_reduce(y)
        return y if fn is einsum else y + 1

    def served(fn, *args) -> tuple[torch.Tensor, int]:  # fn's result, and the calls the custom kernels served
        before = comm.kernels.calls
        out = fn(*args)
        return out, comm.kernels.calls - before

    try:
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="graphar")  # default: dynamic from the second shape
        for b in (1, 2, 3, 4, 8, 5):
            x = integer_valued(b * HIDDEN, torch.float32, -2, 2).view(b, HIDDEN)
            out, calls = served(compiled, x)
            assert torch.equal(out, block(x)) and calls == 1, f"batch {b}: {calls} calls served"
        for fn in (einsum, transposed):
            torch._dynamo.reset()
            x = integer_valued(2 * 4 * HIDDEN, torch.float32, -2, 2).view(2, 4, HIDDEN)
            out, calls = served(torch.compile(fn, backend="graphar", fullgraph=True), x)
            assert torch.equal(out, reference(fn, x)) and calls == 1, f"{fn.__name__}: {calls} calls served"
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dynamic_shapes_and_strided_inputs_stay_on_the_custom_kernels(world_size: int) -> None:
    run_workers(_dynamic_and_strided, world_size)
