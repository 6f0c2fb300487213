"""Fused all-reduce + residual add + RMSNorm against the all-reduce alone, at decode sizes.

    python bench/norm.py [--tokens 1,8,...] [--hidden 4096] [--world-size N] [--quick] [--dry-run] [--out F]

Per op, in a CUDA graph of back-to-back ops (graphar.allreduce.graphs.graph), bf16, [tokens, hidden]:
  NCCL + norm:        dist.all_reduce, then the residual add and RMSNorm compiled by Inductor;
  all-reduce alone:   graphar's all-reduce (the policy's kernel), and the push one-shot;
  unfused:            graphar's all-reduce, then the same compiled add + RMSNorm;
  fused:              graphar::all_reduce_add_rms_norm, one kernel.
The fused op's cost over the all-reduce alone is what fusing adds; over "unfused", what it saves.
The table goes to stdout and to norm-<gpu>-ws<N>.md (bench/results/, or --out), with a
plot of time against tokens beside it (.png).
"""

from __future__ import annotations

import argparse
import operator
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import common
import plot
import ranks

DTYPE = torch.bfloat16
EPS = 1e-6
# The fused op's normed output against the unfused ops', relative to their magnitude (clamped at 1e-3):
# bf16's bound in tools/one_gpu_check.py, a few ulps; the sum + residual must match exactly.
NORMED_TOLERANCE = 2**-6
NCCL_NORM, AUTO, PUSH = "NCCL + norm", "graphar all-reduce", "graphar push-oneshot"
UNFUSED, FUSED = "graphar unfused", "graphar fused"
COLUMNS = (NCCL_NORM, AUTO, PUSH, UNFUSED, FUSED)
TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Settings:
    tokens: list[int]
    hidden: int
    ops: int
    replays: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="1,2,4,8,16,32,64", help="comma-separated token counts (rows)")
    p.add_argument("--hidden", type=int, default=4096)
    common.add_arguments(p, quick_help="3 token counts, fewer ops and replays")


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    tokens = [1, 8, 64] if args.quick else sorted({int(t) for t in args.tokens.split(",") if t.strip()})
    if not tokens or min(tokens) < 1 or args.hidden < 8 or args.hidden % 8:
        p.error("tokens must be positive and hidden a positive multiple of 8")
    return Settings(tokens=tokens, hidden=args.hidden, ops=20 if args.quick else 50, replays=5 if args.quick else 9)


def add_rms_norm(summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HF's residual add and LlamaRMSNorm."""
    h = summed + residual
    v = h.float()
    return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype), h


Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def contenders(comm) -> dict[str, Op]:
    norm = torch.compile(add_rms_norm, dynamic=False)
    group = comm.group_name

    def nccl(x, residual, weight):
        dist.all_reduce(x)  # in place, as allreduce.py times NCCL: no copy that graphar's columns do not pay
        return norm(x, residual, weight)

    return {
        NCCL_NORM: nccl,
        AUTO: lambda x, residual, weight: comm.all_reduce(x),
        PUSH: lambda x, residual, weight: comm.all_reduce(x, algo="push-oneshot"),
        UNFUSED: lambda x, residual, weight: norm(comm.all_reduce(x), residual, weight),
        FUSED: lambda x, residual, weight: torch.ops.graphar.all_reduce_add_rms_norm(x, residual, weight, EPS, group),
    }


def fused_is_right(op: Op, tokens: int, hidden: int) -> bool:
    """On integer-valued inputs (their sum is exact in any order), from an eager call and from a replay
    of a captured one: sum + residual equal to the unfused ops' bits, the normed output within
    NORMED_TOLERANCE of theirs."""
    from graphar.allreduce.graphs import graph as graphar_graph

    mine = torch.Generator(device="cuda").manual_seed(dist.get_rank())  # x differs between ranks
    x = torch.randint(-4, 5, (tokens, hidden), device="cuda", generator=mine).to(DTYPE)
    gen = torch.Generator(device="cuda").manual_seed(7)  # replicated: equal on every rank
    residual = torch.randint(-4, 5, (tokens, hidden), device="cuda", generator=gen).to(DTYPE)
    weight = torch.rand(hidden, device="cuda", generator=gen).to(DTYPE) + 0.5
    total = x.clone()
    dist.all_reduce(total)
    want_normed, want_summed = add_rms_norm(total, residual, weight)

    def right(got: tuple[torch.Tensor, torch.Tensor]) -> bool:
        normed, summed = got
        err = (normed.float() - want_normed.float()).abs() / want_normed.float().abs().clamp_min(1e-3)
        return torch.equal(summed, want_summed) and err.max().item() <= NORMED_TOLERANCE

    ok = right(op(x, residual, weight))
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    graph = common.capture(lambda i: outs.append(op(x, residual, weight)), 1, context=graphar_graph)
    for t in outs[-1]:
        t.fill_(float("nan"))  # the replay must write them
    graph.replay()
    torch.cuda.synchronize()
    return ok and right(outs[-1])


def fused_status(
    comm, op: Op, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, reasons: dict[str, str]
) -> str | None:
    """Why the fused op is not timed at x's size ("-", "WRONG", "err"), alike on every rank; None: time it."""
    tokens, hidden = x.shape

    def refused() -> str | None:
        # graphar exposes no predicate for the fused kernel's limits: an eager call tells (it launches
        # the kernel, a collective, where the kernel takes x, which is on every rank alike).
        return None if comm.kernels.try_all_reduce_norm(x, residual, weight, EPS, False) is not None else "-"

    status = ranks.verdict(refused, "the fused kernel's eager call", reasons, f"{FUSED} eager call")
    if status == "-":
        reasons[FUSED] = "'-': over the fused kernel's size (graphar.allreduce.policy), the op runs unfused"
    if status is not None:
        return status
    status = ranks.verdict(
        lambda: None if fused_is_right(op, tokens, hidden) else "WRONG",
        "the fused op's check",
        reasons,
        f"{FUSED} check",
    )
    if status == "WRONG":
        reasons.setdefault(f"{FUSED} check", f"differs from the unfused ops at {tokens} tokens")
    return status


def run_tokens(tokens: int, comm, ops: dict[str, Op], s: Settings, reasons: dict[str, str]) -> dict[tuple, common.Cell]:
    """(tokens, column) -> cell; every rank takes the same decisions, each through a collective."""
    from graphar.allreduce.graphs import graph as graphar_graph

    x = torch.randn(tokens, s.hidden, device="cuda", dtype=DTYPE)
    gen = torch.Generator(device="cuda").manual_seed(tokens)  # replicated: equal on every rank
    residual = torch.randn(tokens, s.hidden, device="cuda", dtype=DTYPE, generator=gen)
    weight = torch.rand(s.hidden, device="cuda", dtype=DTYPE, generator=gen) + 0.5
    cells: dict[tuple, common.Cell] = {}
    for name, op in ops.items():
        status = fused_status(comm, op, x, residual, weight, reasons) if name == FUSED else None
        # NCCL sums in place: its own copy of x keeps the others' input as drawn.
        inp = x.clone() if name == NCCL_NORM else x
        cells[(tokens, name)] = status or ranks.measured(
            lambda: common.capture(lambda i: op(inp, residual, weight), s.ops, context=graphar_graph),
            lambda graph: common.time_gpu(graph.replay, repeats=s.replays, per=s.ops),
            "capture",
            reasons,
            name,
        )
    return cells


def worker(rank: int, world_size: int, s: Settings, out_path: Path | None) -> None:
    import graphar

    comm = graphar.init()
    if comm is None:
        raise RuntimeError("graphar.init returned None (its log says why)")
    ops = contenders(comm)
    reasons: dict[str, str] = {}
    common.run_units(
        s.tokens,
        lambda t: f"{t} tokens",
        lambda t: run_tokens(t, comm, ops, s, reasons),
        common.reporter("norm", s, "tokens", write, reasons, out_path),
    )


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main(args, s, dry_run, worker, TIMEOUT_S)


def write(
    cells: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    rows = []
    for t in s.tokens:
        fused = cells[(t, FUSED)]
        rows.append(
            [
                str(t),
                common.format_bytes(t * s.hidden * DTYPE.itemsize),
                *(cells[(t, c)] for c in COLUMNS),
                *(common.derived(fused, cells[(t, c)], "{:+.1f}", operator.sub) for c in (PUSH, UNFUSED)),
            ]
        )
    columns = ["tokens", "bytes", *COLUMNS, "fused - push-oneshot", "fused - unfused"]
    info = common.header("norm, CUDA graphs", world_size, gpu)
    notes = [
        f"bf16 [tokens, {s.hidden}]; us per op: median of {s.replays} replays of a graphar.graph of {s.ops} "
        "back-to-back ops, max over ranks.",
        "norm: the residual add and HF's LlamaRMSNorm (weight * normed.to(bf16)), compiled by Inductor.",
        "The fused op is checked first on integer-valued inputs, eager and replayed: sum + residual equal to "
        "the unfused ops' bits, the normed output within 2**-6 of theirs, relatively (WRONG otherwise).",
    ] + [f"{name}: {why}" for name, why in sorted(reasons.items())]
    title = "Fused all-reduce + residual add + RMSNorm (us)"
    text = common.report(title, info, [("per op, us", common.markdown_table(columns, rows))], notes)
    lines = [
        plot.Line(c, plot.points(s.tokens, [cells[(t, c)] for t in s.tokens]), colour_key=c, dash_key="graph")
        for c in COLUMNS
    ]
    chart = plot.LineChart(
        f"bf16, hidden {s.hidden}, max over ranks", "tokens", "us per op", lines, [(t, str(t)) for t in s.tokens]
    )
    common.write_report(text, path, [chart], f"{title}, {gpu}, world size {world_size}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU, no graphar needed."""
    rng = random.Random(0)
    cells: dict[tuple, common.Cell] = {}
    for t in s.tokens:
        base = 3 + t * 0.02
        cells.update({(t, c): base * rng.uniform(0.9, 2.5) for c in COLUMNS})
    path = common.results_path("norm", common.DRY_RUN_GPU, 2, out, common.dry_run_dir())
    write(cells, s, 2, {}, common.DRY_RUN_GPU, path)


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
