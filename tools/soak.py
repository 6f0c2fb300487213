"""Soak graphar's cross-GPU orderings with two ranks running at once (issue 33): bounded runs that count.

One time-sliced GPU drains memory traffic at every hand-off between ranks, so it cannot show whether
the orderings that NVIDIA hardware keeps but the PTX memory model does not promise hold: a push slot's
reset landing before a peer writes the slot again, a pushing pack's stores visible once the next
kernel's flag says so, and a replay beside eager calls on two streams. Cases (`--list`):

- replay-KERNEL (push-oneshot, push-twoshot; 1stage and 2stage as the control): one CUDA graph of
  many all-reduces whose sizes alternate (each call's slots sit elsewhere than the last call's), PDL
  on, replayed until 10^6 calls. Before each call but every third (those two kernels stay back to
  back, overlapped by PDL) a kernel spins for a time it reads from device memory when it runs, refilled
  at random before every replay and non-zero on one rank per call. The integer inputs change every
  replay; the graph itself compares every output bitwise with the reference sum (NCCL's; gloo's on a
  shared GPU) and counts on the device, so the host syncs once per round; a sample is compared across
  ranks.
- exchange-TRANSPORT (pull, push): Q/K/V exchanges (graphar::qkv_all_to_all) of 2 MB per rank in 8
  pipeline stages, a new bit pattern every call, no host sync between calls, each output compared
  bitwise on the device with NCCL's all_to_all of the same pattern (gloo's on a shared GPU).
- two-streams-KERNEL: a graph replay on one stream and an eager call of the same communicator on
  another, unordered, 10^5 iterations: each must end exact, or in NaN (or a refused call) with a
  GrapharCommError at the next host call (detected), never in a finite wrong value (docs/design.md,
  the failure model). A detection breaks the communicator, so the case sets up a fresh one, at most
  50 times (3 in --quick).

Each case is bounded: by its count, by a wall-clock limit (set-up included; `--limit`), and by the
launcher, which kills ranks still at it well past the limit (a hang: counted as a timeout) and goes
on with fresh ranks. Each case prints one line: calls, mismatches (finite wrong values), timeouts,
NaNs, detections, seconds. Calls are per rank; the other counts add up the ranks' outputs. A markdown
table of every case so far is rewritten after each case under bench/results/ of the checkout
(soak-GPU-ws2[-shared][-quick][-CASES].md), or at --out (a file or a folder); a dry run writes to a
temporary folder.

Modes. Default: two GPUs, one process each, NCCL references: the verdict counts. --shared: two ranks
on cuda:0 over gloo, graphar's set-up relaxed as in tools/one_gpu_check.py: the ranks take turns, so
there is no verdict ("no verdict (shared GPU)"), only the counts, but a finite wrong value fails there
too. --quick (--smoke): CI-sized counts. --dry-run: no GPU; made-up clean results through the report.

Exit status: 0 every case passed; 1 a case failed (any mode: a finite wrong value, or an error: a rank
that raised or died, a communicator that failed other than by a timeout; on two GPUs also a NaN, a
timeout or a hang, but in a two-streams case only a NaN without an error or a hang); 2 too few GPUs,
or --cases names none. Usage, from the checkout:

    python tools/soak.py                     # the full soak on 2 GPUs (about 10 minutes)
    python tools/soak.py --cases replay      # ... or in two parts, each under 9 minutes
    python tools/soak.py --cases exchange,two-streams
    python tools/soak.py --shared --quick    # the CI-sized smoke run on one GPU (1-2 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from unittest import mock

import testing_library
import torch
import torch.distributed as dist
from one_gpu_common import KB, MB, integers, ranks_differ, reference_device, reference_sum

import graphar
from graphar import processes, settings
from graphar.allreduce import policy
from graphar.allreduce.communicator import Communicator
from graphar.ulysses import stages, transport
from graphar.ulysses.unpacked import seq_to_heads_unpacked

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package: by path
import common

try:
    import triton
    import triton.language as tl
except ImportError:  # --list and --dry-run run without it; the replays need it
    triton = None

WORLD = 2  # the pair of GPUs
REPLAY, EXCHANGE, TWO_STREAMS = "replay", "exchange", "two-streams"


@dataclass(frozen=True)
class Sizing:
    """How much each kind of case does in one form of the run."""

    calls: dict[str, int]  # per case and rank (two-streams: iterations)
    limit_s: dict[str, float]  # wall-clock bound per case, set-up included
    calls_per_graph: int  # replay: all-reduces captured in one graph
    replays_per_round: int  # replay: graph replays between host checks
    exchanges_per_round: int  # exchange: calls between host checks
    max_fresh: int  # two-streams: fresh communicators after detections, at most


# The limits let the replays, then the rest, each fit one 560 s step of tools/gpu_session.sh.
FULL = Sizing(
    calls={REPLAY: 10**6, EXCHANGE: 10**5, TWO_STREAMS: 10**5},
    limit_s={REPLAY: 130.0, EXCHANGE: 50.0, TWO_STREAMS: 55.0},
    calls_per_graph=500,
    replays_per_round=20,
    exchanges_per_round=500,
    max_fresh=50,
)
# Ranks sharing a GPU take turns at every hand-off (milliseconds each): a hundredth of the calls or
# fewer, and limits that keep the whole smoke run under about three minutes even where each case
# runs to its limit.
QUICK = Sizing(
    calls={REPLAY: 10**3, EXCHANGE: 100, TWO_STREAMS: 100},
    limit_s=dict.fromkeys(FULL.limit_s, 8.0),
    calls_per_graph=100,
    replays_per_round=2,
    exchanges_per_round=20,
    max_fresh=3,
)


def sizing(quick: bool) -> Sizing:
    return QUICK if quick else FULL


@dataclass(frozen=True)
class Case:
    """One bounded run: `kernel` is an all-reduce kernel, "norm" (the fused norm), or an exchange's
    transport ("pull", "push"; "exchange-pull", "exchange-push" beside the all-reduce kernels)."""

    name: str
    kind: str
    kernel: str
    calls: int
    limit_s: float


def plan(quick: bool) -> list[Case]:
    """Every case, in the order they run."""
    s = sizing(quick)
    kernels = {
        REPLAY: ("push-oneshot", "push-twoshot", "1stage", "2stage"),  # the v1 kernels: the control
        EXCHANGE: settings.ALLTOALL_ALGOS,
        TWO_STREAMS: (*settings.ALGOS, "norm", *(f"exchange-{t}" for t in settings.ALLTOALL_ALGOS)),
    }
    return [
        Case(f"{kind}-{kernel}", kind, kernel, s.calls[kind], s.limit_s[kind])
        for kind, names in kernels.items()
        for kernel in names
    ]


def select(cases: Sequence[Case], names: str | None) -> list[Case]:
    """The cases whose names start with one of the comma-separated `names` (all for None or "")."""
    prefixes = [n.strip() for n in (names or "").split(",") if n.strip()]
    unknown = [p for p in prefixes if not any(c.name.startswith(p) for c in cases)]
    if unknown:
        raise ValueError(f"no soak case starts with {', '.join(unknown)} (--list names them)")
    return [c for c in cases if not prefixes or any(c.name.startswith(p) for p in prefixes)]


# ---- results, verdicts and the report (CPU) -------------------------------------------------------


@dataclass
class Result:
    """What one case counted on one rank, or over the ranks (`merged`)."""

    case: str
    calls: int = 0
    mismatches: int = 0  # outputs with a finite value that is not the reference's, bitwise
    timeouts: int = 0  # GrapharTimeoutErrors seen, and hangs cut by the launcher
    nans: int = 0  # outputs with a NaN
    detected: int = 0  # two-streams: iterations that ended in a GrapharCommError
    undetected: int = 0  # two-streams: iterations with a NaN (or a refused call) and no error
    seconds: float = 0.0
    hung: bool = False  # cut by the launcher's time bound
    crashed: bool = False  # a rank raised or died: the case did not run to its end
    error: str = ""  # why it crashed, or a GrapharCommError other than a timeout in a clean case
    note: str = ""


def merged(case: str, results: Sequence[Result]) -> Result:
    """The ranks' results as one: calls and seconds the largest, counts added up."""
    notes = dict.fromkeys(r.note for r in results if r.note)  # in order, once each
    return Result(
        case,
        calls=max((r.calls for r in results), default=0),
        mismatches=sum(r.mismatches for r in results),
        timeouts=sum(r.timeouts for r in results),
        nans=sum(r.nans for r in results),
        detected=sum(r.detected for r in results),
        undetected=sum(r.undetected for r in results),
        seconds=max((r.seconds for r in results), default=0.0),
        hung=any(r.hung for r in results),
        crashed=any(r.crashed for r in results),
        error=next((r.error for r in results if r.error), ""),
        note="; ".join(notes),
    )


def failures(case: Case, r: Result, shared: bool) -> list[str]:
    """Why `r` fails: finite wrong values and errors (a rank that raised or died, a communicator that
    failed other than by a timeout) fail in every mode; a shared GPU gives no verdict on the rest,
    which depends on the ranks running at once."""
    found = [f"{r.mismatches} finite wrong"] if r.mismatches else []
    if r.error:
        found.append("an error")
    if shared:
        return found
    if r.hung:
        found.append("hung")
    if case.kind == TWO_STREAMS:  # a NaN with an error is the contract's answer to unordered streams
        if r.undetected:
            found.append(f"{r.undetected} NaN without an error")
        return found
    if r.nans:
        found.append(f"{r.nans} NaN")
    if r.timeouts - r.hung:
        found.append(f"{r.timeouts - r.hung} timed out")
    return found


def verdict(case: Case, r: Result, shared: bool) -> str:
    bad = failures(case, r, shared)
    if bad:
        return "FAIL: " + ", ".join(bad)
    return "no verdict (shared GPU)" if shared else "ok"


def line(case: Case, r: Result, shared: bool) -> str:
    """The case's one line, as the run prints it."""
    streams = case.kind == TWO_STREAMS
    detections = f", {r.detected} detected, {r.undetected} undetected" if streams else ""
    notes = "; ".join(n for n in (r.error, r.note) if n)
    counts = f"{r.mismatches} mismatches, {r.timeouts} timeouts, {r.nans} NaNs{detections}"
    return (
        f"{r.case}: {r.calls} {'iterations' if streams else 'calls'}, {counts}, {r.seconds:.1f} s: "
        f"{verdict(case, r, shared)}" + (f" ({notes})" if notes else "")
    )


COLUMNS = ("case", "calls", "mismatches", "timeouts", "NaNs", "detected", "undetected", "seconds", "verdict", "note")


def _cell(text: str, width: int = 160) -> str:
    """Text a table cell can hold: one line, no column bar, not too long."""
    text = " ".join(text.replace("|", "/").split())
    return text if len(text) <= width else text[: width - 3] + "..."


def report(rows: Sequence[tuple[Case, Result]], *, shared: bool, quick: bool, gpu: str, planned: int) -> str:
    """The markdown report of the cases run so far (of `planned`)."""
    table = common.markdown_table(
        COLUMNS,
        [
            [
                r.case,
                str(r.calls),
                str(r.mismatches),
                str(r.timeouts),
                str(r.nans),
                *((str(r.detected), str(r.undetected)) if case.kind == TWO_STREAMS else ("-", "-")),
                r.seconds,
                verdict(case, r, shared),
                _cell("; ".join(n for n in (r.error, r.note) if n)),
            ]
            for case, r in rows
        ],
    )
    failed = [r.case for case, r in rows if failures(case, r, shared)]
    done = f"{len(rows)} of {planned} cases, {sum(r.seconds for _, r in rows):.0f} s"
    if failed:
        outcome = f"FAIL: {', '.join(failed)} ({done})"
    else:
        outcome = f"{'no verdict (shared GPU): no finite wrong value' if shared else 'every case passed'} ({done})"
    mode = "2 ranks sharing one GPU over gloo (no verdict)" if shared else "2 GPUs, one process each, NCCL references"
    info = common.header(mode + (", --quick" if quick else ""), WORLD, gpu)
    notes = [
        "calls: per rank (two-streams: iterations, each a replay beside an eager call); the other counts add up "
        "both ranks' outputs",
        "mismatches: outputs with a finite value not bitwise the reference's; NaNs: outputs with a NaN; timeouts: "
        "GrapharTimeoutErrors and hangs cut by the launcher",
        "two-streams: detected, an iteration that ended in NaN (or a refused call) with a GrapharCommError, the "
        "contract's answer; undetected, a NaN without an error (a failure)",
        "tools/soak.py's docstring describes the cases",
    ]
    return common.report("graphar soak (issue 33)", info, [("Cases", table), ("Verdict", outcome)], notes)


def report_path(out: Path | None, *, gpu: str, shared: bool, quick: bool, names: str | None, dry_run: bool) -> Path:
    """bench/results/soak-GPU-ws2[-shared][-quick][-CASES].md, or `out` (a file, or a folder for that name)."""
    tags = [common.gpu_slug(gpu), f"ws{WORLD}", *(["shared"] if shared else []), *(["quick"] if quick else [])]
    if names:
        tags.append(re.sub(r"[^a-z0-9]+", "-", names.lower()).strip("-"))
    name = "-".join(["soak", *tags]) + ".md"
    return common.results_file(name, out, common.dry_run_dir() if dry_run else None)


def dry_run_result(case: Case) -> Result:
    """What a clean run of `case` reports (two-streams with two detections, to show them), for --dry-run."""
    detections = 2 if case.kind == TWO_STREAMS else 0
    return Result(case.name, calls=case.calls, nans=detections, detected=detections, seconds=case.limit_s / 3)


# ---- a rank: the cases on the GPU -----------------------------------------------------------------

CLEAN_TIMEOUT_S = 10.0  # replay and exchange cases: far beyond any call here, and a stuck peer ends soon
TWO_STREAMS_TIMEOUT_S = 2.0  # as tests/gpu/test_faults.py: an eager call and a replay out of step time out
DTYPE = torch.bfloat16
BITS = {2: torch.int16, 4: torch.int32}
# Replays: the sizes the calls cycle through (bytes, 16-byte multiples), inputs that change every
# replay, the spin before each call.
SIZES = (48, 16 * KB, 256 * KB + 16, MB)
INPUT_VARIANTS = 4
DELAY_VARIANTS = 8
MAX_DELAY_NS = 20_000  # a few push calls' time
BACK_TO_BACK = 3  # every third call follows the one before with no spin between them
REPLAY_MAX_BYTES = 4 * MB
# Exchanges: Q, K and V of [b, s, heads, d] per rank, 2 MB per rank in all, in STAGES pipeline stages.
EXCHANGE_B, EXCHANGE_S, EXCHANGE_D = 1, 1024, 64
STAGES = 8
# Patterns: a positive normal bfloat16 (exponent neither 0 nor all ones) XOR a mask of mantissa and
# sign bits stays a normal number: no NaN, Inf, or subnormal a copy could flush.
NORMAL_BITS = (0x0080, 0x7F7F)


def exchange_heads(world: int) -> tuple[int, int, int]:
    """Q, K and V heads per rank before the exchange (GQA: K and V have half Q's)."""
    return 4 * world, 2 * world, 2 * world


def exchange_bytes(world: int) -> int:
    """Bytes each rank sends in one Q/K/V exchange."""
    return EXCHANGE_B * EXCHANGE_S * sum(exchange_heads(world)) * EXCHANGE_D * DTYPE.itemsize


def stage_bytes(world: int) -> int:
    """graphar.ulysses.stages._STAGE_BYTES that cuts one exchange into STAGES stages (8, its most)."""
    return exchange_bytes(world) // STAGES


def pattern(call: int) -> int:
    """The XOR mask (an int16) of a call's bit pattern: 256 masks of mantissa and sign bits, so any two
    of 256 consecutive calls differ in every element, and a stale element of the last 255 shows."""
    return (call & 0x7F) | (-0x8000 if call & 0x80 else 0)


if triton is not None:

    @triton.jit
    def _now():
        """%globaltimer in ns, as triton.language.extra.cuda.globaltimer reads it (not in every Triton)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _spin(ns_ptr):
        """Spin for the nanoseconds at ns_ptr, read when the kernel runs (a replay reads the refill)."""
        ns = tl.load(ns_ptr)
        start = _now()
        now = start
        while now - start < ns:
            now = _now()


class _Clock:
    def __init__(self, limit_s: float) -> None:
        self.start, self.limit_s = time.monotonic(), limit_s

    def up(self) -> bool:
        return time.monotonic() - self.start > self.limit_s


def _on_any_rank(*flags: bool) -> list[bool]:
    """Collective: each flag, true if true on any rank, so that every rank takes the same way."""
    t = torch.tensor([int(f) for f in flags], device=reference_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _communicator(group: dist.ProcessGroup, timeout_s: float, max_bytes: int) -> Communicator:
    """A fresh graphar communicator on `group` (collective; again after its last one was closed)."""
    comm = graphar.init(group, max_bytes=max_bytes, timeout_s=timeout_s)
    if comm is None:
        raise RuntimeError("graphar.init set up no communicator (the graphar log says why)")
    return comm


def _count_bad(got: torch.Tensor, expected: torch.Tensor, counts: torch.Tensor) -> None:
    """counts += (rows of `got` with a finite value that is not bitwise `expected`'s, rows with a NaN),
    on the device: no sync, and capturable."""
    bits = BITS[got.element_size()]
    nan = got.isnan()
    wrong = (got.view(bits) != expected.view(bits)) & ~nan
    counts.add_(torch.stack([wrong.flatten(1).any(1).sum(), nan.flatten(1).any(1).sum()]))


def _tally(result: Result, counts: torch.Tensor, calls: int, differ: int = 0) -> None:
    """A clean case's counts so far (`counts` from `_count_bad`, cumulative) into `result`."""
    wrong, nans = counts.tolist()
    result.calls, result.mismatches, result.nans = calls, wrong + differ, nans


class _Rounds(Protocol):
    """A clean case's work: `round()` enqueues calls without a host sync; `tally(result)` counts them;
    `note()` says what the report should know of how they ran."""

    def round(self) -> None: ...
    def tally(self, result: Result) -> None: ...
    def note(self) -> str: ...


class _Replays:
    """One CUDA graph of `n` all-reduces by `algo` (sizes cycling through SIZES), a spin before each
    but every BACK_TO_BACK-th, then every output compared with its reference sum, counted on the
    device. Inputs, references and spins are refilled before each replay: device copies, no sync."""

    def __init__(self, comm: Communicator, algo: str, s: Sizing, rank: int) -> None:
        if triton is None:
            raise RuntimeError("the replay cases need Triton (the spin kernel)")
        self.comm, self.algo, self.per_round = comm, algo, s.replays_per_round
        sizes = [n for n in SIZES if comm.kernels.policy.pick(n, policy.GRAPH, algo) is not None]
        n = s.calls_per_graph
        self.sizes = [sizes[i % len(sizes)] for i in range(n)]
        self.groups = {size: [i for i in range(n) if self.sizes[i] == size] for size in sizes}
        # The inputs lie grouped by size in one buffer, so each size's outputs compare in one go.
        starts, total = {}, 0
        for size, calls in self.groups.items():
            for i in calls:
                starts[i], total = total, total + size // DTYPE.itemsize
        self.inputs = torch.stack([integers(total, DTYPE, seed=1000 * rank + v) for v in range(INPUT_VARIANTS)])
        self.sums = torch.stack([reference_sum(x) for x in self.inputs])
        self.x, self.expected = torch.empty_like(self.inputs[0]), torch.empty_like(self.sums[0])
        self.x_of = [self.x[starts[i] : starts[i] + self.sizes[i] // DTYPE.itemsize] for i in range(n)]
        self.expected_of = {
            size: self.expected[starts[c[0]] : starts[c[0]] + len(c) * size // DTYPE.itemsize].view(len(c), -1)
            for size, c in self.groups.items()
        }
        self.delay_table = _delay_table(n, rank)
        self.delays = torch.zeros_like(self.delay_table[0])
        self.counts = torch.zeros(2, dtype=torch.int64, device="cuda")
        self.replays, self.differ, self._pick = 0, 0, random.Random(0)
        self._refill()
        self._body()  # eagerly: compiles the spin, warms every call up; its checks count too
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept to count its PDL edges
        with torch.cuda.graph(self.graph):
            self.samples = self._body()
        self.graph.instantiate()
        self.pdl_edges = testing_library.graph_edges(self.graph)[1]  # 0 would mean PDL was off after all

    def _body(self) -> list[torch.Tensor]:
        """Every call, then every check; returns the last output of each size (compared across ranks)."""
        outs = []
        for i, x in enumerate(self.x_of):
            if i % BACK_TO_BACK != BACK_TO_BACK - 1:
                _spin[(1,)](self.delays[i:], num_warps=1)
            outs.append(self.comm.all_reduce(x, algo=self.algo))
        for size, calls in self.groups.items():
            _count_bad(torch.stack([outs[i] for i in calls]), self.expected_of[size], self.counts)
        return [outs[calls[-1]] for calls in self.groups.values()]

    def _refill(self) -> None:
        v = self.replays % INPUT_VARIANTS  # consecutive replays never read the same inputs
        self.x.copy_(self.inputs[v])
        self.expected.copy_(self.sums[v])
        self.delays.copy_(self.delay_table[self._pick.randrange(DELAY_VARIANTS)])

    def round(self) -> None:
        for _ in range(self.per_round):
            self.replays += 1
            self._refill()
            self.graph.replay()

    def tally(self, result: Result) -> None:
        self.differ += sum(map(ranks_differ, self.samples))
        _tally(result, self.counts, (1 + self.replays) * len(self.sizes), self.differ)

    def note(self) -> str:
        return f"{self.pdl_edges} PDL edges in the graph of {len(self.sizes)} calls"


def _delay_table(n: int, rank: int) -> torch.Tensor:
    """[DELAY_VARIANTS, n] spins in ns: for each call one rank, drawn alike on every rank, spins up to
    MAX_DELAY_NS; the others do not."""
    gen = torch.Generator().manual_seed(7)
    late = torch.randint(WORLD, (DELAY_VARIANTS, n), generator=gen)
    ns = torch.randint(MAX_DELAY_NS + 1, (DELAY_VARIANTS, n), generator=gen)
    return torch.where(late == rank, ns, 0).cuda()


class _Exchanges:
    """Q/K/V exchanges (graphar::qkv_all_to_all), call c's inputs a base pattern XOR pattern(c): an
    exchange only moves elements, so its output is the reference exchange of the base XOR the same
    mask, which the device compares and counts."""

    def __init__(self, comm: Communicator, s: Sizing, rank: int) -> None:
        self.group_name, self.per_round = comm.group_name, s.exchanges_per_round
        b, seq, d = EXCHANGE_B, EXCHANGE_S, EXCHANGE_D
        heads = exchange_heads(WORLD)
        gen = torch.Generator().manual_seed(rank)
        self.base = torch.randint(*NORMAL_BITS, (b * seq * sum(heads) * d,), dtype=torch.int16, generator=gen).cuda()
        self.bits = torch.empty_like(self.base)  # the inputs, rewritten each call
        sizes = [b * seq * h * d for h in heads]
        self.qkv = [t.view(DTYPE).view(b, seq, h, d) for t, h in zip(self.bits.split(sizes), heads)]
        refs = [
            seq_to_heads_unpacked(t.view(DTYPE).view(b, seq, h, d).to(reference_device())).cuda()
            for t, h in zip(self.base.split(sizes), heads)
        ]
        self.expected_base = torch.cat(refs, dim=2).view(torch.int16)  # packed: Q's heads, then K's, then V's
        self.expected = torch.empty_like(self.expected_base)
        self.counts = torch.zeros(2, dtype=torch.int64, device="cuda")
        self.calls = 0
        if len(stages._slices(seq, exchange_bytes(WORLD))) != STAGES:
            raise RuntimeError(f"the exchanges do not run in {STAGES} stages: has stages._slices changed?")
        self._call()  # grows the exchange buffers (collective)
        if transport.of(comm).capacity == 0:
            raise RuntimeError("the exchanges did not take the IPC transport")

    def _call(self) -> None:
        mask = pattern(self.calls)
        torch.bitwise_xor(self.base, mask, out=self.bits)
        out = torch.ops.graphar.qkv_all_to_all(*self.qkv, self.group_name)
        torch.bitwise_xor(self.expected_base, mask, out=self.expected)
        _count_bad(out.unsqueeze(0), self.expected.view(DTYPE).unsqueeze(0), self.counts)
        self.calls += 1

    def round(self) -> None:
        for _ in range(self.per_round):
            self._call()

    def tally(self, result: Result) -> None:
        _tally(result, self.counts, self.calls)

    def note(self) -> str:
        return f"{STAGES} stages of {stage_bytes(WORLD) >> 10} KB per exchange"


def _failure(comm: Communicator, result: Result) -> str | None:
    """How the communicator failed, if it did (host read, no sync): a timeout is counted, another
    failure is the case's error."""
    try:
        comm.check()
    except graphar.GrapharTimeoutError as e:
        result.timeouts += 1
        return str(e)
    except graphar.GrapharCommError as e:
        result.error = str(e)
        return str(e)
    return None


def _clean_case(case: Case, make: Callable[[Communicator], _Rounds], max_bytes: int) -> Result:
    """Rounds of calls on one communicator until the count, the time limit or a failure on any rank."""
    result, clock = Result(case.name), _Clock(case.limit_s)
    comm = _communicator(dist.new_group(list(range(WORLD))), CLEAN_TIMEOUT_S, max_bytes)
    try:
        rounds = make(comm)
        while True:
            rounds.round()
            rounds.tally(result)  # syncs
            failure = _failure(comm, result)
            failed, time_up = _on_any_rank(failure is not None, clock.up())
            if failed or time_up or result.calls >= case.calls:
                break
    finally:
        comm.close()
    notes = [rounds.note(), *([failure] if failure and not result.error else [])]
    if time_up and result.calls < case.calls:
        notes.append(f"stopped at the time limit ({case.limit_s:.0f} s)")
    result.note = "; ".join(notes)
    return result


def run_replay(case: Case, s: Sizing, rank: int) -> Result:
    return _clean_case(case, lambda comm: _Replays(comm, case.kernel, s, rank), REPLAY_MAX_BYTES)


def run_exchange(case: Case, s: Sizing, rank: int) -> Result:
    os.environ[settings.ALLTOALL_ALGO.name] = case.kernel  # read as the communicator is made; equal on every rank
    with mock.patch.object(stages, "_STAGE_BYTES", stage_bytes(WORLD)):
        return _clean_case(case, lambda comm: _Exchanges(comm, s, rank), MB)


@dataclass
class _Subject:
    """One kernel's call on a static input `x`, refilled before each call; `right(values)` is the output
    when rank r's x holds values[r] everywhere."""

    x: torch.Tensor
    run: Callable[[], torch.Tensor]
    right: Callable[[list[float]], torch.Tensor]


def _subject(comm: Communicator, kernel: str) -> _Subject:
    """As tests/gpu/test_faults.py's kinds: an all-reduce, the fused norm's residual stream, or the
    output exchange (heads block i of the output comes from rank i)."""
    if kernel in settings.ALGOS:
        x = torch.empty(32 * KB, device="cuda", dtype=DTYPE)
        return _Subject(x, lambda: comm.all_reduce(x, algo=kernel), lambda v: torch.full_like(x, sum(v)))
    if kernel == "norm":
        x = torch.empty(16, 1024, device="cuda", dtype=DTYPE)
        residual = integers(x.numel(), DTYPE, seed=3).view(x.shape)
        weight = torch.ones(x.shape[1], device="cuda", dtype=DTYPE)

        def norm() -> torch.Tensor:
            fused = comm.kernels.try_all_reduce_norm(x, residual, weight, 1e-6, False)
            if fused is None:
                raise RuntimeError("the fused norm refused its shapes")
            return fused[1]  # the residual stream, sum + residual: the normed rows of a constant hide the sum

        return _Subject(x, norm, lambda v: sum(v) + residual)
    if not kernel.startswith("exchange-"):
        raise ValueError(f"no two-streams subject {kernel!r}")
    heads, seq = 4, 256
    x = torch.empty(1, WORLD * seq, heads, 64, device="cuda", dtype=DTYPE)
    return _Subject(
        x,
        lambda: torch.ops.graphar.heads_to_seq_all_to_all(x, comm.group_name),
        lambda v: torch.cat([torch.full((1, seq, heads, 64), r, device="cuda", dtype=DTYPE) for r in v], dim=2),
    )


EXACT, DETECTED, UNDETECTED, WRONG = "exact", "detected", "undetected", "wrong"


def classify(wrong: bool, nan: bool, error: bool) -> str:
    """One rank's two-streams iteration: a finite wrong value is wrong whatever else; an error at the
    next host call makes it detected; a NaN (or a refused call) without one, undetected."""
    if wrong:
        return WRONG
    if error:
        return DETECTED
    return UNDETECTED if nan else EXACT


class _TwoStreams:
    """A fresh communicator, a graph replaying `kernel` on one stream and eager calls on another."""

    def __init__(self, group: dist.ProcessGroup, kernel: str, rank: int) -> None:
        self.rank = rank
        self.comm = _communicator(group, TWO_STREAMS_TIMEOUT_S, MB)
        self.subjects = [_subject(self.comm, kernel), _subject(self.comm, kernel)]
        for subject in self.subjects:
            subject.x.fill_(1.0)
            subject.run()  # sizes the exchange buffer (collective), warms up before the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            captured = self.subjects[0].run()
        self.calls = [lambda: self.graph.replay() or captured, self.subjects[1].run]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def iterate(self, i: int) -> tuple[str, bool, bool]:
        """Iteration i: the outcome, whether an output held a NaN, whether the error was a timeout."""
        values = [
            [float((r + 1) * (i % 7 + 1)) for r in range(WORLD)],
            [float((r + 1) * (i % 5 + 9)) for r in range(WORLD)],
        ]
        outs: list[torch.Tensor | None] = []
        for subject, call, stream, v in zip(self.subjects, self.calls, self.streams, values):
            with torch.cuda.stream(stream):
                subject.x.fill_(v[self.rank])
                try:
                    outs.append(call())
                except graphar.GrapharCommError:  # an eager call on a failed communicator: refused at once
                    outs.append(None)
        torch.cuda.synchronize()
        flags = []  # per output: a finite wrong value, a NaN
        for subject, out, v in zip(self.subjects, outs, values):
            if out is not None:
                isnan = out.isnan()
                flags += [(~isnan & (out != subject.right(v))).any(), isnan.any()]
        pairs = torch.stack(flags).view(-1, 2).tolist() if flags else []
        wrong, nan = any(p[0] for p in pairs), any(p[1] for p in pairs)
        refused = None in outs
        error = self._error()
        return classify(wrong, nan or refused, error is not None), nan, isinstance(error, graphar.GrapharTimeoutError)

    def _error(self) -> graphar.GrapharCommError | None:
        try:
            self.comm.check()
        except graphar.GrapharCommError as e:
            return e
        return None

    def close(self) -> None:
        del self.graph, self.calls
        self.comm.close()


def run_two_streams(case: Case, s: Sizing, rank: int) -> Result:
    """Iterations until the count or the time limit; after a detection on any rank, a fresh
    communicator (at most s.max_fresh times)."""
    transport = case.kernel.removeprefix("exchange-") if case.kernel.startswith("exchange-") else "pull"
    os.environ[settings.ALLTOALL_ALGO.name] = transport  # read as the communicator is made; equal on every rank
    result, clock = Result(case.name), _Clock(case.limit_s)
    group = dist.new_group(list(range(WORLD)))
    fresh = 0
    while True:
        pair = _TwoStreams(group, case.kernel, rank)
        try:
            broken = stop = False
            while not (broken or stop):
                outcome, nan, timed_out = pair.iterate(result.calls)
                result.calls += 1
                result.mismatches += outcome == WRONG
                result.detected += outcome == DETECTED
                result.undetected += outcome == UNDETECTED
                result.nans += nan
                result.timeouts += timed_out
                broken, stop = _on_any_rank(outcome != EXACT, clock.up() or result.calls >= case.calls)
        finally:
            pair.close()
        if stop or fresh == s.max_fresh:
            break
        fresh += 1
    notes = [f"{fresh} fresh communicators after detections"] if fresh else []
    if broken and fresh == s.max_fresh:
        notes.append(f"stopped after the last of them broke ({s.max_fresh}, the most)")
    elif result.calls < case.calls:
        notes.append(f"stopped at the time limit ({case.limit_s:.0f} s)")
    result.note = "; ".join(notes)
    return result


RUNNERS: dict[str, Callable[[Case, Sizing, int], Result]] = {
    REPLAY: run_replay,
    EXCHANGE: run_exchange,
    TWO_STREAMS: run_two_streams,
}


def _result_file(folder: str, case: str, rank: int) -> Path:
    return Path(folder, f"{case}.rank{rank}.json")


def _put(folder: str, rank: int, result: Result) -> None:
    """Leave the result where the launcher looks, whole or not at all."""
    path = _result_file(folder, result.case, rank)
    path.with_suffix(".tmp").write_text(json.dumps(dataclasses.asdict(result)))
    os.replace(path.with_suffix(".tmp"), path)


def _rank(rank: int, world_size: int, shared: bool, quick: bool, cases: list[Case], folder: str) -> None:
    """One rank's process (its group made by processes.gpu_group): `cases` in order, each result left in `folder`
    as it ends. A case that raises ends the process (its peer may wait in a collective: the launcher
    ends it)."""
    for case in cases:
        dist.barrier()
        start = time.monotonic()
        try:
            result = RUNNERS[case.kind](case, sizing(quick), rank)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a case that raises is reported as crashed, the soak goes on)
            traceback.print_exc()
            _put(
                folder,
                rank,
                Result(
                    case.name,
                    crashed=True,
                    error=f"rank {rank}: {type(e).__name__}: {e}",
                    seconds=time.monotonic() - start,
                ),
            )
            sys.stdout.flush()
            os._exit(1)
        result.seconds = time.monotonic() - start
        _put(folder, rank, result)
        gc.collect()  # the case's graphs and tensors, before the next case allocates
        torch.cuda.empty_cache()


# ---- the launcher ----------------------------------------------------------------------------------

START_S = 180.0  # the first case of a launch also waits for the ranks' start (imports, set-up, builds)
GRACE_S = 60.0  # past a case's limit: a kernel's timeout, a close; beyond it the ranks are hung


RankBody = Callable[[int, int, bool, bool, list[Case], str], None]  # as _rank: what a rank's process runs


class _Ranks:
    """One launch of the rank processes, which run `cases` in order."""

    def __init__(
        self, cases: Sequence[Case], shared: bool, quick: bool, body: RankBody, group: processes.Group
    ) -> None:
        self.folder = tempfile.mkdtemp(prefix="graphar-soak-")
        self._ranks = processes.start(body, WORLD, shared, quick, list(cases), self.folder, group=group)
        self.procs = self._ranks.procs

    def result(self, case: Case, deadline: float) -> tuple[Result, bool]:
        """`case`'s result over the ranks, and whether they can go on: not if a rank raised or died, or
        the ranks are still at it at `deadline` (hung)."""
        start = time.monotonic()
        while True:
            files = [_result_file(self.folder, case.name, r) for r in range(WORLD)]
            got = [Result(**json.loads(f.read_text())) for f in files if f.exists()]
            if len(got) == WORLD or any(r.crashed for r in got):
                return merged(case.name, got), not any(r.crashed for r in got)
            gone = [r for r, (p, f) in enumerate(zip(self.procs, files)) if p.exitcode is not None and not f.exists()]
            if gone:
                died = Result(
                    case.name, crashed=True, error=f"rank {gone[0]} died (exit code {self.procs[gone[0]].exitcode})"
                )
                return merged(case.name, [*got, died]), False
            if time.monotonic() > deadline:
                seconds = time.monotonic() - start
                hung = Result(
                    case.name, timeouts=1, hung=True, seconds=seconds, note=f"hung: ranks killed after {seconds:.0f} s"
                )
                return merged(case.name, [*got, hung]), False
            time.sleep(0.2)

    def stop(self, wait_s: float) -> None:
        """End the processes: those still running after `wait_s` are killed."""
        self._ranks.stop(wait_s)
        shutil.rmtree(self.folder, ignore_errors=True)


def soak(
    cases: Sequence[Case],
    shared: bool,
    quick: bool,
    record: Callable[[Case, Result], None],
    body: RankBody = _rank,
    group: processes.Group | None = None,
) -> None:
    """Run `cases`, `record`ing each one's result as it ends; after a case that hung or failed a rank,
    the rest run on a fresh launch. `body` is what each rank's process runs, in `group` (default
    `processes.gpu_group(shared, collective_timeout_s=300)`; tests pass stand-ins)."""
    todo = list(cases)
    while todo:
        ranks = _Ranks(todo, shared, quick, body, group or processes.gpu_group(shared, collective_timeout_s=300))
        healthy = False
        try:
            extra = START_S
            for case in list(todo):
                result, healthy = ranks.result(case, time.monotonic() + extra + case.limit_s + GRACE_S)
                extra = 0.0
                todo.remove(case)
                record(case, result)
                if not healthy:
                    break
        finally:
            ranks.stop(wait_s=30.0 if healthy else 0.0)  # the healthy end their work with a barrier


def _set_environment() -> None:
    """What every rank inherits: graphar's settings the soak relies on, multicast off as for the benchmarks."""
    for name, value in common.MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    os.environ[settings.PDL.name] = "1"  # the push soak runs with PDL on
    os.environ[settings.AUTO_INIT.name] = "0"  # only the cases' own graphar.init sets communicators up
    os.environ.pop(settings.ALLREDUCE_ALGO.name, None)  # each call names its kernel (forcing one turns the norm off)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shared", action="store_true", help="two ranks sharing cuda:0 over gloo: counts, no verdict")
    p.add_argument("--quick", "--smoke", action="store_true", help="CI-sized counts and limits")
    p.add_argument("--cases", default=None, help="comma-separated names of cases or their starts ('replay,exchange')")
    p.add_argument("--limit", type=float, default=None, help="wall-clock limit of each case in s (default: by kind)")
    p.add_argument("--out", type=Path, default=None, help="report file (.md) or folder (default: bench/results/)")
    p.add_argument("--list", action="store_true", help="print the cases, their counts and limits, and exit")
    p.add_argument("--dry-run", action="store_true", help="no GPU: made-up clean results through the report")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cases = select(plan(args.quick), args.cases)
    except ValueError as e:
        print(e)
        return 2
    if args.limit is not None:
        cases = [dataclasses.replace(c, limit_s=args.limit) for c in cases]
    if args.list:
        for c in cases:
            print(f"{c.name}: {c.calls} {'iterations' if c.kind == TWO_STREAMS else 'calls'}, limit {c.limit_s:.0f} s")
        return 0
    if not args.dry_run and torch.cuda.device_count() < (1 if args.shared else WORLD):
        print("no GPU" if torch.cuda.device_count() == 0 else f"needs {WORLD} GPUs (or --shared)")
        return 2
    gpu = common.DRY_RUN_GPU if args.dry_run else common.gpu_name()
    path = report_path(args.out, gpu=gpu, shared=args.shared, quick=args.quick, names=args.cases, dry_run=args.dry_run)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[Case, Result]] = []

    def record(case: Case, result: Result) -> None:
        rows.append((case, result))
        print(line(case, result, args.shared), flush=True)
        path.write_text(report(rows, shared=args.shared, quick=args.quick, gpu=gpu, planned=len(cases)))

    if args.dry_run:
        for case in cases:
            record(case, dry_run_result(case))
    else:
        _set_environment()
        soak(cases, args.shared, args.quick, record)
    print(path.read_text())
    print(f"report: {path}")
    return 1 if any(failures(case, r, args.shared) for case, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
