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
- A peer that dies (its process exits with nothing closed): the survivors' calls end in NaN and an
  error, and their CUDA contexts keep working.
Each at every world size the GPUs allow (2 and 4 with ranks sharing one GPU under MPS), the all-reduce
kernels at 64 KB and at fewer 16-byte packs than ranks (where push two-shot's shards are all the last
rank's).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from _dist import WORLD_SIZES, registered_buffer, run_workers

import graphar
from graphar.allreduce.communicator import Communicator

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


def _all_reduce(comm: Communicator, algo: str, small: bool) -> Case:
    # small: one 16-byte pack fewer than ranks (8 bf16 a pack)
    x = torch.empty((comm.world_size - 1) * 8 if small else 32 * 1024, device="cuda", dtype=torch.bfloat16)
    return Case(x, lambda: comm.all_reduce(x, algo=algo), lambda values: torch.full_like(x, sum(values)))


def _fused_norm(comm: Communicator, small: bool) -> Case:
    """The residual stream (sum + residual): the normed rows of a constant input hide the sum."""
    x = torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.randint(-8, 9, x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    residual = residual.to(x.dtype)
    weight = torch.ones(x.shape[1], device="cuda", dtype=x.dtype)

    def run() -> torch.Tensor:
        fused = comm.kernels.try_all_reduce_norm(x, residual, weight, 1e-6, False)
        assert fused is not None, "the fused kernel refused its shapes"
        return fused[1]

    return Case(x, run, lambda values: sum(values) + residual)


def _exchange(comm: Communicator, small: bool) -> Case:
    """heads -> sequence: heads block i of the output comes from rank i."""
    p, heads = comm.world_size, 4
    x = torch.empty(1, p * 256, heads, 64, device="cuda", dtype=torch.bfloat16)

    def right(values: list[float]) -> torch.Tensor:
        return torch.cat([torch.full((1, 256, heads, 64), v, device="cuda", dtype=x.dtype) for v in values], dim=2)

    return Case(x, lambda: torch.ops.graphar.heads_to_seq_all_to_all(x, comm.group_name), right)


ALL_REDUCES = ("1stage", "2stage", "push-oneshot", "push-twoshot")
KINDS: dict[str, Callable[[Communicator, bool], Case]] = {
    **{algo: lambda comm, small, algo=algo: _all_reduce(comm, algo, small) for algo in ALL_REDUCES},
    "fused norm": _fused_norm,
    "pulled exchange": _exchange,
    "pushed exchange": _exchange,
}
SMALL = "fewer packs than ranks"
# (kind, size) at each world size: every kind at its size, and the all-reduces small too.
CASES = [
    pytest.param(world_size, kind, small, id=f"ws{world_size}-{kind}{'-' + SMALL if small else ''}")
    for world_size in WORLD_SIZES
    for kind, small in [*((kind, False) for kind in KINDS), *((kind, True) for kind in ALL_REDUCES)]
]


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


def _late_peer(rank: int, world_size: int, kind: str, small: bool) -> None:
    os.environ["GRAPHAR_ALLTOALL_ALGO"] = "push" if kind == "pushed exchange" else "pull"
    for mode in ("eager", "torch.cuda.graph", "graphar.graph"):
        what = f"{kind}, {mode}"
        comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=TIMEOUT_S)
        case = KINDS[kind](comm, small)
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


@pytest.mark.parametrize("world_size, kind, small", CASES)
def test_a_late_peer_gets_the_right_sum_or_nan(world_size: int, kind: str, small: bool) -> None:
    run_workers(_late_peer, world_size, kind, small, timeout_s=120)


def _captured(case: Case, mode: str = "torch.cuda.graph") -> Callable[[], torch.Tensor]:
    graph = torch.cuda.CUDAGraph()
    with graphar.graph(graph) if mode == "graphar.graph" else torch.cuda.graph(graph):
        out = case.run()
    return lambda: graph.replay() or out


def _cases(world_size: int, kind: str, small: bool, n: int = 2) -> tuple[Communicator, list[Case]]:
    """A communicator and n calls of `kind` on it, each run once: every rank sizes the exchange buffer
    (collective) and warms up before a capture."""
    os.environ["GRAPHAR_ALLTOALL_ALGO"] = "push" if kind == "pushed exchange" else "pull"
    comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=TIMEOUT_S)
    cases = [KINDS[kind](comm, small) for _ in range(n)]
    for case in cases:
        case.x.fill_(LATE)
        case.run()
    torch.cuda.synchronize()
    return comm, cases


def _swapped_replays(rank: int, world_size: int, kind: str, small: bool, mode: str) -> None:
    what = f"{kind}, {mode}"
    comm, cases = _cases(world_size, kind, small)
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
    order = (1, 0) if rank == 1 else (0, 1)  # rank 1 alone replays the other order
    outs = {n: calls[n]().clone() for n in order}
    torch.cuda.synchronize()
    for n in order:
        _right_or_nan(outs[n], cases[n].right(values[n]), f"{what}, graph {n} replayed in swapped order")
    assert torch.isnan(outs[order[0]]).any(), f"{what}: the first replay met the peer's other graph unnoticed"
    _raises_at_next_host_call(comm, what)
    dist.barrier()
    comm.close()


@pytest.mark.parametrize("mode", ["torch.cuda.graph", "graphar.graph"])
@pytest.mark.parametrize("world_size, kind, small", CASES)
def test_graphs_replayed_in_swapped_orders_are_nan_and_an_error(
    world_size: int, kind: str, small: bool, mode: str
) -> None:
    run_workers(_swapped_replays, world_size, kind, small, mode, timeout_s=120)


def _two_streams(rank: int, world_size: int, kind: str, small: bool, other: str) -> None:
    """A graph replayed on one stream and, unordered with it, an eager call (or a second graph's replay,
    or two more graphs' replays, each on a stream of its own) of the same communicator on another: each
    output is right or NaN, and a NaN comes with an error at the next host call. In one process the
    streams' kernels do run at once. Three launches at once were the claim's blind spot: tags t - 1 and
    t + 1 summed like two blocks of t (csrc/claim.cuh, claim_word)."""
    comm, cases = _cases(world_size, kind, small, 3 if other == "two replays" else 2)
    calls = [_captured(case) for case in cases] if other != "eager" else [_captured(cases[0]), cases[1].run]
    streams = [torch.cuda.Stream() for _ in cases]
    failed_at = None
    for i in range(ITERATIONS):
        values = [[float((r + 1) * (i % m + base)) for r in range(world_size)] for m, base in ((7, 1), (5, 9), (3, 20))]
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
@pytest.mark.parametrize("other", ["eager", "replay", "two replays"])
@pytest.mark.parametrize("world_size, kind, small", CASES)
def test_two_streams_on_one_communicator_are_right_or_an_error(
    world_size: int, kind: str, small: bool, other: str
) -> None:
    run_workers(_two_streams, world_size, kind, small, other, timeout_s=120)


def _lost_claim(rank: int, world_size: int, timeout_s: float | None) -> None:
    """Rank 0 replays graph A, whose kernel waits at its entry for peers that are not there yet, and then,
    unordered with it, graph B: B's kernel loses the claim and must say so at once (its lanes stopped
    waiting for peers, within 10 ms), whatever the timeout, unbounded (0) included."""
    comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=timeout_s)
    xs = [torch.full((32 * 1024,), float(rank + 1), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for x in xs:
        comm.all_reduce(x, algo="1stage")
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in xs]
    outs = []
    for graph, x in zip(graphs, xs):
        with graphar.graph(graph):  # zero copy: the graph path claims beside its entry barrier
            outs.append(comm.all_reduce(x, algo="1stage"))
    dist.barrier()
    seconds = 0.0
    if rank == 0:
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        with torch.cuda.stream(streams[0]):
            graphs[0].replay()
        time.sleep(0.1)  # A's blocks have claimed the communicator and wait for their peers
        done = torch.cuda.Event()
        start = time.monotonic()
        with torch.cuda.stream(streams[1]):
            graphs[1].replay()
            done.record()
        while not done.query() and time.monotonic() - start < 5:
            time.sleep(0.0002)
        seconds = time.monotonic() - start
    dist.barrier()
    if rank != 0:
        graphs[0].replay()  # meets rank 0's A (right or NaN), so that nothing waits any more
    torch.cuda.synchronize()
    if rank == 0:
        assert seconds < 0.01, f"the kernel that lost its claim ended {seconds * 1e3:.1f} ms after its start"
        assert torch.isnan(outs[1]).all(), "the kernel that lost its claim wrote numbers"
        with pytest.raises(graphar.GrapharCommError, match="two of its kernels ran at once"):
            comm.check()
    _right_or_nan(outs[0], torch.full_like(outs[0], sum(range(1, world_size + 1))), "the kernel that won")
    dist.barrier()


@pytest.mark.parametrize("timeout_s", [None, 0], ids=["default timeout", "no timeout"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_kernel_that_loses_its_claim_says_so_at_once(world_size: int, timeout_s: float | None) -> None:
    run_workers(_lost_claim, world_size, timeout_s, timeout_s=120)


def _failed_copy_ins(rank: int, world_size: int, algo: str) -> None:
    """Rank 0 calls alone (its call times out) and queues two more calls behind it before the host can know:
    those find the group failed and copy nothing into the registered buffer, which a late peer may still
    be reading. It holds the first call's input."""
    comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=0.5)
    x = torch.full((32 * 1024,), LATE, device="cuda", dtype=torch.bfloat16)
    comm.all_reduce(x, algo=algo)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        buffer = registered_buffer(comm, x.nbytes).view(x.dtype)
        outs = [comm.all_reduce(torch.full_like(x, value), algo=algo) for value in (FIRST, SECOND, 3 * SECOND)]
        torch.cuda.synchronize()
        assert all(torch.isnan(out).all() for out in outs), "a call without its peers wrote numbers"
        assert torch.equal(buffer, torch.full_like(x, FIRST)), (
            f"calls of a failed group copied their inputs in: {buffer[:4].tolist()} where {FIRST} was the last input before the failure"
        )
        _raises_at_next_host_call(comm, algo)
    dist.barrier()


@pytest.mark.parametrize("algo", ["1stage", "2stage"])
def test_calls_of_a_failed_group_copy_nothing_in(algo: str) -> None:
    run_workers(_failed_copy_ins, 2, algo, timeout_s=120)


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie until its parent reaps it)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _peer_dies(rank: int, world_size: int, kind: str) -> None:
    """The last rank exits after one call, closing nothing; then the others call."""
    os.environ["GRAPHAR_ALLTOALL_ALGO"] = "push" if kind == "pushed exchange" else "pull"
    comm = graphar.init(dist.new_group(list(range(world_size))), timeout_s=TIMEOUT_S)
    case = KINDS[kind](comm, False)
    case.x.fill_(LATE)
    case.run()  # sizes the exchange buffer (collective)
    torch.cuda.synchronize()
    pids = comm.all_gather(os.getpid(), "process ids")
    if rank == world_size - 1:
        os._exit(0)
    deadline = time.monotonic() + 60
    while not _gone(pids[-1]):
        assert time.monotonic() < deadline, "the dying rank did not exit"
        time.sleep(0.01)
    case.x.fill_(FIRST)
    out = case.run().clone()
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), f"{kind}: a call without its dead peer wrote numbers"
    _raises_at_next_host_call(comm, kind)
    assert torch.arange(4, device="cuda").sum().item() == 6, "this rank's CUDA context broke"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_peer_that_dies_leaves_nan_and_an_error(world_size: int, kind: str) -> None:
    run_workers(_peer_dies, world_size, kind, timeout_s=120, meet_at_end=False)
