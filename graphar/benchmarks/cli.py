"""`python -m graphar bench BENCHMARK [options]`: time graphar against NCCL (and PyTorch) on this machine.

Each benchmark spawns one process per visible GPU (run it with plain `python`, not torchrun; it needs
two GPUs or more), prints progress lines, then a markdown table, written with the GPU, world size,
versions, commit and date to BENCHMARK-<gpu>-ws<N>.md: under bench/results/ when graphar runs from a
source checkout, else in the current folder (or where --out says). `chunking`, `norm-local` and `pack`
run in this process on one GPU instead (BENCHMARK-<gpu>.md), `compile` in this process on the CPU
(compile-cpu.md). A plot of the same numbers goes beside it as a .png when matplotlib is installed
(pip install 'graphar[plot]'). `--dry-run` formats fake numbers on a machine without GPUs, to check
the reporting path. `BENCHMARK --help` lists its options.
"""

from __future__ import annotations

import argparse
from types import ModuleType

from graphar.benchmarks import allreduce, attention, capture, chunking, common, decode, norm, norm_local, pack, ulysses
from graphar.benchmarks import compile as compile_time

# Benchmarks that run in this process (on one GPU, or on the CPU): no launch, their own main(args, settings).
IN_PROCESS: dict[str, ModuleType] = {
    "chunking": chunking,
    "compile": compile_time,
    "norm-local": norm_local,
    "pack": pack,
}
BENCHMARKS: dict[str, ModuleType] = {
    "allreduce": allreduce,
    "attention": attention,
    "capture": capture,
    "decode": decode,
    "norm": norm,
    "ulysses": ulysses,
    **IN_PROCESS,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(title="benchmarks", dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module in BENCHMARKS.items():
        summary = module.__doc__.splitlines()[0]
        sub = benchmarks.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(sub)
        sub.set_defaults(benchmark_module=module, benchmark_parser=sub)


def run(args: argparse.Namespace) -> int:
    """The `bench` command of `python -m graphar`."""
    module = args.benchmark_module
    settings = module.settings(args, args.benchmark_parser)
    if module in IN_PROCESS.values():
        return module.main(args, settings)
    return common.main(args, settings, module.dry_run, module.worker, module.TIMEOUT_S)
