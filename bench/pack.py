"""The Ulysses pack kernel against torch.Tensor.copy_ of the same bytes, on one GPU.

    python bench/pack.py [--shapes 1x4096x32x128:kv8,...] [--tiles 8192:8,...] [--world-size 2]
                         [--quick] [--dry-run] [--out F]

Runs in this process on the current GPU. For each shape `b x s x h x d` (global sequence s; K/V heads
with `:kvN`) laid out for --world-size ranks P (local sequence S = s / P), it times the four layouts
of graphar.ulysses.pack as graphar calls them:
  pack_heads       Q, K, V [b, S, h_c, d] -> [P, b, S, (hq + 2 hkv) / P, d]   (sequence -> heads, send)
  gather_sequence  [P, b, S, H, d] -> [b, P*S, H, d]                          (its receive side; b > 1)
  pack_sequence    [b, P*S, h, d] -> [P, b, S, h, d]                          (heads -> sequence, send)
  gather_heads     [P, b, S, h, d] -> [b, S, P*h, d]                          (its receive side)
against `torch.Tensor.copy_` of as many contiguous bytes (the target's reference: the kernel at 90 %
of it at least), `copy_` of the same strided views (what graphar falls back to without Triton), and
the same kernel launched with other tiles (`--tiles T:W`: _TILE_ELEMENTS = T, num_warps = W; a sweep,
for tuning: graphar.ulysses.pack launches 4096:4). Each result is checked bit for bit against the
strided copy_ first (WRONG otherwise). Per op over CUDA graphs of back-to-back ops (median of
replays), inputs rotating among enough sets that L2 holds none of them. Bandwidth: bytes read +
written per second. The table goes to stdout and to pack-<gpu>.md (bench/results/, or --out),
with a bar chart of the bandwidths beside it (.png).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import common
import plot
import ranks
import shapes
from graphar.triton_common import triton_available
from graphar.ulysses import pack as kernels
from shapes import Shape

OPS = ("pack_heads", "gather_sequence", "pack_sequence", "gather_heads")
KERNEL, COPY, STRIDED = "kernel", "copy_", "strided copy_"
TARGET = 0.90  # of copy_'s bandwidth, at every shape
DEFAULT_TILES = "2048:4,4096:8,8192:4,8192:8,16384:8"
QUICK_SHAPES = [shapes.LLAMA_4K, shapes.GQA[0], shapes.ODD, shapes.ULYSSES[2], shapes.WAN]
DTYPE = torch.bfloat16
GRAPH_BYTES = 4 << 30  # bytes moved per captured graph, which bounds its op count
ROTATE_BYTES = 256 << 20  # inputs rotate among sets of at least this many bytes in all (past L2)
MAX_SETS = 8

Tile = tuple[int, int]  # (_TILE_ELEMENTS, num_warps)


@dataclass(frozen=True)
class Settings:
    shapes: list[Shape]
    tiles: list[Tile]
    world_size: int  # ranks P of the layout
    max_ops: int  # back-to-back ops per captured graph, at most
    replays: int


def tile_label(tile: Tile) -> str:
    return f"tiles {tile[0]}:{tile[1]}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", help="comma-separated BxSxHxD[:kvN] (S: global sequence, H: all heads)")
    p.add_argument(
        "--tiles",
        default=None,
        help=(
            f"kernel launches to sweep, T:W = _TILE_ELEMENTS:num_warps (default {DEFAULT_TILES}; "
            "--quick: 8192:8; '' for none)"
        ),
    )
    common.add_arguments(
        p,
        quick_help=(
            "5 shapes (GQA, an odd and an unaligned local sequence, b > 1), one tile sweep, fewer ops and replays"
        ),
        world_size_help="ranks P the layouts are for (default 2)",
    )


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    text = args.tiles if args.tiles is not None else "8192:8" if args.quick else DEFAULT_TILES
    try:
        tiles = [(int(t), int(w)) for t, w in (item.split(":") for item in text.split(",") if item)]
    except ValueError:
        tiles = [(0, 0)]
    if any(t < 1 or t & (t - 1) or w < 1 or w & (w - 1) for t, w in tiles):
        p.error(f"--tiles {text!r}: expected comma-separated T:W, powers of two, e.g. 8192:8")
    world_size = args.world_size or 2
    if world_size < 1 or world_size > 8:
        p.error("--world-size must be 1 to 8 (the kernel's peers)")
    default = QUICK_SHAPES if args.quick else shapes.PACK
    return Settings(
        shapes=shapes.parse_list(args.shapes, p) or default,
        tiles=tiles,
        world_size=world_size,
        max_ops=10 if args.quick else 20,
        replays=5 if args.quick else 9,
    )


# ---- the layouts -------------------------------------------------------------------------------------


@dataclass
class Layout:
    """One op at one shape: `run(i)` calls graphar's function on input set i of `sets`; `out(i)` is where
    it writes."""

    nbytes: int
    sets: int
    run: Callable[[int], bool]
    out: Callable[[int], torch.Tensor]


def layout(op: str, shape: Shape, p: int, sets: Callable[[int], int], device: str = "cuda") -> Layout | None:
    """`op` at `shape` for P ranks, its inputs in `sets(bytes)` sets; None where graphar never calls it."""
    b, s_local, d, hl = shape.b, shape.s // p, shape.d, shape.heads // p
    packed = (shape.heads + 2 * shape.kv) // p

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=DTYPE)

    def empty(*size: int) -> torch.Tensor:
        return torch.empty(*size, device=device, dtype=DTYPE)

    if op == "pack_heads":
        nbytes = b * s_local * packed * p * d * DTYPE.itemsize
        n = sets(nbytes)
        xs = [[randn(b, s_local, h, d) for h in (shape.heads, shape.kv, shape.kv)] for _ in range(n)]
        outs = [empty(p, b, s_local, packed, d) for _ in range(n)]
        return Layout(nbytes, n, lambda i: kernels.pack_heads(xs[i], p, outs[i]), outs.__getitem__)
    if op == "gather_sequence" and b == 1:
        return None  # at b == 1 the received chunks are the result already (a view)
    src_shape, out_shape, call = {
        "gather_sequence": ((p, b, s_local, packed, d), (b, p * s_local, packed, d), kernels.gather_sequence),
        "pack_sequence": ((b, p * s_local, hl, d), (p, b, s_local, hl, d), lambda x, o: kernels.pack_sequence(x, p, o)),
        "gather_heads": ((p, b, s_local, hl, d), (b, s_local, p * hl, d), kernels.gather_heads),
    }[op]
    nbytes = torch.Size(src_shape).numel() * DTYPE.itemsize
    n = sets(nbytes)
    srcs, outs = [randn(*src_shape) for _ in range(n)], [empty(*out_shape) for _ in range(n)]
    return Layout(nbytes, n, lambda i: call(srcs[i], outs[i]), outs.__getitem__)


def recorded(run: Callable[[], object]) -> list[kernels.Pair]:
    """The (dst, src) pairs graphar's function hands to graphar.ulysses.pack.relayout (which does not run)."""
    pairs: list[kernels.Pair] = []

    def record(given: list, *args: object, **kwargs: object) -> bool:
        pairs.extend(given)
        return True

    with common.overriding(kernels, "relayout", record):
        run()
    return pairs


def tiled(pairs: list[kernels.Pair], tile: Tile) -> Callable[[], None]:
    """The relayout kernel on `pairs`, launched with `tile` instead of graphar's own choice (its grid
    and constexprs from graphar.ulysses.pack._launch with _TILE_ELEMENTS = tile[0])."""
    with common.overriding(kernels, "_TILE_ELEMENTS", tile[0]):
        grid, args, constants = kernels._launch(pairs, None)
    return lambda: kernels._relayout_kernel[grid](*args, **constants, num_warps=tile[1])


def launch_tiles(pairs: list[kernels.Pair]) -> str:
    """BLOCK_R x BLOCK_H x D_PAD: the tile graphar's own launch moves per program."""
    constants = kernels._launch(pairs, None)[2]
    return f"{constants['BLOCK_R']}x{constants['BLOCK_H']}x{constants['D_PAD']}"


# ---- measuring ----------------------------------------------------------------------------------------


def sets_for(nbytes: int) -> int:
    return max(1, min(MAX_SETS, -(-ROTATE_BYTES // max(nbytes, 1))))


def run_op(op: str, shape: Shape, s: Settings, reasons: dict[str, str]) -> dict[tuple, common.Cell]:
    """(shape, op, variant) -> cell, and the bytes moved and graphar's tile as (shape, op, "bytes"/"launch")."""
    lay = layout(op, shape, s.world_size, sets_for)
    if lay is None:
        return {}
    n = lay.sets
    key = f"{shape.layout_label}, {op}"
    pairs = [recorded(lambda i=i: lay.run(i)) for i in range(n)]
    flat = [
        (
            torch.empty(lay.nbytes, dtype=torch.uint8, device="cuda"),
            torch.empty(lay.nbytes, dtype=torch.uint8, device="cuda"),
        )
        for _ in range(n)
    ]

    def strided(i: int) -> None:
        for dst, src in pairs[i]:
            dst.copy_(src)

    steps: dict[str, Callable[[int], object]] = {
        KERNEL: lay.run,
        COPY: lambda i: flat[i][0].copy_(flat[i][1]),
        STRIDED: strided,
    }
    cells: dict[tuple, common.Cell] = {(shape, op, "bytes"): float(lay.nbytes)}
    # graphar.ulysses.pack's private launch, read as it is today: where it has changed, the sweep's
    # cells say so ("err") and the rest still runs.
    cells[(shape, op, "launch")] = ranks.attempt(lambda: launch_tiles(pairs[0]), "reading the launch")[0] or "err"
    for tile in s.tiles:
        launches, problem = ranks.attempt(lambda: [tiled(pairs[i], tile) for i in range(n)], "the swept launch")
        if problem is not None:
            reasons.setdefault(f"{key}, {tile_label(tile)}", problem)
            cells[(shape, op, tile_label(tile))] = "err"
            continue
        steps[tile_label(tile)] = lambda i, launches=launches: launches[i]()
    # The reference: the strided copy_ (torch's own), into set 0's output.
    strided(0)
    reference = lay.out(0).clone()
    ops = max(2, min(s.max_ops, GRAPH_BYTES // lay.nbytes))
    for v, step in steps.items():
        checked = v not in (COPY, STRIDED)  # copy_ moves other bytes; the strided copy_ is the reference
        status = (
            ranks.verdict(lambda: wrong(step, lay, reference, v), f"checking {v}", reasons, f"{key}, {v}")
            if checked
            else None
        )
        cells[(shape, op, v)] = status or ranks.measured(
            lambda: common.capture(lambda i: step(i % n), ops),
            lambda graph: common.time_gpu(graph.replay, repeats=s.replays, per=ops),
            f"capturing {v}",
            reasons,
            f"{key}, {v}",
        )
    return cells


def wrong(step: Callable[[int], object], lay: Layout, reference: torch.Tensor, v: str) -> str | None:
    """ "WRONG" unless `step` writes the reference's bits into set 0's output (NaN first: an element it
    does not write cannot pass); "fallback" where graphar's function let torch do the copy."""
    lay.out(0).fill_(float("nan"))
    done = step(0)
    if v == KERNEL and done is False:
        return "fallback"
    return None if torch.equal(lay.out(0).view(torch.int16), reference.view(torch.int16)) else "WRONG"


def run_shape(shape: Shape, s: Settings, reasons: dict[str, str]) -> dict[tuple, common.Cell]:
    if not shape.splits(s.world_size):
        reasons[shape.layout_label] = f"does not split over {s.world_size} ranks"
        return {}
    cells: dict[tuple, common.Cell] = {}
    for op in OPS:
        cells.update(run_op(op, shape, s, reasons))
        torch.cuda.empty_cache()
    return cells


def worker(s: Settings, out: Path | None) -> None:
    if not triton_available():
        raise SystemExit("Triton is not installed: graphar's pack kernel cannot run")
    torch.manual_seed(0)
    common.progress(f"timing {len(OPS)} layouts at {len(s.shapes)} shapes on one GPU")
    common.run_shapes("pack", s, lambda shape: shape.layout_label, run_shape, write, out)


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main_one_gpu(args, s, dry_run, worker)


# ---- the report ---------------------------------------------------------------------------------------


def bandwidth(cells: dict[tuple, common.Cell], shape: Shape, op: str, v: str) -> common.Cell:
    """GB/s read + written, or why there is none."""
    us, nbytes = cells.get((shape, op, v), "-"), cells.get((shape, op, "bytes"), "-")
    return 2 * nbytes / us / 1e3 if isinstance(us, float) and isinstance(nbytes, float) and us > 0 else us


def rows_of(cells: dict[tuple, common.Cell], s: Settings) -> list[tuple[Shape, str]]:
    """The (shape, layout) pairs measured (or tried): those graphar calls at a shape that splits."""
    return [(shape, op) for shape in s.shapes for op in OPS if (shape, op, "bytes") in cells]


def best_tile(cells: dict[tuple, common.Cell], s: Settings, shape: Shape, op: str) -> tuple[str, common.Cell]:
    timed = [(bandwidth(cells, shape, op, tile_label(t)), tile_label(t)) for t in s.tiles]
    timed = [(bw, label) for bw, label in timed if isinstance(bw, float)]
    if not timed:
        return "-", "-"
    bw, label = max(timed)
    return label.removeprefix("tiles "), bw


def tables(cells: dict[tuple, common.Cell], s: Settings) -> list[tuple[str, str]]:
    main_rows, sweep_rows = [], []
    for shape, op in rows_of(cells, s):
        kernel, copy = bandwidth(cells, shape, op, KERNEL), bandwidth(cells, shape, op, COPY)
        share = common.derived(kernel, copy, "{:.1%}")
        met = "-" if share == "-" else "yes" if kernel / copy >= TARGET else "NO"
        tile, best = best_tile(cells, s, shape, op)
        nbytes = cells[(shape, op, "bytes")]
        mb = f"{nbytes / 1e6:.1f}" if isinstance(nbytes, float) else nbytes
        main_rows.append(
            [
                shape.layout_label,
                op,
                mb,
                str(cells.get((shape, op, "launch"), "-")),
                kernel,
                copy,
                share,
                met,
                bandwidth(cells, shape, op, STRIDED),
                tile,
                common.derived(best, copy, "{:.0%}"),
            ]
        )
        swept = (bandwidth(cells, shape, op, tile_label(t)) for t in s.tiles)
        sweep_rows.append([shape.layout_label, op, share, *(common.derived(bw, copy, "{:.0%}") for bw in swept)])
    main = common.markdown_table(
        [
            "shape",
            "layout",
            "MB",
            "tile (R x H x D)",
            "kernel GB/s",
            "copy_ GB/s",
            "kernel / copy_",
            f">= {TARGET:.0%}",
            "strided copy_ GB/s",
            "best swept T:W",
            "its / copy_",
        ],
        main_rows,
    )
    sections = [("Pack kernel against copy_, GB/s (read + write)", main)]
    if s.tiles:
        sweep = common.markdown_table(
            [
                "shape",
                "layout",
                "kernel (graphar's launch)",
                *(t.removeprefix("tiles ") for t in map(tile_label, s.tiles)),
            ],
            sweep_rows,
        )
        sections.append(("Tile sweep, % of copy_ (T:W = _TILE_ELEMENTS:num_warps)", sweep))
    return sections


def notes(s: Settings, reasons: dict[str, str]) -> list[str]:
    return [
        f"bf16; layouts for {s.world_size} ranks (S = s / {s.world_size}); us per op: median of {s.replays} replays "
        f"of a CUDA graph of up to {s.max_ops} back-to-back ops ({GRAPH_BYTES >> 30} GB moved per graph at most); "
        f"inputs rotate among sets of {ROTATE_BYTES >> 20} MB in all (up to {MAX_SETS}), so L2 holds none.",
        "GB/s: 2 x the bytes moved (read + write) over the time. kernel: graphar.ulysses.pack's function as graphar "
        "calls it; copy_: torch.Tensor.copy_ of as many contiguous bytes; strided copy_: copy_ of the same views.",
        "tile (R x H x D): BLOCK_R rows x BLOCK_H heads x D_PAD elements, the tile graphar's launch moves per "
        f"program (_TILE_ELEMENTS = {kernels._TILE_ELEMENTS}, 4 warps). The sweep launches the same kernel with "
        "_TILE_ELEMENTS:num_warps.",
        f"Target: the kernel at {TARGET:.0%} of copy_ or more at every shape. Every result is checked bit for bit "
        "against the strided copy_ first (WRONG otherwise; fallback: graphar's function let torch copy).",
        "gather_sequence runs only for b > 1 (at b == 1 the received chunks are the result: no row).",
    ] + [f"{k}: {v}" for k, v in sorted(reasons.items())]


def charts(cells: dict[tuple, common.Cell], s: Settings) -> list[plot.Chart]:
    panels = []
    for op in OPS:
        shown = [shape for shape in s.shapes if isinstance(cells.get((shape, op, "bytes")), float)]
        if not shown:
            continue
        bars = {v: [bandwidth(cells, shape, op, v) for shape in shown] for v in (KERNEL, COPY, STRIDED)}
        bars["best swept tiles"] = [best_tile(cells, s, shape, op)[1] for shape in shown]
        panels.append(plot.BarChart(f"{op}: GB/s (read + write)", "GB/s", [shape.layout for shape in shown], bars))
    return panels or [plot.BarChart("nothing measured", "GB/s", [], {})]


def write(
    cells: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    info = common.header("one process, CUDA graphs; bf16", f"{s.world_size} (the layouts'; one GPU)", gpu)
    title = "Ulysses pack kernel against copy_"
    text = common.report(title, info, tables(cells, s), notes(s, reasons))
    common.write_report(text, path, charts(cells, s), f"{title}, {gpu}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU needed."""
    rng = random.Random(0)
    cells: dict[tuple, common.Cell] = {}
    for shape in s.shapes:
        for op in OPS:
            if op == "gather_sequence" and shape.b == 1:
                continue
            nbytes = float(shape.b * shape.s // s.world_size * (shape.heads + 2 * shape.kv) * shape.d * 2)
            copy_us = 2 * nbytes / 4.0e6  # 4 TB/s
            cells.update(
                {
                    (shape, op, "bytes"): nbytes,
                    (shape, op, "launch"): "8x4x128",
                    (shape, op, COPY): copy_us,
                    (shape, op, KERNEL): copy_us / rng.uniform(0.8, 1.0),
                    (shape, op, STRIDED): copy_us / rng.uniform(0.3, 0.6),
                }
            )
            cells.update({(shape, op, tile_label(t)): copy_us / rng.uniform(0.8, 1.0) for t in s.tiles})
    write(
        cells,
        s,
        1,
        {},
        common.DRY_RUN_GPU,
        common.results_path("pack", common.DRY_RUN_GPU, None, out, common.dry_run_dir()),
    )


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
