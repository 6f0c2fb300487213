"""The chunking tax of the pipelined Ulysses attention: chunked against unchunked, on one GPU.

    python bench/chunking.py [--shapes 1x4096x32x128:causal,...] [--backends flash,cudnn,efficient]
                             [--chunks 1,2,4,8] [--world-size 2] [--quick] [--dry-run] [--out F]

`attention_chunks` (graphar::ulysses_attention) hides the Ulysses exchanges behind the attention by
attending the heads in chunks; it can only win where attending in chunks costs less than the exchange
it hides. This measures that cost in this process, on the current GPU, with no peers: one rank's share
of the heads (heads / --world-size) attending the whole sequence, through graphar's own
`graphar.ulysses.overlap.ulysses_attention` (its chunk plan, head slicing, SDPA call pinned to the
backend, side stream and events), with its two exchanges replaced
  none:  by nothing: each chunk's Q/K/V already lie where the exchange would put them (packed, as
         graphar's exchange leaves them), and the output stays where the attention wrote it;
  copy:  by a local copy of the same bytes (on the op's side stream, so a chunk's copies run while
         another chunk attends, as its exchanges would).
Each (shape, backend) is timed at the chunk counts graphar runs when asked for --chunks (its plan may
run fewer: an even split of the heads, and flash's cap) and at the count attention_chunks="auto" picks
(graphar.ulysses.overlap.auto_chunks). Per call over a CUDA graph of back-to-back calls (median of
replays). The chunking tax is a chunked time over the unchunked one (1 chunk) in the same mode, less
1; the target is at most 3 % at the count the rule picks. Before timing, every chunk count's
attention output is checked bit for bit against the unchunked one ("NO" otherwise), and the SDPA
backend that actually ran is named ("ran"; another one where the pinned backend refused the inputs).
The table goes to stdout and to chunking-<gpu>.md (bench/results/, or --out), with a
plot of the tax against chunks beside it (.png).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import common
import plot
import ranks
import shapes
from graphar.ulysses import overlap
from shapes import Shape

BACKENDS = ("flash", "cudnn", "efficient")  # the SDPA kernels Inductor lowers to, which the op pins
CHUNKS = (1, 2, 4, 8)
NONE, COPY = "none", "copy"
MODES = (NONE, COPY)
MODE_LABELS = {NONE: "exchanges replaced by nothing", COPY: "exchanges replaced by a local copy of their bytes"}
TARGET_TAX = 0.03
FLOP_BUDGET = 4e12  # attention FLOPs per captured graph (a few ms on an H200), which bounds its calls
DTYPE = torch.bfloat16
GROUP = "emulated"  # the group name the op is given: the exchanges it would name are emulated


@dataclass(frozen=True)
class Settings:
    shapes: list[Shape]
    backends: list[str]
    chunks: list[int]  # chunk counts asked for; 1 (the unchunked baseline) always
    world_size: int  # ranks whose share of heads one rank attends
    max_calls: int  # back-to-back calls per captured graph, at most
    replays: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", help="comma-separated BxSxHxD[:kvN][:causal] (S: global sequence, H: all heads)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="SDPA backends to pin (default: all three)")
    p.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="chunk counts to ask for (default 1,2,4,8)")
    common.add_arguments(
        p,
        quick_help="fewer calls per graph and replays (every shape, backend and count)",
        world_size_help="ranks whose share of the heads is attended (default 2)",
    )


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    backends = [b for b in args.backends.split(",") if b]
    if not backends or set(backends) - set(BACKENDS):
        p.error(f"--backends {args.backends!r}: expected some of {','.join(BACKENDS)}")
    try:
        chunks = sorted({1, *(int(c) for c in args.chunks.split(",") if c)})
    except ValueError:
        chunks = [0]
    if chunks[0] < 1:
        p.error(f"--chunks {args.chunks!r}: expected comma-separated positive counts")
    world_size = args.world_size or 2
    if world_size < 1:
        p.error("--world-size must be positive")
    return Settings(
        shapes=shapes.parse_list(args.shapes, p) or shapes.CHUNKING,
        backends=backends,
        chunks=chunks,
        world_size=world_size,
        max_calls=8 if args.quick else 20,
        replays=3 if args.quick else 9,
    )


# ---- what graphar runs, and how many chunks ------------------------------------------------------------


def planned(shape: Shape, world_size: int, wanted: int, backend: str) -> int:
    """The chunks graphar's op runs for `shape` when asked for `wanted` (overlap.AUTO_CHUNKS: the rule)."""
    return overlap.planned_chunks(
        shape.b, shape.heads, shape.kv, shape.s, world_size, wanted, backend, shape.causal, on_gpu=True
    )


def counts(shape: Shape, s: Settings, backend: str) -> list[int]:
    """The chunk counts to time: those the op runs for --chunks, and the rule's pick."""
    asked = [*s.chunks, overlap.AUTO_CHUNKS]
    return sorted({planned(shape, s.world_size, w, backend) for w in asked})


def rows_per_chunk(shape: Shape, world_size: int, n: int) -> int:
    """Query rows (batch x heads x tokens) each of n chunks attends on one rank: the rule's measure."""
    return shape.b * shape.heads // world_size * shape.s // n


class Emulated:
    """graphar's ulysses_attention on one rank of `world_size`, its exchanges emulated (see the module
    docstring). `call(n, mode)` runs the op once over n chunks; `prepare(n)` lays out the chunks' inputs
    first (as the Q/K/V exchange leaves them: Q, K and V heads of the chunk packed side by side)."""

    def __init__(self, shape: Shape, world_size: int, device: str = "cuda", dtype: torch.dtype = DTYPE) -> None:
        b, s, d, p = shape.b, shape.s, shape.d, world_size
        self.shape, self.p, self.s_local = shape, p, s // p
        gen = torch.Generator(device).manual_seed(0)
        # This rank's Q, K and V after the exchange, [b, s, heads / P, d]; what the attention reads.
        self.qkv = [
            torch.randn(b, s, h // p, d, device=device, dtype=dtype, generator=gen)
            for h in (shape.heads, shape.kv, shape.kv)
        ]
        # The op's own inputs: only their shapes matter (the exchange that would read them is emulated).
        self.q_in = torch.empty(b, s // p, shape.heads, d, device=device, dtype=dtype)
        self.kv_in = torch.empty(b, s // p, shape.kv, d, device=device, dtype=dtype)
        self.sources: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []  # the check's: each chunk's attention output
        self.backend, self.mode, self.n, self.chunk = "flash", NONE, 1, iter(())

    def prepare(self, n: int) -> None:
        def chunk(x: torch.Tensor, c: int) -> torch.Tensor:
            h = x.shape[2] // n
            return x[:, :, c * h : (c + 1) * h]

        self.sources = [torch.cat([chunk(x, c) for x in self.qkv], dim=2) for c in range(n)]
        self.copies = [torch.empty_like(x) for x in self.sources]

    def call(self, n: int, mode: str) -> torch.Tensor:
        """The op over n chunks (a count its plan keeps: one that `planned` gave)."""
        self.mode, self.n, self.chunk = mode, n, iter(range(n))
        return overlap.ulysses_attention(
            self.q_in, self.kv_in, self.kv_in, GROUP, self.shape.causal, None, n, self.backend
        )

    # The op's calls into graphar.ulysses.exchanges and ulysses_shapes, replaced while `patched()` holds.

    def world_size(self, group_name: str) -> int:
        return self.p

    def qkv_exchange(self, xs: list[torch.Tensor], group_name: str) -> torch.Tensor:
        if xs[0].shape[2] * self.n != self.shape.heads:  # the op's plan ran another count than asked
            raise RuntimeError(f"the op chunks {self.shape.heads} heads by {xs[0].shape[2]}, not into {self.n}")
        c = next(self.chunk)
        if self.mode == COPY:
            return self.copies[c].copy_(self.sources[c])
        return self.sources[c]

    def output_exchange(self, o: torch.Tensor, group_name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        # o: [b, s, h, d] (all tokens, the chunk's heads); out: [b, S, P*h, d] (the rank's tokens, the
        # chunk's heads of every rank), as the exchange reads and writes them.
        if self.mode == COPY:
            h = o.shape[2]
            out.unflatten(2, (self.p, h)).copy_(o.unflatten(1, (self.p, self.s_local)).permute(0, 2, 1, 3, 4))
        elif self.mode == "check":
            self.outputs.append(o.clone())
        return out

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        from graphar.ulysses import exchanges, shapes

        with contextlib.ExitStack() as stack:
            patches = ((shapes, "world_size"), (exchanges, "qkv_exchange"), (exchanges, "output_exchange"))
            for module, name in patches:
                stack.enter_context(common.overriding(module, name, getattr(self, name)))
            yield

    def attended(self, n: int) -> torch.Tensor:
        """The attention output of every head, attended over n chunks (the check's call)."""
        self.prepare(n)
        self.outputs = []
        self.call(n, "check")  # the op joins its side stream, where the outputs were cloned, before it returns
        return torch.cat(self.outputs, dim=2)

    def ran(self) -> str:
        """The SDPA backend that attends chunk 0 of the unchunked call, as the op pins it."""
        from torch.nn.attention import sdpa_kernel

        self.prepare(1)
        hq, hk = self.shape.heads // self.p, self.shape.kv // self.p
        q, k, v = (x.transpose(1, 2) for x in self.sources[0].split([hq, hk, hk], dim=2))
        gqa = hk != hq
        if gqa and self.backend != "flash":  # the op repeats K/V for the other kernels (overlap._attention)
            k, v, gqa = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1), False
        names = {backend.value: name for name, (backend, _) in overlap._BACKENDS.items()}
        with sdpa_kernel(overlap._preferring(self.backend), set_priority=True):
            choice = torch._fused_sdp_choice(q, k, v, is_causal=self.shape.causal, enable_gqa=gqa)
        return names.get(int(choice), f"backend {int(choice)}")


# ---- measuring ----------------------------------------------------------------------------------------


def calls_per_graph(shape: Shape, world_size: int, s: Settings) -> int:
    flops = 4 * shape.b * shape.heads // world_size * shape.s**2 * shape.d * (0.5 if shape.causal else 1)
    return int(max(1, min(s.max_calls, FLOP_BUDGET // flops)))


def run_backend(
    emu: Emulated, shape: Shape, backend: str, s: Settings, reasons: dict[str, str]
) -> dict[tuple, common.Cell]:
    emu.backend = backend
    key = f"{shape.label}, {backend}"
    cells: dict[tuple, common.Cell] = {}
    ran, problem = ranks.attempt(emu.ran, "naming the backend")
    cells[(shape, backend, "ran")] = ran or "err"
    if problem is not None:
        reasons.setdefault(key, problem)
    calls = calls_per_graph(shape, s.world_size, s)
    whole = None
    for n in counts(shape, s, backend):
        got, problem = ranks.attempt(lambda: emu.attended(n), f"{n} chunks, the check's call")
        if problem is not None:
            reasons.setdefault(f"{key}, {n} chunks", problem)
        whole = got if n == 1 else whole
        equal = "err" if got is None or whole is None else "yes" if torch.equal(got, whole) else "NO"
        cells[(shape, backend, n, "equal")] = equal
        del got
        emu.prepare(n)
        for mode in MODES:
            cells[(shape, backend, n, mode)] = ranks.measured(
                lambda: common.capture(lambda i: emu.call(n, mode), calls),
                lambda graph: common.time_gpu(graph.replay, repeats=s.replays, per=calls),
                f"capturing {n} chunks, {mode}",
                reasons,
                f"{key}, {n} chunks, {mode}",
            )
    return cells


def run_shape(shape: Shape, s: Settings, reasons: dict[str, str]) -> dict[tuple, common.Cell]:
    if not shape.splits(s.world_size):
        reasons[shape.label] = f"does not split over {s.world_size} ranks"
        return {}
    emu = Emulated(shape, s.world_size)
    cells: dict[tuple, common.Cell] = {}
    with emu.patched():
        for backend in s.backends:
            cells.update(run_backend(emu, shape, backend, s, reasons))
    del emu
    torch.cuda.empty_cache()
    return cells


def worker(s: Settings, out: Path | None) -> None:
    common.progress(f"timing {len(s.shapes)} shapes x {len(s.backends)} backends on one GPU")
    common.run_shapes("chunking", s, lambda shape: shape.label, run_shape, write, out)


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main_one_gpu(args, s, dry_run, worker)


# ---- the report ---------------------------------------------------------------------------------------


def tax(cells: dict[tuple, common.Cell], shape: Shape, backend: str, n: int, mode: str) -> common.Cell:
    """A chunked time over the unchunked one in the same mode, less 1; or why there is none."""
    chunked, whole = cells.get((shape, backend, n, mode), "-"), cells.get((shape, backend, 1, mode), "-")
    return chunked / whole - 1 if isinstance(chunked, float) and isinstance(whole, float) and whole > 0 else "-"


def _percent(cell: common.Cell) -> str:
    return f"{cell:+.1%}" if isinstance(cell, float) else str(cell)


def tax_table(cells: dict[tuple, common.Cell], s: Settings, mode: str) -> str:
    """Per shape and backend: the tax at each count asked for, and at the rule's pick. The target (and
    the check) go with the tax of the attention alone (mode none)."""
    asked = [w for w in s.chunks if w > 1]
    target = [f"<= {TARGET_TAX:.0%}", "bits equal"] if mode == NONE else []
    columns = [
        "shape",
        "backend",
        "ran",
        "rows per rank",
        "unchunked, us",
        *(f"{w} chunks" for w in asked),
        "rule picks",
        "tax at the pick",
        *target,
    ]
    rows = []
    for shape in s.shapes:
        for backend in s.backends:
            if (shape, backend, "ran") not in cells:
                continue
            cols = []
            for w in asked:
                n = planned(shape, s.world_size, w, backend)
                cols.append("1 (not chunked)" if n == 1 else f"{_percent(tax(cells, shape, backend, n, mode))} ({n})")
            pick = planned(shape, s.world_size, overlap.AUTO_CHUNKS, backend)
            at_pick = tax(cells, shape, backend, pick, mode) if pick > 1 else 0.0
            met = "-" if not isinstance(at_pick, float) else "yes" if at_pick <= TARGET_TAX else "NO"
            equal = [str(cells.get((shape, backend, n, "equal"), "-")) for n in counts(shape, s, backend) if n > 1]
            rows.append(
                [
                    shape.label,
                    backend,
                    cells[(shape, backend, "ran")],
                    f"{rows_per_chunk(shape, s.world_size, 1):,}",
                    cells.get((shape, backend, 1, mode), "-"),
                    *cols,
                    str(pick),
                    _percent(at_pick) if pick > 1 else "0 (unchunked)",
                    *([met, ", ".join(dict.fromkeys(equal)) or "-"] if target else []),
                ]
            )
    return common.markdown_table(columns, rows)


def time_table(cells: dict[tuple, common.Cell], s: Settings) -> str:
    timed = sorted({key[2] for key in cells if len(key) == 4 and key[3] in MODES})
    columns = ["shape", "backend", "exchanges", *(f"{n} chunk{'s' * (n > 1)}" for n in timed)]
    rows = [
        [shape.label, backend, mode, *(cells.get((shape, backend, n, mode), "-") for n in timed)]
        for shape in s.shapes
        for backend in s.backends
        for mode in MODES
        if (shape, backend, "ran") in cells
    ]
    return common.markdown_table(columns, rows)


def suggested_rows(cells: dict[tuple, common.Cell], s: Settings, backend: str) -> str:
    """The smallest chunk (query rows, causal ones counted 1 / AUTO_CAUSAL_FACTOR) at and above which
    every measured chunk of `backend` keeps the tax (exchanges replaced by nothing) within the target."""
    points = []
    for shape in s.shapes:
        factor = overlap.AUTO_CAUSAL_FACTOR if shape.causal else 1
        for n in counts(shape, s, backend)[1:]:
            taxed = tax(cells, shape, backend, n, NONE)
            if isinstance(taxed, float):
                points.append((rows_per_chunk(shape, s.world_size, n) // factor, taxed))
    if not points:
        return "nothing measured"
    least = None
    for rows, taxed in sorted(points, reverse=True):  # from the largest chunk down, while within the target
        if taxed > TARGET_TAX:
            break
        least = rows
    return "none: no measured chunk is within the target" if least is None else f"{least:,}"


def notes(cells: dict[tuple, common.Cell], s: Settings, reasons: dict[str, str]) -> list[str]:
    rule = {k: v for k, v in overlap.AUTO_MIN_ROWS.items() if k in s.backends}
    return [
        f"bf16; one rank's share of the heads at world size {s.world_size} (heads / {s.world_size}) attending the "
        f"whole sequence s, on one GPU in one process; us per call: median of {s.replays} replays of a CUDA graph "
        f"of up to {s.max_calls} back-to-back calls ({FLOP_BUDGET:.0e} attention FLOPs per graph at most).",
        "Each call is graphar.ulysses.overlap.ulysses_attention with its exchanges emulated: its chunk plan, head "
        "slicing, SDPA call pinned to the backend, side stream and events as graphar runs them.",
        "Chunk columns: the tax, a chunked time over the unchunked one in the same mode, less 1, and in brackets "
        "the chunks graphar's plan runs when asked for that many (an even split of the heads; with flash each "
        "chunk keeps 160 query blocks); '1 (not chunked)' where the plan runs one.",
        f"Rule: attention_chunks='auto' (graphar.ulysses.overlap.auto_chunks; AUTO_MAX_CHUNKS = "
        f"{overlap.AUTO_MAX_CHUNKS}, AUTO_MIN_ROWS = {rule}, AUTO_CAUSAL_FACTOR = {overlap.AUTO_CAUSAL_FACTOR}); "
        f"target: a tax of at most {TARGET_TAX:.0%} (exchanges replaced by nothing) at the count it picks, for "
        "every shape; where no count meets it the rule must pick 1.",
        "Suggested AUTO_MIN_ROWS (query rows a chunk keeps, causal ones counted 1 / AUTO_CAUSAL_FACTOR; the "
        "smallest measured chunk at and above which every measured chunk is within the target): "
        + "; ".join(f"{b}: {suggested_rows(cells, s, b)}" for b in s.backends)
        + ".",
        "rows per rank: batch x heads / world size x s, the unchunked call's query rows. ran: the backend SDPA "
        "runs for the unchunked call as the op pins it (another where the pinned one refuses the inputs). bits "
        "equal: every chunked call's attention output equals the unchunked one's, bit for bit.",
    ] + [f"{k}: {v}" for k, v in sorted(reasons.items())]


def charts(cells: dict[tuple, common.Cell], s: Settings) -> list[plot.Chart]:
    panels = []
    for mode in MODES:
        lines = []
        for shape in s.shapes:
            for backend in s.backends:
                timed = [n for n in counts(shape, s, backend) if (shape, backend, n, mode) in cells]
                taxes = [tax(cells, shape, backend, n, mode) for n in timed]
                points = plot.points(timed, [100 * t if isinstance(t, float) else t for t in taxes])
                lines.append(plot.Line(f"{shape.label}, {backend}", points, colour_key=shape.label, dash_key=backend))
        ticks = sorted({n for shape in s.shapes for backend in s.backends for n in counts(shape, s, backend)})
        panels.append(
            plot.LineChart(
                f"chunking tax, {MODE_LABELS[mode]}",
                "chunks",
                "% over unchunked",
                lines,
                [(n, str(n)) for n in ticks],
                log=False,
            )
        )
    return panels


def write(
    cells: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    info = common.header(
        "one process, one rank's share of the heads; bf16, CUDA graphs",
        f"{s.world_size} (emulated: one GPU, no peers)",
        gpu,
    )
    title = "Chunking tax of the pipelined Ulysses attention"
    sections = [(f"Chunking tax, {MODE_LABELS[mode]}, % over 1 chunk", tax_table(cells, s, mode)) for mode in MODES]
    sections.append(("us per call", time_table(cells, s)))
    text = common.report(title, info, sections, notes(cells, s, reasons))
    common.write_report(text, path, charts(cells, s), f"{title}, {gpu}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU needed."""
    rng = random.Random(0)
    cells: dict[tuple, common.Cell] = {}
    for shape in s.shapes:
        for backend in s.backends:
            cells[(shape, backend, "ran")] = backend
            whole = shape.s * shape.heads / 500
            for n in counts(shape, s, backend):
                cells[(shape, backend, n, "equal")] = "yes"
                cells[(shape, backend, n, NONE)] = whole * (1 + (n - 1) * rng.uniform(0, 0.02))
                cells[(shape, backend, n, COPY)] = whole * (1.3 - (n - 1) * rng.uniform(0, 0.05))
    write(
        cells,
        s,
        1,
        {},
        common.DRY_RUN_GPU,
        common.results_path("chunking", common.DRY_RUN_GPU, None, out, common.dry_run_dir()),
    )


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
