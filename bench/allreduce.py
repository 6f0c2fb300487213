"""All-reduce latency: NCCL, PyTorch symmetric memory and graphar, in CUDA graphs and eager.

    python bench/allreduce.py [--sizes 16K,64K,...] [--dtype bf16] [--modes graph,eager,graph-mm]
                              [--world-size N] [--quick] [--dry-run] [--out F]

Modes: "graph" (per-op us over a CUDA graph of back-to-back ops), "eager" (host-timed loop),
"graph-mm" (per-iteration us of a matmul followed by the collective, in a CUDA graph).
The table goes to stdout and to allreduce-<gpu>-ws<N>.md (bench/results/, or --out),
with a log-log plot of latency against size beside it (.png).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import common
import plot
import ranks
import winners
from allreduce_columns import (
    G_AUTO,
    G_AUTO_ZERO,
    GRAPHAR_KERNELS,
    MODES,
    N_BUFFERS,
    NCCL,
    TWO_SHOT,
    Column,
    Contenders,
    add_graphar,
    add_nccl,
    add_symm_mem,
    agree_on_columns,
    column_names,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = [16 * KB << i for i in range(13)]  # 16 KB .. 64 MB
QUICK_SIZES = [16 * KB, 256 * KB, 2 * MB, 8 * MB]
# graphar's default limit is 8 MB; the benchmark raises it so that the whole range is covered.
GRAPHAR_MAX_BYTES = 64 * MB
MM_SHAPE = (512, 4096, 4096)  # [m, k] x [k, n] bf16: a few tens of microseconds on an H200


def ratio_pair(mode: str) -> tuple[str, str]:
    """The graphar column a row compares with NCCL: the policy's pick, in each mode's best capture."""
    return (G_AUTO if mode == "eager" else G_AUTO_ZERO), NCCL


@dataclass(frozen=True)
class Settings:
    sizes: list[int]
    dtype: str
    modes: list[str]
    ops: int  # back-to-back ops per captured graph
    replays: int  # timed replays per graph (median)
    eager_iters: int


TIMEOUT_S = 180.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", help="comma-separated byte sizes, e.g. 16K,1M (default 16K..64M, powers of 2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    common.add_arguments(p, quick_help="4 sizes, fewer ops and replays")


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    sizes = [common.parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else None
    sizes = sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    itemsize = DTYPES[args.dtype].itemsize
    bad = [s for s in sizes if s <= 0 or s % itemsize]
    if bad:
        p.error(f"sizes {bad} are not positive multiples of the {args.dtype} element size")
    return Settings(
        sizes=sorted(set(sizes)),
        dtype=args.dtype,
        modes=modes,
        ops=20 if args.quick else 50,
        replays=5 if args.quick else 9,
        eager_iters=50 if args.quick else 200,
    )


# ---- measuring ---------------------------------------------------------------------------------

# Why a verified column is not timed at a size (the notes give the first size).
UNTIMED = {
    "WRONG": "differs from NCCL at {}",
    "fallback": "graphar's op handed the call to NCCL at {} (its kernels did not run)",
}


def verify(col: Column, numel: int, dtype: torch.dtype) -> str | None:
    """None when graphar's kernels served the eager call and every call of a capture ("fallback"
    otherwise: NCCL equals NCCL whatever graphar does), and both results equal NCCL's exactly on
    integer-valued inputs, the replay's output poisoned first ("WRONG" otherwise)."""
    x = torch.randint(-4, 5, (numel,), device="cuda").to(dtype)
    before = x.clone()
    ref = x.clone()
    dist.all_reduce(ref)
    served_before = col.calls()
    # A zero-copy column's eager call is its plain twin's: only its captures are its own.
    eager = [col.op(x, None)] if col.context is torch.cuda.graph else []
    outs: list[torch.Tensor] = []  # the warm-up calls' and the captured one's
    graph = common.capture(lambda i: outs.append(col.op(x, None)), 1, context=col.context)
    served = col.calls() - served_before
    outs[-1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    if served != len(eager) + len(outs):
        return "fallback"
    right = all(torch.equal(y, ref) for y in eager + outs[-1:]) and torch.equal(x, before)
    return None if right else "WRONG"


def column_status(col: Column | None, name: str, x: torch.Tensor, reasons: dict[str, str]) -> str | None:
    """The cell of a column that is not timed at x's size ("n/a", "-", "fallback", "WRONG", "err"),
    alike on every rank; None: time it."""
    if col is None:  # agreed at set-up
        return "n/a"
    if not ranks.all_ranks(col.eligible(x)):
        return "-"
    if col.calls is None:
        return None
    size = common.format_bytes(x.nbytes)
    status = ranks.verdict(lambda: verify(col, x.numel(), x.dtype), f"verification at {size}", reasons, name)
    if status in UNTIMED:
        reasons.setdefault(name, UNTIMED[status].format(size))
    return status


def measure(
    col: Column,
    mode: str,
    inputs: list[torch.Tensor],
    out: torch.Tensor,
    s: Settings,
    mm: list[torch.Tensor],
    reasons: dict[str, str],
    name: str,
) -> common.Cell:
    def step(i: int) -> None:
        col.op(inputs[i % len(inputs)], out)

    def step_with_matmul(i: int) -> None:
        torch.mm(mm[0], mm[1], out=mm[2])
        step(i)

    if mode == "eager":
        # One call first, agreed: a rank whose call raises must not leave its peer in the timed loop.
        return ranks.measured(
            lambda: step(0), lambda _: common.time_host(step, iters=s.eager_iters), "the eager call", reasons, name
        )
    fn = step_with_matmul if mode == "graph-mm" else step
    return ranks.measured(
        lambda: common.capture(fn, s.ops, context=col.context),
        lambda graph: common.time_gpu(graph.replay, repeats=s.replays, per=s.ops),
        f"{mode} capture",
        reasons,
        name,
    )


def run_size(
    c: Contenders, nbytes: int, s: Settings, mm: list[torch.Tensor], reasons: dict[str, str]
) -> dict[tuple, common.Cell]:
    """(mode, nbytes, column) -> cell; every rank takes the columns in one order and the same
    decisions (each goes through a collective), so their collectives match."""
    dtype = DTYPES[s.dtype]
    numel = nbytes // dtype.itemsize
    plain = [torch.randn(numel, device="cuda", dtype=dtype) for _ in range(N_BUFFERS)]
    symm = [buf[:numel] for buf in c.symm_buffers]
    for buf in symm:
        buf.normal_()
    out = torch.empty(numel, device="cuda", dtype=dtype)
    cells: dict[tuple, common.Cell] = {}
    for name in dict.fromkeys(n for mode in s.modes for n in column_names(mode)):
        col = c.columns.get(name)
        status = column_status(col, name, plain[0], reasons)
        for mode in s.modes:
            if name in column_names(mode):
                cells[(mode, nbytes, name)] = status or measure(
                    col, mode, symm if col.symmetric else plain, out, s, mm, reasons, name
                )
                torch.cuda.synchronize()
    return cells


def worker(rank: int, world_size: int, s: Settings, out_path: Path | None) -> None:
    dtype = DTYPES[s.dtype]
    torch.manual_seed(1234 + rank)
    c = Contenders()
    add_nccl(c)
    add_symm_mem(c, dtype, max(s.sizes) // dtype.itemsize)
    add_graphar(c, max(GRAPHAR_MAX_BYTES, max(s.sizes)))
    agree_on_columns(c)
    m, k, n = MM_SHAPE
    mm = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in ((m, k), (k, n), (m, n))]
    reasons = dict(c.unavailable)
    common.progress(f"set up; timing {len(s.sizes)} sizes in modes {', '.join(s.modes)}")
    common.run_units(
        s.sizes,
        common.format_bytes,
        lambda nbytes: run_size(c, nbytes, s, mm, reasons),
        common.reporter("allreduce", s, "sizes", write, reasons, out_path),
    )


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main(args, s, dry_run, worker, TIMEOUT_S)


# ---- the report --------------------------------------------------------------------------------


def ratio(row: dict[str, common.Cell], mode: str) -> str:
    num, den = (row.get(name) for name in ratio_pair(mode))
    return common.derived(num, den)


def mode_heading(mode: str, s: Settings) -> str:
    if mode == "eager":
        return f"eager: host-timed loop of {s.eager_iters} calls, us per call"
    what = "per iteration (matmul + collective)" if mode == "graph-mm" else "per op"
    return f"{mode}: CUDA graph of {s.ops} back-to-back iterations, us {what}"


def tables(results: dict[tuple, common.Cell], s: Settings) -> list[tuple[str, str]]:
    sections = []
    for mode in s.modes:
        names = column_names(mode)
        num, den = ratio_pair(mode)
        rows = []
        for nbytes in s.sizes:
            row = {name: results[(mode, nbytes, name)] for name in names}
            rows.append([common.format_bytes(nbytes)] + [row[n] for n in names] + [ratio(row, mode)])
        sections.append((mode_heading(mode, s), common.markdown_table(["size"] + names + [f"{num} / {den}"], rows)))
    best = winners.fastest_table(results, s.sizes, s.modes, GRAPHAR_KERNELS)
    return sections + ([best] if best is not None else [])


def notes(s: Settings, reasons: dict[str, str]) -> list[str]:
    m, k, n = MM_SHAPE
    lines = [
        f"{s.dtype}; max over ranks; graph modes: median of {s.replays} replays; eager: median of 3 loops.",
        f"graphar is initialised with max_bytes={GRAPHAR_MAX_BYTES >> 20} MB (its default limit is 8 MB) "
        "so that the whole range is covered; '-' marks a size graphar refuses.",
        "graphar columns in graph modes run under a plain torch.cuda.graph; 'zero-copy' ones under "
        "graphar.allreduce.graphs.graph (v1 kernels read the inputs in place, pointers backfilled after capture). "
        "The push kernels read their inputs in place under any capture and in eager calls.",
        "'auto' is graphar.allreduce.policy's pick; no-PDL: the kernel launched without programmatic dependent launch.",
        "symm one_shot / two_shot read inputs that already live in the symmetric buffer (no copy-in), "
        "as PyTorch's own symmetric-memory benchmarks do; two_shot is in place.",
        f"Inputs rotate among {N_BUFFERS} buffers; multicast is off (NCCL_NVLS_ENABLE=0, "
        "TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).",
        f"graph-mm: each iteration is a bf16 [{m}, {k}] x [{k}, {n}] matmul then the collective; "
        "'matmul only' is the matmul alone.",
        "graphar columns are checked against NCCL on integer-valued inputs before timing (WRONG = mismatch), "
        "and that graphar's kernels served those calls ('fallback': its op handed them to NCCL, so the "
        "column is not timed under graphar's name); 'err': a call or capture raised (the reason below).",
    ]
    return lines + [f"{name}: {why}" for name, why in sorted(reasons.items())]


def charts(results: dict[tuple, common.Cell], s: Settings) -> list[plot.Chart]:
    """Latency against size, log-log: one line per column and mode (colour: column, dash: mode)."""
    lines = [
        plot.Line(
            f"{name}, {mode}",
            plot.points(s.sizes, [results[(mode, nbytes, name)] for nbytes in s.sizes]),
            colour_key=name,
            dash_key=mode,
        )
        for mode in s.modes
        for name in column_names(mode)
    ]
    ticks = [(nbytes, common.format_bytes(nbytes)) for nbytes in s.sizes]
    title = (
        f"{s.dtype}, max over ranks; colour: implementation, line style: mode\n"
        "(graph: us per op, eager: us per call, graph-mm: us per matmul + op)"
    )
    return [plot.LineChart(title, "message size", "latency, us", lines, ticks)]


def write(
    results: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    info = common.header(",".join(s.modes), world_size, gpu)
    title = "All-reduce latency (us)"
    text = common.report(title, info, tables(results, s), notes(s, reasons))
    common.write_report(text, path, charts(results, s), f"{title}, {gpu}, world size {world_size}", final)


def _fake_latency(rng: random.Random, s: Settings, nbytes: int, name: str) -> common.Cell:
    """A dry run's cell: a latency that grows with size, as real ones do; "-" past graphar's kernels'
    sizes, "err" for the two-shot in fp16. Drawn for every cell, so each keeps its number."""
    fake = (6 + nbytes / 40e3) * rng.uniform(0.7, 1.3)
    if name.startswith("graphar") and nbytes > 8 * MB:
        return "-"
    return "err" if name == TWO_SHOT and s.dtype == "fp16" else fake


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU, no graphar needed."""
    rng = random.Random(0)
    results = {
        (mode, nbytes, name): _fake_latency(rng, s, nbytes, name)
        for mode in s.modes
        for nbytes in s.sizes
        for name in column_names(mode)
    }
    reasons = {TWO_SHOT: "dry run: pretend it raised"} if s.dtype == "fp16" else {}
    path = common.results_path("allreduce", common.DRY_RUN_GPU, 2, out, common.dry_run_dir())
    write(results, s, 2, reasons, common.DRY_RUN_GPU, path)


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
