"""Decode-step latency of a Llama-style tensor-parallel model: Inductor + NCCL against graphar.

    python bench/decode.py [--batches 1,8] [--layers 8] [--steps 20] [--replays 9] [--world-size N]
                           [--quick] [--dry-run] [--out F]

Each decoder block is compiled (torch.compile per block, as torchtitan does) and one decode step,
all blocks plus the final norm, is captured in a CUDA graph:
  (a) backend="inductor": dist.all_reduce stays NCCL; captured with torch.cuda.graph;
  (b) backend="graphar" after graphar.init: captured with graphar.allreduce.graphs.BatchGraphs
      (zero-copy all-reduces);
  (c) backend="graphar": captured with a plain torch.cuda.graph (the copy-in path);
  (d) backend="graphar" with options={"fuse_norm": True} (the all-reduce, residual add and RMSNorm
      fused where the pattern holds): captured with graphar.allreduce.graphs.BatchGraphs;
  (e) as (b), every all-reduce on the push one-shot kernel (the policy forced while capturing).
A variant whose compile or capture fails on any rank is "err" on every rank; (d) is "not rewritten"
where graphar's pass fused no norm.
The table goes to stdout and to decode-<gpu>-ws<N>.md (bench/results/, or --out), with
a bar chart of the time per step by variant beside it (.png).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import common
import plot
import ranks

DTYPE = torch.bfloat16
INDUCTOR, ZERO_COPY, COPY_IN, FUSED = "inductor + NCCL", "graphar zero-copy", "graphar copy-in", "graphar fused norm"
PUSH = "graphar push-oneshot"
VARIANTS = (INDUCTOR, ZERO_COPY, COPY_IN, FUSED, PUSH)
LABELS = {v: f"({'abcde'[i]}) {v}" for i, v in enumerate(VARIANTS)}  # as the table and the plot name them
CAPTURE_ORDER = (INDUCTOR, COPY_IN, ZERO_COPY, FUSED, PUSH)  # (c) compiles the graphar step (b) and (e) reuse
# The rewrite a variant is about: without it, it would time the unfused path under its name.
EXPECTED_REWRITES = {FUSED: "all_reduce_add_rms_norm"}
DIFF_COLUMNS = {ZERO_COPY: "max abs diff (a, b)", FUSED: "max abs diff (a, d)", PUSH: "max abs diff (a, e)"}
CHECK_COLUMNS = (*DIFF_COLUMNS.values(), "(b) == (c) bits", "ranks equal")
# A diff above this fraction of the output's largest magnitude is flagged: far above bf16 rounding
# noise, far below what a wrong all-reduce produces.
REL_TOLERANCE = 0.02
COMPILE_SKEW_S = 240.0  # longest wait of one rank for another (below TIMEOUT_S, NCCL's)

Step = Callable[[torch.Tensor], torch.Tensor]
Runs = dict[str, dict[int, Step] | str]  # variant -> its captured step by batch, or the cell shown instead


@dataclass(frozen=True)
class Shape:
    layers: int = 8
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    past: int = 1024  # cached tokens; the step's own token takes one more slot
    eps: float = 1e-5


@dataclass(frozen=True)
class Settings:
    shape: Shape
    batches: list[int]
    steps: int  # decode steps per timed sample
    replays: int  # timed samples (median)


TIMEOUT_S = 300.0  # NCCL's: past the ranks' compile skew, well before gpu_session.sh's 540 s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,8", help="comma-separated decode batch sizes")
    p.add_argument("--layers", type=int, default=None, help="decoder blocks (default 8; 2 with --quick)")
    p.add_argument("--steps", type=int, default=20, help="decode steps per timed sample")
    p.add_argument("--replays", type=int, default=None, help="timed samples, median reported (default 9)")
    common.add_arguments(p, quick_help="2 layers, batch 1, 3 samples")


def settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    batches = sorted({int(b) for b in args.batches.split(",")})
    if args.quick and args.batches == p.get_default("batches"):
        batches = [1]
    if batches[0] < 1 or args.steps < 1:
        p.error("batch sizes and --steps must be positive")
    layers = args.layers or (2 if args.quick else 8)
    replays = args.replays or (3 if args.quick else 9)
    return Settings(shape=Shape(layers=layers), batches=batches, steps=args.steps, replays=replays)


# ---- the model ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def random_weight(fan_in: int, *size: int, device: str = "cuda") -> nn.Parameter:
    return nn.Parameter(torch.randn(*size, device=device, dtype=DTYPE) / math.sqrt(fan_in), requires_grad=False)


def norm_weight(size: int, device: str = "cuda") -> nn.Parameter:
    # Ones, as Llama initialises them: replicated parameters must be equal on every rank.
    return nn.Parameter(torch.ones(size, device=device, dtype=DTYPE), requires_grad=False)


class Block(nn.Module):
    """This rank's shard of one decoder block.

    QKV and gate/up are column-parallel, O and down row-parallel; each row-parallel output is summed
    with an in-place dist.all_reduce, the pattern real TP models have.
    """

    def __init__(self, shape: Shape, world_size: int, max_batch: int, device: str = "cuda") -> None:
        super().__init__()
        for what, count in (("heads", shape.heads), ("kv_heads", shape.kv_heads), ("intermediate", shape.intermediate)):
            if count % world_size:
                raise ValueError(f"{what}={count} is not divisible by world size {world_size}")
        self.heads, self.kv_heads = shape.heads // world_size, shape.kv_heads // world_size
        self.head_dim, self.eps = shape.head_dim, shape.eps
        hidden, inter, d = shape.hidden, shape.intermediate // world_size, shape.head_dim
        self.attn_norm, self.mlp_norm = norm_weight(hidden, device), norm_weight(hidden, device)
        self.qkv = random_weight(hidden, hidden, (self.heads + 2 * self.kv_heads) * d, device=device)
        self.o = random_weight(shape.heads * d, self.heads * d, hidden, device=device)
        self.gate_up = random_weight(hidden, hidden, 2 * inter, device=device)
        self.down = random_weight(shape.intermediate, inter, hidden, device=device)
        cache = (max_batch, self.kv_heads, shape.past + 1, d)
        self.register_buffer("k_cache", torch.randn(cache, device=device, dtype=DTYPE))
        self.register_buffer("v_cache", torch.randn(cache, device=device, dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, d = x.shape[0], self.head_dim
        qkv = rms_norm(x, self.attn_norm, self.eps) @ self.qkv
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        k_cache, v_cache = self.k_cache[:b], self.v_cache[:b]
        k_cache[:, :, -1] = k.view(b, self.kv_heads, d)
        v_cache[:, :, -1] = v.view(b, self.kv_heads, d)
        # GQA with plain SDPA: the query heads sharing a KV head attend as a group of queries.
        q = q.view(b, self.kv_heads, self.heads // self.kv_heads, d)
        attn = F.scaled_dot_product_attention(q, k_cache, v_cache).reshape(b, self.heads * d) @ self.o
        x = x + self.reduce(attn)
        gate, up = (rms_norm(x, self.mlp_norm, self.eps) @ self.gate_up).chunk(2, dim=-1)
        return x + self.reduce((F.silu(gate) * up) @ self.down)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The row-parallel sum over the ranks, in place (the capture benchmark's baseline copies instead)."""
        dist.all_reduce(x)
        return x


def compiled_step(
    blocks: nn.ModuleList, norm: torch.Tensor, eps: float, backend: str, dynamic: bool = False, **options: object
) -> Step:
    compiled = [torch.compile(block, backend=backend, dynamic=dynamic, options=options or None) for block in blocks]

    def step(x: torch.Tensor) -> torch.Tensor:
        for block in compiled:
            x = block(x)
        return rms_norm(x, norm, eps)

    return step


def plain_graph(step: Step, static_x: torch.Tensor) -> Step:
    """One step captured with torch.cuda.graph; the returned callable copies x in and replays."""
    outs: list[torch.Tensor] = []
    graph = common.capture(lambda i: outs.append(step(static_x)), 1)

    def replay(x: torch.Tensor) -> torch.Tensor:
        static_x.copy_(x)
        graph.replay()
        return outs[-1]

    return replay


# ---- measuring ---------------------------------------------------------------------------------


def capture_variant(v: str, step: Step, s: Settings) -> dict[int, Step]:
    """batch -> a callable that runs one captured step of variant v."""
    from graphar.allreduce.graphs import BatchGraphs

    statics = {b: torch.randn(b, s.shape.hidden, device="cuda", dtype=DTYPE) for b in s.batches}
    if v in (INDUCTOR, COPY_IN):  # dynamic=False: each batch size is a compilation of its own
        return {b: plain_graph(step, statics[b]) for b in s.batches}
    with forced_kernel("push-oneshot" if v == PUSH else None):
        batch_graphs = BatchGraphs(step, lambda b: (statics[b],), s.batches)
    return dict.fromkeys(s.batches, batch_graphs)


def build_variants(steps: dict[str, Step], s: Settings, reasons: dict[str, str]) -> Runs:
    """Each variant's captured steps, or "n/a", "err", "not rewritten", alike on every rank: each
    capture's outcome is agreed before the next collective."""
    runs: Runs = {}
    for v in CAPTURE_ORDER:
        if v not in steps:  # agreed: graphar's set-up is
            runs[v] = "n/a"
            continue
        common.progress(f"compiling and capturing {LABELS[v]}, batches {s.batches}...")
        with ranks.counting_rewrites() as made:
            captured, problem = ranks.attempt(lambda: capture_variant(v, steps[v], s), "compiling and capturing")
        if problem is not None:
            reasons[v] = problem
            runs[v] = "err"
            continue
        if made:  # (c) compiles the step that (b) and (e) reuse: its counts are theirs
            reasons[f"{LABELS[v]} rewrites (rank 0)"] = str(dict(made))
        status = ranks.rewritten(made, EXPECTED_REWRITES[v], reasons, v) if v in EXPECTED_REWRITES else None
        runs[v] = status or captured
    return runs


def forced_kernel(algo: str | None) -> contextlib.AbstractContextManager[None]:
    """Every all-reduce of the world group's communicator on `algo` (None: the policy's picks)."""
    from graphar.allreduce.registry import communicator

    allreduce = communicator(dist.group.WORLD.group_name).kernels
    return common.overriding(allreduce, "policy", allreduce.policy.forcing(algo or allreduce.policy.forced))


def ranks_equal(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return ranks.all_ranks(all(torch.equal(everyone[0], other) for other in everyone))


def checks(runs: Runs, x: torch.Tensor, b: int) -> dict[tuple, common.Cell]:
    """Outputs of one step from the same input: (a) vs (b), (d) and (e) closeness, (b) vs (c) bits,
    ranks' bits."""
    outs = {v: run[b](x).clone() for v, run in runs.items() if not isinstance(run, str)}
    torch.cuda.synchronize()
    equal = [ranks_equal(o) for o in outs.values()]  # each a collective: no short cut
    cells: dict[tuple, common.Cell] = {(b, "ranks equal"): "yes" if all(equal) else "NO"}
    ref = outs[INDUCTOR].float() if INDUCTOR in outs else None
    for v, column in DIFF_COLUMNS.items():
        if v in outs and ref is not None:
            diff = (outs[v].float() - ref).abs().max().item()
            high = not diff <= REL_TOLERANCE * ref.abs().max().item()  # NaN counts as high
            cells[(b, column)] = f"{diff:.3g}" + (" (HIGH)" if high else "")
    if ZERO_COPY in outs and COPY_IN in outs:
        cells[(b, "(b) == (c) bits")] = "yes" if torch.equal(outs[ZERO_COPY], outs[COPY_IN]) else "NO"
    return cells


def run_batch(runs: Runs, b: int, s: Settings, gen: torch.Generator) -> dict[tuple, common.Cell]:
    """(batch, column) -> cell: the checks, then each variant's time (or why it has none)."""
    x = torch.randn(b, s.shape.hidden, device="cuda", dtype=DTYPE, generator=gen)
    cells = checks(runs, x, b)
    for v in VARIANTS:
        run = runs[v]
        cells[(b, v)] = (
            run
            if isinstance(run, str)
            else common.time_gpu(lambda: [run[b](x) for _ in range(s.steps)], repeats=s.replays, per=s.steps)
        )
    return cells


def graphar_steps(blocks: nn.ModuleList, norm: torch.Tensor, eps: float) -> dict[str, Step]:
    """The graphar step of each graphar variant, after graphar.init (which registers backend="graphar")."""
    import graphar

    # The first call of each compiled block runs right after its compilation, which can end
    # tens of seconds apart on different ranks: the spin bound must outlast that skew.
    if graphar.init(dist.group.WORLD, timeout_s=COMPILE_SKEW_S) is None:
        raise RuntimeError("graphar.init returned None (its log says why)")
    step = compiled_step(blocks, norm, eps, "graphar")
    fused = compiled_step(blocks, norm, eps, "graphar", fuse_norm=True)
    return {ZERO_COPY: step, COPY_IN: step, PUSH: step, FUSED: fused}


def worker(rank: int, world_size: int, s: Settings, out_path: Path | None) -> None:
    torch.manual_seed(1000 + rank)  # weights and caches are this rank's shards
    shape = s.shape
    blocks = nn.ModuleList(Block(shape, world_size, max(s.batches)) for _ in range(shape.layers))
    norm = norm_weight(shape.hidden)
    reasons: dict[str, str] = {}
    steps, problem = ranks.attempt(lambda: graphar_steps(blocks, norm, shape.eps), "graphar set-up")
    if problem is not None:
        reasons["graphar"] = problem
    steps = {INDUCTOR: compiled_step(blocks, norm, shape.eps, "inductor"), **(steps or {})}
    runs = build_variants(steps, s, reasons)
    reasons["dynamo graph breaks"] = str(sum(torch._dynamo.utils.counters["graph_break"].values()))
    common.progress(f"compiled and captured; timing {s.replays} samples of {s.steps} steps per variant and batch")
    gen = torch.Generator(device="cuda").manual_seed(0)  # the replicated hidden states: same on every rank
    common.run_units(
        s.batches,
        lambda b: f"batch {b}",
        lambda b: run_batch(runs, b, s, gen),
        common.reporter("decode", s, "batches", write, reasons, out_path),
    )


def main(args: argparse.Namespace, s: Settings) -> int:
    return common.main(args, s, dry_run, worker, TIMEOUT_S)


# ---- the report --------------------------------------------------------------------------------


def table(cells: dict[tuple, common.Cell], s: Settings) -> str:
    ratios = [f"(a) / {label.split()[0]}" for label in list(LABELS.values())[1:]]
    columns = ["batch"] + list(LABELS.values()) + ratios + list(CHECK_COLUMNS)
    rows = []
    for b in s.batches:
        timed = [cells[(b, v)] for v in VARIANTS]
        checked = [cells.get((b, c), "-") for c in CHECK_COLUMNS]
        rows.append([str(b)] + timed + [common.derived(timed[0], t) for t in timed[1:]] + checked)
    return common.markdown_table(columns, rows)


def notes(s: Settings, world_size: int, reasons: dict[str, str]) -> list[str]:
    m = s.shape
    lines = [
        f"Model: {m.layers} Llama-style blocks, hidden {m.hidden}, intermediate {m.intermediate}, {m.heads} heads, "
        f"{m.kv_heads} KV heads, head_dim {m.head_dim}, KV cache of {m.past} past tokens + the new one, "
        f"bf16 random weights, TP={world_size}; no embedding or LM head. Two all-reduces per block.",
        f"Per-step time: median of {s.replays} samples of {s.steps} back-to-back steps (input copy + replay), "
        "max over ranks. (a) / (b) above 1 means graphar is faster.",
        "Each block is compiled with torch.compile(dynamic=False) for the named backend; "
        "the whole step (all blocks, final norm) is one CUDA graph.",
        f"max abs diff (a, b), (a, d), (a, e): one step from the same input; HIGH = above {REL_TOLERANCE} of the "
        "largest output.",
        "(d) must have been rewritten by graphar's fuse_norm pass ('not rewritten' otherwise, not timed); "
        "'err': its compile or capture raised (the reason below).",
    ]
    return lines + [f"{name}: {why}" for name, why in sorted(reasons.items())]


def chart(cells: dict[tuple, common.Cell], s: Settings) -> plot.BarChart:
    bars = {label: [cells[(b, v)] for b in s.batches] for v, label in LABELS.items()}
    return plot.BarChart(
        f"{s.shape.layers} blocks, median of {s.replays} samples, max over ranks",
        "us per decode step",
        [f"batch {b}" for b in s.batches],
        bars,
    )


def write(
    cells: dict, s: Settings, world_size: int, reasons: dict[str, str], gpu: str, path: Path, final: bool = True
) -> None:
    info = common.header("decode, CUDA graphs", world_size, gpu)
    sections = [("per decode step, us", table(cells, s))]
    title = "Decode step (TP, Llama-style)"
    text = common.report(title, info, sections, notes(s, world_size, reasons))
    common.write_report(text, path, [chart(cells, s)], f"{title}, {gpu}, world size {world_size}", final)


def dry_run(s: Settings, out: Path | None) -> None:
    """The formatting path on fake numbers: no GPU, no graphar needed."""
    rng = random.Random(0)
    cells: dict[tuple, common.Cell] = {}
    for b in s.batches:
        cells.update({(b, v): rng.uniform(300, 600) for v in VARIANTS})
        cells.update({(b, column): "0.0156" for column in DIFF_COLUMNS.values()})
        cells.update({(b, "(b) == (c) bits"): "yes", (b, "ranks equal"): "yes"})
    write(
        cells,
        s,
        2,
        {},
        common.DRY_RUN_GPU,
        common.results_path("decode", common.DRY_RUN_GPU, 2, out, common.dry_run_dir()),
    )


if __name__ == "__main__":
    sys.exit(common.run(sys.modules[__name__]))
