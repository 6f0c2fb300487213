"""The bodies of graphar's three Ulysses all-to-all ops (graphar.ops): transport, staging, `reserve`.

- `qkv_exchange`: sequence -> heads for `[b, S, h_c, d]` Q, K and V (K/V may have fewer heads than
  Q) in one exchange. The result is `[b, P*S, H, d]` with H = (hq + hk + hv)/P: Q's heads first, then
  K's, then V's; `split_heads` cuts it into three views. One tensor, not three, because three results
  of a custom op may not alias each other and their views are what makes the receive side free.
- `output_exchange`: heads -> sequence, `[b, P*S, h, d] -> [b, S, P*h, d]`.
- `packed_exchange`: N equal-split `all_to_all_single`s on one group as one exchange, packed per
  destination rank.

Each returns new memory, never staging memory, of the shape graphar.ulysses.shapes gives (it
checks the inputs, for the ops and their fakes alike).

A heads-at-dim-1 layout `[b, h, S, d]` goes through the same ops as a permuted view
(`graphar.ulysses.seq_to_heads`). Packing and unpacking are copies of bits (`graphar.ulysses.pack`),
so every path gives the results of separate `all_to_all_single`s bit for bit. The decision to pack
depends only on shapes, dtypes and the world size, equal on every rank.

Transport: a group with a graphar communicator (`graphar.init(group)`, or set up at the group's first
eager exchange: `set_up.communicator_or_set_up`) exchanges over CUDA IPC: the body makes the exchange's whole plan
(graphar.ulysses.stages) and hands it to the exchange (`graphar.ulysses.transport`), which calls
nothing back. The pack writes into the rank's registered exchange buffer and each rank pulls its
chunks from the peers straight into the result, the receive relayout folded into the copy; or
(`GRAPHAR_ALLTOALL_ALGO=push`) the pack stores each chunk straight into its rank's buffer. Other
groups, and captures whose exchange buffer is too small, use NCCL's `all_to_all_single` through
staging buffers from `graphar.ulysses.pool`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from graphar.allreduce.set_up import communicator_or_set_up
from graphar.ulysses import pack, pool, stages, transport
from graphar.ulysses import shapes as ulysses_shapes  # `shapes` names the inputs' shapes here

_QKV_SEND, _QKV_RECV = "ulysses.qkv.send", "ulysses.qkv.recv"
_OUT_SEND, _OUT_RECV = "ulysses.out.send", "ulysses.out.recv"
_A2A_SEND, _A2A_RECV = "a2a.send", "a2a.recv"


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, group_name: str, op: str) -> None:
    """The NCCL transport: one equal-split `all_to_all_single` of staging (or result) memory."""
    try:
        dist.all_to_all_single(
            recv.view(-1), send.reshape(-1), group=dist.distributed_c10d._resolve_process_group(group_name)
        )
    except RuntimeError as e:
        raise RuntimeError(f"graphar::{op} on group {group_name!r}: all_to_all_single failed: {e}") from e


def _ipc(group_name: str, out: torch.Tensor, plan: Callable[[], stages.Plan]) -> bool:
    """Run the exchange `plan()` plans over the group's IPC exchange into `out`; False (nothing done)
    for NCCL. The whole plan is made before the exchange runs, which calls nothing back."""
    ex = _ipc_transport(group_name, out.device)
    return ex is not None and ex.run(out, plan())


def _ipc_transport(group_name: str, device: torch.device) -> transport.IpcTransport | None:
    """The IPC exchange of a group that has a graphar communicator (`graphar.init`, or set up here at
    the group's first eager exchange: `set_up.communicator_or_set_up`), else None. The Ulysses room's one call into
    set-up: it owns which groups get a communicator and when; this room only asks for the exchange."""
    comm = communicator_or_set_up(group_name, device)
    return None if comm is None else transport.of(comm)


def qkv_exchange(xs: Sequence[torch.Tensor], group_name: str) -> torch.Tensor:
    """Sequence -> heads for Q, K and V in one exchange; see the module docstring for the result."""
    q = xs[0]
    p = ulysses_shapes.world_size(group_name)
    b, s_global, heads, d = ulysses_shapes.qkv_shape(xs, p, group_name)
    s_local = s_global // p
    shape = (p, b, s_local, heads, d)
    out = torch.empty((b, s_global, heads, d), dtype=q.dtype, device=q.device)
    if _ipc(group_name, out, lambda: stages.qkv_plan(xs, p, heads)):
        return out
    send = pool.staging(_QKV_SEND, shape, q.dtype, q.device)
    pack.pack_heads(xs, p, send)
    if b == 1:  # rank i's block lands at sequence offset i*S: the exchange writes the result directly
        _all_to_all(out, send, group_name, "qkv_all_to_all")
        return out
    recv = pool.staging(_QKV_RECV, shape, q.dtype, q.device)
    _all_to_all(recv, send, group_name, "qkv_all_to_all")
    pack.gather_sequence(recv, out)
    return out


def output_exchange(o: torch.Tensor, group_name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Heads -> sequence: `[b, P*S, h, d]` (all tokens, local heads) -> `[b, S, P*h, d]`, new memory
    or `out`: a view of that shape whose tokens are evenly spaced and whose heads are dense, such
    as a run of heads of a larger contiguous tensor (the IPC copy lands there directly)."""
    p = ulysses_shapes.world_size(group_name)
    b, s_local, _, d = out_shape = ulysses_shapes.output_shape(o, p, group_name)
    h = o.shape[2]
    shape = (p, b, s_local, h, d)
    if out is None:
        out = torch.empty(out_shape, dtype=o.dtype, device=o.device)
    elif tuple(out.shape) != out_shape or out.stride()[2:] != (d, 1) or out.stride(0) != s_local * out.stride(1):
        raise ValueError(
            f"output_exchange: out {tuple(out.shape)} with strides {out.stride()} is not a {out_shape} "
            "view with dense heads and evenly spaced tokens"
        )
    elif out.dtype != o.dtype or out.device != o.device or out.data_ptr() % 16 != 0:
        # Checked before any pack: the IPC copy moves bytes, and a pushing pack writes into the peers.
        raise ValueError(
            f"output_exchange: out ({out.dtype} on {out.device}, address {out.data_ptr():#x}) is not "
            f"16-byte aligned {o.dtype} on {o.device}, as o is"
        )
    token_bytes = out.stride(1) * out.element_size()
    if _ipc(group_name, out, lambda: stages.output_plan(o, p, token_bytes)):
        return out
    if b == 1 and o.is_contiguous():  # already destination-major: sequence block j is chunk j
        send = o
    else:
        send = pool.staging(_OUT_SEND, shape, o.dtype, o.device)
        pack.pack_sequence(o, p, send)
    recv = pool.staging(_OUT_RECV, shape, o.dtype, o.device)
    _all_to_all(recv, send, group_name, "heads_to_seq_all_to_all")
    pack.gather_heads(recv, out)
    return out


def packed_exchange(xs: Sequence[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """`[all_to_all_single(x) for x in xs]` (equal splits) as one exchange: chunk j of every x goes to
    rank j side by side, so the packed exchange moves each x's chunks exactly where its own would."""
    p = ulysses_shapes.world_size(group_name)
    out_shapes = ulysses_shapes.packed_shapes(xs, p, group_name)
    widths = [x.numel() // p for x in xs]
    total = sum(widths)
    dtype, device = xs[0].dtype, xs[0].device
    send = pool.staging(_A2A_SEND, (p, total), dtype, device)
    torch.cat([x.reshape(p, w) for x, w in zip(xs, widths)], dim=1, out=send)
    recv = pool.staging(_A2A_RECV, (p, total), dtype, device)
    row = total * dtype.itemsize
    if not _ipc(group_name, recv, lambda: stages.packed_plan(send, row)):
        _all_to_all(recv, send, group_name, "packed_all_to_all_single")
    outs = []
    offset = 0
    for shape, w in zip(out_shapes, widths):
        out = torch.empty(shape, dtype=dtype, device=device)
        out.view(p, w).copy_(recv[:, offset : offset + w])
        outs.append(out)
        offset += w
    return outs


def reserve(
    shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device, group_name: str, graphs: int = 1
) -> None:
    """Reserve staging memory before capturing `graphs` graphs that exchange Q/K/V of `shapes`
    (`[b, S, h_c, d]` each, the largest the graphs will see) and the matching output: the buffers
    the bodies above take, so it lives beside them (graphar.ulysses makes it public).

    Collective on a CUDA device: it sizes the IPC exchange buffers too, and sets up the group's
    communicator where `graphar.init` was not called for it (`set_up.communicator_or_set_up`)."""
    p = ulysses_shapes.world_size(group_name)
    b, s_local, _, d = shapes[0]
    heads = ulysses_shapes.packed_heads([s[2] for s in shapes], p)
    chunk = (p, b, s_local, heads, d)
    pool.reserve(_QKV_SEND, chunk, dtype, device, graphs)
    if b > 1:
        pool.reserve(_QKV_RECV, chunk, dtype, device, graphs)
    out_chunk = (p, b, s_local, shapes[0][2] // p, d)
    if b > 1:  # for b == 1 a contiguous attention output is sent as it is
        pool.reserve(_OUT_SEND, out_chunk, dtype, device, graphs)
    pool.reserve(_OUT_RECV, out_chunk, dtype, device, graphs)
    ex = _ipc_transport(group_name, torch.device(device))
    if ex is not None:  # one exchange buffer serves every graph; the Q/K/V exchange is the larger
        ex.reserve(pool.nbytes(chunk, dtype))
