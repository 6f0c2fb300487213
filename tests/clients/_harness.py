"""What the client tests (tests/clients/test_*.py) and tools/one_gpu_clients.py share: two ranks over
gloo, one compiled run measured (graphar's rewrites, graph breaks, graphar's log, the largest
difference from the uncompiled model), and the comparison with backend="inductor"'s graph breaks.

Each client's test module defines `run(rank, setting, *args) -> list[Run]`: the tests check what it
returns on the CPU in fp32; the tool prints it for bf16 on one GPU.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from graphar import processes

WORLD = 2
# fp32 on the CPU. Inductor fuses and reorders the fp32 arithmetic of norms, softmax and matmul
# epilogues: these tiny models differ from eager by about 1e-6 on values of order 1. A lost or
# doubled rank's share (what a wrong collective gives) differs by order 1, so 1e-4 tells them apart.
TOLERANCE = 1e-4


def rewrites() -> dict[str, int]:
    """graphar's ops in the compiled graphs so far, by op (every op the pass makes, zero included): the
    one place that reads counters["graphar"]."""
    ops = (
        "all_reduce",
        "all_reduce_add_rms_norm",
        "qkv_all_to_all",
        "heads_to_seq_all_to_all",
        "packed_all_to_all_single",
        "ulysses_attention",
    )
    return {name: counters["graphar"][name] for name in ops}


@dataclass(frozen=True)
class Setting:
    """Where and how a client runs: the tests' CPU fp32, or the tool's GPU bf16 with CUDA graphs."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    mode: str | None = None  # torch.compile's mode

    def compile(
        self,
        model: Callable[..., Any],
        backend: str = "graphar",
        options: dict[str, Any] | None = None,
        mode: str | None = None,
        **kwargs: Any,
    ) -> Callable[..., Any]:
        """`model` compiled with `backend` in `mode` (else this setting's); graphar's `options` carry
        the mode (torch refuses mode= beside options=); `kwargs` go to torch.compile."""
        mode = mode or self.mode
        if backend == "inductor":
            return torch.compile(model, backend=backend, mode=mode, **kwargs)
        return torch.compile(model, backend=backend, options={**(options or {}), "mode": mode}, **kwargs)


@dataclass
class Run:
    """One client run compiled with one backend."""

    name: str
    rewrites: dict[str, int] = field(default_factory=dict)
    max_diff: float = 0.0
    graph_breaks: dict[str, int] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def compare(self, got: torch.Tensor, want: torch.Tensor) -> None:
        """Note the largest difference of a compiled output from the uncompiled model's."""
        self.max_diff = max(self.max_diff, (got.float() - want.float()).abs().max().item())

    def left(self) -> dict[str, int]:
        """The collectives graphar's log says it left on the process group's, counted by op."""
        found = (re.match(r"graphar: ([a-z_]+?)(?:_\d+)? left on its collective", m) for m in self.log)
        return dict(Counter(match[1] for match in found if match))

    def summary(self) -> str:
        breaks = sum(self.graph_breaks.values())
        return (
            f"{self.name}: rewrites {self.rewrites}, left {self.left()}, max diff {self.max_diff:.3g}, "
            f"graph breaks {breaks}"
        )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def measured(name: str) -> Iterator[Run]:
    """Measure the compiles inside the block from a clean slate: Dynamo reset, counters cleared."""
    torch._dynamo.reset()
    counters.clear()
    logger, records = logging.getLogger("graphar"), _Records()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    run = Run(name)
    try:
        yield run
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    run.rewrites, run.graph_breaks, run.log = rewrites(), dict(counters["graph_break"]), records.messages


def check(run: Run, expected: dict[str, int], left: dict[str, int], inductor: Run | None = None) -> None:
    """The rewrites are `expected` (ops not named: none), graphar's log names the collectives `left`
    on the process group's, the outputs are within TOLERANCE, and every graph break is one that
    `inductor` (the same client compiled with backend="inductor") has too."""
    want = {name: expected.get(name, 0) for name in run.rewrites}
    assert run.rewrites == want, f"{run.name}: rewrites {run.rewrites}, expected {want}"
    log = "\n".join(run.log)
    assert run.left() == left, f"{run.name}: left on the collectives {run.left()}, expected {left}\n{log}"
    assert run.max_diff <= TOLERANCE, f"{run.name}: compiled differs from eager by {run.max_diff}"
    if run.graph_breaks:
        assert inductor is not None, f"{run.name}: graph breaks {run.graph_breaks}, and no inductor run to compare"
        extra = {k: v for k, v in run.graph_breaks.items() if v > inductor.graph_breaks.get(k, 0)}
        assert not extra, f"{run.name}: graph breaks backend='inductor' does not have: {extra}"


def _entry(
    rank: int, world_size: int, setup: Callable[[int], None] | None, fn: Callable[..., None], args: tuple
) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    import graphar  # noqa: F401  (registers the backend and the ops)

    torch._inductor.config.fx_graph_cache = False  # a cache hit would not log why anything was left alone
    torch._inductor.config.compile_threads = 1  # each rank compiles: a worker pool per rank only adds processes
    if setup is not None:
        setup(rank)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], *args: Any, setup: Callable[[int], None] | None = None) -> None:
    """fn(rank, *args) in WORLD processes with a gloo default group (and the torchrun environment the
    clients read), after `setup(rank)`; both must be module-level functions."""
    processes.run(_entry, WORLD, setup, fn, args, collective_timeout_s=300)
