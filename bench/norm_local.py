"""The fused norm kernel's local part on one GPU, against Inductor's unfused add + RMSNorm.

    python bench/norm_local.py [--tokens 1,2,...] [--hidden 4096,8192] [--quick] [--dry-run] [--out F]

Runs here, in this process, on the current GPU: no peers, no process group. The fused all-reduce +
residual add + RMSNorm kernel (csrc/push_norm.cuh, world size 2) runs on a communicator of rank 0
that the testing library (tools/testing_library.py) makes its own peer, so the kernel does all its local work (the claim and epoch, the pushes, the receive with its
arrival test and slot resets, the sum, the residual add, the mean square, its split rows' exchange
of partial sums, both outputs) with the peer's data arrived at once. What differs from a call
between two GPUs: the pushes go to this GPU's own memory instead of over NVLink, nothing waits for a
peer, and the kernel sums its input twice. Against it, per op, bf16 [tokens, hidden]:
  Inductor:      h = x + residual, then HF's LlamaRMSNorm (weight * normed.to(bf16)), compiled
                 with torch.compile(dynamic=False), the unfused graph a fused call replaces;
  fused:         the loopback launch with the kernel's own grid, PDL off;
  fused, PDL:    the same with programmatic dependent launch (graphar's default on Hopper): a
                 kernel's start overlaps the end of the kernel before it, here the previous op;
  a block/row:   the same kernel with its rows never split between blocks.
Each time is the median of replays of a CUDA graph of back-to-back ops, per op. Before timing, the
fused outputs are checked: sum + residual equal to PyTorch's bits, the normed rows within 2**-6 of
the unfused ops' (relative), and the kernel's grid and one block per row giving the same bits (the
mean square does not depend on the grid). The table (per hidden size) goes to stdout and to
norm-local-<gpu>.md (bench/results/, or --out), a plot of
time against tokens beside it (.png).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import common
import plot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # tools/ is not a package: by path
import testing_library

from norm import NORMED_TOLERANCE, add_rms_norm

DTYPE = torch.bfloat16
EPS = 1e-6
INDUCTOR, FUSED, FUSED_PDL = "Inductor add + norm", "fused local", "fused local, PDL"
PER_ROW = "fused, a block/row"
TIMED = (INDUCTOR, FUSED, FUSED_PDL, PER_ROW)
GRID, SMS, CHECK = "grid", "SMs", "check"
TIMEOUT_NS = 10 * 10**9  # the kernel's bound on a wait: none should wait here

Unit = tuple[int, int]  # (hidden, tokens)


@dataclass(frozen=True)
class Settings:
    tokens: list[int]
    hidden: list[int]
    ops: int
    replays: int

    @property
    def units(self) -> list[Unit]:
        return [(h, t) for h in self.hidden for t in self.tokens]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512", help="comma-separated token counts (rows)")
    p.add_argument("--hidden", default="4096,8192", help="comma-separated hidden sizes")
    common.add_arguments(
        p, quick_help="1, 8 and 64 tokens, fewer ops and replays", world_size_help="ignored: one GPU, no peers"
    )


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    def numbers(text: str) -> list[int]:
        return sorted({int(n) for n in text.split(",") if n.strip()})

    quick = args.quick and args.tokens == p.get_default("tokens")
    tokens = [1, 8, 64] if quick else numbers(args.tokens)
    hidden = numbers(args.hidden)
    if not tokens or not hidden or min(tokens) < 1 or min(hidden) < 8 or any(h % 8 for h in hidden):
        p.error("tokens must be positive and hidden sizes positive multiples of 8")
    return Settings(tokens=tokens, hidden=hidden, ops=20 if args.quick else 50, replays=5 if args.quick else 9)


# ---- the loopback launch ------------------------------------------------------------------------


class Loopback:
    """A world-size-2 communicator of rank 0 that is its own peer (tools/testing_library.py loopback):
    the fused kernel's local work, launched as graphar launches it between ranks."""

    def __init__(self, max_bytes: int) -> None:
        from graphar import _cuda, abi
        from graphar.allreduce.kernels import block_limit

        self._cuda, self._abi = _cuda, abi
        self.lib = _cuda.library()
        self.device = torch.cuda.current_device()
        handle = ctypes.c_void_p()
        self.blocks = block_limit(torch.cuda.get_device_capability(self.device)[0])
        _cuda.check(
            self.lib.graphar_comm_create(0, 2, max_bytes, self.blocks, TIMEOUT_NS, 1, ctypes.byref(handle)),
            "graphar_comm_create (loopback)",
        )
        self.handle = handle.value
        record = ctypes.c_void_p()
        _cuda.check(self.lib.graphar_comm_error_record(self.handle, ctypes.byref(record)), "error record")
        self.record = abi.ErrorRecord.from_address(record.value)

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        normed: torch.Tensor,
        summed: torch.Tensor,
        *,
        pdl: bool,
        max_split: int = 0,
        eps: float = EPS,
        weight_first: bool = False,
    ) -> tuple[int, int, int]:
        """One launch on the current stream, writing normed and summed (x's shape and dtype, contiguous, as
        residual; weight one row; None: none); returns its grid (blocks, threads per block, blocks per row)."""
        row_bytes = x.shape[-1] * x.element_size()
        kernels = self._abi.Kernels()  # no rows: a direct launch needs no plan, only PDL
        kernels.pdl = int(pdl)
        self._cuda.check(self.lib.graphar_comm_set_kernels(self.handle, ctypes.byref(kernels)), "set kernels")
        testing_library.loopback(self.handle, x.nbytes)
        testing_library.norm_split(self.handle, max_split)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        address = [0 if t is None else t.data_ptr() for t in (x, residual, weight, normed, summed)]
        args = self._abi.NORM_ARGS.pack(
            *address, x.nbytes, row_bytes, stream, eps, self._abi.DTYPE_CODES[x.dtype], int(weight_first), 0
        )
        self._cuda.check(self.lib.graphar_comm_all_reduce_norm(self.handle, args), "graphar_comm_all_reduce_norm")
        return testing_library.norm_grid(self.handle, x.nbytes, row_bytes)

    def check(self) -> None:
        """Raise when a kernel gave up a wait (its outputs are poison, its times meaningless)."""
        if self.record.failed:
            where = self._abi.WHERE.get(self.record.where, self.record.where)
            raise RuntimeError(
                f"the fused kernel gave up at {where}, block {self.record.block}, cause {self.record.cause}"
            )

    def close(self) -> None:
        torch.cuda.synchronize()
        self._cuda.check(self.lib.graphar_comm_destroy(self.handle), "graphar_comm_destroy (loopback)")


# ---- one shape ----------------------------------------------------------------------------------


def capture(fn: Callable[[], object], n: int) -> torch.cuda.CUDAGraph:
    """fn() twice on a side stream (a compiled fn compiles there), then n calls in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, replays: int, per: int) -> float:
    """Median over replays of the CUDA-event time of one replay, in us per op."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / per)
    return statistics.median(samples)


def check_fused(loop: Loopback, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the fused kernel's outputs are wrong (None: right), from eager calls: sum + residual equal to
    PyTorch's bits, normed within NORMED_TOLERANCE of the unfused ops', the kernel's grid and a block
    per row bitwise equal."""
    outs = {}
    for split in (0, 1):
        normed, summed = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        loop(x, residual, weight, normed, summed, pdl=False, max_split=split)
        outs[split] = normed, summed
    torch.cuda.synchronize()
    loop.check()
    want_normed, want_summed = add_rms_norm(x + x, residual, weight)  # the loopback sums its input twice
    normed, summed = outs[0]
    if not torch.equal(summed, want_summed):
        return "sum + residual differs from PyTorch's"
    err = ((normed.float() - want_normed.float()).abs() / want_normed.float().abs().clamp_min(1e-3)).max().item()
    if not err <= NORMED_TOLERANCE:
        return f"normed off by {err:.3g} (relative)"
    if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs[0], outs[1])):
        return "the kernel's grid and a block per row give different bits"
    return None


def run_unit(unit: Unit, loop: Loopback, norm: Callable, s: Settings, reasons: dict[str, str]) -> dict:
    hidden, tokens = unit
    gen = torch.Generator(device="cuda").manual_seed(tokens * 131 + hidden)
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen)
    residual = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen)
    weight = torch.rand(hidden, device="cuda", dtype=DTYPE, generator=gen) + 0.5
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    cells: dict = {}

    def key(column: str) -> tuple[Unit, str]:
        return (unit, column)

    def cell(column: str, measure: Callable[[], float]) -> None:
        try:
            cells[key(column)] = measure()
        except Exception as e:  # noqa: BLE001  (a cell that cannot be measured says why, the run goes on)
            cells[key(column)] = "err"
            reasons.setdefault(column, f"{type(e).__name__}: {str(e).partition(chr(10))[0]}")

    cell(INDUCTOR, lambda: time_graph(capture(lambda: norm(x, residual, weight), s.ops), s.replays, s.ops))
    try:
        blocks, threads, split = loop(x, residual, weight, normed, summed, pdl=False)
        sms = torch.cuda.get_device_properties(loop.device).multi_processor_count
        cells[key(GRID)] = f"{blocks} x {threads}" + (f", {split}/row" if split > 1 else "")
        cells[key(SMS)] = str(min(blocks, sms))
        problem = check_fused(loop, x, residual, weight)
    except Exception as e:  # noqa: BLE001  (whatever the fused kernel raised, the check's note says it)
        problem = f"raised {type(e).__name__}: {str(e).partition(chr(10))[0]}"
        cells[key(GRID)] = cells[key(SMS)] = "err"
    if problem is not None:
        reasons.setdefault(f"check at hidden {hidden}, {tokens} tokens", problem)
        cells.update({key(name): "WRONG" for name in (CHECK, *TIMED[1:])})
        return cells
    cells[key(CHECK)] = "ok"
    for column, pdl, max_split in ((FUSED, False, 0), (FUSED_PDL, True, 0), (PER_ROW, False, 1)):

        def measure(pdl: bool = pdl, max_split: int = max_split) -> float:
            graph = capture(lambda: loop(x, residual, weight, normed, summed, pdl=pdl, max_split=max_split), s.ops)
            t = time_graph(graph, s.replays, s.ops)
            loop.check()  # a kernel that gave up would have been fast for nothing
            return t

        cell(column, measure)
    return cells


def main(args: argparse.Namespace, s: Settings) -> int:
    if args.dry_run:
        dry_run(s, args.out)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("bench/norm_local.py needs a GPU")
    common._raise_recompile_limit()  # one compile per shape (dynamic=False)
    gpu = common.gpu_name()
    path = common.results_file(f"norm-local-{common.gpu_slug(gpu)}.md", args.out)
    largest = max(s.hidden) * max(s.tokens) * DTYPE.itemsize
    loop = Loopback(max(8 << 20, -(-largest // 16) * 16))
    norm = torch.compile(add_rms_norm, dynamic=False)
    cells: dict = {}
    reasons: dict[str, str] = {}
    try:
        units = s.units
        for i, unit in enumerate(units, 1):
            cells.update(run_unit(unit, loop, norm, s, reasons))
            done = units[:i]
            partial = Settings(
                tokens=[t for t in s.tokens if any(u[1] == t for u in done)],
                hidden=[h for h in s.hidden if any(u[0] == h for u in done)],
                ops=s.ops,
                replays=s.replays,
            )
            write(cells, partial, reasons, gpu, path, final=i == len(units))
            common.progress(f"done hidden {unit[0]}, {unit[1]} tokens ({i}/{len(units)})")
    finally:
        loop.close()
    return 0


# ---- the report ---------------------------------------------------------------------------------


def write(cells: dict, s: Settings, reasons: dict[str, str], gpu: str, path: Path, final: bool = True) -> None:
    columns = ["tokens", "bytes", GRID, SMS, *TIMED, "fused / Inductor", "fused PDL / Inductor", CHECK]
    sections, charts = [], []
    for hidden in s.hidden:
        rows = []
        tokens = [t for t in s.tokens if ((hidden, t), INDUCTOR) in cells]
        for t in tokens:
            c = {name: cells.get(((hidden, t), name), "-") for name in (GRID, SMS, CHECK, *TIMED)}
            rows.append(
                [
                    str(t),
                    common.format_bytes(t * hidden * DTYPE.itemsize),
                    c[GRID],
                    c[SMS],
                    *(c[name] for name in TIMED),
                    common.derived(c[FUSED], c[INDUCTOR]),
                    common.derived(c[FUSED_PDL], c[INDUCTOR]),
                    c[CHECK],
                ]
            )
        sections.append((f"hidden {hidden}, us per op", common.markdown_table(columns, rows)))
        lines = [
            plot.Line(name, plot.points(tokens, [cells.get(((hidden, t), name), "-") for t in tokens]), colour_key=name)
            for name in TIMED
        ]
        charts.append(
            plot.LineChart(f"bf16, hidden {hidden}", "tokens", "us per op", lines, [(t, str(t)) for t in tokens])
        )
    notes_head = [target_line(cells, s, hidden) for hidden in s.hidden]
    info = {
        "GPU": gpu,
        **{k: v for k, v in common.versions().items() if k != "NCCL"},
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "mode": "one GPU, CUDA graphs",
    }
    notes = (
        notes_head
        + [
            f"us per op: median of {s.replays} replays of a CUDA graph of {s.ops} back-to-back ops; bf16 [tokens, hidden].",
            "fused local: graphar's fused all-reduce + residual add + RMSNorm kernel (world size 2) with its peer's "
            "data arrived at once: the loopback launch, whose pushes land in this GPU's own memory instead of going "
            "over NVLink and which sums its input twice. Everything else is the kernel as it runs between two GPUs.",
            "Inductor add + norm: h = x + residual and HF's LlamaRMSNorm, torch.compile(dynamic=False): the unfused "
            "graph the fused op replaces, without its all-reduce.",
            "grid: blocks x threads per block, and blocks per row where rows are split; SMs: the SMs those blocks "
            "can cover, one block each (the scheduler spreads a grid this small over idle SMs).",
            "fused PDL: launched with programmatic dependent launch (graphar's default where the library holds "
            "sm_90 code): each op's start overlaps the end of the op before it, here the same kernel; Inductor's "
            "kernels have no such overlap. a block/row: the kernel with its rows never split between blocks.",
            "check: sum + residual equal to PyTorch's bits, normed within 2**-6 of the unfused ops' (relative), "
            "and the kernel's grid and one block per row bitwise equal (WRONG otherwise; then nothing fused is timed).",
        ]
        + [f"{name}: {why}" for name, why in sorted(reasons.items())]
    )
    title = "Fused norm, local part, against Inductor's add + RMSNorm (us)"
    text = common.report(title, info, sections, notes)
    common.write_report(text, path, charts, f"{title}, {gpu}", final)


def target_line(cells: dict, s: Settings, hidden: int) -> str:
    """The issue's target at one hidden size: the fused local part at most Inductor's time from 1 to 64
    tokens (worst ratio, PDL off and on), and at least 32 SMs at one token."""

    def worst(column: str) -> str:
        ratios = [
            cells[((hidden, t), column)] / cells[((hidden, t), INDUCTOR)]
            for t in s.tokens
            if t <= 64 and all(isinstance(cells.get(((hidden, t), c)), float) for c in (column, INDUCTOR))
        ]
        return f"{max(ratios):.2f}x" if ratios else "-"

    sms = cells.get(((hidden, 1), SMS), "-") if 1 in s.tokens else "-"
    return (
        f"target at hidden {hidden} (fused local <= 1.0x Inductor at 1-64 tokens, >= 32 SMs at 1 token): "
        f"worst fused / Inductor {worst(FUSED)} (PDL off), {worst(FUSED_PDL)} (PDL on); SMs at 1 token {sms}."
    )


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU, no graphar needed."""
    rng = random.Random(0)
    cells: dict = {}
    for hidden, tokens in s.units:
        unit = (hidden, tokens)
        base = 2.5 + tokens * hidden * 2e-6
        split = max(1, 64 // tokens)
        cells.update({(unit, name): base * rng.uniform(0.7, 1.4) for name in TIMED})
        threads = min(512, max(32, hidden // 8 // split))
        cells[(unit, GRID)] = f"{min(tokens * split, 64)} x {threads}" + (f", {split}/row" if split > 1 else "")
        cells[(unit, SMS)] = str(min(tokens * split, 64))
        cells[(unit, CHECK)] = "ok"
    path = common.results_file(f"norm-local-{common.gpu_slug(common.DRY_RUN_GPU)}.md", out, common.dry_run_dir())
    write(cells, s, {}, common.DRY_RUN_GPU, path)


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
