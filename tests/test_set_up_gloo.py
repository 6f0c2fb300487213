"""Two gloo processes on the CPU run graphar.init's real set-up exchange, its GPU facts faked, up to
its verdict: ranks that differ in a setting every rank must share both raise, naming it and each
rank's value; set alike, the same group sets up (here: falls back, as there is no GPU)."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

from graphar import processes

WORLD = 2


def _fake_gpus(rank: int) -> contextlib.ExitStack:
    """What `init` asks of a GPU, answered as on a pair of H200s; gloo stands in for NCCL."""
    from graphar import _cuda
    from graphar.allreduce import set_up
    from graphar.errors import GrapharUnavailable

    def no_library(**kwargs):
        raise GrapharUnavailable("no CUDA library on the CPU")

    stack = contextlib.ExitStack()
    for target, name, fake in [
        (set_up, "_uniform_reason", lambda group: None),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (_cuda, "pci_bus_id", lambda device: f"0000:0{rank + 1}:00.0"),
        (_cuda, "build_id", lambda: "0123abcd"),
        (set_up, "Communicator", no_library),
    ]:
        stack.enter_context(mock.patch.object(target, name, fake))
    return stack


def _worker(rank: int, world_size: int) -> None:
    import graphar
    from graphar.allreduce import set_up

    with _fake_gpus(rank):
        if rank == 1:
            os.environ["GRAPHAR_PULL_BLOCKS"] = "32"
        with pytest.raises(graphar.GrapharCommError) as refused:
            graphar.init()
        assert "GRAPHAR_PULL_BLOCKS (rank 0: 64, rank 1: 32): set GRAPHAR_PULL_BLOCKS alike" in str(refused.value)
        os.environ.pop("GRAPHAR_PULL_BLOCKS", None)
        with mock.patch.object(set_up, "_disabled") as disabled:
            assert graphar.init() is None
        assert "no CUDA library on the CPU" in disabled.call_args.args[2]  # agreed: it went on to the library


def test_ranks_that_differ_in_a_setting_both_raise_naming_it(monkeypatch) -> None:
    for name in [n for n in os.environ if n.startswith("GRAPHAR_")]:
        monkeypatch.delenv(name)
    processes.run(_worker, WORLD, env={"GRAPHAR_EXCHANGE_TIMEOUT_S": "60"}, collective_timeout_s=120)
