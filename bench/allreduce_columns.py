"""The all-reduce benchmark's columns (bench/allreduce.py): what each times, and how each
is set up on every rank (NCCL, PyTorch symmetric memory, graphar's kernels), with the columns some
rank could not set up agreed "n/a" on all of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import ranks

MODES = ("graph", "eager", "graph-mm")
N_BUFFERS = 4  # inputs rotate among these so that L2 does not flatter back-to-back ops
NCCL, ONE_SHOT, TWO_SHOT = "NCCL", "symm one_shot", "symm two_shot"
MM_ONLY = "matmul only"
G_AUTO, G_AUTO_ZERO = "graphar auto", "graphar auto zero-copy"


@dataclass(frozen=True)
class Kernel:
    """What a graphar column runs: a kernel (None: the policy's pick), how graph modes capture it."""

    algo: str | None
    zero_copy: bool = False  # captured under graphar.allreduce.graphs.graph (the v1 kernels read inputs in place)
    pdl: bool = True  # programmatic dependent launch


GRAPHAR_KERNELS = {
    "graphar 1stage": Kernel("1stage"),
    "graphar 2stage": Kernel("2stage"),
    "graphar 1stage zero-copy": Kernel("1stage", zero_copy=True),
    "graphar 2stage zero-copy": Kernel("2stage", zero_copy=True),
    "graphar push-oneshot": Kernel("push-oneshot"),
    "graphar push-twoshot": Kernel("push-twoshot"),
    "graphar 1stage no-PDL": Kernel("1stage", pdl=False),
    "graphar 1stage zero-copy no-PDL": Kernel("1stage", zero_copy=True, pdl=False),
    "graphar push-oneshot no-PDL": Kernel("push-oneshot", pdl=False),
    "graphar push-twoshot no-PDL": Kernel("push-twoshot", pdl=False),
    G_AUTO: Kernel(None),
    G_AUTO_ZERO: Kernel(None, zero_copy=True),
}


def column_names(mode: str) -> list[str]:
    graphar = [name for name, k in GRAPHAR_KERNELS.items() if mode != "eager" or not k.zero_copy]
    return ([MM_ONLY] if mode == "graph-mm" else []) + [NCCL, ONE_SHOT, TWO_SHOT] + graphar


ALL_COLUMNS = list(dict.fromkeys(name for mode in MODES for name in column_names(mode)))


Op = Callable[[torch.Tensor, torch.Tensor], Any]  # (input, preallocated output) -> result


@dataclass
class Column:
    op: Op
    symmetric: bool = False  # the input must live in a symmetric-memory buffer
    eligible: Callable[[torch.Tensor], bool] = lambda x: True
    context: Callable[..., Any] = torch.cuda.graph  # how graph modes capture it
    # graphar's count of calls its kernels served; a column that has one is verified before timing
    calls: Callable[[], int] | None = None


@dataclass
class Contenders:
    columns: dict[str, Column] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # column name -> reason
    symm_buffers: list[torch.Tensor] = field(default_factory=list)


def add_nccl(c: Contenders) -> None:
    c.columns[NCCL] = Column(op=lambda x, out: dist.all_reduce(x))
    c.columns[MM_ONLY] = Column(op=lambda x, out: None)


def add_symm_mem(c: Contenders, dtype: torch.dtype, max_numel: int) -> None:
    """One_shot and two_shot on symmetric buffers; their columns say n/a if anything fails here."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        ops = torch.ops.symm_mem
        group_name = dist.group.WORLD.group_name
        try:
            symm_mem.set_backend("CUDA")  # the IPC backend; NVSHMEM is not the peer we compare with
        except Exception:  # noqa: BLE001  (older torch has no set_backend, or the backend is already fixed)
            pass
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buffers = [symm_mem.empty(max_numel, dtype=dtype, device="cuda") for _ in range(N_BUFFERS)]
        for buf in buffers:
            symm_mem.rendezvous(buf, group_name)
        if hasattr(ops, "one_shot_all_reduce_out"):
            one_shot = lambda x, out: ops.one_shot_all_reduce_out(x, "sum", group_name, out)  # noqa: E731
        else:
            one_shot = lambda x, out: ops.one_shot_all_reduce(x, "sum", group_name)  # noqa: E731
        two_shot_op = ops.two_shot_all_reduce_
    except Exception as e:  # noqa: BLE001  (whatever stops symmetric memory, its columns say why)
        reason = f"symmetric memory unavailable: {type(e).__name__}: {e}"
        c.unavailable.update({ONE_SHOT: reason, TWO_SHOT: reason})
        return
    c.symm_buffers = buffers
    c.columns[ONE_SHOT] = Column(op=one_shot, symmetric=True)
    c.columns[TWO_SHOT] = Column(op=lambda x, out: two_shot_op(x, "sum", group_name), symmetric=True)


def add_graphar(c: Contenders, max_bytes: int) -> None:
    try:
        import graphar

        comm = graphar.init(None, max_bytes=max_bytes)
        reason = "" if comm is not None else "graphar.init returned None (its log says why)"
    except Exception as e:  # noqa: BLE001  (whatever stops graphar, its columns say why)
        comm, reason = None, f"graphar unavailable: {type(e).__name__}: {e}"
    if comm is None:
        c.unavailable.update(dict.fromkeys(GRAPHAR_KERNELS, reason))
        return

    def use(kernel: Kernel) -> None:
        # The column's kernel and PDL, set only when they change (each change hands the CUDA library a
        # new kernel table, a call that must not be timed); every graphar column sets both.
        ar = comm.kernels
        if ar.pdl != kernel.pdl:
            ar.pdl = kernel.pdl
        if ar.policy.forced != kernel.algo:
            ar.policy = ar.policy.forcing(kernel.algo)

    def run(x: torch.Tensor, kernel: Kernel) -> torch.Tensor:
        use(kernel)  # the op, as compiled code calls it: eager calls take its C++ kernel, captures its Python one
        return torch.ops.graphar.all_reduce(x, comm.group_name)

    def eligible(x: torch.Tensor, kernel: Kernel) -> bool:
        use(kernel)  # comm.eligible reads the policy in force: the column's own, not the previous column's
        return comm.eligible(x)

    for name, kernel in GRAPHAR_KERNELS.items():
        c.columns[name] = Column(
            op=lambda x, out, kernel=kernel: run(x, kernel),
            eligible=lambda x, kernel=kernel: eligible(x, kernel),
            context=graphar.allreduce.graphs.graph if kernel.zero_copy else torch.cuda.graph,
            calls=lambda: comm.kernels.calls,
        )


def agree_on_columns(c: Contenders) -> None:
    """Collective: a column that some rank could not set up is n/a on every rank (a rank timing it
    alone would wait for its peer in each collective)."""
    for name in ALL_COLUMNS:  # one order on every rank
        reason = ranks.agree(c.unavailable.get(name))
        if reason is not None:
            c.columns.pop(name, None)
            c.unavailable[name] = reason
