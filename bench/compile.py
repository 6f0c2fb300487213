"""Compile time of backend="graphar" against backend="inductor", and graphar's passes' share of it (CPU).

    python bench/compile.py [--layers 8,32,80] [--dit-layers 40] [--world-size 2]
                            [--quick] [--dry-run] [--out F]

Runs here, in this process, on the CPU: no GPU and no peers. A fake process group of --world-size
ranks (this process is rank 0) moves nothing, so only the compile is real. Each model is compiled
whole (fullgraph, dynamic=False) at its first call, once per backend, each time cold: Dynamo reset,
a fresh Inductor cache folder, Inductor's in-memory caches cleared, the FX-graph and AOTAutograd
caches off (graphar's pass runs in every compile), after a warm-up compile of each. `--quick` (a
smoke run, for tests) keeps the compiled kernels between compiles and warms nothing up: its times
leave out most of the C++ compiler's, and its first row holds one-time costs. Models, bf16
with small widths (only the graph's size matters here):
  llama  N tensor-parallel Llama-style decoder blocks, one decode step (decode's Block: q/k/v/o and
         gate/up/down sharded, a dist.all_reduce after o and after down, RMSNorms);
  dit    N Ulysses DiT blocks (attention's Block: Q/K/V, QK-norm, RoPE, three all-to-alls in and one
         out; then a GELU MLP; LayerNorms and residuals, no conditioning).
graphar's passes' time is what graphar's pass manager records in torch's compile metrics
(graphar.passes.manager.TIMER). The table goes to stdout and to compile-cpu.md (bench/results/, or
--out) with the CPU, torch and the git commit, and a plot of the times against layers beside it (.png).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import attention
import common
import decode
import plot
import ranks

LLAMA, DIT = "llama", "dit"
LLAMA_SHAPE = decode.Shape(hidden=256, intermediate=512, heads=8, kv_heads=4, head_dim=32, past=16)
LLAMA_BATCH = 4
DIT_SHAPE = (1, 256, 8, 32)  # b x global sequence x heads x head_dim: hidden 256
INDUCTOR, GRAPHAR, PASSES, REWRITES = "inductor compile s", "graphar compile s", "graphar passes s", "rewrites made"
FILE_NAME = "compile-cpu.md"

Unit = tuple[str, int]  # (model, layers)


@dataclass(frozen=True)
class Settings:
    units: list[Unit]
    world_size: int
    cold: bool  # a fresh Inductor cache per compile; else one per run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", default="8,32,80", help="comma-separated layer counts of the Llama-style model")
    p.add_argument("--dit-layers", default="40", help="comma-separated layer counts of the DiT ('' for none)")
    common.add_arguments(
        p,
        quick_help="Llama 2 and 4 layers, DiT 2 layers",
        world_size_help="ranks of the fake process group (default 2)",
    )


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    def counts(option: str, quick: str) -> list[int]:
        text = quick if args.quick and getattr(args, option) == p.get_default(option) else getattr(args, option)
        return [int(n) for n in text.split(",") if n]

    llama, dit = counts("layers", "2,4"), counts("dit_layers", "2")
    world_size = args.world_size or 2
    if min(llama + dit, default=1) < 1 or world_size < 2:
        p.error("layer counts must be positive and --world-size at least 2")
    return Settings(
        units=[(LLAMA, n) for n in llama] + [(DIT, n) for n in dit], world_size=world_size, cold=not args.quick
    )


# ---- the models ---------------------------------------------------------------------------------


class DiTBlock(nn.Module):
    """A DiT block without conditioning: LayerNorm, Ulysses attention, LayerNorm, GELU MLP, residuals."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.hidden = DIT_SHAPE[2] * DIT_SHAPE[3]
        self.attn = attention.Block(DIT_SHAPE, 0, world_size, exchange=True, device="cpu")
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, 4 * self.hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * self.hidden, self.hidden),
        ).to(attention.DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(F.layer_norm(x, (self.hidden,)))
        return x + self.mlp(F.layer_norm(x, (self.hidden,)))


def model(name: str, layers: int, world_size: int) -> tuple[nn.Module, torch.Tensor]:
    """The model of `layers` blocks and an input for it."""
    if name == LLAMA:
        blocks = [decode.Block(LLAMA_SHAPE, world_size, LLAMA_BATCH, device="cpu") for _ in range(layers)]
        return nn.Sequential(*blocks), torch.randn(LLAMA_BATCH, LLAMA_SHAPE.hidden, dtype=decode.DTYPE)
    b, seq, h, d = DIT_SHAPE
    blocks = [DiTBlock(world_size) for _ in range(layers)]
    return nn.Sequential(*blocks), torch.randn(b, seq // world_size, h * d, dtype=attention.DTYPE)


# ---- measuring ----------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A process group whose collectives move nothing: the graphs are those of rank 0 of world_size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fresh_cache_if(fresh: bool) -> contextlib.AbstractContextManager:
    """A fresh Inductor cache folder with its in-memory caches cleared, within the block (if `fresh`)."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache() if fresh else contextlib.nullcontext()


def compile_once(module: nn.Module, x: torch.Tensor, backend: str, cold: bool) -> tuple[float, float, str]:
    """Seconds of the first call (the compile, and one run of a few ms), seconds of graphar's passes
    within it, and the rewrites made; `cold`: with an empty Inductor cache."""
    from torch._dynamo.utils import compilation_time_metrics

    from graphar.passes.manager import TIMER

    torch._dynamo.reset()
    start = len(compilation_time_metrics.get(TIMER, []))
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    with fresh_cache_if(cold), ranks.counting_rewrites() as made, torch.no_grad():
        t0 = time.perf_counter()
        compiled(x)
        seconds = time.perf_counter() - t0
    passes = sum(compilation_time_metrics.get(TIMER, [])[start:])
    return seconds, passes, ", ".join(f"{op} {n}" for op, n in sorted(made.items())) or "none"


def measure(unit: Unit, s: Settings, reasons: dict[str, str]) -> dict[tuple, common.Cell]:
    name, layers = unit
    module, x = model(name, layers, s.world_size)
    cells: dict[tuple, common.Cell] = {}
    for backend, column in (("inductor", INDUCTOR), ("graphar", GRAPHAR)):
        try:
            seconds, passes, rewrites = compile_once(module, x, backend, s.cold)
        except Exception as e:  # noqa: BLE001  (one failed compile costs its cell, not the run)
            cells[(unit, column)] = "err"
            reasons[f"{name} {layers} layers, {backend}"] = f"{type(e).__name__}: {e}"
            continue
        cells[(unit, column)] = seconds
        if backend == "graphar":
            cells.update({(unit, PASSES): passes, (unit, REWRITES): rewrites})
    return cells


def main(args: argparse.Namespace, s: Settings) -> int:
    if args.dry_run:
        dry_run(s, args.out)
        return 0
    import graphar  # noqa: F401  (graphar's ops, and the backend where its entry point is not installed)

    path = common.results_file(FILE_NAME, args.out)
    common.git_commit()  # read as the run starts: edits made while it runs are not what ran
    cells: dict[tuple, common.Cell] = {}
    reasons: dict[str, str] = {}
    with (
        fake_world(s.world_size),
        fresh_cache_if(not s.cold),
        torch._inductor.config.patch(fx_graph_cache=False),  # a hit in these would skip graphar's pass
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        # A process's first compiles pay for imports and one-time set-up: not the first row's to pay
        # (but --quick's, to be quick).
        if s.cold:
            common.progress("warming up: both backends on one block of each model...")
            for name in dict(s.units):
                module, x = model(name, 1, s.world_size)
                for backend in ("inductor", "graphar"):
                    compile_once(module, x, backend, s.cold)
        for i, unit in enumerate(s.units, 1):
            cells.update(measure(unit, s, reasons))
            write(cells, dataclasses.replace(s, units=s.units[:i]), reasons, path, final=i == len(s.units))
            common.progress(f"done {unit[0]}, {unit[1]} layers ({i}/{len(s.units)})")
    return 0


# ---- the report ---------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _seconds(cell: common.Cell, fmt: str) -> str:
    return fmt.format(cell) if isinstance(cell, float) else str(cell)


def table(cells: dict[tuple, common.Cell], s: Settings) -> str:
    columns = [
        "model",
        "layers",
        INDUCTOR,
        GRAPHAR,
        PASSES,
        "passes % of graphar compile",
        "passes ms per layer",
        REWRITES,
    ]
    rows = []
    for unit in s.units:
        name, layers = unit
        passes, graphar_s = cells.get((unit, PASSES), "-"), cells[(unit, GRAPHAR)]
        rows.append(
            [
                name,
                str(layers),
                _seconds(cells[(unit, INDUCTOR)], "{:.1f}"),
                _seconds(graphar_s, "{:.1f}"),
                _seconds(passes, "{:.3f}"),
                common.derived(passes, graphar_s, "{:.2%}"),
                common.derived(passes, float(layers), "{:.2f}", lambda a, b: 1000 * a / b),
                str(cells.get((unit, REWRITES), "-")),
            ]
        )
    return common.markdown_table(columns, rows)


def chart(cells: dict[tuple, common.Cell], s: Settings) -> plot.LineChart:
    lines = []
    for name in dict(s.units):
        layers = [n for model_name, n in s.units if model_name == name]
        for column in (INDUCTOR, GRAPHAR, PASSES):
            ys = [cells.get(((name, n), column), "-") for n in layers]
            lines.append(plot.Line(f"{name}: {column}", plot.points(layers, ys), colour_key=column, dash_key=name))
    ticks = sorted({n for _, n in s.units})
    return plot.LineChart(
        "cold compile, seconds against layers (log-log)", "layers", "seconds", lines, [(n, str(n)) for n in ticks]
    )


def write(
    cells: dict[tuple, common.Cell], s: Settings, reasons: dict[str, str], path: Path, final: bool = True
) -> None:
    versions = {k: v for k, v in common.versions().items() if k != "NCCL"}
    info = {
        "CPU": f"{cpu_name()}, {os.cpu_count()} cores",
        **versions,
        "commit": common.git_commit(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "mode": f"cold compile, fake process group of {s.world_size} ranks",
    }
    caches = (
        "every cache cold, after a warm-up"
        if s.cold
        else "kernels compiled once per run, no warm-up "
        "(--quick: a smoke run; most of the C++ compiler's time left out, the first row pays one-time costs)"
    )
    notes = [
        "Compile s: wall time of the compiled model's first call (Dynamo, AOTAutograd, Inductor, the C++ "
        f"compiler, and one run of a few ms), {caches}; FX-graph and AOTAutograd caches off; one sample each, on "
        "a machine other jobs may share.",
        "Passes s: graphar's pass manager's own time in that compile (torch._dynamo.utils.compilation_time_metrics"
        "['graphar_pass']), all rewrites together.",
        f"llama: decode's Block, hidden {LLAMA_SHAPE.hidden}, intermediate {LLAMA_SHAPE.intermediate}, "
        f"{LLAMA_SHAPE.heads} heads, {LLAMA_SHAPE.kv_heads} KV heads, head_dim {LLAMA_SHAPE.head_dim}, "
        f"{LLAMA_SHAPE.past} cached tokens, batch {LLAMA_BATCH}: two all-reduces per layer.",
        f"dit: attention's Block at b x s x h x d = {'x'.join(map(str, DIT_SHAPE))} and a GELU MLP: one "
        "Q/K/V exchange and one output exchange per layer.",
    ] + [f"{k}: {v}" for k, v in sorted(reasons.items())]
    title = "Compile time, backend='graphar' against 'inductor' (CPU)"
    text = common.report(title, info, [("seconds per cold compile", table(cells, s))], notes)
    common.write_report(text, path, [chart(cells, s)], f"{title}, {cpu_name()}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: nothing compiled."""
    cells: dict[tuple, common.Cell] = {}
    for unit in s.units:
        layers = unit[1]
        cells.update(
            {
                (unit, INDUCTOR): 5 + 0.8 * layers,
                (unit, GRAPHAR): 5.1 + 0.8 * layers,
                (unit, PASSES): 0.002 * layers,
                (unit, REWRITES): f"all_reduce {2 * layers}",
            }
        )
    write(cells, s, {}, common.results_file(FILE_NAME, out, common.dry_run_dir()))


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
