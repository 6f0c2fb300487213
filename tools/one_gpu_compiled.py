"""The one-GPU harness's compiled checks (tools/one_gpu_check.py): steps compiled with
backend="graphar" as users write them, against gloo references."""

from __future__ import annotations

import torch
import torch.distributed as dist
from one_gpu_common import integers, new_pair, reference_sum, world_size


def check_compiled(comm, rank: int) -> None:
    """A tensor-parallel step compiled with backend="graphar" as users call it: the default mode with
    changing batch sizes (automatic dynamic shapes), then mode="reduce-overhead", each also under
    torch.inference_mode (as serving loops run); exact against the reference, and the default mode's
    all-reduces served by the op's C++ kernel."""
    w = integers(256 * 256, torch.float32, seed=rank).view(256, 256)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x @ w  # integer-valued: exact in fp32
        dist.all_reduce(y)
        return y + 1

    for mode, inference in ((None, False), ("reduce-overhead", False), (None, True), ("reduce-overhead", True)):
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="graphar", mode=mode)
        before, batches = comm.native_calls(), (1, 8, 3, 8, 8, 5)
        for batch in batches:
            with torch.inference_mode(inference):
                x = integers(batch * 256, torch.float32, seed=rank + batch).view(batch, 256)
                got, want = compiled(x), reference_sum(x @ w) + 1
            assert torch.equal(got, want), f"compiled, mode {mode}, inference_mode {inference}, batch {batch}"
        if mode is None:
            assert comm.native_calls() - before == len(batches), "the compiled step's all-reduces skipped C++"
    torch._dynamo.reset()


def check_compiled_fused_norm(comm, rank: int) -> None:
    """The fused all-reduce + residual add + RMSNorm as users get it: an HF-style block compiled with
    fuse_norm, in the default mode across batch sizes, then reduce-overhead. Integer-valued fp32: the
    residual stream exact, the normed output within the fused kernel's rounding of the eager one."""
    from torch._dynamo.utils import counters

    hidden, eps = 256, 1e-6
    w = integers(hidden * hidden, torch.float32, seed=rank).view(hidden, hidden).clamp(-1, 1)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(5)) + 0.5).cuda()

    def norm(h: torch.Tensor) -> torch.Tensor:  # HF's LlamaRMSNorm
        v = h.to(torch.float32)
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)

    def block(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ w
        dist.all_reduce(y)
        h = y + residual
        return norm(h), h

    runs = (({"fuse_norm": True}, (1, 8, 3, 5)), ({"fuse_norm": True, "mode": "reduce-overhead"}, (8,) * 4))
    for options, batches in runs:
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(block, backend="graphar", options=options)
        for i, batch in enumerate(batches):
            x = integers(batch * hidden, torch.float32, seed=rank + 60 + i).view(batch, hidden).clamp(-2, 2)
            residual = integers(batch * hidden, torch.float32, seed=70 + i).view(batch, hidden)
            normed, h = (t.clone() for t in compiled(x, residual))
            want_h = reference_sum(x @ w) + residual
            assert torch.equal(h, want_h), f"compiled fused norm {options}, batch {batch}: the residual stream"
            err = ((normed - norm(want_h)).abs() / norm(want_h).abs().clamp_min(1e-3)).max().item()
            assert err <= 2**-20, f"compiled fused norm {options}, batch {batch}: {err}"
        assert counters["graphar"]["all_reduce_add_rms_norm"] >= 1, f"not fused: {dict(counters['graphar'])}"
    torch._dynamo.reset()


def check_compiled_attention(comm, rank: int) -> None:
    """Ulysses attention as yunchang writes it, compiled with attention_chunks=2 (the pipelined op,
    default mode then reduce-overhead): bitwise the same model compiled without it."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (seq_to_heads_unpacked(t) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
        return heads_to_seq_unpacked(o)

    gen = torch.Generator().manual_seed(rank)
    qkv = [torch.randn(1, 64, h * world_size(), 64, generator=gen).to(torch.bfloat16).cuda() for h in (4, 2, 2)]
    torch._dynamo.reset()
    want = torch.compile(attention, backend="graphar")(*qkv).clone()
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(attention, backend="graphar", options={"attention_chunks": 2, "mode": mode})
        for call in range(3):
            assert torch.equal(compiled(*qkv), want), f"compiled pipelined attention, mode {mode}, call {call}"
        assert counters["graphar"]["ulysses_attention"] >= 1, f"not pipelined: {dict(counters['graphar'])}"
    torch._dynamo.reset()


def check_compiled_on_fresh_pairs(comm, rank: int) -> None:
    """mode="reduce-overhead" on groups that never had graphar.init: the warm-up call (eager) sets
    each pair up, and the recorded graph's all-reduce is graphar's."""
    from graphar.allreduce import registry

    pair = new_pair()
    w = integers(256 * 256, torch.float32, seed=rank).view(256, 256)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x @ w  # integer-valued: exact in fp32
        dist.all_reduce(y, group=pair)
        return y + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="graphar", mode="reduce-overhead")
    try:
        calls = []  # the pair's custom-kernel calls after each step
        for i in range(4):  # warm-up (eager: sets the pair up), recording, replays
            x = integers(8 * 256, torch.float32, seed=rank + 40 + i).view(8, 256)
            ref = (x @ w).cpu()
            dist.all_reduce(ref, group=pair)
            assert torch.equal(compiled(x), ref.cuda() + 1), f"compiled on a fresh pair, call {i}"
            served = registry.communicator(pair.group_name)
            calls.append(served.kernels.calls if served is not None else 0)
        assert calls[0] >= 1 and calls[1] > calls[0], f"the recorded graph's all-reduce is not graphar's: {calls}"
    finally:
        torch._dynamo.reset()
        if registry.communicator(pair.group_name) is not None:
            registry.communicator(pair.group_name).close()
