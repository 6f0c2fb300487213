"""`python -m graphar demo`: both of graphar's rewrites on small models, compiled and checked.

Spawns `--world-size` processes (NCCL with one GPU each when there are enough GPUs, else gloo on the
CPU) and compiles with `backend="graphar"`, the only change a model needs (the group sets up its IPC
communicator at its first collective):
(a) a tensor-parallel MLP, whose all-reduces become `graphar::all_reduce` (its graph is printed
    before and after graphar's pass), in fp32 and bf16;
(b) a Ulysses attention block, whose Q/K/V `all_to_all_single`s become one `graphar::qkv_all_to_all`.
For every rewrite it prints what the collectives became, read from the compiled graph, and the
transport that serves them in this run, asked of graphar's runtime. Each compiled output is checked
against the uncompiled model.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_graph_lowering
from torch.utils._pytree import tree_leaves

import graphar
from graphar import _cuda, processes
from graphar.allreduce.registry import communicator
from graphar.passes.manager import graph_log
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked

WORLD_SIZES = (2, 4, 8)  # each divides HEADS and FFN, and graphar.init serves it on NVLink GPUs
HIDDEN, FFN, BATCH = 64, 256, 8
HEADS, SEQ = 8, 16  # attention heads of HIDDEN // HEADS dims; tokens per rank
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class TensorParallelMLP(torch.nn.Module):
    """Two residual MLP blocks: column-parallel up projection, row-parallel down projection + all_reduce."""

    def __init__(self, rank: int, world_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)  # same full weights on every rank; each keeps its shard
        shard = FFN // world_size
        self.up = torch.nn.ParameterList()
        self.down = torch.nn.ParameterList()
        for _ in range(2):
            up = torch.randn(HIDDEN, FFN, generator=gen) / HIDDEN**0.5
            down = torch.randn(FFN, HIDDEN, generator=gen) / FFN**0.5
            self.up.append(up[:, rank * shard : (rank + 1) * shard].to(device, dtype))
            self.down.append(down[rank * shard : (rank + 1) * shard].to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            y = torch.nn.functional.silu(x @ up) @ down
            dist.all_reduce(y)
            x = x + y
        return x


class UlyssesAttention(torch.nn.Module):
    """Sequence-parallel attention as Ulysses code writes it: each rank holds SEQ tokens of all heads;
    one all_to_all_single per tensor gives it every token of HEADS / world_size heads, and one more
    sends the attention output back."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)  # same weights on every rank
        self.q, self.k, self.v, self.out = (torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (seq_to_heads_unpacked(proj(x).view(b, s, HEADS, -1)) for proj in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out(heads_to_seq_unpacked(o.transpose(1, 2)).reshape(b, s, HIDDEN))


@dataclass
class _Printer:
    """What the launcher and rank 0 print (other ranks are silent); progress lines carry the seconds
    since the demo started."""

    active: bool
    start: float

    def __call__(self, text: str) -> None:
        if self.active:
            print(text, flush=True)

    def progress(self, text: str) -> None:
        self(f"[{time.time() - self.start:5.1f} s] {text}")


class _GraphPrinter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), flush=True)


def cuda_library_status() -> str:
    """One line: whether graphar's CUDA library was built at install and loads here, and if not, why."""
    packaged = _cuda.PACKAGE_DIR / _cuda.LIB_NAME
    built = f"built at install ({packaged})" if packaged.is_file() else "not built at install"
    try:
        lib = _cuda.library()
    except Exception as e:  # noqa: BLE001  (whatever the cause, say it: the demo runs without it)
        return f"graphar CUDA library: {built}; not usable here: {e}. graphar's ops fall back to torch.distributed."
    return f"graphar CUDA library: {built}; loaded from {lib._name}"


def _transport(op: str, exchanges: int, group: str, backend: str) -> str:
    """What serves `op` on `group` in this run: graphar's runtime picks it by the group's communicator."""
    if op == "graphar::all_reduce":
        if communicator(group) is not None:
            return "custom IPC all-reduce"
        return f"{backend} fallback (no graphar communicator on this group)"
    kind = "one packed exchange" if exchanges > 1 else "one exchange"
    return f"{kind} over {'CUDA IPC' if communicator(group) is not None else backend}"


def rewrites(graph: torch.fx.Graph, backend: str) -> list[str]:
    """One line per graphar op in a compiled graph: the collectives it replaced, and its transport here."""
    lines = []
    for node in graph.nodes:
        if not (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "graphar"):
            continue
        op, group = node.target.name(), node.args[-1]  # every graphar op takes the group name last
        inputs = [n.meta["val"] for n in tree_leaves(node.args[:-1])]  # one per collective it replaced
        collective = "all_reduce" if op == "graphar::all_reduce" else "all_to_all_single"
        count = f"{len(inputs)} x " if len(inputs) > 1 else ""
        shapes = ", ".join(dict.fromkeys("x".join(map(str, t.shape)) for t in inputs))
        lines.append(
            f"{count}{collective} (group {group!r}, {shapes} {SHORT[inputs[0].dtype]}) -> {op}: "
            f"{_transport(op, len(inputs), group, backend)}"
        )
    return lines


def _compile_and_check(out: _Printer, name: str, model: torch.nn.Module, x: torch.Tensor, backend: str) -> None:
    out.progress(f"compiling {name} ({SHORT[x.dtype]})...")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphar", fullgraph=True)
    actual, lowerings = run_and_get_graph_lowering(compiled, x)
    lines = [line for lowering in lowerings for line in rewrites(lowering.graph, backend)]
    if not lines:
        raise AssertionError(f"{name}: graphar rewrote no collective")
    for line in lines:
        out(f"  {line}")
    error = (actual.float() - model(x).float()).abs().max().item()
    out(f"  compiled vs uncompiled: max |diff| = {error:.3g} (tolerance {TOLERANCE[x.dtype]})")
    if error > TOLERANCE[x.dtype]:
        raise AssertionError(f"rank {dist.get_rank()}: {name}: outputs differ by {error}")


def _run(out: _Printer, rank: int, world_size: int, device: torch.device, backend: str) -> None:
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            model = TensorParallelMLP(rank, world_size, dtype, device)
            x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            _compile_and_check(out, "the tensor-parallel MLP", model, x, backend)
            graph_log.setLevel(logging.WARNING)  # show the graphs once
        x = torch.randn(1, SEQ, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(device)  # this rank's tokens
        _compile_and_check(out, "the Ulysses attention block", UlyssesAttention(device), x, backend)


def _worker(rank: int, world_size: int, use_gpu: bool, start: float) -> None:
    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    backend = "nccl" if use_gpu else "gloo"
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass we want to show
    if rank == 0:
        graph_log.addHandler(_GraphPrinter())
        graph_log.setLevel(logging.DEBUG)
    try:
        _run(_Printer(rank == 0, start), rank, world_size, device, backend)
    finally:
        graphar.shutdown()
        dist.destroy_process_group()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size",
        type=int,
        choices=WORLD_SIZES,
        default=2,
        help="processes to spawn, one GPU each when there are that many (default: 2)",
    )


def main(world_size: int = 2) -> int:
    start = time.time()
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    out = _Printer(True, start)
    out(f"graphar demo: {world_size} processes, {'NCCL, one GPU each' if use_gpu else 'gloo on the CPU'}")
    if torch.cuda.is_available():
        out.progress("loading graphar's CUDA library (nvcc builds it on first use: a minute or two)...")
    out(cuda_library_status())
    out.progress(f"starting {world_size} processes...")
    processes.run(
        _worker, world_size, use_gpu, start, backend="nccl" if use_gpu else "gloo", device="rank" if use_gpu else None
    )
    out(f"graphar demo: OK, compiled outputs match the uncompiled models ({time.time() - start:.0f} s)")
    return 0


def run(args: argparse.Namespace) -> int:
    """The `demo` command of `python -m graphar`."""
    return main(args.world_size)
