"""`python -m graphar demo`: compile a small tensor-parallel model with backend="graphar".

Spawns 2 processes (NCCL on GPUs 0 and 1 when there are two GPUs, else gloo on the CPU), compiles a
built-in TP MLP with `backend="graphar"`, prints the graph before and after graphar's pass, and
checks the compiled outputs against the uncompiled model for fp32 and bf16.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
HIDDEN, FFN, BATCH = 64, 256, 8
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class TensorParallelMLP(torch.nn.Module):
    """Two residual MLP blocks: column-parallel up projection, row-parallel down projection + all_reduce."""

    def __init__(self, rank: int, world_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)  # same full weights on every rank; each keeps its shard
        shard = FFN // world_size
        self.up = torch.nn.ParameterList()
        self.down = torch.nn.ParameterList()
        for _ in range(2):
            up = torch.randn(HIDDEN, FFN, generator=gen) / HIDDEN**0.5
            down = torch.randn(FFN, HIDDEN, generator=gen) / FFN**0.5
            self.up.append(up[:, rank * shard : (rank + 1) * shard].to(device, dtype))
            self.down.append(down[rank * shard : (rank + 1) * shard].to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            y = torch.nn.functional.silu(x @ up) @ down
            dist.all_reduce(y)
            x = x + y
        return x


class _GraphPrinter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, use_gpu: bool) -> None:
    import graphar

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world_size)
    if use_gpu:
        graphar.init()
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass we want to show
    if rank == 0:
        logging.getLogger("graphar.graphs").addHandler(_GraphPrinter())
        logging.getLogger("graphar.graphs").setLevel(logging.DEBUG)
    try:
        _compare(rank, world_size, device)
    finally:
        graphar.shutdown()
        dist.destroy_process_group()


def _compare(rank: int, world_size: int, device: torch.device) -> None:
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            model = TensorParallelMLP(rank, world_size, dtype, device)
            x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            expected = model(x)
            torch._dynamo.reset()
            actual = torch.compile(model, backend="graphar", fullgraph=True)(x)
            error = (actual.float() - expected.float()).abs().max().item()
            if rank == 0:
                print(f"{dtype}: compiled vs uncompiled max |diff| = {error:.3g} (tolerance {TOLERANCE[dtype]})")
            if error > TOLERANCE[dtype]:
                raise AssertionError(f"rank {rank}: {dtype} outputs differ by {error}")
            logging.getLogger("graphar.graphs").setLevel(logging.WARNING)  # show the graphs once


def main() -> int:
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD_SIZE
    start = time.time()
    print(f"graphar demo: {WORLD_SIZE} processes on {'NCCL + GPUs' if use_gpu else 'gloo + CPU'}", flush=True)
    mp.spawn(_worker, args=(WORLD_SIZE, _free_port(), use_gpu), nprocs=WORLD_SIZE, join=True)
    print(f"graphar demo: OK, compiled outputs equal the uncompiled model ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
