"""Ulysses exchanges: graphar's packed Q/K/V exchange against three all_to_all_singles, in CUDA graphs.

    python bench/ulysses.py [--shapes 1x4096x24x128,...] [--world-size N] [--quick] [--dry-run] [--out F]

Spawns one process per GPU (run it with plain `python`, not torchrun). For each shape
`b x s x h x d` (global sequence s, all heads h; bf16) it times, per op, CUDA graphs of back-to-back:
- input exchange: 3 x (permute + all_to_all_single + permute) as Ulysses code writes it, and
  `graphar.ulysses.seq_to_heads` (one packed exchange, the op the pass rewrites triplets into)
  over both transports: NCCL (a group without a graphar communicator) and CUDA IPC (the world
  group, after `graphar.init()`), pulled and pushed (GRAPHAR_ALLTOALL_ALGO);
- output exchange: the same for heads -> sequence;
- the pack kernel alone and a device-to-device copy of the same bytes, as bandwidths.
Every graphar result is checked bitwise against the three-collective path first (WRONG on a mismatch).
Times are the max over ranks of the median replay. The table goes to stdout and to
ulysses-<gpu>-ws<N>.md (bench/results/, or --out), with a bar
chart of the time per shape by transport beside it (.png).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import common
import plot
import ranks
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked

# The Ulysses baseline shapes (DiT-like), then Wan-2.1-like (40 heads, d 128): 480p and 720p, 81 frames.
DEFAULT_SHAPES = [(1, 4096, 24, 128), (1, 16384, 40, 128), (2, 4096, 16, 64), (1, 32760, 40, 128), (1, 75600, 40, 128)]
QUICK_SHAPES = DEFAULT_SHAPES[:3]
DTYPE = torch.bfloat16
SMALL_BYTES = 256 << 20  # below this, inputs rotate between two sets so that L2 does not flatter
GRAPH_BYTES = 4 << 30  # bytes exchanged per captured graph, which bounds its op count (and run time)

UNPACKED, PACKED = "3 x all_to_all_single", "graphar packed, NCCL"
PACKED_IPC, PACKED_PUSH = "graphar packed, IPC pull", "graphar packed, IPC push"
OUT_UNPACKED, OUT_GRAPHAR, OUT_IPC, OUT_PUSH = (
    "all_to_all_single",
    "graphar, NCCL",
    "graphar, IPC pull",
    "graphar, IPC push",
)
TIMED = (UNPACKED, PACKED, PACKED_IPC, PACKED_PUSH, OUT_UNPACKED, OUT_GRAPHAR, OUT_IPC, OUT_PUSH)


@dataclass(frozen=True)
class Settings:
    shapes: list[tuple[int, int, int, int]]
    max_ops: int  # back-to-back ops per captured graph, at most
    replays: int  # timed replays per graph (median)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    b, s, h, d = (int(v) for v in text.lower().split("x"))
    return b, s, h, d


TIMEOUT_S = 180.0  # NCCL's: a hang ends with a traceback well before gpu_session.sh's 300 s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", help="comma-separated b x s x h x d (global sequence, all heads)")
    common.add_arguments(p, quick_help="the baseline shapes only, fewer ops and replays")


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")] if args.shapes else None
    except ValueError:
        p.error(f"--shapes {args.shapes!r}: expected comma-separated b x s x h x d, e.g. 1x4096x24x128")
    return Settings(
        shapes=shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES),
        max_ops=10 if args.quick else 20,
        replays=5 if args.quick else 7,
    )


def shape_label(shape: tuple[int, int, int, int]) -> str:
    return "{}, {}, {}, {}".format(*shape)


def qkv_bytes(shape: tuple[int, int, int, int], world_size: int) -> int:
    b, s, h, d = shape
    return 3 * b * (s // world_size) * h * d * DTYPE.itemsize


def time_graph(
    step: Callable[[int], object], nbytes: int, s: Settings, reasons: dict[str, str], key: str
) -> common.Cell:
    ops = max(2, min(s.max_ops, GRAPH_BYTES // max(nbytes, 1)))
    return ranks.measured(
        lambda: common.capture(step, ops),
        lambda graph: common.time_gpu(graph.replay, repeats=s.replays, per=ops),
        "capture",
        reasons,
        key,
    )


def wrong_exchanges(qkv: list[torch.Tensor], out: torch.Tensor, groups: list[tuple[str, bool]], ex: Any) -> str | None:
    """ "WRONG" unless graphar's exchanges over each (group, push: ex.push) equal the three-collective
    path's bits. Every exchange runs, whatever an earlier one gave: each is a collective its peers run."""
    from graphar import ulysses

    reference = [seq_to_heads_unpacked(t) for t in qkv]
    out_reference = heads_to_seq_unpacked(out)
    right = []
    for group, push in groups:
        with common.overriding(ex, "push", push):  # every rank alike, as GRAPHAR_ALLTOALL_ALGO would set it
            got, got_out = ulysses.seq_to_heads(*qkv, group), ulysses.heads_to_seq(out, group)
        right.append(all(map(torch.equal, got, reference)) and torch.equal(got_out, out_reference))
    return None if all(right) else "WRONG"


def run_shape(
    shape: tuple[int, int, int, int], world_size: int, nccl_group: str, s: Settings, reasons: dict[str, str]
) -> dict[tuple, common.Cell]:
    """(shape, column) -> cell; every rank takes the same decisions, each through a collective."""
    from graphar import ulysses
    from graphar.allreduce.registry import communicator
    from graphar.ulysses import pack, transport

    ipc_group = dist.group.WORLD.group_name  # graphar.init() gave it a communicator: the IPC transport
    b, seq, h, d = shape
    if seq % world_size or h % world_size:
        return {(shape, k): "-" for k in (*TIMED, "pack", "copy")}
    s_local, h_local = seq // world_size, h // world_size
    nbytes = qkv_bytes(shape, world_size)
    sets = 2 if nbytes < SMALL_BYTES else 1
    qkv = [[torch.randn(b, s_local, h, d, device="cuda", dtype=DTYPE) for _ in range(3)] for _ in range(sets)]
    outs = [torch.randn(b, seq, h_local, d, device="cuda", dtype=DTYPE) for _ in range(sets)]

    ex = transport.of(communicator(ipc_group))
    groups = [(nccl_group, False), (ipc_group, False), (ipc_group, True)]  # IPC pull first sizes the buffers
    status = ranks.verdict(
        lambda: wrong_exchanges(qkv[0], outs[0], groups, ex),
        "the exchange check",
        reasons,
        f"check at {shape_label(shape)}",
    )
    if status is not None:
        return {(shape, k): status for k in TIMED} | {(shape, "pack"): "-", (shape, "copy"): "-"}

    def timed(key: str, step: Callable[[int], object], nbytes: int) -> common.Cell:
        return time_graph(step, nbytes, s, reasons, key)

    def ipc(key: str, push: bool, step: Callable[[int], object], nbytes: int) -> common.Cell:
        with common.overriding(ex, "push", push):  # read at capture
            return timed(key, step, nbytes)

    def qkv_step(group: str) -> Callable[[int], object]:
        return lambda i: ulysses.seq_to_heads(*qkv[i % sets], group)

    def out_step(group: str) -> Callable[[int], object]:
        return lambda i: ulysses.heads_to_seq(outs[i % sets], group)

    cells: dict[str, common.Cell] = {
        UNPACKED: timed(UNPACKED, lambda i: [seq_to_heads_unpacked(t) for t in qkv[i % sets]], nbytes),
        PACKED: timed(PACKED, qkv_step(nccl_group), nbytes),
        PACKED_IPC: ipc(PACKED_IPC, False, qkv_step(ipc_group), nbytes),
        PACKED_PUSH: ipc(PACKED_PUSH, True, qkv_step(ipc_group), nbytes),
        OUT_UNPACKED: timed(OUT_UNPACKED, lambda i: heads_to_seq_unpacked(outs[i % sets]), nbytes // 3),
        OUT_GRAPHAR: timed(OUT_GRAPHAR, out_step(nccl_group), nbytes // 3),
        OUT_IPC: ipc(OUT_IPC, False, out_step(ipc_group), nbytes // 3),
        OUT_PUSH: ipc(OUT_PUSH, True, out_step(ipc_group), nbytes // 3),
    }
    # The pack kernel alone, and a plain copy of as many bytes: their bandwidths go in the report.
    packed = torch.empty(world_size, b, s_local, 3 * h_local, d, device="cuda", dtype=DTYPE)
    src, dst = (
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
    )
    cells["pack"] = timed("pack", lambda i: pack.pack_heads(qkv[i % sets], world_size, packed), nbytes)
    cells["copy"] = timed("copy", lambda i: dst.copy_(src), nbytes)
    return {(shape, k): v for k, v in cells.items()}


def worker(rank: int, world_size: int, s: Settings, out_path: Path | None) -> None:
    import graphar

    torch.manual_seed(1234 + rank)
    if graphar.init() is None:
        raise SystemExit("graphar.init() set up no communicator: the IPC transport cannot be measured here")
    # No communicator on this group: the NCCL transport (and none set up at its first call).
    os.environ["GRAPHAR_AUTO_INIT"] = "0"
    nccl_group = dist.new_group(list(range(world_size))).group_name
    common.progress(f"set up; timing {len(s.shapes)} shapes")
    reasons: dict[str, str] = {}

    def run(shape: tuple[int, int, int, int]) -> dict[tuple, common.Cell]:
        cells = run_shape(shape, world_size, nccl_group, s, reasons)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return cells

    common.run_units(s.shapes, shape_label, run, common.reporter("ulysses", s, "shapes", write, reasons, out_path))


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main(args, s, dry_run, worker, TIMEOUT_S)


def bandwidth(nbytes: int, us: common.Cell) -> common.Cell:
    """GB/s of bytes read + bytes written, for a time in us."""
    return 2 * nbytes / us / 1e3 if isinstance(us, float) else us


def link_bandwidth(nbytes: int, world_size: int, us: common.Cell) -> common.Cell:
    """GB/s each rank sends over its links (all but its own chunk of `nbytes`), for a time in us."""
    return nbytes * (world_size - 1) / world_size / us / 1e3 if isinstance(us, float) else us


def tables(results: dict[tuple, common.Cell], s: Settings, world_size: int) -> list[tuple[str, str]]:
    exchange_rows, output_rows, pack_rows = [], [], []
    for shape in s.shapes:
        r = {k: results[(shape, k)] for k in (*TIMED, "pack", "copy")}
        label = shape_label(shape)
        nbytes = qkv_bytes(shape, world_size)
        mb = f"{nbytes / 1e6:.1f} MB"
        # speedup: the baseline's time over graphar's
        exchange_rows.append(
            [
                label,
                mb,
                r[UNPACKED],
                r[PACKED],
                r[PACKED_IPC],
                r[PACKED_PUSH],
                *(common.derived(r[UNPACKED], r[k]) for k in (PACKED, PACKED_IPC, PACKED_PUSH)),
                *(link_bandwidth(nbytes, world_size, r[k]) for k in (PACKED_IPC, PACKED_PUSH)),
            ]
        )
        output_rows.append(
            [
                label,
                r[OUT_UNPACKED],
                r[OUT_GRAPHAR],
                r[OUT_IPC],
                r[OUT_PUSH],
                *(common.derived(r[OUT_UNPACKED], r[k]) for k in (OUT_GRAPHAR, OUT_IPC, OUT_PUSH)),
            ]
        )
        pack_bw, copy_bw = (bandwidth(nbytes, r[k]) for k in ("pack", "copy"))
        pack_rows.append([label, pack_bw, copy_bw, common.derived(pack_bw, copy_bw, "{:.0%}")])
    return [
        (
            "Input exchange, q/k/v [b, s/P, h, d] -> [b, s, h/P, d], us per op (graph)",
            common.markdown_table(
                [
                    "b, s, h, d",
                    "q+k+v per rank",
                    UNPACKED,
                    PACKED,
                    PACKED_IPC,
                    PACKED_PUSH,
                    "speedup NCCL",
                    "speedup pull",
                    "speedup push",
                    "pull GB/s per direction",
                    "push GB/s per direction",
                ],
                exchange_rows,
            ),
        ),
        (
            "Output exchange, [b, s, h/P, d] -> [b, s/P, h, d], us per op (graph)",
            common.markdown_table(
                [
                    "b, s, h, d",
                    OUT_UNPACKED,
                    OUT_GRAPHAR,
                    OUT_IPC,
                    OUT_PUSH,
                    "speedup NCCL",
                    "speedup pull",
                    "speedup push",
                ],
                output_rows,
            ),
        ),
        (
            "Pack kernel vs device copy, GB/s (read + write)",
            common.markdown_table(["b, s, h, d", "pack kernel", "copy_", "pack / copy"], pack_rows),
        ),
    ]


def notes(s: Settings, reasons: dict[str, str]) -> list[str]:
    return [
        f"bf16; CUDA graphs of up to {s.max_ops} back-to-back ops (fewer for large shapes, "
        f"{GRAPH_BYTES >> 30} GB exchanged per graph at most); median of {s.replays} replays; max over ranks.",
        f"Inputs rotate between two sets below {SMALL_BYTES >> 20} MB of q+k+v per rank.",
        "3 x all_to_all_single: graphar.ulysses.unpacked.seq_to_heads_unpacked (yunchang's all_to_all_4D "
        "layout); graphar packed: graphar.ulysses.seq_to_heads (graphar::qkv_all_to_all + views), on a group "
        "without a graphar communicator (NCCL) and on the world group after graphar.init() (IPC): pulled "
        "(each rank reads its chunks from its peers' buffers) or pushed (the pack stores each chunk in its "
        "rank's buffer), as GRAPHAR_ALLTOALL_ALGO picks.",
        "Pack bandwidths: 2 x q+k+v bytes (read + write) over the worst rank's time. Per direction: the "
        "q+k+v bytes a rank sends to its peers ((P-1)/P of them) over the op's time.",
        "Targets (2 x H200): input exchange >= 2.5x the three-collective path and >= 350 GB/s per direction "
        "on the large shapes; pack kernel >= 80% of copy_.",
    ] + [f"{k}: {v}" for k, v in sorted(reasons.items())]


def charts(results: dict[tuple, common.Cell], s: Settings) -> list[plot.Chart]:
    """Time per shape by transport, for each exchange (log scale: the shapes span 20x in bytes)."""
    groups = [shape_label(shape) for shape in s.shapes]
    panels = (
        ("input exchange (q, k, v)", (UNPACKED, PACKED, PACKED_IPC, PACKED_PUSH)),
        ("output exchange", (OUT_UNPACKED, OUT_GRAPHAR, OUT_IPC, OUT_PUSH)),
    )
    return [
        plot.BarChart(
            f"{what}: b, s, h, d; CUDA graphs, max over ranks",
            "us per op",
            groups,
            {k: [results[(shape, k)] for shape in s.shapes] for k in keys},
            log=True,
        )
        for what, keys in panels
    ]


def write(
    results: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    info = common.header("graph", world_size, gpu)
    title = "Ulysses all-to-all (us)"
    text = common.report(title, info, tables(results, s, world_size), notes(s, reasons))
    common.write_report(text, path, charts(results, s), f"{title}, {gpu}, world size {world_size}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU, no graphar needed."""
    rng = random.Random(0)
    results: dict[tuple, common.Cell] = {}
    for shape in s.shapes:
        for k in (*TIMED, "pack", "copy"):
            results[(shape, k)] = rng.uniform(100, 3000)
    path = common.results_path("ulysses", common.DRY_RUN_GPU, 2, out, common.dry_run_dir())
    write(results, s, 2, {}, common.DRY_RUN_GPU, path)


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
