"""End to end: a TP block compiled with backend="graphar" under Inductor's CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import WORLD_SIZES, integer_valued, run_workers
from torch._dynamo.utils import counters

import graphar

pytestmark = pytest.mark.gpu

HIDDEN, FFN = 256, 512


def _reduce_overhead(rank: int, world_size: int) -> None:
    comm = graphar.init()
    served = []
    try_all_reduce = comm.try_all_reduce

    def counting(x: torch.Tensor, algo: str | None = None) -> torch.Tensor | None:
        out = try_all_reduce(x, algo)
        if out is not None:
            served.append(x.shape)
        return out

    comm.try_all_reduce = counting  # what graphar::all_reduce reaches when the pass rewrote the call
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
        for step in range(6):  # warm-up, recording, then replays
            x = integer_valued(8 * HIDDEN, torch.float32, -2, 2).view(8, HIDDEN)
            out = compiled(x).clone()
            assert torch.equal(out, block(x)), f"step {step}"
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert served, "the all-reduce never reached graphar's communicator"
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_overhead_has_no_cudagraph_skip_and_equals_eager(world_size: int) -> None:
    run_workers(_reduce_overhead, world_size)
