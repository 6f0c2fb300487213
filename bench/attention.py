"""A Ulysses attention block, compiled three ways, against its compute-only floor.

    python bench/attention.py [--shapes 1x4096x24x128,...] [--chunks 2] [--world-size N]
                              [--quick] [--dry-run] [--out F]

The block is DiT/Llama-style: Q/K/V projection, QK-norm (RMSNorm over the head dim), RoPE at the
rank's global positions, Ulysses sequence -> heads (three all-to-alls as yunchang writes them),
attention, heads -> sequence, output projection. For each shape `b x s x h x d` (global sequence
s, all heads h; bf16), per block, in CUDA graphs of back-to-back blocks:
  (a) inductor + NCCL:       torch.compile(backend="inductor");
  (b) graphar packed:        backend="graphar" (one packed Q/K/V exchange, IPC after graphar.init);
  (c) graphar overlapped:    backend="graphar", options={"attention_chunks": N} (exchanges hidden
                             behind the attention, chunk by chunk);
  (d) compute only:          (a) with every exchange replaced by a local copy of the same bytes.
Exposed communication is a variant's time minus (d)'s. The table goes to stdout and to
attention-<gpu>-ws<N>.md (bench/results/, or --out), with a bar
chart of the time per shape by variant beside it (.png).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import common
import plot
import ranks
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked
from ulysses import parse_shape

DTYPE = torch.bfloat16
DEFAULT_SHAPES = [(1, 4096, 24, 128), (1, 16384, 24, 128), (1, 16384, 40, 128), (1, 32760, 40, 128)]
QUICK_SHAPES = DEFAULT_SHAPES[:2]
NCCL, PACKED, OVERLAPPED, FLOOR = "inductor + NCCL", "graphar packed", "graphar overlapped", "compute only"
VARIANTS = (NCCL, PACKED, OVERLAPPED, FLOOR)
LABELS = {v: f"({'abcd'[i]}) {v}" for i, v in enumerate(VARIANTS)}
# The rewrite each graphar variant is about: without it, it would time another path under its name.
EXPECTED_REWRITES = {PACKED: "qkv_all_to_all", OVERLAPPED: "ulysses_attention"}
GRAPH_BYTES = 2 << 30  # activations per captured graph, which bounds its block count
# NCCL's: past the ranks' compile skew, and a hang ends with a traceback well before gpu_session.sh's 540 s.
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Settings:
    shapes: list[tuple[int, int, int, int]]
    chunks: int
    max_blocks: int  # back-to-back blocks per captured graph, at most
    replays: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", help="comma-separated b x s x h x d, e.g. 1x4096x24x128 (s: global sequence)")
    p.add_argument("--chunks", type=int, default=2, help="attention_chunks of variant (c) (default 2)")
    common.add_arguments(p, quick_help="2 shapes, fewer blocks and replays")


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    shapes = [parse_shape(s) for s in args.shapes.split(",")] if args.shapes else None
    if args.chunks < 2:
        p.error("--chunks must be 2 or more")
    return Settings(
        shapes=shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES),
        chunks=args.chunks,
        max_blocks=5 if args.quick else 10,
        replays=5 if args.quick else 9,
    )


# ---- the block ----------------------------------------------------------------------------------


def _local_seq_to_heads(x: torch.Tensor, p: int) -> torch.Tensor:
    """The bytes of the sequence -> heads exchange moved by a local copy: same shapes, no peer."""
    b, s, h, d = x.shape
    return x.view(b, s, p, h // p, d).transpose(1, 2).reshape(b, p * s, h // p, d).clone()


def _local_heads_to_seq(o: torch.Tensor, p: int) -> torch.Tensor:
    b, s_global, h, d = o.shape
    return o.view(b, p, s_global // p, h, d).transpose(1, 2).reshape(b, s_global // p, p * h, d).clone()


class Block(nn.Module):
    """This rank's view of one attention block over its slice of the sequence."""

    def __init__(
        self, shape: tuple[int, int, int, int], rank: int, world_size: int, exchange: bool, device: str = "cuda"
    ) -> None:
        super().__init__()
        _, s, h, d = shape
        gen = torch.Generator().manual_seed(0)  # replicated weights: equal on every rank
        self.qkv = nn.Parameter((torch.randn(h * d, 3 * h * d, generator=gen) / (h * d) ** 0.5).to(device, DTYPE))
        self.out = nn.Parameter((torch.randn(h * d, h * d, generator=gen) / (h * d) ** 0.5).to(device, DTYPE))
        self.q_norm = nn.Parameter(torch.ones(d, dtype=DTYPE, device=device))
        self.k_norm = nn.Parameter(torch.ones(d, dtype=DTYPE, device=device))
        local = s // world_size
        positions = torch.arange(rank * local, (rank + 1) * local, dtype=torch.float32)
        freqs = positions[:, None] / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.cat([freqs, freqs], dim=-1)[None, :, None, :]  # [1, S, 1, d]
        self.register_buffer("cos", angles.cos().to(device, DTYPE))
        self.register_buffer("sin", angles.sin().to(device, DTYPE))
        self.shape, self.p, self.exchange = (h, d), world_size, exchange

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h, d = self.shape
        q, k, v = (t.view(b, s, h, d) for t in (x @ self.qkv).chunk(3, dim=-1))
        q = self.rope(F.rms_norm(q, (d,), self.q_norm))
        k = self.rope(F.rms_norm(k, (d,), self.k_norm))
        to_heads = seq_to_heads_unpacked if self.exchange else lambda t: _local_seq_to_heads(t, self.p)
        to_seq = heads_to_seq_unpacked if self.exchange else lambda t: _local_heads_to_seq(t, self.p)
        qh, kh, vh = (to_heads(t).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)
        return to_seq(o.contiguous()).reshape(b, s, h * d) @ self.out


# ---- measuring ------------------------------------------------------------------------------------


def variants(shape, rank: int, world_size: int, chunks: int, graphar_ok: bool) -> dict[str, Callable]:
    with_exchange = Block(shape, rank, world_size, exchange=True)
    runs = {
        NCCL: torch.compile(with_exchange, backend="inductor", dynamic=False),
        FLOOR: torch.compile(Block(shape, rank, world_size, exchange=False), backend="inductor", dynamic=False),
    }
    if graphar_ok:
        runs[PACKED] = torch.compile(with_exchange, backend="graphar", dynamic=False)
        runs[OVERLAPPED] = torch.compile(
            with_exchange, backend="graphar", dynamic=False, options={"attention_chunks": chunks}
        )
    return runs


def variant_cell(
    v: str,
    run: Callable,
    x: torch.Tensor,
    outs: dict[str, torch.Tensor],
    blocks: int,
    s: Settings,
    reasons: dict[str, str],
) -> common.Cell:
    """One variant at x's shape: compiled (its first call, kept in outs), its rewrite and its output
    checked, then timed; "err", "not rewritten" or "WRONG" instead, alike on every rank."""
    with ranks.counting_rewrites() as made:
        out, problem = ranks.attempt(lambda: run(x), f"compiling {LABELS[v]}")
    if problem is not None:
        reasons.setdefault(v, problem)
        return "err"
    outs[v] = out
    status = graphar_status(v, out, made, outs, reasons) if v in EXPECTED_REWRITES else None
    return status or ranks.measured(
        lambda: common.capture(lambda i: run(x), blocks),
        lambda graph: common.time_gpu(graph.replay, repeats=s.replays, per=blocks),
        "capture",
        reasons,
        v,
    )


def graphar_status(
    v: str, out: torch.Tensor, made: Mapping[str, int], outs: dict[str, torch.Tensor], reasons: dict[str, str]
) -> str | None:
    """Why a graphar variant is not timed ("not rewritten", "WRONG", "err"), alike on every rank; None: time it."""
    status = ranks.rewritten(made, EXPECTED_REWRITES[v], reasons, v)
    if status is not None:
        return status
    if NCCL not in outs:
        reasons.setdefault(v, f"timed unchecked: {LABELS[NCCL]} failed")
        return None
    return ranks.verdict(lambda: None if _close(out, outs[NCCL]) else "WRONG", f"checking {LABELS[v]}", reasons, v)


def run_shape(
    shape, rank: int, world_size: int, s: Settings, graphar_ok: bool, reasons: dict[str, str]
) -> dict[tuple, common.Cell]:
    """(shape, variant) -> cell; every rank takes the same decisions, each through a collective."""
    b, seq, h, d = shape
    x = torch.randn(b, seq // world_size, h * d, device="cuda", dtype=DTYPE)
    runs = variants(shape, rank, world_size, s.chunks, graphar_ok)
    blocks = max(1, min(s.max_blocks, GRAPH_BYTES // (8 * x.nbytes)))
    outs: dict[str, torch.Tensor] = {}  # (a) first: the others are checked against it
    with torch.no_grad():
        cells = {
            (shape, v): variant_cell(v, runs[v], x, outs, blocks, s, reasons) if v in runs else "n/a" for v in VARIANTS
        }
    reasons["graphar rewrites (rank 0)"] = str(dict(torch._dynamo.utils.counters["graphar"]))
    return cells


def set_up_graphar() -> None:
    import graphar

    if graphar.init() is None:
        raise RuntimeError("graphar.init returned None: the exchanges would use NCCL (its log says why)")


def worker(rank: int, world_size: int, s: Settings, out_path: Path | None) -> None:
    reasons: dict[str, str] = {}
    _, problem = ranks.attempt(set_up_graphar, "graphar set-up")
    if problem is not None:
        reasons["graphar"] = problem
    common.run_units(
        s.shapes,
        lambda shape: "x".join(map(str, shape)),
        lambda shape: run_shape(shape, rank, world_size, s, problem is None, reasons),
        common.reporter("attention", s, "shapes", write, reasons, out_path),
    )


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main(args, s, dry_run, worker, TIMEOUT_S)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got.float() - want.float()).abs().max().item() <= 0.02 * want.float().abs().max().item()


# ---- the report -----------------------------------------------------------------------------------


def _exposed(cells: dict, shape, v: str) -> common.Cell:
    t, floor = cells[(shape, v)], cells[(shape, FLOOR)]
    return t - floor if isinstance(t, float) and isinstance(floor, float) else "-"


def write(
    cells: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    columns = [
        "shape (b x s x h x d)",
        *LABELS.values(),
        "exposed (a)",
        "exposed (c)",
        "exposed (c) / (a)",
        "(a) / (b)",
        "(a) / (c)",
    ]
    rows = []
    for shape in s.shapes:
        t = [cells[(shape, v)] for v in VARIANTS]
        exposed_a, exposed_c = _exposed(cells, shape, NCCL), _exposed(cells, shape, OVERLAPPED)
        rows.append(
            [
                "x".join(map(str, shape)),
                *t,
                exposed_a,
                exposed_c,
                common.derived(exposed_c, exposed_a, "{:.0%}"),
                common.derived(t[0], t[1]),
                common.derived(t[0], t[2]),
            ]
        )
    notes = [
        f"bf16; us per block: median of {s.replays} replays of a CUDA graph of back-to-back blocks, max over "
        "ranks; s is the global sequence, each rank holds s / world size tokens.",
        f"(c) pipelines the attention over up to {s.chunks} chunks of heads (graphar::ulysses_attention).",
        "Exposed communication: the variant's time minus the compute-only floor (d).",
        "(b) and (c) are checked against (a) first (within 2% of the largest output; WRONG otherwise), and "
        "must have been rewritten by graphar's pass (qkv_all_to_all, ulysses_attention; 'not rewritten' "
        "otherwise, not timed).",
    ] + [f"{k}: {v}" for k, v in sorted(reasons.items())]
    info = common.header("attention block, CUDA graphs", world_size, gpu)
    title = "Ulysses attention block (us)"
    text = common.report(title, info, [("per block, us", common.markdown_table(columns, rows))], notes)
    bars = {label: [cells[(shape, v)] for shape in s.shapes] for v, label in LABELS.items()}
    chart = plot.BarChart(
        "us per block, max over ranks", "us per block", ["x".join(map(str, shape)) for shape in s.shapes], bars
    )
    common.write_report(text, path, [chart], f"{title}, {gpu}, world size {world_size}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU, no graphar needed."""
    rng = random.Random(0)
    cells: dict[tuple, common.Cell] = {}
    for shape in s.shapes:
        floor = shape[1] * shape[2] / 200
        cells.update(
            {
                (shape, FLOOR): floor,
                (shape, NCCL): floor * rng.uniform(1.4, 1.8),
                (shape, PACKED): floor * rng.uniform(1.2, 1.4),
                (shape, OVERLAPPED): floor * rng.uniform(1.0, 1.2),
            }
        )
    path = common.results_path("attention", common.DRY_RUN_GPU, 2, out, common.dry_run_dir())
    write(cells, s, 2, {}, common.DRY_RUN_GPU, path)


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
