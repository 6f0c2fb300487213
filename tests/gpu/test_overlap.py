"""The pipelined Ulysses attention on real GPUs: bitwise the unchunked path on both transports, and
in the three capture modes."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import WORLD_SIZES, assert_equal_across_ranks, run_workers
from torch.nn.attention import SDPBackend, sdpa_kernel

import graphar
from graphar import ulysses
from graphar.ulysses.shapes import world_size
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked

pytestmark = pytest.mark.gpu


_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _unchunked(q, k, v, group_name, is_causal=False, scale=None, kernel=None):
    """The exchanges and attention apart; `kernel`: the graph's attention kernel (the efficient one
    takes GQA's K/V heads repeated, as HF's repeat_kv feeds it)."""
    p = world_size(group_name)
    qh, kh, vh = (x.transpose(1, 2) for x in ulysses.seq_to_heads(q, k, v, group_name))
    gqa = k.shape[2] != q.shape[2]
    if gqa and kernel == "efficient":
        r = q.shape[2] // k.shape[2]
        kh, vh, gqa = kh.repeat_interleave(r, dim=1), vh.repeat_interleave(r, dim=1), False
    with sdpa_kernel(_BACKENDS[kernel]) if kernel else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    assert o.shape[1] == q.shape[2] // p
    return ulysses.heads_to_seq(o.transpose(1, 2), group_name)


def _qkv(b, s, hq, hk, d=128, dtype=torch.bfloat16):
    return [torch.randn(b, s, h, d, device="cuda", dtype=dtype) for h in (hq, hk, hk)]


def _bitwise_on_both_transports(rank: int, world_size: int) -> None:
    nccl_group = dist.new_group(list(range(world_size)))  # no communicator: NCCL transport
    comm = graphar.init()
    try:
        for group_name in (comm.group_name, nccl_group.group_name):
            cases = itertools.product(
                (1, 2),
                ((8 * world_size, 8 * world_size), (8 * world_size, 2 * world_size)),
                (False, True),
                (2, 4),
                (None, "flash", "efficient"),
            )
            for b, (hq, hk), is_causal, chunks, kernel in cases:
                q, k, v = _qkv(b, 256, hq, hk)
                got = torch.ops.graphar.ulysses_attention(q, k, v, group_name, is_causal, None, chunks, kernel)
                want = _unchunked(q, k, v, group_name, is_causal, kernel=kernel)
                what = f"group {group_name} b={b} heads={hq}/{hk} causal={is_causal} chunks={chunks} kernel={kernel}"
                assert torch.equal(got, want), f"{what}: differs from the unchunked path"
            # Flash pipelines only problems it attends whole chunk by chunk: this one it does.
            q, k, v = _qkv(1, 4096, 8 * world_size, 2 * world_size)
            got = torch.ops.graphar.ulysses_attention(q, k, v, group_name, True, None, 2, "flash")
            assert torch.equal(got, _unchunked(q, k, v, group_name, True, kernel="flash")), f"group {group_name}: flash"
        assert_equal_across_ranks(torch.ones(1, device="cuda"), "done")
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bitwise_the_unchunked_path(world_size: int) -> None:
    run_workers(_bitwise_on_both_transports, world_size)


def _capture_modes(rank: int, world_size: int) -> None:
    comm = graphar.init()
    try:
        name = comm.group_name
        q, k, v = _qkv(1, 512, 4 * world_size, 2 * world_size)
        ulysses.reserve([t.shape for t in (q, k, v)], q.dtype, q.device, name)
        # The efficient kernel, which pipelines at any size (flash only problems it attends whole).
        torch.ops.graphar.ulysses_attention(q, k, v, name, True, None, 2, "efficient")  # warm-up outside the capture
        for capture in (torch.cuda.graph, graphar.graph):
            graph = torch.cuda.CUDAGraph()
            with capture(graph):
                out = torch.ops.graphar.ulysses_attention(q, k, v, name, True, None, 2, "efficient")
            for _ in range(3):
                for t in (q, k, v):
                    t.copy_(torch.randn_like(t))
                out.fill_(float("nan"))
                graph.replay()
                assert torch.equal(out, _unchunked(q, k, v, name, True, kernel="efficient")), capture.__name__
        _reduce_overhead(name, world_size)
    finally:
        comm.close()


class _Block(torch.nn.Module):
    """A DiT-style Ulysses attention, as yunchang writes the exchanges."""

    def __init__(self, heads: int, d: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)  # equal on every rank
        self.w = torch.nn.Parameter(
            (torch.randn(heads * d, 3 * heads * d, generator=gen) / (heads * d) ** 0.5).to(torch.bfloat16).cuda()
        )
        self.heads, self.d = heads, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.d) for t in (x @ self.w).chunk(3, dim=-1))
        qh, kh, vh = (seq_to_heads_unpacked(t).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)
        return heads_to_seq_unpacked(o.contiguous()).reshape(b, s, -1)


def _reduce_overhead(name: str, world_size: int) -> None:
    from torch._dynamo.utils import counters

    block = _Block(4 * world_size, 64)
    compiled = torch.compile(block, backend="graphar", options={"mode": "reduce-overhead", "attention_chunks": 2})
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 128, 4 * world_size * 64, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), block(x), rtol=2e-2, atol=2e-2)
    assert counters["graphar"]["ulysses_attention"] >= 1, dict(counters["graphar"])


@pytest.mark.parametrize("world_size", WORLD_SIZES[:1])
def test_three_capture_modes(world_size: int) -> None:
    run_workers(_capture_modes, world_size)
