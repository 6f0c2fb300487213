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
