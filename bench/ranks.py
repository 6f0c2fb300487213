"""Decisions every rank of a benchmark takes alike (common uses them too).

    alone(), rank()                     no process group (a one-GPU benchmark), and this process's rank
    all_ranks(flag)                     True on every rank iff flag is True on every rank
    max_over_ranks(cells)               {key: float | str} -> the same keys, max over ranks (a str wins)
    agree(problem)                      None on every rank iff every rank passes None, else the lowest rank's problem
    attempt(fn, what)                   fn() on every rank, (value, None), or (None, why) on every rank if one raised
    verdict(fn, what, reasons, key)     a check's cell ("WRONG", ...; "err" if it raised), alike on every rank
    measured(prepare, time_it, ...)     a timed cell: prepare() (a capture) agreed, then time_it(it); else "err"
    counting_rewrites()                 the graphar ops compiled within a with block
    rewritten(made, expected, ...)      "not rewritten" on every rank unless the expected op was compiled

Every collective must be reached by every rank in the same order, or the ranks hang until NCCL's
timeout: a decision taken before a collective (eligible? did the capture work? did the check pass?)
is agreed first, which is what `attempt`, `verdict` and `measured` do.

Without a process group (the one-GPU benchmarks, which run in the calling process) this process is
the only rank: every decision is its own, and nothing is exchanged.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Cell = float | str  # microseconds, or why there is no time ("-", "n/a", "err", "WRONG", ...)
T = TypeVar("T")


def alone() -> bool:
    """No process group: this process is rank 0 of a world of one."""
    return not dist.is_initialized()


def rank() -> int:
    return 0 if alone() else dist.get_rank()


def combine(values: Iterable[Cell]) -> Cell:
    """The max of floats; the first string if any rank reported one (n/a, err, ...)."""
    values = list(values)
    strings = [v for v in values if isinstance(v, str)]
    return strings[0] if strings else max(values)


def max_over_ranks(cells: Mapping[Any, Cell]) -> dict[Any, Cell]:
    """Collective: every rank passes its cells (same keys); each key gets the max over ranks."""
    if alone():
        return dict(cells)
    gathered: list[Mapping[Any, Cell]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, dict(cells))
    return {key: combine(rank_cells[key] for rank_cells in gathered) for key in cells}


def all_ranks(flag: bool) -> bool:
    """Collective: a decision every rank must take the same way (a split decision would hang)."""
    if alone():
        return flag
    t = torch.tensor([1 if flag else 0], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def agree(problem: str | None) -> str | None:
    """Collective: None on every rank when every rank passes None, else the lowest rank's problem."""
    if all_ranks(problem is None) or alone():
        return problem
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next(p for p in problems if p is not None)


def attempt(fn: Callable[[], T], what: str) -> tuple[T | None, str | None]:
    """Collective: fn() on every rank; (its value, None), or (None, why) on every rank when it raised
    on any. fn must not hold collectives that a rank raising before them would leave unmatched."""
    try:
        value, problem = fn(), None
    except Exception as e:  # noqa: BLE001  (any failure: every rank must agree on it, not just the raiser)
        traceback.print_exc()  # the whole story to the log; the report's notes get its first line
        first_line = str(e).partition("\n")[0]
        value, problem = None, f"{what} raised on rank {rank()}: {type(e).__name__}: {first_line}"
    problem = agree(problem)
    return (value, None) if problem is None else (None, problem)


def verdict(fn: Callable[[], str | None], what: str, reasons: dict[str, str], key: str) -> str | None:
    """Collective: a check fn() returns None (passed) or the cell to show ("WRONG", ...); every rank
    gets the lowest failing rank's cell, or "err" when fn raised on any (the reason in reasons[key])."""
    status, problem = attempt(fn, what)
    if problem is not None:
        reasons.setdefault(key, problem)
        return "err"
    return agree(status)


def measured(
    prepare: Callable[[], T], time_it: Callable[[T], float], what: str, reasons: dict[str, str], key: str
) -> Cell:
    """Collective: prepare() (a capture, a compile: what can fail on one rank alone), then time_it(its
    value) where it worked on every rank, else "err" on every rank (the reason in reasons[key]). The
    timing holds collectives, so it runs on all ranks or none; an exception there ends the run."""
    value, problem = attempt(prepare, what)
    if problem is not None:
        reasons.setdefault(key, problem)
        return "err"
    return time_it(value)


@contextlib.contextmanager
def counting_rewrites() -> Iterator[Counter[str]]:
    """The graphar ops compiled within the block, by op name (torch._dynamo.utils.counters["graphar"]).
    Compiles are lazy: the block must hold the compiled function's first call."""
    from torch._dynamo.utils import counters

    before = Counter(counters["graphar"])
    made: Counter[str] = Counter()
    try:
        yield made
    finally:
        made.update(Counter(counters["graphar"]) - before)


def rewritten(made: Mapping[str, int], expected: str, reasons: dict[str, str], key: str) -> str | None:
    """Collective: None when every rank's compile made the `expected` op, else "not rewritten" on
    every rank (the counts in reasons[key]): the variant would time graphar's fallback under its name."""
    problem = agree(None if made.get(expected) else f"not rewritten: no {expected} rewrite, rewrites {dict(made)}")
    if problem is not None:
        reasons.setdefault(key, problem)
        return "not rewritten"
    return None
