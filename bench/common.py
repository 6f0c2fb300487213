"""Shared helpers of graphar's benchmarks, the other scripts of this folder (`python bench/NAME.py`).

    run(benchmark, argv)                `python bench/NAME.py [options]`: parse NAME's options, run its main
    add_arguments(p, quick_help)        the options every benchmark has: --world-size, --quick, --dry-run, --out
    main(args, settings, dry_run, worker, timeout_s)   a multi-GPU benchmark's main: --dry-run, or launch
    main_one_gpu(args, settings, dry_run, worker)      a one-GPU benchmark's: --dry-run, or worker here
    launch(worker, world_size, *args)   spawn one process per GPU; each runs worker(rank, world_size, *args)
                                        with torch.cuda.set_device(rank) and an NCCL default group ready
    progress(text)                      a progress line (rank 0, the launcher): seconds since the start
    capture(fn, n, ...)                 warm up fn(0..) (agreed), then capture fn(0), ..., fn(n-1) in one CUDA graph
    time_gpu(run, repeats, per)         median GPU time (CUDA events) of run(), in us per `per` units,
                                        ranks aligned before each repeat
    time_host(run, iters, repeats)      median host time of `iters` calls of run() until the GPU is idle, us/call
    run_units(units, label, run, write) run unit by unit; after each, rank 0 rewrites the report so far
    reporter(name, s, field, write, ...) run_units' `write` for a benchmark's report file
    run_shapes(name, s, label, run_shape, write, out)   a one-GPU benchmark's run over s.shapes, reported
    overriding(obj, attr, value)        obj.attr = value within a with block, the old value restored after
    derived(a, b, fmt, op)              a cell computed from two (a ratio by default), "-" unless both are times
    header(mode, world_size)            GPU, world size, torch/NCCL/graphar versions, commit, date, mode
    git_commit()                        the checkout's commit (GRAPHAR_BENCH_COMMIT where there is no .git)
    markdown_table(columns, rows)       rows of cells (float -> "12.3", str as is) -> markdown text
    report(title, info, sections, notes) + write_report(text, path, charts, title)   the file and its plot
    results_path(name, gpu, world_size, out)   where the results file goes (bench/results/ unless told)
    results_file(file_name, out)        the same for a file named otherwise (the CPU benchmark's)

Cells are floats (microseconds) or short strings: "-" not eligible, "n/a" peer unavailable,
"err" the measurement raised (the reason is printed once by rank 0), "not rewritten" graphar's pass
did not make the rewrite the variant is about (so it is not timed under graphar's name).

Every collective must be reached by every rank in the same order, or the ranks hang until NCCL's
timeout: a decision taken before a collective goes through `ranks` first. The one-GPU benchmarks
(chunking, pack) run in the calling process without a process group: there the same helpers serve
a world of one (ranks.alone).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import operator
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import plot
from graphar import processes
from graphar.settings import SHARE_GPU
from ranks import Cell, alone, attempt, max_over_ranks, rank

U = TypeVar("U")
CHECKOUT = Path(__file__).resolve().parent.parent
RESULTS_DIR = CHECKOUT / "bench" / "results"
# Multicast (NVLS) stays off for every peer. The workers are spawned processes, which read these
# when they set up NCCL and symmetric memory: setting them before the spawn is enough.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Benchmarks compile per shape (dynamic=False): past Dynamo's default of 8 recompilations of one
# function it falls back to eager without a word, and the table would time eager code.
DYNAMO_RECOMPILE_LIMIT = 64
# About 50 us of GPU sleep on an H200 (1.98 GHz): the host enqueues the timed work meanwhile.
_ALIGN_SLEEP_CYCLES = 100_000
# graphar's store exchanges (graph registration) wait this long for a peer, 300 s by default: a rank
# whose capture failed never arrives, and its peer must give up well within NCCL's timeout. Not less:
# decode's ranks can finish compiling tens of seconds apart.
EXCHANGE_TIMEOUT_S = "120"
# The commit a report names where the code runs from a copy without .git (a lent machine's copy).
COMMIT_ENV = "GRAPHAR_BENCH_COMMIT"


@dataclass
class _Progress:
    """Progress lines carry the seconds since the command started; among the ranks only rank 0 prints."""

    start: float = field(default_factory=time.time)
    active: bool = True


_progress = _Progress()


def progress(text: str) -> None:
    if _progress.active:
        print(f"[{time.time() - _progress.start:6.1f} s] {text}", flush=True)


def add_arguments(
    p: argparse.ArgumentParser, quick_help: str, world_size_help: str = "GPUs to use (default: all visible)"
) -> None:
    """The options every benchmark has; each adds its own after these."""
    p.add_argument("--world-size", type=int, default=None, help=world_size_help)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--dry-run", action="store_true", help="format a table (and plot) of fake numbers on CPU")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file (.md; the plot goes beside it as .png) or folder (default: bench/results/)",
    )


def _raise_recompile_limit() -> None:
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit"):  # the name differs between torch versions
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, DYNAMO_RECOMPILE_LIMIT)


def _entry(rank: int, world_size: int, worker: Callable[..., None], start: float, args: tuple) -> None:
    global _progress
    _progress = _Progress(start, rank == 0)
    _raise_recompile_limit()
    try:
        dist.barrier()
        worker(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(worker: Callable[..., None], world_size: int, *args: Any, timeout_s: float = 300.0) -> None:
    """Run worker(rank, world_size, *args) in world_size processes, one per GPU over NCCL; with
    GRAPHAR_SHARE_GPU set (tools/one_gpu_bench.py), every rank on cuda:0 over gloo.

    `worker` must be a module-level function (it is pickled). A failing rank ends the others;
    a hung collective ends after `timeout_s` through the group's watchdog.
    """
    shared = SHARE_GPU.get()
    available = torch.cuda.device_count()
    if not shared and world_size > available:
        raise SystemExit(f"needs {world_size} GPUs, {available} visible")
    for name, value in {**MULTICAST_OFF, "GRAPHAR_EXCHANGE_TIMEOUT_S": EXCHANGE_TIMEOUT_S}.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault(COMMIT_ENV, git_commit())  # read once, before the ranks start: what runs
    progress(f"starting {world_size} processes, {'on one GPU' if shared else 'one per GPU'}...")
    group = processes.gpu_group(shared, collective_timeout_s=timeout_s)
    processes.start(_entry, world_size, worker, _progress.start, args, group=group).wait()


def run(benchmark: ModuleType, argv: list[str] | None = None) -> int:
    """`python bench/NAME.py [options]`: the benchmark's options (its docstring is the help), its
    settings from them, then its main(args, settings)."""
    p = argparse.ArgumentParser(
        prog=f"python bench/{Path(benchmark.__file__).name}",
        description=benchmark.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    benchmark.add_arguments(p)
    args = p.parse_args(argv)
    return benchmark.main(args, benchmark.settings(args, p))


def main(
    args: argparse.Namespace,
    settings: Any,
    dry_run: Callable[[Any, Path | None], None],
    worker: Callable[..., None],
    timeout_s: float,
) -> int:
    """A benchmark's entry point: `--dry-run` formats fake numbers on the CPU, else one process per GPU."""
    if args.dry_run:
        dry_run(settings, args.out)
        return 0
    world_size = args.world_size or torch.cuda.device_count()
    if world_size < 2:
        raise SystemExit(f"needs at least 2 GPUs, {torch.cuda.device_count()} visible")
    launch(worker, world_size, settings, args.out, timeout_s=timeout_s)
    return 0


def main_one_gpu(
    args: argparse.Namespace,
    settings: Any,
    dry_run: Callable[[Any, Path | None], None],
    worker: Callable[[Any, Path | None], None],
) -> int:
    """A one-GPU benchmark's entry point: `--dry-run` formats fake numbers on the CPU, else
    worker(settings, out) runs here, on the current GPU, with no process group (a world of one)."""
    if args.dry_run:
        dry_run(settings, args.out)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU (--dry-run formats fake numbers without one)")
    os.environ.setdefault(COMMIT_ENV, git_commit())  # read as the run starts: what runs
    _raise_recompile_limit()
    worker(settings, args.out)
    return 0


def align_ranks() -> None:
    """Queue a GPU sleep and a tiny all-reduce so that every rank's next kernel starts together (alone:
    the sleep only, so that the host has enqueued the timed work before it starts)."""
    torch.cuda._sleep(_ALIGN_SLEEP_CYCLES)
    if not alone():
        dist.all_reduce(torch.zeros(1, device="cuda"))


def capture(
    fn: Callable[[int], object],
    n: int,
    *,
    context: Callable[..., AbstractContextManager] = torch.cuda.graph,
    warmup: int = 2,
    pool: Any = None,
) -> torch.cuda.CUDAGraph:
    """Capture fn(0), ..., fn(n - 1) into one CUDA graph after `warmup` eager calls on the capture stream.

    Collective. `context` is torch.cuda.graph or a drop-in with its arguments (graphar.allreduce.graphs.graph).
    The warm-up (where a compiled fn compiles) is agreed: if it raised on any rank, this raises on
    every rank, none of them left capturing alone.
    """

    def warm_up() -> None:
        for i in range(warmup):
            fn(i)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _, problem = attempt(warm_up, "the warm-up")  # its agreement is the barrier before the capture
    stream.synchronize()
    if problem is not None:
        raise RuntimeError(problem)
    graph = torch.cuda.CUDAGraph()
    try:
        with context(graph, pool=pool, stream=stream):
            for i in range(n):
                fn(i)
    except BaseException:
        _fresh_cuda_generator()
        raise
    torch.cuda.synchronize()
    return graph


def _fresh_cuda_generator() -> None:
    """A capture that failed never ends the CUDA generator's capture (torch ends it only in a capture
    that succeeds), and every later random draw on the device would raise: a fresh generator state,
    seeded as the old one, lets the next cells run."""
    default = torch.cuda.default_generators[torch.cuda.current_device()]
    fresh = torch.Generator(device="cuda")
    fresh.manual_seed(default.initial_seed())
    default.graphsafe_set_state(fresh.graphsafe_get_state())


def time_gpu(run: Callable[[], object], *, repeats: int, per: int = 1) -> float:
    """Median over `repeats` of the CUDA-event time of run(), in microseconds per `per` units."""
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        align_ranks()
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / per)
    return statistics.median(samples)


def time_host(run: Callable[[int], object], *, iters: int, repeats: int = 3, warmup: int = 10) -> float:
    """Median over `repeats` of the host time of run(0..iters-1) until the GPU is idle, us per call."""
    for i in range(warmup):
        run(i)
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if not alone():
            dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(iters):
            run(i)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(samples)


def run_units(
    units: Sequence[U],
    label: Callable[[U], str],
    run: Callable[[U], Mapping[Any, Cell]],
    write: Callable[[dict[Any, Cell], list[U], bool], None],
) -> None:
    """Collective: run(unit) on every rank, unit by unit (a size, a shape, a batch); after each, rank 0
    passes the cells so far (max over ranks), the units done and whether they are all to
    write(cells, done, final). The report on disk always holds every finished unit: a run cut at its
    time limit or by a crash keeps what it measured."""
    results: dict[Any, Cell] = {}
    for i, unit in enumerate(units, 1):
        results.update(max_over_ranks(run(unit)))
        if rank() == 0:
            write(results, list(units[:i]), i == len(units))
        progress(f"done {label(unit)} ({i}/{len(units)})")


Writer = Callable[..., None]  # a benchmark's write(cells, s, world_size, reasons, gpu, path, final)


def reporter(
    name: str, s: Any, field: str, write: Writer, reasons: dict[str, str], out: Path | None
) -> Callable[[dict[Any, Cell], list, bool], None]:
    """`run_units`' write for the benchmark `name`: its report so far, settings `s` with only the units
    done in `s.<field>`, to its results file for this GPU and world size (`results_path`; alone: for
    this GPU, and `write` gets world size 1)."""
    gpu = gpu_name()
    world_size = 1 if alone() else dist.get_world_size()
    path = results_path(name, gpu, None if alone() else world_size, out)

    def report_so_far(cells: dict[Any, Cell], done: list, final: bool) -> None:
        write(cells, dataclasses.replace(s, **{field: done}), world_size, reasons, gpu, path, final)

    return report_so_far


def run_shapes(
    name: str,
    s: Any,
    label: Callable[[Any], str],
    run_shape: Callable[[Any, Any, dict[str, str]], Mapping[Any, Cell]],
    write: Writer,
    out: Path | None,
) -> None:
    """A one-GPU benchmark's run (chunking, pack): run_shape(shape, s, reasons) for each of `s.shapes`,
    its report `name` rewritten after each (`run_units`, `reporter`)."""
    reasons: dict[str, str] = {}
    run_units(
        s.shapes, label, lambda shape: run_shape(shape, s, reasons), reporter(name, s, "shapes", write, reasons, out)
    )


@contextlib.contextmanager
def overriding(obj: Any, attr: str, value: Any) -> Iterator[None]:
    """obj.attr = value within the block; the previous value comes back after it, even if it raises
    (a switch left flipped would skew every later measurement)."""
    previous = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, previous)


def derived(a: Cell, b: Cell, fmt: str = "{:.2f}x", op: Callable[[float, float], float] = operator.truediv) -> str:
    """fmt.format(op(a, b)): a ratio of two times by default; "-" unless both cells are numbers (not
    n/a, err, WRONG, ...) and b is positive (an exposed time at or below its floor has no ratio)."""
    return fmt.format(op(a, b)) if isinstance(a, float) and isinstance(b, float) and b > 0 else "-"


def versions() -> dict[str, str]:
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001  (CPU-only builds have no NCCL)
        nccl = "n/a"
    try:
        import graphar

        graphar_version = graphar.__version__
    except Exception as e:  # noqa: BLE001  (the dry run works without graphar)
        graphar_version = f"n/a ({type(e).__name__})"
    return {"torch": torch.__version__, "NCCL": nccl, "graphar": graphar_version}


DRY_RUN_GPU = "cpu (dry run)"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else DRY_RUN_GPU


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the file-name form of a GPU name."""
    words = [w for w in name.lower().replace("nvidia", "").split() if w.isalnum()]
    return "-".join(words[:2]) or "gpu"


def header(mode: str, world_size: int | str, gpu: str | None = None) -> dict[str, str]:
    return {
        "GPU": gpu or gpu_name(),
        "world size": str(world_size),
        **versions(),
        "commit": git_commit(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "mode": mode,
    }


@functools.cache  # read once per process; the launcher hands its reading to the ranks (COMMIT_ENV)
def git_commit() -> str:
    """The checkout's commit, "+ uncommitted changes" where its code differs; GRAPHAR_BENCH_COMMIT
    where set (a copy of the checkout without .git can be told what it is), else "n/a" without .git."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    if not (CHECKOUT / ".git").exists():
        return "n/a"
    git = ["git", "-C", str(CHECKOUT)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        changes = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "n/a"
    return head.stdout.strip() + (" + uncommitted changes" if changes.stdout.strip() else "")


def format_cell(cell: Cell) -> str:
    return f"{cell:.1f}" if isinstance(cell, float) else str(cell)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report(title: str, info: Mapping[str, str], sections: Sequence[tuple[str, str]], notes: Sequence[str]) -> str:
    """The results file: title, one line of run facts, a table per section, then notes."""
    parts = [f"# {title}", "", "; ".join(f"{k}: {v}" for k, v in info.items()), ""]
    for heading, table in sections:
        parts += [f"## {heading}", "", table, ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(parts)


def dry_run_dir() -> Path:
    """Dry runs' default: fake numbers stay out of the results folder."""
    return Path(tempfile.gettempdir()) / "graphar-bench-dry-run"


def results_path(
    name: str, gpu: str, world_size: int | None, out: Path | None, default_dir: Path | None = None
) -> Path:
    """`results_file` named <name>-<gpu>-ws<N>.md, or <name>-<gpu>.md for a one-GPU benchmark (world_size None)."""
    suffix = "" if world_size is None else f"-ws{world_size}"
    return results_file(f"{name}-{gpu_slug(gpu)}{suffix}.md", out, default_dir)


def results_file(file_name: str, out: Path | None, default_dir: Path | None = None) -> Path:
    """`out` when it names a file (it has a suffix and is not a folder), else `file_name` in the folder
    `out`, `default_dir` or bench/results/."""
    if out is not None and out.suffix and not out.is_dir():
        return out
    return (out or default_dir or RESULTS_DIR) / file_name


def write_report(text: str, path: Path, charts: Sequence[plot.Chart], title: str, final: bool = True) -> None:
    """The table to `path` and the charts beside it as a .png (when matplotlib is there); the final
    report goes to stdout too (a partial one, written after each unit, only to the files)."""
    plot.write_whole(path, lambda partial: partial.write_text(text))
    try:
        said = plot.write_png(charts, path.with_suffix(".png"), title)
    except Exception as e:  # noqa: BLE001  (a plot that cannot be drawn must not cost the table or the run)
        said = f"plot not written: {type(e).__name__}: {e}"
    if final:
        print(text)
        print(f"written to {path}")
        print(said, flush=True)


def format_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def parse_bytes(text: str) -> int:
    """'16K', '4M', '65536' -> bytes."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale
