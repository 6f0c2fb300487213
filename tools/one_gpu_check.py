"""Correctness of graphar's IPC paths with several processes sharing ONE GPU (a harness, not a test).

When only single-GPU machines are lent, this still runs the real kernels, launches, barriers and
graph registration end to end: 2, 4, 6 or 8 processes on cuda:0 (so the kernels of every world size
graphar supports run, not only the 2 of the lent pair), a gloo group for the references, and a
graphar communicator whose set-up checks are relaxed for this harness alone (NCCL refuses two ranks
on one GPU, and graphar.init refuses a shared GPU because it would be slow, not wrong: the GPU
time-slices the processes' kernels, so every barrier costs milliseconds). It says nothing about
speed. Usage, from the checkout: PYTHONPATH=. python tools/one_gpu_check.py [--world N]
(exit code 0: every check passed)
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import testing_library
import torch
import torch.distributed as dist
from one_gpu_common import (
    ALGOS,
    KB,
    MB,
    assert_ranks_equal,
    integers,
    new_pair,
    reference_sum,
    relax_set_up,
    world_size,
)
from one_gpu_compiled import (
    check_compiled,
    check_compiled_attention,
    check_compiled_fused_norm,
    check_compiled_on_fresh_pairs,
)


def _init_relaxed():
    from graphar.allreduce import set_up

    relax_set_up()  # gloo groups set up at their first call too, here
    comm = set_up.init(max_bytes=8 * MB, timeout_s=30)
    assert comm is not None, "graphar.init set up no communicator"
    return comm


def check_all_reduce(comm, rank: int) -> None:
    from graphar.allreduce import policy

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for nbytes in (16, 48, 64 * KB + 16, MB, 8 * MB):
            for algo in ALGOS:
                if comm.kernels.policy.pick(nbytes, policy.EAGER, algo) is None:
                    continue  # over this kernel's limit at this world size (the push one-shot's shrinks with it)
                x = integers(nbytes // dtype.itemsize, dtype, seed=rank * 1000 + nbytes)
                y = comm.all_reduce(x, algo=algo)
                assert torch.equal(y, reference_sum(x)), f"all_reduce {dtype} {nbytes} B {algo}"
        # Every kernel sums in rank order, so they round alike: from 3 ranks up another order would differ.
        nbytes = 64 * KB + 48  # shards of unequal length
        x = torch.randn(nbytes // dtype.itemsize, generator=torch.Generator().manual_seed(rank)).to(dtype).cuda()
        sums = {
            algo: comm.all_reduce(x, algo=algo)
            for algo in ALGOS
            if comm.kernels.policy.pick(nbytes, policy.EAGER, algo)
        }
        first, *others = sums
        for algo in others:
            assert torch.equal(sums[algo], sums[first]), f"all_reduce {dtype}: {algo} rounds unlike {first}"
        assert_ranks_equal(sums[first], f"all_reduce {dtype} {first}")


def check_native_op(comm, rank: int) -> None:
    """graphar::all_reduce's C++ kernel serves eager calls exactly; strided inputs and captures go to
    the Python kernel; the eager choice follows a changed policy."""
    import graphar
    from graphar.allreduce import native_op

    assert native_op.library() is not None, "the op library was not built (see the log)"
    op, name = torch.ops.graphar.all_reduce, dist.group.WORLD.group_name
    for algo in (None, *ALGOS):
        comm.kernels.policy = comm.kernels.policy.forcing(algo)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for nbytes in (16, 64 * KB + 16, MB):
                x = integers(nbytes // dtype.itemsize, dtype, seed=rank * 7 + nbytes)
                before = comm.native_calls()
                y = op(x, name)
                assert comm.native_calls() == before + 1, f"C++ kernel skipped {dtype} {nbytes} B {algo}"
                assert torch.equal(y, reference_sum(x)), f"C++ kernel {dtype} {nbytes} B {algo}"
    comm.kernels.policy = comm.kernels.policy.forcing(None)
    x = integers(64 * 64, torch.bfloat16, seed=rank).view(64, 64)
    before, calls = comm.native_calls(), comm.kernels.calls
    assert torch.equal(op(x.t(), name), reference_sum(x.t().contiguous())), "strided input"
    misaligned = integers(64 * 64 + 1, torch.bfloat16, seed=rank)[1:]  # contiguous, 2 bytes off
    assert torch.equal(op(misaligned, name), reference_sum(misaligned)), "misaligned input"
    for capture in (torch.cuda.graph, graphar.graph):
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            y = op(x, name)
        x.copy_(integers(64 * 64, torch.bfloat16, seed=rank + 9).view(64, 64))
        y.fill_(float("nan"))
        graph.replay()
        assert torch.equal(y, reference_sum(x)), f"{capture.__name__} replay"
    assert comm.native_calls() == before and comm.kernels.calls == calls + 4, "the Python kernel's calls"
    # The fused norm's C++ kernel: the same kernel as the Python one's, in and out of a capture; a
    # strided input goes to Python, which copies it and fuses too.
    x = integers(8 * 4096, torch.bfloat16, seed=rank).view(8, 4096)
    residual, weight = integers(8 * 4096, torch.bfloat16, seed=3).view(8, 4096), torch.full_like(x[0], 1.5)
    want = comm.kernels.try_all_reduce_norm(x, residual, weight, 1e-6, False)
    norm_op = torch.ops.graphar.all_reduce_add_rms_norm
    before = comm.native_calls()
    got = norm_op(x, residual, weight, 1e-6, name)
    assert comm.native_calls() == before + 1 and all(map(torch.equal, got, want)), "fused norm's C++ kernel"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = norm_op(x, residual, weight, 1e-6, name)
    got[0].fill_(float("nan"))
    graph.replay()
    assert comm.native_calls() == before + 2 and all(map(torch.equal, got, want)), "captured fused norm"
    strided = norm_op(x.t().contiguous().t(), residual, weight, 1e-6, name)
    assert comm.native_calls() == before + 2 and all(map(torch.equal, strided, want)), "strided fused norm"


def check_special_values(comm, rank: int) -> None:
    """-0.0, Inf and NaNs (the push kernels' empty-slot pattern among them) sum as in PyTorch,
    NaN payloads aside; the ranks agree bitwise."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    for dtype, ints in bits.items():
        width = torch.iinfo(ints).bits
        pool = torch.cat(
            [
                torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), 3.0], dtype=dtype),
                torch.tensor([-1, (1 << (width - 1)) - 1], dtype=ints).view(dtype),
            ]
        )
        gen = torch.Generator().manual_seed(rank)
        x = pool[torch.randint(len(pool), (4096,), generator=gen)]
        x[:1000] = -0.0
        for algo in ALGOS:
            y = comm.all_reduce(x.cuda(), algo=algo).cpu()
            ref = x.float()
            dist.all_reduce(ref)
            ref = ref.to(dtype)
            nan = torch.isnan(ref)
            assert torch.equal(torch.isnan(y), nan) and torch.equal(y.view(ints)[~nan], ref.view(ints)[~nan]), algo
            assert_ranks_equal(y, algo)


def check_fused_norm(comm, rank: int) -> None:
    """The fused all-reduce + residual add + RMSNorm: the sum exact, the norm within one ulp of the
    unfused ops, the ranks bitwise equal."""
    from graphar.ops import unfused_add_rms_norm

    for dtype, hidden, rows in ((torch.bfloat16, 4096, 8), (torch.float32, 1024, 3), (torch.float16, 5120, 1)):
        x = integers(rows * hidden, dtype, seed=rank).view(rows, hidden)
        residual = integers(rows * hidden, dtype, seed=77).view(rows, hidden)
        weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(5)) + 0.5).to(dtype).cuda()
        for weight_first in (False, True):
            fused = comm.kernels.try_all_reduce_norm(x, residual, weight, 1e-6, weight_first)
            assert fused is not None, f"fused norm refused {dtype} {rows}x{hidden}"
            want_normed, want_summed = unfused_add_rms_norm(reference_sum(x), residual, weight, 1e-6, weight_first)
            assert torch.equal(fused[1], want_summed), f"fused norm: sum + residual {dtype}"
            err = ((fused[0].float() - want_normed.float()).abs() / want_normed.float().abs().clamp_min(1e-3)).max()
            assert err <= {torch.float32: 2**-20, torch.float16: 2**-9, torch.bfloat16: 2**-6}[dtype], f"{dtype}: {err}"
            assert_ranks_equal(fused[0].float().cpu(), "fused norm")  # exact, and a dtype gloo gathers


def check_overlap(comm, rank: int) -> None:
    """The pipelined Ulysses attention equals the unchunked path bit for bit, eager and captured."""
    import contextlib
    import itertools

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphar import ulysses
    from graphar.ulysses import transport

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)

    def unchunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        """The exchanges and attention apart, on the graph's kernel (the efficient one takes GQA's
        K/V heads repeated, as HF's repeat_kv feeds it)."""
        qh, kh, vh = (x.transpose(1, 2) for x in ulysses.seq_to_heads(q, k, v, name))
        gqa = kernel != "efficient"
        if not gqa:
            r = q.shape[2] // k.shape[2]
            kh, vh = kh.repeat_interleave(r, dim=1), vh.repeat_interleave(r, dim=1)
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
        with sdpa_kernel(backends[kernel]) if kernel else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa).transpose(1, 2)
        return ulysses.heads_to_seq(o, name)

    heads = (4 * world_size(), 2 * world_size(), 2 * world_size())  # GQA, and two chunks of whole groups
    for b in (1, 2):  # b > 1: the output exchange's rows span batch rows of the chunk's run of heads
        q, k, v = (torch.randn(b, 64, h, 64, generator=gen).to(torch.bfloat16).cuda() for h in heads)
        for push in (False, True):  # both ranks alike, as GRAPHAR_ALLTOALL_ALGO would set it
            transport.of(comm).push = push
            for chunks, kernel in itertools.product((1, 2), (None, "flash", "efficient")):
                got = torch.ops.graphar.ulysses_attention(q, k, v, name, True, None, chunks, kernel)
                assert torch.equal(got, unchunked(q, k, v, kernel)), f"b={b} push={push} chunks={chunks} {kernel}"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # the efficient kernel chunks at any size (flash, large problems only)
                out = torch.ops.graphar.ulysses_attention(q, k, v, name, True, None, 2, "efficient")
            q.copy_(torch.randn_like(q))
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, unchunked(q, k, v, "efficient")), f"captured pipelined attention, b={b} push={push}"
    # Flash pipelines only problems it attends whole chunk by chunk (the ones above it does not chunk).
    q, k, v = (torch.randn(1, 8192, h, 64, generator=gen).to(torch.bfloat16).cuda() for h in heads)
    got = torch.ops.graphar.ulysses_attention(q, k, v, name, True, None, 2, "flash")
    assert torch.equal(got, unchunked(q, k, v, "flash")), "flash, chunked"
    transport.of(comm).push = False


def check_graphs(comm, rank: int) -> None:
    import graphar

    cases = [(capture, algo, False) for capture in (graphar.graph, torch.cuda.graph) for algo in (None, "push-oneshot")]
    for capture, algo, inference in cases + [(graphar.graph, None, True)]:  # serving loops run in inference_mode
        with torch.inference_mode(inference):
            _check_graph(comm, rank, capture, algo)


def _check_graph(comm, rank: int, capture, algo: str | None) -> None:
    """Two all-reduces captured (the input changed between them), replayed on fresh inputs; the
    graph's registrations and slots handed back when it is freed."""
    import graphar

    x = integers(32 * KB, torch.bfloat16, seed=rank)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    before = comm.kernels.graph_calls
    with capture(graph):
        y = comm.all_reduce(x, algo=algo)
        x.mul_(-1)
        z = comm.all_reduce(x, algo="push-twoshot" if algo else None)
    graph.instantiate()
    assert comm.kernels.graph_calls - before == (2 if capture is graphar.graph and algo is None else 0)
    held = comm.kernels.slots_in_use
    if algo is not None:
        total, programmatic = testing_library.graph_edges(graph)
        assert programmatic >= 1, f"no programmatic edge among {total}"
    for i in range(3):
        values = integers(32 * KB, torch.bfloat16, seed=100 + i + rank)
        x.copy_(values)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, reference_sum(values)), f"{capture.__name__} replay {i}: first"
        assert torch.equal(z, reference_sum(-values)), f"{capture.__name__} replay {i}: second"
    del graph
    gc.collect()  # a freed graph hands its slots back; the next capture takes them
    assert comm.kernels.slots_in_use == held - (2 if capture is graphar.graph and algo is None else 0)


def check_ulysses(comm, rank: int) -> None:
    """Both exchanges against gloo's, pulled and pushed, in one stage and pipelined over several,
    eager and replayed from a torch.cuda.graph capture."""
    from unittest import mock

    from graphar import ulysses
    from graphar.ulysses import stages, transport
    from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked

    group, world = dist.group.WORLD, world_size()
    default = stages._STAGE_BYTES
    for push, stage_bytes in ((False, default), (True, default), (True, 4 * KB)):
        transport.of(comm).push = push  # both ranks alike, as the setting would be
        with mock.patch.object(stages, "_STAGE_BYTES", stage_bytes):
            for b, s, h, hkv, d in ((1, 64, 2 * world, world, 64), (2, 48, 2 * world, 2 * world, 32)):
                q, k, v = (
                    integers(b * s * n * d, torch.bfloat16, seed=10 * rank + i).view(b, s, n, d)
                    for i, n in enumerate((h, hkv, hkv))
                )
                want = [seq_to_heads_unpacked(t.cpu(), group).cuda() for t in (q, k, v)]
                got = ulysses.seq_to_heads(q, k, v, group.group_name)
                what = f"push={push} stage={stage_bytes} b={b} s={s}"
                assert all(torch.equal(g, w) for g, w in zip(got, want)), f"qkv exchange {what}"
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = ulysses.seq_to_heads(q, k, v, group.group_name)
                for t in captured:
                    t.fill_(float("nan"))
                graph.replay()
                assert all(torch.equal(g, w) for g, w in zip(captured, want)), f"captured qkv exchange {what}"
                shape = (b, world * s, h // world, d)
                o = integers(math.prod(shape), torch.bfloat16, seed=rank).view(shape)
                got = ulysses.heads_to_seq(o, group.group_name)
                assert torch.equal(got, heads_to_seq_unpacked(o.cpu(), group).cuda()), f"output exchange {what}"
    transport.of(comm).push = False
    assert transport.of(comm).capacity > 0, "the exchanges did not take the IPC transport"


def check_pairs(comm, rank: int) -> None:
    """Groups of two ranks beside the world's communicator, as a 2-D mesh's tensor-parallel rows
    have, never given graphar.init: each pair's first all-reduce (or, in a second set of pairs, its
    first Q/K/V exchange) sets its communicator up; each sums its own ranks, interleaved with the
    world's calls."""
    from graphar import ulysses
    from graphar.allreduce import registry
    from graphar.ulysses import transport
    from graphar.ulysses.unpacked import seq_to_heads_unpacked

    pair, other = new_pair(), new_pair()
    op = torch.ops.graphar.all_reduce
    try:
        assert registry.communicator(pair.group_name) is None and registry.communicator(other.group_name) is None
        for i, nbytes in enumerate((16, 64 * KB + 16, MB)):
            x = integers(nbytes // 2, torch.bfloat16, seed=rank * 31 + i)
            pair_sum, world_sum = op(x, pair.group_name), op(x, dist.group.WORLD.group_name)
            ref = x.float().cpu()
            dist.all_reduce(ref, group=pair)
            assert torch.equal(pair_sum, ref.to(x.dtype).cuda()), f"pair all-reduce {nbytes} B"
            assert torch.equal(world_sum, reference_sum(x)), f"world all-reduce beside the pairs, {nbytes} B"
        assert registry.communicator(pair.group_name) is not None, "the pair's first all-reduce did not set it up"
        q, k, v = (integers(64 * 4 * 32, torch.bfloat16, seed=rank + i).view(1, 64, 4, 32) for i in range(3))
        got = ulysses.seq_to_heads(q, k, v, other.group_name)
        want = [seq_to_heads_unpacked(t.cpu(), other).cuda() for t in (q, k, v)]
        assert all(map(torch.equal, got, want)), "the pair's first Q/K/V exchange"
        assert transport.of(registry.communicator(other.group_name)).capacity > 0, "that exchange did not go over IPC"
    finally:
        for group in (pair, other):
            if registry.communicator(group.group_name) is not None:
                registry.communicator(group.group_name).close()


def _worker(rank: int, world: int) -> None:
    import graphar  # noqa: F401

    comm = _init_relaxed()
    try:
        checks = (
            check_all_reduce,
            check_native_op,
            check_compiled,
            check_special_values,
            check_fused_norm,
            check_compiled_fused_norm,
            check_graphs,
            check_ulysses,
            check_overlap,
            check_compiled_attention,
            check_pairs,
            check_compiled_on_fresh_pairs,
        )
        for check in checks:
            start = time.perf_counter()
            check(comm, rank)
            torch.cuda.synchronize()
            if rank == 0:
                print(f"ok: {check.__name__} (world {world}, {time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        comm.close()


def main() -> int:
    from graphar import processes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, choices=(2, 4, 6, 8), help="processes (ranks) on the GPU")
    world = parser.parse_args().world
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    processes.start(_worker, world, group=processes.gpu_group(True, collective_timeout_s=300)).wait()
    print(f"one-GPU check, world size {world}: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
