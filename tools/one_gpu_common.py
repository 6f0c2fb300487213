"""What the one-GPU tools share (tools/one_gpu_check.py, tools/one_gpu_bench.py, and tools/soak.py, which
runs on two GPUs too): graphar's set-up relaxed for ranks on one GPU, integer-valued inputs, references
by the world group's own backend (gloo on the CPU for ranks sharing a GPU, NCCL on two GPUs), the
group's size, a bitwise comparison across ranks."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

KB, MB = 1 << 10, 1 << 20
ALGOS = ("1stage", "2stage", "push-oneshot", "push-twoshot")


def mps_running() -> bool:
    """Whether CUDA's Multi-Process Service would serve this process's contexts, so that ranks sharing
    the GPU run their kernels at once instead of time-sliced: its control pipe is where the client looks
    for it (CUDA_MPS_PIPE_DIRECTORY, else the default folder)."""
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control").exists()


def relax_set_up() -> None:
    """Let graphar.init set up a communicator whose ranks share one GPU over a gloo group: graphar's
    testing-only switch GRAPHAR_SHARE_GPU (graphar.settings), refused by default."""
    os.environ["GRAPHAR_SHARE_GPU"] = "1"


def integers(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integers in [-8, 8] on this rank's GPU: their sums are exact in every dtype the kernels take."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (numel,), generator=gen).to(dtype).cuda()


def reference_device() -> torch.device:
    """Where the world group's collectives take tensors: this rank's GPU for NCCL, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def reference_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the world group in fp32, by its own backend (gloo on the CPU, or NCCL)."""
    ref = x.float().to(reference_device(), copy=True)
    dist.all_reduce(ref)
    return ref.to(x.dtype).to(x.device)


def world_size() -> int:
    return dist.get_world_size()


def ranks_differ(mine: torch.Tensor) -> bool:
    """Whether some rank's `mine` differs bitwise from rank 0's, NaN payloads included (gathered as bytes,
    which every backend takes)."""
    bits = mine.contiguous().view(torch.uint8).to(reference_device())
    everyone = [torch.empty_like(bits) for _ in range(world_size())]
    dist.all_gather(everyone, bits)
    return not all(torch.equal(everyone[0], other) for other in everyone[1:])


def assert_ranks_equal(mine: torch.Tensor, what: str) -> None:
    """Every rank's `mine` is bitwise rank 0's, NaN payloads included."""
    assert not ranks_differ(mine), f"{what}: ranks differ"


def new_pair() -> dist.ProcessGroup:
    """A new group of this rank and its neighbour (ranks 0-1, 2-3, ...), as a 2-D mesh's
    tensor-parallel rows; every rank creates every pair, in the same order, as new_group requires."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world_size(), 2)]
    return pairs[dist.get_rank() // 2]
