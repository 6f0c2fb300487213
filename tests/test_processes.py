"""graphar's process launcher (graphar.processes) on the CPU: a rank that raises is reported with its
traceback and ends its peers at once (fail-fast), or they go on to their own end; ranks past the
deadline are killed and said to have hung; every rank starts with the launcher's environment as it
is, `env` over it, in a gloo group of the given size."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from graphar import processes
from graphar.errors import RanksFailed


def _rank_1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(60)  # a peer that would wait: fail-fast kills it


def _sleeps(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _sees(rank: int, world_size: int, wanted: dict[str, str]) -> None:
    assert dist.get_world_size() == world_size == 3 and dist.get_rank() == rank
    assert {k: os.environ.get(k) for k in wanted} == wanted


def test_a_rank_that_raises_is_reported_with_its_traceback_and_ends_its_peers() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed) as failed:
        processes.run(_rank_1_raises, 2)
    e = failed.value
    assert list(e.failed) == [1] and "ValueError: boom on rank 1" in e.failed[1], e.failed
    assert e.killed == [0] and not e.hung and "when another rank failed" in str(e)
    assert time.monotonic() - start < 45


def test_ranks_past_the_deadline_are_killed_and_said_to_hang() -> None:
    with pytest.raises(RanksFailed) as failed:
        processes.run(_sleeps, 2, 60.0, deadline_s=3)
    assert failed.value.hung and failed.value.killed == [0, 1] and not failed.value.failed


def test_every_rank_starts_with_the_launcher_s_environment_and_env_over_it(monkeypatch) -> None:
    monkeypatch.setenv("GRAPHAR_TEST_LAUNCHER", "as the launcher has it now")
    wanted = {"GRAPHAR_TEST_LAUNCHER": "as the launcher has it now", "GRAPHAR_TEST_GIVEN": "given"}
    processes.run(_sees, 3, wanted, env={"GRAPHAR_TEST_GIVEN": "given"})
