"""The all-reduce kernel for each size, measured on the group's own GPUs at set-up.

The shipped table (graphar.allreduce.policy) was measured once, on one machine; every other GPU, world
size and link gets a guess. The tuner times every candidate for each size class and capture mode on
this group and keeps the fastest, NCCL included: where NCCL measured faster, the size stays on NCCL.

Rules, each for a reason:
1. The ranks decide from the same numbers. Each size's times are all-gathered, a candidate's time is
   its slowest rank's (a collective ends when its last rank does), and every rank takes the minimum
   in one fixed order of candidates: a rank's noise can never make two ranks pick different kernels,
   which would hang them.
2. Deterministic by default: every graphar kernel sums in rank order in fp32, so switching between
   them never changes a bit; NCCL's ring order does not have that property, so it is a candidate
   only where the user lets the choice be non-deterministic (`deterministic=False`).
3. A time budget bounds the whole table (`budget_s`). Sizes are measured smallest first, and the
   ranks stop together before a size whose cost, predicted from the last one's, would overrun it (the
   slowest rank's clock decides, gathered with the times); sizes not measured keep the shipped table's
   kernels.
4. A table is cached on disk under a key of everything it depends on (GPU model, driver, world size,
   topology, library build, NCCL, candidates), so a job pays for it once. Rank 0's cache decides for
   all ranks: two ranks reading the file at different moments could otherwise disagree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphar.abi import ONE_STAGE, PUSH_ONE_SHOT, PUSH_TWO_SHOT, TWO_STAGE
from graphar.allreduce import graphs, policy

logger = logging.getLogger("graphar")

NCCL = "nccl"
GRAPHAR_CANDIDATES = (ONE_STAGE, TWO_STAGE, PUSH_ONE_SHOT, PUSH_TWO_SHOT)
# Size classes: a call of n bytes takes the pick of the smallest class >= n.
SIZE_CLASSES = tuple(1 << k for k in range(10, 27))  # 1 KB .. 64 MB
FORMAT = 1  # of the cache file: a file of another format is not read

# (candidate, bytes, capture mode) -> microseconds per call on this rank, or None: it cannot run that call.
Timer = Callable[[str, int, str], "float | None"]
AllGather = Callable[[Any, str], list[Any]]


@dataclass
class Table:
    """What the tuner decided: per capture mode, rows as the policy takes them (bound, kernel; None
    is NCCL), and the times behind each pick."""

    rows: dict[str, policy.Rows]
    # mode -> [(size class, {candidate: us of the slowest rank, or None})], in the order measured
    times: dict[str, list[tuple[int, dict[str, float | None]]]] = field(default_factory=dict)
    source: str = "tuned"  # or "cache": read from the tuner's cache

    def describe(self) -> list[str]:
        """One line per measured size and mode: each candidate's time, the pick first."""
        lines = []
        for mode, measured in self.times.items():
            for nbytes, times in measured:
                pick = winner(times)
                cells = [f"{c} {t:.1f}" if t is not None else f"{c} n/a" for c, t in times.items()]
                lines.append(f"{mode} {_size(nbytes)}: {pick or 'shipped'} <- " + ", ".join(cells))
        return lines


def candidates(deterministic: bool, nccl: bool) -> tuple[str, ...]:
    """What may serve a call: graphar's kernels, and NCCL where the user allows a non-deterministic sum."""
    return GRAPHAR_CANDIDATES + ((NCCL,) if nccl and not deterministic else ())


def winner(times: Mapping[str, float | None]) -> str | None:
    """The fastest candidate, ties to the earlier one; None when none ran."""
    ran = [(t, i, c) for i, (c, t) in enumerate(times.items()) if t is not None]
    return min(ran)[2] if ran else None


def slowest(per_rank: Sequence[Mapping[str, float | None]]) -> dict[str, float | None]:
    """Each candidate's time as a collective's: its slowest rank's; None when any rank could not run it."""
    out: dict[str, float | None] = {}
    for c in per_rank[0]:
        ts = [r.get(c) for r in per_rank]
        out[c] = None if any(t is None for t in ts) else max(ts)
    return out


def tune(
    all_gather: AllGather,
    timer: Timer,
    names: Sequence[str],
    shipped: Mapping[str, policy.Rows],
    max_bytes: int,
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Table:
    """Time every candidate of `names` at each size class up to `max_bytes` in every capture mode, in
    step with the other ranks (`all_gather`, collective), within `budget_s`; the rows above the last
    size measured are the shipped table's."""
    start = clock()
    sizes = [s for s in SIZE_CLASSES if s <= max_bytes]
    measured: dict[str, list[tuple[int, dict[str, float | None]]]] = {m: [] for m in policy.MODES}
    elapsed = 0.0
    for nbytes in sizes:
        local = {m: {c: timer(c, nbytes, m) for c in names} for m in policy.MODES}
        gathered = all_gather((local, clock() - start), f"graphar tuner, {_size(nbytes)}")
        for m in policy.MODES:
            measured[m].append((nbytes, slowest([times[m] for times, _ in gathered])))
        # The next size, twice the bytes, costs at most about twice this one: stop where it would
        # overrun the budget, not after it has (at world size 4 under load, one size took 0.5 s).
        now = max(e for _, e in gathered)
        step, elapsed = now - elapsed, now
        if elapsed + 2 * step > budget_s:
            break
    complete = len(measured[policy.MODES[0]]) == len(sizes)
    rows = {m: merged_rows(measured[m], shipped[m], complete) for m in policy.MODES}
    return Table(rows, measured)


def merged_rows(
    measured: Sequence[tuple[int, Mapping[str, float | None]]], shipped: policy.Rows, complete: bool
) -> policy.Rows:
    """Rows for the policy: each measured size class's winner (None: NCCL), then, where the budget cut
    the sizes short (not `complete`), the shipped rows above the last size measured; neighbours with
    one kernel merge into one row, and the last row takes every larger size."""
    out: list[tuple[int, str | None]] = []
    last = 0
    for nbytes, times in measured:
        pick = winner(times)
        if pick is None:  # nothing ran at this size here: the shipped table's kernel
            pick = next(k for bound, k in shipped if nbytes <= bound)
        out.append((nbytes, None if pick == NCCL else pick))
        last = nbytes
    if not complete:
        out += [(bound, k) for bound, k in shipped if bound > last]
    merged: list[tuple[int, str | None]] = []
    for bound, k in out:
        if merged and merged[-1][1] == k:
            merged[-1] = (bound, k)
        else:
            merged.append((bound, k))
    merged[-1] = (policy.OPEN, merged[-1][1])
    return tuple(merged)


# ---- timing on the GPU ------------------------------------------------------------------------------


class GpuTimer:
    """Times one candidate at one size and capture mode on this rank, in step with the peers (every
    rank times the same calls in the same order: each is a collective). Eager: a host loop of `calls`
    calls, as a decode loop without graphs makes them. The graph modes: a CUDA graph of `calls` calls
    (torch.cuda.graph, and graphar.graph, where the v1 kernels read inputs in place), replayed; the
    best of `replays`. Microseconds per call."""

    def __init__(self, allreduce: Any, group: dist.ProcessGroup, calls: int = 8, replays: int = 3) -> None:
        self.kernels = allreduce
        self.group = group
        self.calls = calls
        self.replays = replays
        # NCCL's collective can be captured; gloo's (ranks sharing a GPU in the tests) cannot.
        self.nccl_captures = dist.get_backend(group) == "nccl"

    def __call__(self, candidate: str, nbytes: int, mode: str) -> float | None:
        if candidate == NCCL:
            if mode != policy.EAGER and not self.nccl_captures:
                return None
            op = lambda x: dist.all_reduce(x, group=self.group)  # noqa: E731  (in place: NCCL's own form)
        else:
            if self.kernels.policy.pick(nbytes, mode, candidate) is None:
                return None  # past this kernel's room
            op = lambda x: self.kernels.all_reduce(x, algo=candidate)  # noqa: E731
        x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")  # NCCL sums in place: stays finite
        op(x)  # warm: module load, first-call set-up
        if mode == policy.EAGER:
            return self._timed(lambda: [op(x) for _ in range(self.calls)])
        graph = torch.cuda.CUDAGraph()
        capture = graphs.graph if mode == policy.GRAPHAR_GRAPH else torch.cuda.graph
        with capture(graph):
            for _ in range(self.calls):
                op(x)
        graph.replay()
        return min(self._timed(graph.replay) for _ in range(self.replays))

    def _timed(self, run: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / self.calls


# ---- the cache -------------------------------------------------------------------------------------


def cache_key(facts: Mapping[str, Any]) -> str:
    """The file name of a table tuned where these facts hold (GPU, driver, world size, topology, build, ...)."""
    return hashlib.sha256(json.dumps(dict(sorted(facts.items())), default=str).encode()).hexdigest()[:20]


def load(folder: Path, facts: Mapping[str, Any]) -> Table | None:
    """The cached table for these facts, or None (absent, unreadable, another format, other facts)."""
    try:
        data = json.loads((folder / f"{cache_key(facts)}.json").read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != FORMAT or data.get("facts") != json.loads(json.dumps(dict(facts), default=str)):
        return None
    rows = {m: tuple((int(b), k) for b, k in data["rows"][m]) for m in policy.MODES}
    times = {m: [(int(n), t) for n, t in data["times"].get(m, [])] for m in policy.MODES}
    return Table(rows, times, source="cache")


def save(folder: Path, facts: Mapping[str, Any], table: Table) -> None:
    """Write the table for these facts, atomically (a rank of another job may read it meanwhile)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "facts": dict(facts), "rows": table.rows, "times": table.times}
    fd, tmp = tempfile.mkstemp(prefix=".tuned-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, folder / f"{cache_key(facts)}.json")


def tuned_table(
    rank: int,
    all_gather: AllGather,
    timer: Timer,
    facts: Mapping[str, Any],
    names: Sequence[str],
    shipped: Mapping[str, policy.Rows],
    max_bytes: int,
    budget_s: float,
    folder: Path,
) -> Table:
    """The group's table: rank 0's cached one where it has one (every rank takes it), else tuned now
    by every rank together and cached by rank 0. Collective."""
    facts = {**facts, "candidates": list(names), "max_bytes": max_bytes}
    cached = load(folder, facts) if rank == 0 else None
    cached = all_gather(cached, "graphar tuner, the cached table")[0]
    if cached is not None:
        return cached
    table = tune(all_gather, timer, names, shipped, max_bytes, budget_s)
    if rank == 0:
        try:
            save(folder, facts, table)
        except OSError as e:  # a read-only cache: the next job tunes again
            logger.warning("graphar: the tuned all-reduce table could not be cached in %s: %s", folder, e)
    return table


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
