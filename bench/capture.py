"""Capture cost of graphar's zero-copy graphs: BatchGraphs over a serving loop's batch sizes.

    python bench/capture.py [--batches 1,2,4,8,...] [--layers 8] [--repeats 3] [--world-size N]
                            [--quick] [--dry-run] [--out F]

Spawns one process per GPU (on one GPU: `PYTHONPATH=. python tools/one_gpu_bench.py capture [ARGS]`,
its ranks sharing it). One decode step of decode's tensor-parallel Llama-style model (hidden 4096,
8 layers, two all-reduces per layer), each block compiled once for every batch size
(torch.compile(dynamic=True); compiled before any capture), is captured by
`graphar.allreduce.graphs.BatchGraphs` for 64 batch sizes (1, 2, 4, then 8 to 480 in steps of 8, and 512: a
serving loop's list) two ways:
  (a) local copies: every all-reduce replaced by a local copy of its bytes (an opaque op, which
      Inductor cannot fuse away), compiled by Inductor;
  (b) graphar: backend="graphar" after graphar.init (whose buffers are set up before any capture),
      every all-reduce on graphar's kernels, zero-copy: registered with the peers as each capture ends.
Per variant: the wall time of building the BatchGraphs (per size: the warm-up steps, the capture and,
for (b), the registration; median of --repeats, max over ranks) and the memory the graphs hold once
built (from the first build: torch's reserved memory and the device memory the GPU lost, both after
empty_cache; the device's per rank where ranks share a GPU). What graphar adds is (b) against (a):
the targets are at most 5 % more capture time and at most 64 MB more memory over the 64 sizes. The
table goes to stdout and to capture-<gpu>-ws<N>.md (bench/results/, or --out), with a bar
chart beside it (.png).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import common
import decode
import plot
import ranks

LOCAL, GRAPHAR = "(a) local copies", "(b) graphar"
VARIANTS = [LOCAL, GRAPHAR]
# A serving loop's capture sizes: 1, 2, 4, then every 8 to 480, and 512 (64 sizes).
SERVING_BATCHES = [1, 2, 4, *range(8, 481, 8), 512]
QUICK_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
WARMUP = 2  # eager steps per size before its capture (BatchGraphs' default)
CAPTURE_S, FIRST_S, PER_SIZE_MS = "capture, s (median)", "capture, s (first build)", "per size, ms (median)"
TORCH_MB, DEVICE_MB = "torch reserved, MB", "device, MB per rank"
COMPILES, SERVED, REGISTERED = "compiles during capture", "all-reduces on graphar's kernels", "zero-copy all-reduces"
REGISTER_MS = "of which registration, ms per size (median)"
TARGETS = {CAPTURE_S: 0.05, TORCH_MB: 64.0, DEVICE_MB: 64.0}  # what graphar may add: a share of (a)'s, MB
MB = 1 << 20
COMPILE_SKEW_S = 240.0  # graphar.init's spin bound: past the ranks' compile skew (as decode's)
TIMEOUT_S = 300.0  # NCCL's: past the ranks' compile skew, well before gpu_session.sh's 540 s


@dataclass(frozen=True)
class Settings:
    batches: list[int]
    layers: int
    repeats: int  # builds per variant (median time; memory from the first)
    variants: list[str] = dataclasses.field(default_factory=lambda: list(VARIANTS))  # the units, run_units'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 64 sizes from 1 to 512)")
    p.add_argument("--layers", type=int, default=None, help="decoder blocks (default 8; 2 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="builds per variant, median time (default 3; 1 --quick)")
    common.add_arguments(p, quick_help="2 layers, 8 sizes from 1 to 128, one build per variant")


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    try:
        batches = sorted({int(b) for b in args.batches.split(",")}) if args.batches else None
    except ValueError:
        batches = [0]
    batches = batches or (QUICK_BATCHES if args.quick else SERVING_BATCHES)
    layers = args.layers or (2 if args.quick else 8)
    repeats = args.repeats or (1 if args.quick else 3)
    if batches[0] < 1 or layers < 1 or repeats < 1:
        p.error("batch sizes, --layers and --repeats must be positive")
    return Settings(batches=batches, layers=layers, repeats=repeats)


# ---- the steps ----------------------------------------------------------------------------------------

_local_copy_lib: list[torch.library.Library] = []  # defined once per process, at its first need


def define_local_copy() -> None:
    """graphar_bench::local_copy(x): a copy of x, as one op Inductor calls and cannot fuse or drop."""
    if _local_copy_lib:
        return
    lib = torch.library.Library("graphar_bench", "DEF")
    lib.define("local_copy(Tensor x) -> Tensor")
    lib.impl("local_copy", lambda x: x.clone(), "CompositeExplicitAutograd")
    lib.impl("local_copy", lambda x: torch.empty_like(x), "Meta")  # its shapes, for the compile's fake tensors
    _local_copy_lib.append(lib)


class LocalCopyBlock(decode.Block):
    """decode's block with each all-reduce replaced by a local copy of its bytes."""

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.graphar_bench.local_copy(x)


def steps(s: Settings, world_size: int, graphar_ok: bool) -> dict[str, decode.Step]:
    """Each variant's step: its blocks compiled with dynamic shapes (a batch size is no new compile)."""
    shape = dataclasses.replace(decode.Shape(), layers=s.layers)
    norm = decode.norm_weight(shape.hidden)
    built = {}
    for v, block, backend in ((LOCAL, LocalCopyBlock, "inductor"), (GRAPHAR, decode.Block, "graphar")):
        if v == GRAPHAR and not graphar_ok:
            continue
        blocks = nn.ModuleList(block(shape, world_size, max(s.batches)) for _ in range(shape.layers))
        built[v] = decode.compiled_step(blocks, norm, shape.eps, backend, dynamic=True)
    return built


def compile_all(step: decode.Step, batches: list[int]) -> None:
    """Compile a step before any capture: at the smallest size (1 is a graph of its own, where it is a
    size) and one more, which serves every other size."""
    hidden = decode.Shape().hidden
    for b in sorted(set(batches))[:2]:
        step(torch.randn(b, hidden, device="cuda", dtype=decode.DTYPE))
    torch.cuda.synchronize()


# ---- measuring ----------------------------------------------------------------------------------------


def held_memory() -> tuple[int, int]:
    """(torch's reserved bytes, the device's used bytes) once freed memory went back, after every rank's
    work (ranks sharing a GPU see each other's in the device's)."""
    dist.barrier()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    dist.barrier()
    return torch.cuda.memory_reserved(), total - free


def ranks_per_gpu() -> int:
    """How many ranks share this rank's GPU (one GPU lent: all of them, tools/one_gpu_bench.py)."""
    mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone.count(mine)


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def build(step: decode.Step, s: Settings) -> tuple[object | None, str | None, float]:
    """BatchGraphs of `step` over s.batches, agreed on every rank: (graphs, None, seconds) or (None, why, 0)."""
    from graphar.allreduce.graphs import BatchGraphs

    hidden = decode.Shape().hidden
    statics = {b: torch.randn(b, hidden, device="cuda", dtype=decode.DTYPE) for b in s.batches}
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graphs, problem = ranks.attempt(
        lambda: BatchGraphs(step, lambda b: (statics[b],), s.batches, warmup=WARMUP), "building the BatchGraphs"
    )
    torch.cuda.synchronize()
    return graphs, problem, time.perf_counter() - t0


@contextlib.contextmanager
def timed_registrations(spent: list[float]) -> Iterator[None]:
    """Each capture's end in graphar.allreduce.graphs (the registration with the peers, collective: it waits for the
    slowest rank) timed into `spent`, in seconds."""
    from graphar.allreduce import graphs

    real = graphs.finish

    def timed(cuda_graph: torch.cuda.CUDAGraph, capture: graphs.Capture) -> None:
        start = time.perf_counter()
        try:
            real(cuda_graph, capture)
        finally:
            spent.append(time.perf_counter() - start)

    graphs.finish = timed
    try:
        yield
    finally:
        graphs.finish = real


def graphar_counts() -> tuple[int, int]:
    """(calls graphar's kernels served, zero-copy calls captured) of the world group's communicator."""
    from graphar.allreduce.registry import communicator

    allreduce = communicator(dist.group.WORLD.group_name).kernels
    return allreduce.calls, allreduce.graph_calls


def measure(
    v: str, built: dict[str, decode.Step | str], s: Settings, sharing: int, reasons: dict[str, str]
) -> dict[tuple, common.Cell]:
    step = built.get(v, "n/a")
    if isinstance(step, str):
        return {(v, m): step for m in (CAPTURE_S, TORCH_MB, DEVICE_MB)}
    compiles, counts = unique_graphs(), graphar_counts() if v == GRAPHAR else (0, 0)
    times, held, registering = [], None, []
    for i in range(s.repeats):
        common.progress(f"{v}: building BatchGraphs over {len(s.batches)} sizes ({i + 1}/{s.repeats})")
        before = held_memory()
        spent: list[float] = []
        with timed_registrations(spent):
            graphs, problem, seconds = build(step, s)
        registering.append(sum(spent))
        if problem is not None:
            reasons.setdefault(v, problem)
            return {(v, m): "err" for m in (CAPTURE_S, TORCH_MB, DEVICE_MB)}
        times.append(seconds)
        if held is None:  # the first build's: a later one may free what graphar held for an earlier one
            after = held_memory()
            held = ((after[0] - before[0]) / MB, (after[1] - before[1]) / MB / sharing)
        del graphs
    cells = {
        (v, CAPTURE_S): statistics.median(times),
        (v, FIRST_S): times[0],
        (v, TORCH_MB): held[0],
        (v, DEVICE_MB): held[1],
        (v, COMPILES): float(unique_graphs() - compiles),
    }
    if v == GRAPHAR:
        served, registered = (now - then for now, then in zip(graphar_counts(), counts))
        expected = s.repeats * len(s.batches) * (WARMUP + 1) * 2 * s.layers
        cells[(v, SERVED)] = f"{served}/{expected}" + ("" if served >= expected else " fallback")
        cells[(v, REGISTERED)] = float(registered)
        cells[(v, REGISTER_MS)] = 1000 * statistics.median(registering) / len(s.batches)
    return cells


def set_up_graphar() -> None:
    import graphar

    if graphar.init(dist.group.WORLD, timeout_s=COMPILE_SKEW_S) is None:
        raise RuntimeError("graphar.init returned None (its log says why)")


def prepare(s: Settings, world_size: int, reasons: dict[str, str]) -> dict[str, decode.Step | str]:
    """Each variant's step, compiled (graphar's checked to have been rewritten), or why it has none."""
    define_local_copy()
    _, problem = ranks.attempt(set_up_graphar, "graphar set-up")
    if problem is not None:
        reasons["graphar"] = problem
    built: dict[str, decode.Step | str] = {GRAPHAR: "n/a", **steps(s, world_size, problem is None)}
    for v, step in list(built.items()):
        if isinstance(step, str):
            continue
        common.progress(f"compiling {v} (dynamic shapes)...")
        with ranks.counting_rewrites() as made:
            _, problem = ranks.attempt(lambda: compile_all(step, s.batches), f"compiling {v}")
        if problem is not None:
            reasons[v], built[v] = problem, "err"
        elif v == GRAPHAR:
            built[v] = ranks.rewritten(made, "all_reduce", reasons, v) or step
            reasons[f"{v} rewrites (rank 0)"] = str(dict(made))
    return built


def worker(rank: int, world_size: int, s: Settings, out_path: Path | None) -> None:
    torch.manual_seed(1000 + rank)  # weights and caches are this rank's shards
    reasons: dict[str, str] = {}
    built = prepare(s, world_size, reasons)
    sharing = ranks_per_gpu()
    if not isinstance(built[LOCAL], str):
        # The process's first capture pays what every later one shares (the capture stream, its
        # workspaces): (a)'s, on one size, before either is timed. Not (b)'s: its dead graph would
        # hold its inputs until the next registration, which would free them inside (b)'s measurement.
        build(built[LOCAL], dataclasses.replace(s, batches=s.batches[:1]))
    common.run_units(
        s.variants,
        str,
        lambda v: {**measure(v, built, s, sharing, reasons), ("ranks per GPU", ""): float(sharing)},
        common.reporter("capture", s, "variants", write, reasons, out_path),
    )


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main(args, s, dry_run, worker, TIMEOUT_S)


# ---- the report ---------------------------------------------------------------------------------------


def added(cells: dict[tuple, common.Cell], measure_name: str) -> tuple[str, str]:
    """What graphar adds to the measure, and whether that meets its target."""
    a, b = cells.get((LOCAL, measure_name), "-"), cells.get((GRAPHAR, measure_name), "-")
    if not (isinstance(a, float) and isinstance(b, float)):
        return "-", "-"
    target = TARGETS[measure_name]
    if measure_name == CAPTURE_S:
        share = b / a - 1 if a > 0 else float("inf")
        return f"{share:+.1%}", "yes" if share <= target else "NO"
    return f"{b - a:+.1f} MB", "yes" if b - a <= target else "NO"


def table(cells: dict[tuple, common.Cell], s: Settings) -> str:
    def per_size(v: str) -> common.Cell:
        t = cells.get((v, CAPTURE_S), "-")
        return 1000 * t / len(s.batches) if isinstance(t, float) else t

    def seconds(cell: common.Cell) -> str:
        return f"{cell:.2f}" if isinstance(cell, float) else str(cell)

    targets = {
        CAPTURE_S: f"<= {TARGETS[CAPTURE_S]:.0%}",
        TORCH_MB: f"<= {TARGETS[TORCH_MB]:.0f} MB",
        DEVICE_MB: f"<= {TARGETS[DEVICE_MB]:.0f} MB",
    }
    first = [cells.get((v, FIRST_S), "-") for v in VARIANTS]
    rows = [
        [
            CAPTURE_S,
            *(seconds(cells.get((v, CAPTURE_S), "-")) for v in VARIANTS),
            *added(cells, CAPTURE_S),
            targets[CAPTURE_S],
        ],
        [FIRST_S, *map(seconds, first), common.derived(first[1], first[0], "{:+.1%}", lambda g, l: g / l - 1), "-", ""],
        [PER_SIZE_MS, *(per_size(v) for v in VARIANTS), "-", "-", ""],
        [REGISTER_MS, *(cells.get((v, REGISTER_MS), "-") for v in VARIANTS), "-", "-", ""],
    ]
    for m in (TORCH_MB, DEVICE_MB):
        rows.append([m, *(cells.get((v, m), "-") for v in VARIANTS), *added(cells, m), targets[m]])
    for m in (COMPILES, SERVED, REGISTERED):  # counts
        counted = (cells.get((v, m), "-") for v in VARIANTS)
        rows.append([m, *(f"{c:.0f}" if isinstance(c, float) else c for c in counted), "-", "-", ""])
    return common.markdown_table(["measure", *VARIANTS, "graphar adds", "met", "target"], rows)


def notes(s: Settings, world_size: int, sharing: common.Cell, reasons: dict[str, str]) -> list[str]:
    m = dataclasses.replace(decode.Shape(), layers=s.layers)
    shared = f"{int(sharing)} ranks share each GPU" if isinstance(sharing, float) and sharing > 1 else "a GPU per rank"
    return [
        f"Step: {m.layers} of decode's Llama-style blocks (hidden {m.hidden}, intermediate {m.intermediate}, "
        f"{m.heads} heads, {m.kv_heads} KV heads, {m.past} cached tokens), TP={world_size}, {shared}; bf16, each "
        "block compiled once with dynamic shapes before any capture (a compile during one is counted above).",
        f"Sizes ({len(s.batches)}): {', '.join(map(str, s.batches))}. Per size BatchGraphs runs {WARMUP} eager "
        f"steps, captures one, and (b) registers its all-reduces with the peers (collective).",
        f"capture: wall seconds to build the BatchGraphs, median of {s.repeats} builds (a serving loop builds once: "
        "the first build is shown too), max over ranks. Memory: what the "
        "graphs hold once built (the first build), after empty_cache: torch's reserved bytes, and the bytes the "
        "device lost (cudaMemGetInfo: graph executables, peer mappings, memory outside torch too), max over ranks.",
        "graphar.init's own buffers (its configured max_bytes) are set up before any capture: neither variant's.",
        "Targets: graphar adds at most 5% capture time and 64 MB over the sizes; 'fallback': fewer all-reduces on "
        "graphar's kernels than the builds made.",
    ] + [f"{k}: {v}" for k, v in sorted(reasons.items())]


def charts(cells: dict[tuple, common.Cell]) -> list[plot.Chart]:
    return [
        plot.BarChart(
            "BatchGraphs build, wall seconds (max over ranks)",
            "s",
            VARIANTS,
            {CAPTURE_S: [cells.get((v, CAPTURE_S), "-") for v in VARIANTS]},
        ),
        plot.BarChart(
            "memory the graphs hold once built",
            "MB",
            VARIANTS,
            {m: [cells.get((v, m), "-") for v in VARIANTS] for m in (TORCH_MB, DEVICE_MB)},
        ),
    ]


def write(
    cells: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    sharing = cells.get(("ranks per GPU", ""), "-")
    info = common.header("BatchGraphs capture", world_size, gpu)
    title = "Capture cost of BatchGraphs, graphar against local copies"
    sections = [(f"{len(s.batches)} batch sizes, {s.layers} layers", table(cells, s))]
    text = common.report(title, info, sections, notes(s, world_size, sharing, reasons))
    common.write_report(text, path, charts(cells), f"{title}, {gpu}, world size {world_size}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU, no graphar needed."""
    rng = random.Random(0)
    cells: dict[tuple, common.Cell] = {("ranks per GPU", ""): 1.0}
    for v in s.variants:
        seconds = 0.05 * len(s.batches) * rng.uniform(1, 1.1)
        cells.update(
            {
                (v, CAPTURE_S): seconds,
                (v, FIRST_S): 1.2 * seconds,
                (v, COMPILES): 0.0,
                (v, TORCH_MB): 20.0 * s.layers * rng.uniform(1, 1.2),
                (v, DEVICE_MB): 30.0 * s.layers,
            }
        )
    expected = s.repeats * len(s.batches) * (WARMUP + 1) * 2 * s.layers
    cells.update(
        {
            (GRAPHAR, SERVED): f"{expected}/{expected}",
            (GRAPHAR, REGISTERED): float(len(s.batches) * 2),
            (GRAPHAR, REGISTER_MS): 0.4,
        }
    )
    write(
        cells,
        s,
        2,
        {},
        common.DRY_RUN_GPU,
        common.results_path("capture", common.DRY_RUN_GPU, 2, out, common.dry_run_dir()),
    )


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
