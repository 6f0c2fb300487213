"""Faults end in the right answer, NaN plus an error at the next host call, or an error: never a
finite wrong value (docs/design.md, the failure model).

- A late but alive peer: rank 0 calls twice in a row, alone, so its first call gives up on rank 1
  and its second finds the group failed; only then does rank 1 make its first call. Rank 1 must get
  the sum with rank 0's first input, or NaN; before the barriers took their arrivals back, 1stage and
  the pulled exchange gave rank 1 the sum with rank 0's second input. Every kernel, eager and
  replayed from a torch.cuda.graph and a graphar.graph.
- Graphs replayed in different orders on the ranks: rank 0 replays graph A then B, rank 1 B then A,
  so that each rank's first replay meets the peer's other graph. Before the kernels compared the
  launches' call numbers, each rank summed its own input of one call with the peer's of the other.
- Two streams on one communicator, unordered: a graph replay beside eager calls or beside another
  graph's replay, 1000 times (ITERATIONS). Two replays that do not overlap on either rank may still
  run in different orders on the two ranks, the case above, which must also end in NaN and an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from _dist import run_workers

import graphar
from graphar.comm.communicator import Communicator

pytestmark = pytest.mark.gpu

TIMEOUT_S = 2.0
ITERATIONS = 1000
# rank 0's two calls, then rank 1's: rank 1 must see FIRST + LATE or NaN, never SECOND + LATE.
FIRST, SECOND, LATE = 1.0, 100.0, 10.0


@dataclass
class Case:
    """One kernel: `run()` reads the static `x` (refilled before each call) and returns what to check,
    `right(values)` what that is when rank r's x holds values[r]."""

    x: torch.Tensor
    run: Callable[[], torch.Tensor]
    right: Callable[[list[float]], torch.Tensor]


def _all_reduce(comm: Communicator, algo: str) -> Case:
    x = torch.empty(32 * 1024, device="cuda", dtype=torch.bfloat16)
    return Case(x, lambda: comm.all_reduce(x, algo=algo), lambda values: torch.full_like(x, sum(values)))


def _fused_norm(comm: Communicator) -> Case:
    """The residual stream (sum + residual): the normed rows of a constant input hide the sum."""
    x = torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.randint(-8, 9, x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    residual = residual.to(x.dtype)
    weight = torch.ones(x.shape[1], device="cuda", dtype=x.dtype)

    def run() -> torch.Tensor:
        fused = comm.allreduce.try_all_reduce_norm(x, residual, weight, 1e-6, False)
        assert fused is not None, "the fused kernel refused its shapes"
        return fused[1]

    return Case(x, run, lambda values: sum(values) + residual)


def _exchange(comm: Communicator) -> Case:
    """heads -> sequence: heads block i of the output comes from rank i."""
    p, heads = comm.world_size, 4
    x = torch.empty(1, p * 256, heads, 64, device="cuda", dtype=torch.bfloat16)

    def right(values: list[float]) -> torch.Tensor:
        return torch.cat([torch.full((1, 256, heads, 64), v, device="cuda", dtype=x.dtype) for v in values], dim=2)

    return Case(x, lambda: torch.ops.graphar.heads_to_seq_all_to_all(x, comm.group_name), right)


KINDS: dict[str, Callable[[Communicator], Case]] = {
    "1stage": lambda comm: _all_reduce(comm, "1stage"),
    "2stage": lambda comm: _all_reduce(comm, "2stage"),
    "push-oneshot": lambda comm: _all_reduce(comm, "push-oneshot"),
    "push-twoshot": lambda comm: _all_reduce(comm, "push-twoshot"),
    "fused norm": _fused_norm,
    "pulled exchange": _exchange,
    "pushed exchange": _exchange,
}


def _right_or_nan(out: torch.Tensor, right: torch.Tensor, what: str) -> bool:
    """Every element is the right value or NaN; whether any is NaN."""
    nan = torch.isnan(out)
    wrong = ~nan & (out != right)
    assert not wrong.any(), (
        f"{what}: {int(wrong.sum())} finite wrong values, e.g. {out[wrong][:4].tolist()} where "
        f"{right[wrong][:4].tolist()} is right"
    )
    return bool(nan.any())


def _raises_at_next_host_call(comm: Communicator, what: str) -> None:
    with pytest.raises(graphar.GrapharCommError):
        comm.check()
    assert not comm.usable, what


def _late_peer(rank: int, world_size: int, kind: str) -> None:
    os.environ["GRAPHAR_ALLTOALL_ALGO"] = "push" if kind == "pushed exchange" else "pull"
    for mode in ("eager", "torch.cuda.graph", "graphar.graph"):
        what = f"{kind}, {mode}"
        comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=TIMEOUT_S)
        case = KINDS[kind](comm)
        case.x.fill_(LATE)
        case.run()  # every rank once: sizes the exchange buffer (collective), warms up before a capture
        torch.cuda.synchronize()
        if mode == "eager":
            call = case.run
        else:
            graph = torch.cuda.CUDAGraph()
            with graphar.graph(graph) if mode == "graphar.graph" else torch.cuda.graph(graph):
                captured = case.run()
            call = lambda: graph.replay() or captured  # noqa: E731

        dist.barrier()
        if rank == 0:
            case.x.fill_(FIRST)
            first = call().clone()
            case.x.fill_(SECOND)
            second = call().clone()
            torch.cuda.synchronize()
            assert torch.isnan(first).all() and torch.isnan(second).all(), f"{what}: rank 0 alone wrote numbers"
            _raises_at_next_host_call(comm, what)
        dist.barrier()
        if rank == 1:
            case.x.fill_(LATE)
            out = call().clone()
            torch.cuda.synchronize()
            if _right_or_nan(out, case.right([FIRST, LATE] + [LATE] * (world_size - 2)), what):
                _raises_at_next_host_call(comm, what)
        dist.barrier()
        comm.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_late_peer_gets_the_right_sum_or_nan(kind: str) -> None:
    run_workers(_late_peer, 2, kind, timeout_s=120)


def _captured(case: Case, mode: str = "torch.cuda.graph") -> Callable[[], torch.Tensor]:
    graph = torch.cuda.CUDAGraph()
    with graphar.graph(graph) if mode == "graphar.graph" else torch.cuda.graph(graph):
        out = case.run()
    return lambda: graph.replay() or out


def _two_cases(world_size: int, kind: str) -> tuple[Communicator, list[Case]]:
    """A communicator and two calls of `kind` on it, each run once: every rank sizes the exchange buffer
    (collective) and warms up before a capture."""
    os.environ["GRAPHAR_ALLTOALL_ALGO"] = "push" if kind == "pushed exchange" else "pull"
    comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=TIMEOUT_S)
    cases = [KINDS[kind](comm), KINDS[kind](comm)]
    for case in cases:
        case.x.fill_(LATE)
        case.run()
    torch.cuda.synchronize()
    return comm, cases


def _swapped_replays(rank: int, world_size: int, kind: str, mode: str) -> None:
    what = f"{kind}, {mode}"
    comm, cases = _two_cases(world_size, kind)
    calls = [_captured(case, mode) for case in cases]  # in one order on every rank
    values = [[float(r + 1) for r in range(world_size)], [float(10 * (r + 1)) for r in range(world_size)]]
    for case, v in zip(cases, values):
        case.x.fill_(v[rank])
    for _ in range(3):  # in one order: the right sums, exactly
        for n, call in enumerate(calls):
            out = call()
            torch.cuda.synchronize()
            assert torch.equal(out, cases[n].right(values[n])), f"{what}: replays in one order"
    dist.barrier()
    order = (0, 1) if rank == 0 else (1, 0)
    outs = {n: calls[n]().clone() for n in order}
    torch.cuda.synchronize()
    for n in order:
        _right_or_nan(outs[n], cases[n].right(values[n]), f"{what}, graph {n} replayed in swapped order")
    assert torch.isnan(outs[order[0]]).any(), f"{what}: the first replay met the peer's other graph unnoticed"
    _raises_at_next_host_call(comm, what)
    dist.barrier()
    comm.close()


@pytest.mark.parametrize("mode", ["torch.cuda.graph", "graphar.graph"])
@pytest.mark.parametrize("kind", KINDS)
def test_graphs_replayed_in_swapped_orders_are_nan_and_an_error(kind: str, mode: str) -> None:
    run_workers(_swapped_replays, 2, kind, mode, timeout_s=120)


def _two_streams(rank: int, world_size: int, kind: str, other: str) -> None:
    """A graph replayed on one stream and, unordered with it, an eager call (or a second graph's replay)
    of the same communicator on another: each output is right or NaN, and a NaN comes with an error at
    the next host call. In one process the two streams' kernels do run at once."""
    comm, cases = _two_cases(world_size, kind)
    calls = [_captured(cases[0]), _captured(cases[1]) if other == "replay" else cases[1].run]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    failed_at = None
    for i in range(ITERATIONS):
        values = [
            [float((r + 1) * (i % 7 + 1)) for r in range(world_size)],
            [float((r + 1) * (i % 5 + 9)) for r in range(world_size)],
        ]
        outs: list[torch.Tensor | None] = []
        for case, call, stream, v in zip(cases, calls, streams, values):
            with torch.cuda.stream(stream):
                case.x.fill_(v[rank])
                try:
                    outs.append(call())
                except graphar.GrapharCommError:  # an eager call after the failure: the error, at once
                    assert failed_at is not None or not comm.usable, "an eager call raised on a healthy communicator"
                    outs.append(None)
        torch.cuda.synchronize()
        for n, (case, out, v) in enumerate(zip(cases, outs, values)):
            if out is None or _right_or_nan(
                out, case.right(v), f"{kind}, replay beside {other}, iteration {i}, call {n}"
            ):
                failed_at = i if failed_at is None else failed_at
                _raises_at_next_host_call(comm, f"{kind} beside {other}")
    print(
        f"rank {rank}, {kind}, a replay beside {other}: {ITERATIONS} iterations, "
        f"{'no failure' if failed_at is None else f'failed from iteration {failed_at} on, with an error'}"
    )
    dist.barrier()
    comm.close()


# Every kernel, the exchanges included: their packs write before any copy claims the communicator,
# so an exchange holds a lease from before its first pack to its last copy (csrc/all_to_all.cuh).
TWO_STREAMS = [(kind, other) for kind in KINDS for other in ("eager", "replay")]


@pytest.mark.parametrize("kind, other", TWO_STREAMS)
def test_two_streams_on_one_communicator_are_right_or_an_error(kind: str, other: str) -> None:
    run_workers(_two_streams, 2, kind, other, timeout_s=120)
