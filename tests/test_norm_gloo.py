"""Two gloo processes on the CPU: an HF-style row-parallel block compiled with `fuse_norm` runs the
fused all-reduce + residual add + RMSNorm op and matches eager.

float32; sums of two ranks' partial products in a different order and a compiled rsqrt differ from
eager by rounding only, so outputs are compared with rtol=atol=1e-5.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

from graphar import processes

WORLD = 2


class Block(torch.nn.Module):
    """A row-parallel projection, the residual add and HF's LlamaRMSNorm; the sum flows on."""

    def __init__(self, rank: int, hidden: int = 32, eps: float = 1e-6) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(rank)
        self.w = torch.randn(hidden, hidden, generator=generator)
        self.weight = torch.randn(hidden, generator=torch.Generator().manual_seed(99))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ self.w
        dist.all_reduce(y)
        h = y + residual
        v = h.to(torch.float32)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * v.to(h.dtype), h


def _worker(rank: int, world_size: int) -> None:
    import graphar  # noqa: F401  (registers the backend and the ops)

    torch._inductor.config.fx_graph_cache = False  # the pass must run to be seen in the code
    try:
        block = Block(rank)
        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(10 + rank))
        residual = torch.randn(6, 32, generator=torch.Generator().manual_seed(20))  # equal on both ranks
        compiled = torch.compile(block, backend="graphar", options={"fuse_norm": True}, fullgraph=True)
        with torch.no_grad():
            actual, code = run_and_get_code(compiled, x, residual)
            expected = block(x, residual)
        if not any("graphar.all_reduce_add_rms_norm" in c for c in code):
            raise AssertionError(f"rank {rank}: the fused op is not in the compiled code")
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_fused_norm_matches_eager() -> None:
    processes.run(_worker, WORLD, collective_timeout_s=120)
