"""From the all-reduce benchmark's numbers to graphar.allreduce.policy's table, and back from a report.

The benchmark names the fastest graphar kernel per size for each capture mode of the policy
(`fastest_table`, a section of its report); `policy_rows` turns those winners into the policy's
rows, and `winners_from_report` reads them back from a committed report (tools/policy_rows.py and
the policy's test do).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import common
from graphar.allreduce import policy

FASTEST_HEADING = "fastest graphar kernel per capture mode (PDL on); graphar.allreduce.policy's table follows it"
Winners = dict[str, list[tuple[int, str]]]  # capture mode -> [(bytes, kernel)]
# A kernel keeps its sizes while it stays within this fraction of the fastest: timing noise between
# near-equal kernels must not cut the table into many rows.
TIE = 0.03


def policy_columns(kernels: Mapping[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """Each policy capture mode's benchmark mode and the columns that measure its kernels: one
    kernel each (not the policy's own pick), PDL on (the default), v1 zero-copy only where graphar
    owns the capture (`kernels`: column name -> an object with algo, zero_copy and pdl)."""
    picked = {n: k for n, k in kernels.items() if k.algo is not None and k.pdl}
    plain = [n for n, k in picked.items() if not k.zero_copy]
    owned = [n for n, k in picked.items() if k.zero_copy or k.algo.startswith("push")]
    return {policy.EAGER: ("eager", plain), policy.GRAPH: ("graph", plain), policy.GRAPHAR_GRAPH: ("graph", owned)}


def fastest(
    results: Mapping[tuple, common.Cell], sizes: Sequence[int], modes: Sequence[str], kernels: Mapping[str, Any]
) -> Winners:
    """The fastest kernel per size, for each capture mode whose benchmark mode ran; the previous
    size's kernel wins a near tie (within TIE of the fastest)."""
    winners = {}
    for capture, (mode, names) in policy_columns(kernels).items():
        if mode not in modes:
            continue
        rows: list[tuple[int, str]] = []
        for nbytes in sizes:
            timed = {kernels[n].algo: results[(mode, nbytes, n)] for n in names}
            timed = {algo: t for algo, t in timed.items() if isinstance(t, float)}
            if not timed:
                continue
            best = min(timed, key=timed.__getitem__)
            held = rows[-1][1] if rows else None
            keep = held in timed and timed[held] <= timed[best] * (1 + TIE)
            rows.append((nbytes, held if keep else best))
        winners[capture] = rows
    return winners


def fastest_table(
    results: Mapping[tuple, common.Cell], sizes: Sequence[int], modes: Sequence[str], kernels: Mapping[str, Any]
) -> tuple[str, str] | None:
    """(heading, markdown table) of `fastest`, for the report; None when no mode of the policy ran."""
    winners = fastest(results, sizes, modes, kernels)
    if not winners:
        return None
    captures = list(winners)
    by_size = {capture: dict(rows) for capture, rows in winners.items()}
    rows = [[common.format_bytes(n)] + [by_size[c].get(n, "-") for c in captures] for n in sizes]
    return FASTEST_HEADING, common.markdown_table(["size"] + captures, rows)


def policy_rows(winners: Sequence[tuple[int, str]]) -> policy.Rows:
    """The policy's rows from per-size winners: each kernel up to the last size it won before
    another took over; the last kernel serves every larger size."""
    rows: list[tuple[int, str]] = []
    for (nbytes, algo), following in zip(winners, [*winners[1:], (None, None)]):
        if following[1] != algo:
            rows.append((nbytes if following[0] is not None else policy.OPEN, algo))
    return tuple(rows)


def winners_from_report(text: str) -> Winners | None:
    """A written report's fastest-kernel section; None when it has none."""
    marker = f"## {FASTEST_HEADING}"
    if marker not in text:
        return None
    section = text.split(marker, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    captures = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    winners: Winners = {c: [] for c in captures}
    for line in lines[2:]:
        size, *kernels = (c.strip() for c in line.strip("|").split("|"))
        for capture, kernel in zip(captures, kernels):
            if kernel != "-":
                winners[capture].append((common.parse_bytes(size.replace(" ", "")), kernel))
    return winners
