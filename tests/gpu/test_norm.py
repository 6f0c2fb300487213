"""The fused all-reduce + residual add + RMSNorm kernel on real GPUs: against the unfused ops (the
sum and the residual exact, the norm within a stated bound), ranks bitwise equal, three capture modes;
the kernel's local work alone on one GPU (its loopback launch), whatever its grid; and the op's
fallback where no fused kernel serves (graphar's all-reduce, then one Triton norm kernel), held to the
same bound, eager and captured."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from _dist import WORLD_SIZES, assert_equal_across_ranks, integer_valued, nccl_sum, run_workers

import graphar
from graphar.allreduce import rms_norm
from graphar.ops import add_rms_norm_dtypes, unfused_add_rms_norm
from tests._norm import assert_close_to

pytestmark = pytest.mark.gpu

EPS = 1e-6


def _reference(x, residual, weight, weight_first):
    summed = x.clone()
    dist.all_reduce(summed)
    return unfused_add_rms_norm(summed, residual, weight, EPS, weight_first)


def _fused_against_unfused(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        worst = 0.0
        cases = itertools.product(
            (torch.float32, torch.float16, torch.bfloat16),
            (8, 4096, 5120, 16384),
            (1, 8, 37),
            (True, False),
            (True, False),
            (True, False),
        )
        for dtype, hidden, rows, with_residual, with_weight, weight_first in cases:
            if hidden * dtype.itemsize * rows > comm.kernels.policy.fused_norm_max:
                continue
            x = integer_valued(rows * hidden, dtype, -3, 3).view(rows, hidden)
            residual = integer_valued(rows * hidden, dtype).view(rows, hidden) if with_residual else None
            weight = (torch.rand(hidden, device="cuda") + 0.5).to(dtype) if with_weight else None
            for replicated in (residual, weight):  # the residual stream and the weight are equal on every rank
                if replicated is not None:
                    dist.broadcast(replicated, 0)
            what = f"{dtype} {rows}x{hidden} residual={with_residual} weight={with_weight} first={weight_first}"
            torch.full((2 * x.numel(),), float("nan"), device="cuda", dtype=dtype)  # poison what the outputs get
            fused = comm.kernels.try_all_reduce_norm(x, residual, weight, EPS, weight_first)
            assert fused is not None, f"{what}: the fused kernel refused"
            normed, summed = fused
            want_normed, want_summed = _reference(x, residual, weight, weight_first)
            assert torch.equal(summed, want_summed), f"{what}: sum + residual differs"
            worst = max(worst, assert_close_to(normed, want_normed, what))
            assert_equal_across_ranks(torch.cat([normed.flatten(), summed.flatten()]), what)
            before = comm.native_calls()  # the op's C++ kernel: the same kernel, the same bits
            op = torch.ops.graphar.all_reduce_add_rms_norm(x, residual, weight, EPS, comm.group_name, weight_first)
            assert comm.native_calls() == before + 1, f"{what}: the C++ kernel did not serve the op"
            assert torch.equal(op[0], normed) and torch.equal(op[1], summed), f"{what}: the op's C++ kernel differs"
        if rank == 0:
            print(f"fused norm: worst relative error against unfused {worst:.3g}")
        # Shapes the kernel cannot take fall back to the all-reduce and the norm apart through the op.
        x = integer_valued(3 * 12, torch.bfloat16).view(3, 12)  # 24-byte rows
        assert comm.kernels.try_all_reduce_norm(x, None, None, EPS, False) is None
        got = torch.ops.graphar.all_reduce_add_rms_norm(x, None, None, EPS, comm.group_name)
        want = _reference(x, None, None, False)
        assert torch.equal(got[1], want[1]), "fallback: the sum differs"
        assert_close_to(got[0], want[0], "fallback")
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fused_norm_against_unfused(world_size: int) -> None:
    run_workers(_fused_against_unfused, world_size)


def _fallback_against_unfused(rank: int, world_size: int) -> None:
    """GRAPHAR_ALLREDUCE_ALGO=1stage forces a kernel with no fused form: the op runs graphar's all-reduce,
    then the fallback's Triton norm (graphar.allreduce.rms_norm), eagerly and inside a CUDA graph."""
    comm = graphar.init()
    try:
        assert comm.kernels.policy.fused_norm_max == 0, "1stage forced: no fused norm"
        cases = [
            *itertools.product(
                (torch.float32, torch.float16, torch.bfloat16), (4104,), (1, 37), (True, False), (None, False, True)
            ),  # weight: none, after the cast back (HF), before it
            (torch.bfloat16, rms_norm.MAX_HIDDEN, 3, True, False),
        ]
        for dtype, hidden, rows, with_residual, weight_first in cases:
            x = integer_valued(rows * hidden, dtype, -3, 3).view(rows, hidden)
            residual = integer_valued(rows * hidden, dtype).view(rows, hidden) if with_residual else None
            weight = None if weight_first is None else (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
            for replicated in (residual, weight):  # the residual stream and the weight are equal on every rank
                if replicated is not None:
                    dist.broadcast(replicated, 0)
            first = bool(weight_first)
            what = f"{dtype} {rows}x{hidden} residual={with_residual} weight={weight is not None} first={first}"
            calls = comm.kernels.calls
            normed, summed = torch.ops.graphar.all_reduce_add_rms_norm(x, residual, weight, EPS, comm.group_name, first)
            assert comm.kernels.calls == calls + 1, f"{what}: graphar's all-reduce did not serve the fallback"
            want_normed, want_summed = _reference(x, residual, weight, first)
            assert torch.equal(summed, want_summed), f"{what}: sum + residual differs"
            assert_close_to(normed, want_normed, what)
            # The Triton kernel normalised it: its own bits from the same sum (an exact one: integers).
            dtypes = add_rms_norm_dtypes(x, residual, weight, first)
            kernel = rms_norm.add_rms_norm(nccl_sum(x), rms_norm.Norm(residual, weight, EPS, first), dtypes)
            assert kernel is not None and torch.equal(normed, kernel[0]), f"{what}: not the Triton kernel's result"
            assert_equal_across_ranks(torch.cat([normed.flatten(), summed.flatten()]), what)
        # Captured (as reduce-overhead captures it): no sync, no compile (these shapes' kernel ran above).
        x = integer_valued(8 * 4104, torch.bfloat16, -2, 2).view(8, 4104)
        residual = integer_valued(x.numel(), x.dtype).view_as(x)
        weight = (torch.rand(4104, device="cuda") + 0.5).to(x.dtype)
        for replicated in (residual, weight):
            dist.broadcast(replicated, 0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            normed, summed = torch.ops.graphar.all_reduce_add_rms_norm(x, residual, weight, EPS, comm.group_name)
        for _ in range(3):
            x.copy_(integer_valued(x.numel(), x.dtype, -2, 2).view_as(x))
            normed.fill_(float("nan"))
            graph.replay()
            want_normed, want_summed = _reference(x, residual, weight, False)
            assert torch.equal(summed, want_summed), "captured fallback: sum + residual differs"
            assert_close_to(normed, want_normed, "captured fallback")
            assert_equal_across_ranks(normed, "captured fallback")
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fallback_norm_against_unfused(world_size: int) -> None:
    run_workers(_fallback_against_unfused, world_size, env={"GRAPHAR_ALLREDUCE_ALGO": "1stage"})


class _HfBlock(torch.nn.Module):
    """Row-parallel output projection, the residual add and HF's LlamaRMSNorm, as HF writes them."""

    def __init__(self, rank: int, hidden: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(rank)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
        self.proj.weight.data = torch.randn(hidden, hidden, generator=gen).div(hidden**0.5).to(torch.bfloat16)
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16) * 1.5)
        self.variance_epsilon = EPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.proj(x)
        dist.all_reduce(y)
        hidden_states = y + residual
        input_dtype = hidden_states.dtype
        v = hidden_states.to(torch.float32)
        variance = v.pow(2).mean(-1, keepdim=True)
        v = v * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * v.to(input_dtype), hidden_states


def _capture_modes(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        hidden = 4096
        x = integer_valued(8 * hidden, torch.bfloat16, -2, 2).view(8, hidden)
        residual = integer_valued(8 * hidden, torch.bfloat16).view(8, hidden)
        dist.broadcast(residual, 0)
        weight = torch.full((hidden,), 1.5, device="cuda", dtype=torch.bfloat16)
        for capture in (torch.cuda.graph, graphar.graph):
            graph = torch.cuda.CUDAGraph()
            with capture(graph):
                normed, summed = torch.ops.graphar.all_reduce_add_rms_norm(x, residual, weight, EPS, comm.group_name)
            for _ in range(3):
                x.copy_(integer_valued(x.numel(), x.dtype, -2, 2).view_as(x))
                normed.fill_(float("nan"))
                graph.replay()
                want_normed, want_summed = _reference(x, residual, weight, False)
                assert torch.equal(summed, want_summed), capture.__name__
                assert_close_to(normed, want_normed, capture.__name__)
        block = _HfBlock(rank, 1024).cuda()
        # torch.compile takes mode= or options=, not both: graphar reads the mode from its options.
        compiled = torch.compile(block, backend="graphar", options={"mode": "reduce-overhead", "fuse_norm": True})
        calls = comm.kernels.calls
        with torch.no_grad():
            for _ in range(4):
                inp = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
                res = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
                dist.broadcast(res, 0)
                got = compiled(inp, res)
                want = block(inp, res)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
                assert_equal_across_ranks(got[0], "reduce-overhead fused block")
        assert comm.kernels.calls > calls
        assert torch._dynamo.utils.counters["graphar"]["all_reduce_add_rms_norm"] >= 1, "no fusion in the graph"
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_fused_norm_in_three_capture_modes(world_size: int) -> None:
    run_workers(_capture_modes, world_size)


def test_fused_norm_kernel_alone_on_one_gpu() -> None:
    """The kernel's own work on one GPU, in this process (no peers): the loopback launch, a rank that is
    its own peer and sums its input twice (bench/norm_local.py). Every dtype; rows split
    between up to 16 blocks, between a few, or one block per row; rows whose last segment is short;
    residual and weight or none. The sum + residual exact, the normed rows within the bound; the same
    bits whatever the split and however many rows share the call (the mean square's tree depends on
    the row's size alone); a captured launch replays to the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from norm_local import Loopback

    loop = Loopback(8 << 20)
    try:
        cases = itertools.product(
            (torch.float32, torch.float16, torch.bfloat16),
            (8, 4096, 4104, 8192, 16384),
            (1, 2, 7, 64, 100),
            (True, False),
            (True, False),
        )
        for dtype, hidden, rows, with_residual, with_weight in cases:
            if hidden * dtype.itemsize > 65536 or rows * hidden * dtype.itemsize > 4 << 20:
                continue
            x = integer_valued(rows * hidden, dtype, -3, 3).view(rows, hidden)
            residual = integer_valued(rows * hidden, dtype).view(rows, hidden) if with_residual else None
            weight = (torch.rand(hidden, device="cuda") + 0.5).to(dtype) if with_weight else None
            weight_first = with_weight and rows % 2 == 1
            what = f"{dtype} {rows}x{hidden} residual={with_residual} weight={with_weight} first={weight_first}"
            outs, grids = [], []
            for max_split in (0, 3, 1):
                normed, summed = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
                grids.append(
                    loop(
                        x,
                        residual,
                        weight,
                        normed,
                        summed,
                        pdl=True,
                        max_split=max_split,
                        eps=EPS,
                        weight_first=weight_first,
                    )
                )
                outs.append((normed, summed))
            torch.cuda.synchronize()
            loop.check()
            want_normed, want_summed = unfused_add_rms_norm(x + x, residual, weight, EPS, weight_first)
            assert torch.equal(outs[0][1], want_summed), f"{what}: sum + residual differs"
            assert_close_to(outs[0][0], want_normed, what)
            for (normed, summed), grid in zip(outs[1:], grids[1:]):
                assert _same_bits(normed, outs[0][0]) and torch.equal(summed, outs[0][1]), f"{what}: grid {grid}"
            last = torch.full_like(x[-1:], float("nan")), torch.full_like(x[-1:], float("nan"))
            loop(
                x[-1:],
                None if residual is None else residual[-1:],
                weight,
                *last,
                pdl=False,
                eps=EPS,
                weight_first=weight_first,
            )
            torch.cuda.synchronize()
            assert _same_bits(last[0], outs[0][0][-1:]), f"{what}: the last row alone differs"
        x = integer_valued(32768, torch.bfloat16).view(1, 32768)  # the longest rows split most: 16 blocks
        blocks = loop(x, None, None, torch.empty_like(x), torch.empty_like(x), pdl=False)[0]
        assert blocks == min(16, loop.blocks), f"{blocks} blocks (a launch takes at most {loop.blocks})"
        x = integer_valued(4 * 4096, torch.bfloat16).view(4, 4096)
        normed, summed = torch.empty_like(x), torch.empty_like(x)
        loop(x, x, x[0], normed, summed, pdl=True)
        want = normed.clone(), summed.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(3):
                loop(x, x, x[0], normed, summed, pdl=True)
        for _ in range(3):
            normed.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert _same_bits(normed, want[0]) and torch.equal(summed, want[1]), "a replay differs"
        loop.check()
    finally:
        loop.close()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
