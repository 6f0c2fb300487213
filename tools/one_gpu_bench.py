"""Smoke-run a benchmark with its ranks sharing ONE GPU (a harness, not a measurement).

When only single-GPU machines are lent, this still runs every path a benchmark takes (set-up,
checks, captures, timing loops, the per-unit reports) before a 2-GPU session spends its short
device time on it. Time-sliced, the numbers mean nothing (each spin-wait ends at a context switch).
Under CUDA's Multi-Process Service (tools/gpu_session.sh stage `mps`) the ranks' kernels run at once:
graphar's cells are then per-call costs without the link's hop (docs/design.md, evidence levels), and
the report's GPU line says which of the two it was. NCCL refuses
two ranks on one GPU, so the ranks' default group is gloo, and graphar's set-up is relaxed as in
tools/one_gpu_check.py. Peers that need NCCL or a GPU each (the NCCL and symmetric-memory columns,
Inductor + NCCL steps) may come out "err" or "n/a"; graphar's cells must come out timed. Exit code
0: the benchmark ran to its end, every graphar cell timed. Usage, from the checkout:

    PYTHONPATH=. python tools/one_gpu_bench.py NAME [--world N] [ARGS...]

NAME: allreduce, decode, norm, ulysses, attention or capture; ARGS go to the benchmark. The report goes to
a temporary folder (or --out in ARGS), never to bench/results/.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from one_gpu_common import mps_running, relax_set_up

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package: by path

BENCHMARKS = ("allreduce", "decode", "norm", "ulysses", "attention", "capture")
# Cells a graphar column shows when it did not run as itself (see bench/common.py).
FAILED_CELLS = ("err", "WRONG", "fallback", "not rewritten", "NO")


def _share_one_gpu() -> None:
    """In a rank's process (on cuda:0 over gloo: bench/common.launch under GRAPHAR_SHARE_GPU): the
    report names the sharing, and the peers' collectives (gloo) refuse to be captured."""
    import common

    name, sharing = torch.cuda.get_device_name(0), "MPS, kernels at once" if mps_running() else "time-sliced"
    common.gpu_name = lambda: f"{name}, every rank on it ({sharing})"
    _refuse_captured_gloo()


def _uncaptured(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a gloo collective cannot be captured (the NCCL peer, on a shared GPU)")
        return fn(*args, **kwargs)

    return call


_functional: list[torch.library.Library] = []  # the overrides live as long as the process


def _refuse_captured_gloo() -> None:
    """gloo cannot run inside a CUDA-graph capture, and a capture it breaks leaves torch's caching
    allocator in capture mode (an abort at exit): the peers' collectives raise before any work
    instead, in Python (dist.*) and in compiled code (_c10d_functional's CUDA kernels, which then run
    through dist on gloo)."""
    from torch.distributed._functional_collectives import traceable_collective_remaps as remaps

    for name in ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor"):
        original = getattr(dist, name)
        setattr(dist, name, _uncaptured(original))
        if original in remaps:  # Dynamo traces the wrapper as it traces the original: a functional collective
            remaps[getattr(dist, name)] = remaps[original]
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    group = dist.distributed_c10d._resolve_process_group

    def all_reduce_(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
        dist.all_reduce(x, op=ops[op.lower()], group=group(group_name))
        return x

    def all_to_all_single(
        x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str
    ) -> torch.Tensor:
        out = x.new_empty((sum(out_splits), *x.shape[1:])) if out_splits else torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), out_splits or None, in_splits or None, group=group(group_name))
        return out

    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_reduce_", all_reduce_, "CUDA")
    lib.impl("all_reduce", lambda x, op, group_name: all_reduce_(x.clone(), op, group_name), "CUDA")
    lib.impl("all_to_all_single", all_to_all_single, "CUDA")
    _functional.append(lib)


def _rank_entry(*args: Any) -> None:
    """bench/common.py's _entry (a rank's process), on the shared GPU."""
    import common

    _share_one_gpu()
    common._entry(*args)


def graphar_failures(report: str) -> list[str]:
    """Each table row in which a graphar column (not one over NCCL, which is gloo here) or a check
    across graphar's variants shows a failure instead of a time or a verdict."""
    bad = []
    for table in re.split(r"\n(?=## )", report):
        lines = [line for line in table.splitlines() if line.startswith("|")]
        if not lines:
            continue
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        ours = [
            i
            for i, name in enumerate(header)
            if ("graphar" in name and "NCCL" not in name) or name in ("ranks equal", "(b) == (c) bits")
        ]
        for line in lines[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if any(word in cells[i] for i in ours if i < len(cells) for word in FAILED_CELLS):
                bad.append(line)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=BENCHMARKS)
    parser.add_argument("--world", type=int, default=2, choices=(2, 4, 6, 8), help="ranks on the GPU")
    args, rest = parser.parse_known_args()
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    import common

    out = Path(tempfile.mkdtemp(prefix="graphar-one-gpu-bench-"))
    if "--out" not in rest:
        rest += ["--out", str(out)]
    relax_set_up()  # GRAPHAR_SHARE_GPU: the launcher puts every rank on cuda:0 over gloo
    common._entry = _rank_entry  # what the launcher spawns (pickled by name: this script's)
    code = common.run(importlib.import_module(args.name), ["--world-size", str(args.world), *rest])
    reports = sorted(Path(rest[rest.index("--out") + 1]).glob("*.md"))
    failures = [row for report in reports for row in graphar_failures(report.read_text())]
    print(
        f"one-GPU smoke run of bench {args.name}, world size {args.world}: exit code {code}, reports "
        f"{[str(r) for r in reports]}"
    )
    for row in failures:
        print(f"graphar failure: {row}")
    return 0 if code == 0 and reports and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
