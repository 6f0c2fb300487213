"""graphar's one process launcher: the demo, the doctor, the benchmarks, the tools and the tests run
their ranks through `run` (or `start`, to watch them while they run).

Each rank is a fresh process (CUDA cannot be forked) started by a forkserver that imported torch once,
so a rank starts in a fraction of a second. It gets its environment, its GPU and its default process
group before the work, and afterwards meets the others once more and exits without interpreter
teardown (process-group threads still holding work at teardown can abort a process after every check
passed). A rank that raises writes its traceback where the launcher reads it, lets its queued GPU
work finish (under CUDA's Multi-Process Service a client that exits with work outstanding can take
the server down), and exits; the launcher raises `RanksFailed` naming every rank that failed or
outlived the deadline (killed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphar.errors import RanksFailed
from graphar.settings import SHARE_GPU


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Group:
    """How each rank starts: its default group's `backend` over 127.0.0.1, its GPU (`device`: none,
    "rank" for cuda:rank, or one GPU for every rank), whether an NCCL group binds to it at once
    (eager NCCL set-up), `env` over this process's environment as it is when the ranks start, and the
    bound on each collective (`collective_timeout_s`; None: torch's default). The ranks meet once more
    after their work (`meet_at_end`), so none exits while a peer may still read its memory."""

    backend: str = "gloo"
    device: int | str | None = None
    bind_device: bool = False
    env: dict[str, str] = field(default_factory=dict)
    collective_timeout_s: float | None = None
    meet_at_end: bool = True

    def gpu(self, rank: int) -> int | None:
        """The GPU of `rank`, or None."""
        return None if self.device is None else rank if self.device == "rank" else int(self.device)


def gpu_group(shared: bool, env: dict[str, str] | None = None, **fields: Any) -> Group:
    """A GPU each over NCCL, bound at once; or, `shared`, every rank on cuda:0 over gloo (NCCL refuses
    ranks that share a GPU) under graphar's testing-only GRAPHAR_SHARE_GPU. `env` and the other
    fields as Group takes them."""
    share = {SHARE_GPU.name: "1"} if shared else {}
    return Group(
        backend="gloo" if shared else "nccl",
        device=0 if shared else "rank",
        bind_device=not shared,
        env={**share, **(env or {})},
        **fields,
    )


class Ranks:
    """Ranks started by `start`: `procs` in rank order, each rank's traceback where it failed."""

    def __init__(self, fn: Callable[..., None], world_size: int, args: tuple[Any, ...], group: Group) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "torch.distributed"])
        self._errors = tempfile.TemporaryDirectory(prefix="graphar-ranks-")
        # The environment as it is now: a forkserver's process would inherit the server's, from its start.
        group = dataclasses.replace(group, env={**os.environ, **group.env})
        port = free_port()
        self.procs = [
            context.Process(target=_entry, args=(fn, rank, world_size, port, args, group, self._errors.name))
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def wait(self, deadline_s: float | None = None, fail_fast: bool = True) -> None:
        """Until every rank has ended; raises RanksFailed where one failed. A rank that fails ends the
        others at once, killed (`fail_fast`), or they go on to their own end: on a GPU shared under
        MPS a process killed mid-kernel can take the server down, so the GPU tests wait for their
        peers' bounded timeouts instead. Ranks still running after `deadline_s` are killed."""
        end = None if deadline_s is None else time.monotonic() + deadline_s
        hung = False
        while alive := [p for p in self.procs if p.is_alive()]:
            if fail_fast and any(p.exitcode not in (None, 0) for p in self.procs):
                break
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                hung = True
                break
            # A sentinel is ready once its process has ended, also where it ended since is_alive.
            multiprocessing.connection.wait([p.sentinel for p in alive], left)
        killed = [rank for rank, p in enumerate(self.procs) if p.is_alive()]
        self._end(0)
        failed = {
            rank: f"rank {rank} (exit code {p.exitcode}):\n{self.traceback(rank)}"
            for rank, p in enumerate(self.procs)
            if rank not in killed and p.exitcode != 0
        }
        self._errors.cleanup()  # after the tracebacks are read
        if killed or failed:
            raise RanksFailed(failed, killed, hung, deadline_s)

    def traceback(self, rank: int) -> str:
        """What the rank raised, as it wrote it before it exited."""
        path = Path(self._errors.name, f"rank{rank}.txt")
        return path.read_text() if path.exists() else "(no traceback: the process died without raising)"

    def stop(self, wait_s: float) -> None:
        """End the ranks: those still running after `wait_s` are killed."""
        self._end(wait_s)
        self._errors.cleanup()

    def _end(self, wait_s: float) -> None:
        for p in self.procs:
            p.join(timeout=wait_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=30)


def start(fn: Callable[..., None], world_size: int, *args: Any, group: Group | None = None) -> Ranks:
    """fn(rank, world_size, *args) started in `world_size` fresh processes, each rank in its default
    group (`group`). `fn` must be importable by name (a module-level function)."""
    return Ranks(fn, world_size, args, group or Group())


def run(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    deadline_s: float | None = None,
    fail_fast: bool = True,
    **group: Any,
) -> None:
    """`start(fn, world_size, *args)` with `Group(**group)`, then `wait(deadline_s, fail_fast)`."""
    start(fn, world_size, *args, group=Group(**group)).wait(deadline_s, fail_fast)


def init_group(group: Group, rank: int, world_size: int, port: int) -> None:
    """Make this rank's default group as `group` says, rendezvous on 127.0.0.1:`port`, on its GPU (set
    current first). Each rank of a launch runs it before its work; a test that destroys the world
    makes it again with it."""
    import torch
    import torch.distributed as dist

    gpu = group.gpu(rank)
    if gpu is not None:
        torch.cuda.set_device(gpu)
    seconds = group.collective_timeout_s
    timeout = {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}
    bound = {"device_id": torch.device("cuda", gpu)} if group.bind_device and gpu is not None else {}
    dist.init_process_group(
        group.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **timeout, **bound
    )


def _entry(
    fn: Callable[..., None], rank: int, world_size: int, port: int, args: tuple[Any, ...], group: Group, error_dir: str
) -> None:
    os.environ.clear()
    os.environ.update(group.env)
    import torch
    import torch.distributed as dist

    gpu = group.gpu(rank)
    try:
        init_group(group, rank, world_size, port)
        fn(rank, world_size, *args)
        if gpu is not None:
            torch.cuda.synchronize()
        if group.meet_at_end and dist.is_initialized():
            dist.barrier(**({"device_ids": [gpu]} if group.backend == "nccl" else {}))
    except BaseException:  # noqa: BLE001  (whatever ends a rank, its peers and the launcher must hear of it)
        Path(error_dir, f"rank{rank}.txt").write_text(traceback.format_exc())
        if gpu is not None:  # its queued kernels end first (the module's docstring says why)
            with contextlib.suppress(BaseException):
                torch.cuda.synchronize()
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
