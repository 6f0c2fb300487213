"""How the ranks of a group agree before they share memory: small all-gathers over the group's
store, each with a bounded wait, and the verdicts built from them.

Every set-up step whose outcome can differ between ranks (a library that fails to load, an IPC open
that fails, a probe that does not round-trip, a buffer that cannot grow) ends in an all-gather of
each rank's verdict, so every rank takes the same branch: a rank that gave up alone would leave its
peers waiting.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from graphar.errors import GrapharCommError, GrapharCudaError


class Rendezvous:
    """All-gathers of small Python objects over a store, each with a bounded wait."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._timeout = timedelta(seconds=timeout_s)
        self._step = 0

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's `obj`, in rank order; GrapharCommError naming `what` when a rank is missing."""
        keys = [f"{self._prefix}/{self._step}/{r}" for r in range(self._world_size)]
        self._step += 1
        self._store.set(keys[self._rank], pickle.dumps(obj))
        try:
            self._store.wait(keys, self._timeout)
        except Exception as e:  # store backends raise different types
            raise GrapharCommError(
                f"{what}: not every rank arrived within {self._timeout.total_seconds():.0f} s "
                f"(GRAPHAR_EXCHANGE_TIMEOUT_S): {e}"
            ) from e
        return [pickle.loads(self._store.get(k)) for k in keys]


def first_reason(reasons: Sequence[str | None]) -> str | None:
    """The first rank's reason to give up, naming the rank; None when no rank has one."""
    for rank, reason in enumerate(reasons):
        if reason is not None:
            return f"rank {rank}: {reason}"
    return None


def agree(exchange: Rendezvous, what: str, step: Callable[[], str | None]) -> str | None:
    """Run a local step (its result: a reason to give up, or None), then share every rank's result."""
    try:
        local = step()
    except GrapharCudaError as e:
        local = str(e)
    return first_reason(exchange.all_gather(local, what))
