"""Run a test body in one process per GPU with an NCCL default group (graphar.processes); fail loudly,
never hang.

    run_workers(fn, world_size, *args)   # fn(rank, world_size, *args) in every process

`fn` must be importable (a module-level function). Skips when fewer than `world_size` GPUs are
visible. A worker that raises makes the test fail with its traceback; a worker still running at
the deadline is killed and the test fails naming it.

GRAPHAR_TEST_SHARE_GPU=1 runs every rank on cuda:0 over a gloo default group, with graphar's
testing-only switch GRAPHAR_SHARE_GPU, for where only one GPU is lent (cases that capture an
NCCL collective skip there, as gloo cannot be captured). Two forms (docs/design.md, evidence levels):
under CUDA's Multi-Process Service (tools/gpu_session.sh stage `mps`) the ranks' kernels run at once,
so orderings and per-call costs are real without the link, and world sizes 2 and 4 run; without it
the GPU time-slices the ranks (each spin-wait ends at a context switch), two ranks only.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from graphar import processes
from graphar.errors import RanksFailed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import testing_library
from one_gpu_common import mps_running  # tools/ is not a package: by path

SHARED_GPU = os.environ.get("GRAPHAR_TEST_SHARE_GPU") == "1"


# Ranks sharing the GPU under MPS run at once; time-sliced, two ranks only (tools/one_gpu_check.py runs
# the larger worlds' kernels there).
MPS = SHARED_GPU and mps_running()
WORLD_SIZES = (2, 4) if MPS else (2,) if SHARED_GPU else (2, 4, 6, 8)
# A test body takes at most about 25 s there: a hang must not eat the dry run's whole time limit
# (GRAPHAR_TEST_SHARED_DEADLINE_S lifts it for a long run made on purpose, e.g. 200 compiles).
SHARED_DEADLINE_S = float(os.environ.get("GRAPHAR_TEST_SHARED_DEADLINE_S", "120"))


def init_world(rank: int, world_size: int, port: int) -> None:
    """The default group the workers start with, made again (a test that destroys it and makes another)."""
    processes.init_group(processes.gpu_group(SHARED_GPU), rank, world_size, port)


def skip_where_nccl_is_captured() -> None:
    """For a case that captures an NCCL collective: gloo, the shared GPU's stand-in, cannot be captured."""
    if SHARED_GPU:
        pytest.skip("captures an NCCL collective, which gloo (GRAPHAR_TEST_SHARE_GPU=1) cannot stand in for")


def run_workers(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    meet_at_end: bool = True,
) -> None:
    """Run fn(rank, world_size, *args) on `world_size` GPUs, one process each (NCCL; shared: every rank
    on cuda:0 over gloo). The ranks meet once more after fn (`meet_at_end`), so none exits while a
    peer's kernel may still use its memory; a test in which a rank dies on purpose skips that meeting.
    A failing rank's peers are not killed: they end at graphar's bounded waits (under MPS, a process
    killed mid-kernel can take the server down), or at the deadline."""
    if torch.cuda.device_count() < (1 if SHARED_GPU else world_size):
        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    # Tests set their communicators up with graphar.init; a group without one is their NCCL case. The
    # shipped kernel table, so that no pick depends on this machine's timings (test_tuner tunes).
    group = processes.gpu_group(
        SHARED_GPU, {"GRAPHAR_AUTO_INIT": "0", "GRAPHAR_TUNE": "0", **(env or {})}, meet_at_end=meet_at_end
    )
    ranks = processes.start(fn, world_size, *args, group=group)
    WORKERS[:] = [p.pid for p in ranks.procs]
    try:
        ranks.wait(min(timeout_s, SHARED_DEADLINE_S) if SHARED_GPU else timeout_s, fail_fast=False)
    except RanksFailed as e:
        sys.stderr.write(f"{e}\n")  # now, for a run that is cut before pytest's summary
        pytest.fail(str(e), pytrace=False)


# The process ids of the last run_workers' ranks, in rank order (conftest.py names them beside a fault).
WORKERS: list[int] = []


def repetitions(n: int) -> int:
    """How many of a stress test's n repetitions to run: all of them on GPUs of their own or under MPS;
    on a time-sliced GPU, where ranks take turns at every barrier (milliseconds each), a hundredth, so
    the dry run ends inside its time limit."""
    return max(10, n // 100) if SHARED_GPU and not MPS else n


def integer_valued(numel: int, dtype: torch.dtype, low: int = -8, high: int = 8) -> torch.Tensor:
    """Fresh random integers in [low, high] on the current GPU: sums of a few are exact in every dtype."""
    return torch.randint(low, high + 1, (numel,), device="cuda").to(dtype)


def assert_equal_across_ranks(t: torch.Tensor, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of `group` holds bitwise the same `t`."""
    t = t.contiguous()
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t, group=group)
    bits = [g.view(torch.uint8) for g in gathered]
    differing = [r for r, b in enumerate(bits) if not torch.equal(b, bits[0])]
    assert not differing, f"{what}: ranks {differing} differ from rank 0"


def nccl_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """NCCL's sum of `x` over `group`, out of place: the reference every custom kernel is held to."""
    ref = x.clone()
    dist.all_reduce(ref, group=group)
    return ref


def poison_next_output(nbytes: int) -> None:
    """Leave NaN in the allocator block that the next output of this size will most likely get."""
    torch.full((nbytes // 4,), float("nan"), device="cuda")  # freed at once, back to the cache


def check_exact(comm: Any, x: torch.Tensor, algo: str | None, group: dist.ProcessGroup | None = None) -> None:
    """comm.all_reduce(x, algo) (output poisoned first) equals NCCL's sum bit for bit, leaves x
    unchanged, and is the same on every rank."""
    before = x.clone()
    poison_next_output(x.nbytes)
    y = comm.all_reduce(x, algo=algo)
    what = f"{x.numel()} x {x.dtype}, algo {algo}"
    ref = nccl_sum(x, group)
    if not torch.equal(y, ref):
        wrong = y != ref
        nan = torch.isnan(y) & wrong
        raise AssertionError(
            f"differs from NCCL: {what}: {int(wrong.sum())} elements, {int(nan.sum())} of them NaN, "
            f"{int((wrong & ~nan).sum())} finite and wrong (first at {int(wrong.nonzero()[0])})"
        )
    assert torch.equal(x, before), f"input modified: {what}"
    assert_equal_across_ranks(y, what, group)


def set_barrier_counters(comm: Any, value: int) -> None:
    """Collective, while no kernel of `comm` runs anywhere: every barrier counter as if `value`
    barriers had passed (through the testing library), to test the epoch wrap."""
    torch.cuda.synchronize()
    comm.all_gather(None, "barrier counter reset (idle)")
    testing_library.set_barrier_counters(comm, value)
    comm.all_gather(None, "barrier counter reset (done)")


def registered_buffer(comm: Any, nbytes: int) -> torch.Tensor:
    """The first `nbytes` of this rank's registered input buffer, as uint8 (through the testing library):
    what an eager or copy-in call's kernel copies its input into, and peers read."""
    from graphar.ulysses.transport import _DeviceMemory

    return torch.as_tensor(_DeviceMemory(testing_library.registered_buffer(comm), nbytes), device="cuda")


def assert_timed_out_for_good(call: Callable[[], object], group_name: str, barrier: str) -> None:
    """`call()` raises GrapharTimeoutError naming the group, a peer and `barrier`, and keeps raising."""
    from graphar import GrapharTimeoutError

    match = f"group {re.escape(repr(group_name))}.*rank [1-7] did not reach the {barrier}"
    for _ in range(2):
        with pytest.raises(GrapharTimeoutError, match=match):
            call()
