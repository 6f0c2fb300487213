"""What every multi-process launcher of graphar's needs (the demo, the benchmarks, the tests)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_worker() -> None:
    """End a spawned worker whose work is done and checked, on every rank at once: a barrier, then
    exit without interpreter teardown. Process-group threads still holding work at teardown can
    abort the process ("terminate called without an active exception") after every check passed."""
    import os
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_nccl_worker(rank: int, world_size: int, port: int, timeout_s: float, bind_device: bool) -> None:
    """A spawned worker's default group: NCCL, one GPU per rank (cuda:`rank`), rendezvous on 127.0.0.1:`port`.
    `bind_device` binds the group to that GPU at once (eager NCCL set-up), as the benchmarks want."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    bound = {"device_id": torch.device("cuda", rank)} if bind_device else {}
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **bound,
    )
