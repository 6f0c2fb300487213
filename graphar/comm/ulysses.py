"""Ulysses all-to-alls: what graphar's three all-to-all ops (graphar.ops) do, and their shapes.

- `qkv_exchange`: sequence -> heads for `[b, S, h_c, d]` Q, K and V (K/V may have fewer heads than
  Q) in one exchange. The result is `[b, P*S, H, d]` with H = (hq + hk + hv)/P: Q's heads first, then
  K's, then V's; `split_heads` cuts it into three views. One tensor, not three, because three results
  of a custom op may not alias each other and their views are what makes the receive side free.
- `output_exchange`: heads -> sequence, `[b, P*S, h, d] -> [b, S, P*h, d]`.
- `packed_exchange`: N equal-split `all_to_all_single`s on one group as one exchange, packed per
  destination rank.

Each returns new memory, never staging memory; `*_shape(s)` check the inputs and give the result's
shape, for the ops and their fakes alike.

A heads-at-dim-1 layout `[b, h, S, d]` goes through the same ops as a permuted view (`seq_to_heads`).
Packing and unpacking are copies of bits (`graphar.kernels.pack`), so every path gives the results of
separate `all_to_all_single`s bit for bit. The decision to pack depends only on shapes, dtypes and the
world size, equal on every rank.

Transport: a group with a graphar communicator (`graphar.init(group)`, or set up at the group's first
eager exchange: `set_up.serving`) exchanges over CUDA IPC
(`graphar.comm.exchange`): the pack writes into the rank's registered exchange buffer and each rank
pulls its chunks from the peers straight into the result, the receive relayout folded into the copy;
or (`GRAPHAR_ALLTOALL_ALGO=push`) the pack stores each chunk straight into its rank's buffer.
Other groups, and captures whose exchange buffer is too small, use NCCL's `all_to_all_single`
through staging buffers from `graphar.pool`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from graphar import pool
from graphar.comm import exchange
from graphar.comm.set_up import serving
from graphar.kernels import pack

_QKV_SEND, _QKV_RECV = "ulysses.qkv.send", "ulysses.qkv.recv"
_OUT_SEND, _OUT_RECV = "ulysses.out.send", "ulysses.out.recv"
_A2A_SEND, _A2A_RECV = "a2a.send", "a2a.recv"


def _group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


def world_size(group_name: str) -> int:
    return _group(group_name).size()


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, group_name: str, op: str) -> None:
    try:
        dist.all_to_all_single(recv.view(-1), send.reshape(-1), group=_group(group_name))
    except RuntimeError as e:
        raise RuntimeError(f"graphar::{op} on group {group_name!r}: all_to_all_single failed: {e}") from e


# Stages of an IPC exchange: slices of the local sequence of about this much send data, at most this
# many; each pipelines its pull behind the next one's pack (graphar.comm.exchange).
_STAGE_BYTES = 16 << 20
_MAX_STAGES = 8


def _ipc(group_name: str, like: torch.Tensor, out: torch.Tensor, stages: Callable[[], list[exchange.Stage]],
         nbytes: int) -> bool:
    """Run `stages()` over the group's IPC exchange into `out`; False (nothing done) for NCCL."""
    ex = _ipc_exchange(group_name, like.device)
    return ex is not None and ex.serves(like) and ex.run(out, stages(), nbytes)


def _ipc_exchange(group_name: str, device: torch.device) -> exchange.IpcExchange | None:
    """The IPC exchange of a group that has a graphar communicator (`graphar.init`, or set up here at
    the group's first eager exchange: `set_up.serving`), else None."""
    comm = serving(group_name, device)
    return None if comm is None else comm.exchange


def _slices(length: int, nbytes: int) -> list[tuple[int, int]]:
    """[s0, s1) slices of a local sequence of `length` tokens, one per stage of an exchange of `nbytes`."""
    k = max(1, min(_MAX_STAGES, length, nbytes // _STAGE_BYTES))
    bounds = [length * i // k for i in range(k + 1)]
    return list(zip(bounds, bounds[1:]))


def _pack_heads_at(xs: Sequence[torch.Tensor], world_size: int, shape: Sequence[int],
                   dest: exchange.Destination) -> None:
    pack.pack_heads(xs, world_size, dest.chunks(shape, xs[0].dtype), dest.guard)


def _relayout_at(src: torch.Tensor, dest: exchange.Destination) -> None:
    pack.relayout([(dest.chunks(src.shape, src.dtype), src)], dest.guard)


def _qkv_stages(xs: Sequence[torch.Tensor], p: int, heads: int) -> list[exchange.Stage]:
    """Stage per sequence slice [s0, s1): chunk i, `[b, n, H, d]`, lands at tokens i*S + s0.. of each batch row."""
    b, s_local, _, d = xs[0].shape
    unit = heads * d * xs[0].element_size()  # one token's packed heads
    stages, offset = [], 0
    kernel_pack = pack.kernel_serves(xs)
    for s0, s1 in _slices(s_local, p * b * s_local * unit):
        n = s1 - s0
        pack_fn = functools.partial(_pack_heads_at, [x[:, s0:s1] for x in xs], p, (p, b, n, heads, d))
        placement = exchange.Placement(b * n * unit, n * unit, p * s_local * unit, s_local * unit)
        stages.append(exchange.Stage(pack_fn, placement, offset, s0 * unit, kernel_pack))
        offset += p * b * n * unit
    return stages


def _output_stages(o: torch.Tensor, p: int, token_bytes: int) -> list[exchange.Stage]:
    """Stage per sequence slice (one stage for b > 1, whose rows are not evenly spaced across slices):
    row (bb, s) of chunk i, `h` heads, lands at heads i*h.. of token (bb, s); tokens of the output
    are `token_bytes` apart."""
    b, s_global, h, d = o.shape
    s_local = s_global // p
    unit = h * d * o.element_size()  # one token's heads
    chunks = o.unflatten(1, (p, s_local)).permute(1, 0, 2, 3, 4)  # [P, b, S, h, d]: sequence block j to rank j
    slices = _slices(s_local, p * b * s_local * unit) if b == 1 else [(0, s_local)]
    kernel_pack = pack.kernel_serves([o])
    stages, offset = [], 0
    for s0, s1 in slices:
        n = s1 - s0
        pack_fn = functools.partial(_relayout_at, chunks[:, :, s0:s1])
        placement = exchange.Placement(b * n * unit, unit, token_bytes, unit)
        stages.append(exchange.Stage(pack_fn, placement, offset, s0 * token_bytes, kernel_pack))
        offset += p * b * n * unit
    return stages


def _require(cond: bool | torch.SymBool, message: Callable[[], str]) -> None:
    """Raise ValueError(message()) unless `cond`. On symbolic sizes (the fakes under dynamic shapes)
    a condition that is already proved adds nothing; one that is not becomes a guard (or a runtime
    assert for data-dependent sizes) on a relation the op needs, never on a size's value."""
    torch._check_with(ValueError, cond, message)


def _check_qkv(xs: Sequence[torch.Tensor], world_size: int, group_name: str) -> None:
    op = f"graphar::qkv_all_to_all on group {group_name!r}"
    first = xs[0]
    for x in xs:
        if x.dim() != 4:
            raise ValueError(f"{op}: expects [b, s_local, heads, d] tensors, got shape {tuple(x.shape)}")
        if x.dtype != first.dtype or x.device != first.device:
            raise ValueError(f"{op}: q, k and v must share dtype and device")
        for dim in (0, 1, 3):
            _require(x.shape[dim] == first.shape[dim],
                     lambda: f"{op}: q, k and v must share b, s_local and d; got {[tuple(t.shape) for t in xs]}")
        _require(x.shape[2] % world_size == 0,
                 lambda x=x: f"{op}: {x.shape[2]} heads do not split over {world_size} ranks")


def qkv_shape(xs: Sequence[torch.Tensor], group_name: str) -> tuple[int, int, int, int]:
    """The shape of `qkv_exchange(xs)`, after checking xs."""
    return _qkv_shape(xs, world_size(group_name), group_name)


def _qkv_shape(xs: Sequence[torch.Tensor], p: int, group_name: str) -> tuple[int, int, int, int]:
    _check_qkv(xs, p, group_name)
    b, s, _, d = xs[0].shape
    return b, p * s, pack.packed_heads([x.shape[2] for x in xs], p), d


def qkv_exchange(xs: Sequence[torch.Tensor], group_name: str) -> torch.Tensor:
    """Sequence -> heads for Q, K and V in one exchange; see the module docstring for the result."""
    q = xs[0]
    p = world_size(group_name)
    b, s_global, heads, d = _qkv_shape(xs, p, group_name)
    s_local = s_global // p
    shape = (p, b, s_local, heads, d)
    out = torch.empty((b, s_global, heads, d), dtype=q.dtype, device=q.device)
    if _ipc(group_name, q, out, lambda: _qkv_stages(xs, p, heads), pool.nbytes(shape, q.dtype)):
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


def _check_output(o: torch.Tensor, world_size: int, group_name: str) -> None:
    def message() -> str:
        return (f"graphar::heads_to_seq_all_to_all on group {group_name!r}: expects [b, s, heads, d] "
                f"with s divisible by {world_size}, got {tuple(o.shape)}")

    if o.dim() != 4:
        raise ValueError(message())
    _require(o.shape[1] % world_size == 0, message)


def output_shape(o: torch.Tensor, group_name: str) -> tuple[int, int, int, int]:
    """The shape of `output_exchange(o)`, after checking o."""
    return _output_shape(o, world_size(group_name), group_name)


def _output_shape(o: torch.Tensor, p: int, group_name: str) -> tuple[int, int, int, int]:
    _check_output(o, p, group_name)
    b, s_global, h, d = o.shape
    return b, s_global // p, p * h, d


def output_exchange(o: torch.Tensor, group_name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Heads -> sequence: `[b, P*S, h, d]` (all tokens, local heads) -> `[b, S, P*h, d]`, new memory
    or `out`: a view of that shape whose tokens are evenly spaced and whose heads are dense, such
    as a run of heads of a larger contiguous tensor (the IPC copy lands there directly)."""
    p = world_size(group_name)
    b, s_local, _, d = out_shape = _output_shape(o, p, group_name)
    h = o.shape[2]
    shape = (p, b, s_local, h, d)
    if out is None:
        out = torch.empty(out_shape, dtype=o.dtype, device=o.device)
    elif tuple(out.shape) != out_shape or out.stride()[2:] != (d, 1) or out.stride(0) != s_local * out.stride(1):
        raise ValueError(f"output_exchange: out {tuple(out.shape)} with strides {out.stride()} is not a {out_shape} "
                         "view with dense heads and evenly spaced tokens")  # fmt: skip
    elif out.dtype != o.dtype or out.device != o.device or out.data_ptr() % 16 != 0:
        # Checked before any pack: the IPC copy moves bytes, and a pushing pack writes into the peers.
        raise ValueError(f"output_exchange: out ({out.dtype} on {out.device}, address {out.data_ptr():#x}) is not "
                         f"16-byte aligned {o.dtype} on {o.device}, as o is")  # fmt: skip
    token_bytes = out.stride(1) * out.element_size()
    if _ipc(group_name, o, out, lambda: _output_stages(o, p, token_bytes), pool.nbytes(shape, o.dtype)):
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


def _check_packed(xs: Sequence[torch.Tensor], world_size: int, group_name: str) -> None:
    op = f"graphar::packed_all_to_all_single on group {group_name!r}"
    if not xs:
        raise ValueError(f"{op}: needs at least one tensor")
    for x in xs:
        if x.dim() == 0:
            raise ValueError(f"{op}: dim 0 of {tuple(x.shape)} does not split equally over {world_size} ranks")
        _require(x.shape[0] % world_size == 0,
                 lambda x=x: f"{op}: dim 0 of {tuple(x.shape)} does not split equally over {world_size} ranks")
        if x.dtype != xs[0].dtype or x.device != xs[0].device:
            raise ValueError(f"{op}: all tensors must share dtype and device")


def packed_shapes(xs: Sequence[torch.Tensor], group_name: str) -> list[tuple[int, ...]]:
    """The shapes of `packed_exchange(xs)` (those of xs), after checking xs."""
    _check_packed(xs, world_size(group_name), group_name)
    return [tuple(x.shape) for x in xs]


def packed_exchange(xs: Sequence[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """`[all_to_all_single(x) for x in xs]` (equal splits) as one exchange: chunk j of every x goes to
    rank j side by side, so the packed exchange moves each x's chunks exactly where its own would."""
    p = world_size(group_name)
    _check_packed(xs, p, group_name)
    widths = [x.numel() // p for x in xs]
    total = sum(widths)
    dtype, device = xs[0].dtype, xs[0].device
    send = pool.staging(_A2A_SEND, (p, total), dtype, device)
    torch.cat([x.reshape(p, w) for x, w in zip(xs, widths)], dim=1, out=send)
    recv = pool.staging(_A2A_RECV, (p, total), dtype, device)
    row = total * dtype.itemsize
    if not _ipc(group_name, xs[0], recv, lambda: [_packed_stage(send, row)], p * row):
        _all_to_all(recv, send, group_name, "packed_all_to_all_single")
    outs = []
    offset = 0
    for x, w in zip(xs, widths):
        out = torch.empty(x.shape, dtype=dtype, device=device)
        out.view(p, w).copy_(recv[:, offset : offset + w])
        outs.append(out)
        offset += w
    return outs


def _packed_stage(send: torch.Tensor, row: int) -> exchange.Stage:
    """The packed exchange's one stage: row j of `send` (`row` bytes) is chunk j. The pack kernel
    copies it as 16-byte words (the only pack an IPC exchange takes), whatever the dtype."""
    p = send.shape[0]
    words = send.view(torch.uint8).view(torch.int32).view(p, 1, row // 16, 1, 4) if row % 16 == 0 else None
    return exchange.Stage(lambda dest: pack.relayout([(dest.chunks(words.shape, words.dtype), words)], dest.guard),
                          exchange.Placement(row, row, p * row, row), 0, 0,
                          kernel_pack=words is not None and pack.kernel_serves([words]))  # fmt: skip


def split_heads(packed: torch.Tensor, head_counts: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Views of Q, K and V in `qkv_all_to_all`'s result, given each one's local head count."""
    return tuple(packed.split(list(head_counts), dim=2))


def seq_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, heads_dim: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence -> heads for Q, K, V: `[b, S, h, d] -> [b, P*S, h/P, d]` (heads_dim=2) or
    `[b, h, S, d] -> [b, h/P, P*S, d]` (heads_dim=1). Returns views of one new tensor."""
    if heads_dim not in (1, 2):
        raise ValueError(f"heads_dim must be 1 or 2, got {heads_dim}")
    xs = (q, k, v) if heads_dim == 2 else tuple(x.transpose(1, 2) for x in (q, k, v))
    p = world_size(group_name)
    packed = torch.ops.graphar.qkv_all_to_all(*xs, group_name)
    out = split_heads(packed, [x.shape[2] // p for x in xs])
    return out if heads_dim == 2 else tuple(x.transpose(1, 2) for x in out)


def heads_to_seq(o: torch.Tensor, group_name: str, heads_dim: int = 2) -> torch.Tensor:
    """Heads -> sequence for the attention output, in either layout (see `seq_to_heads`)."""
    if heads_dim not in (1, 2):
        raise ValueError(f"heads_dim must be 1 or 2, got {heads_dim}")
    if heads_dim == 2:
        return torch.ops.graphar.heads_to_seq_all_to_all(o, group_name)
    return torch.ops.graphar.heads_to_seq_all_to_all(o.transpose(1, 2), group_name).transpose(1, 2)


def reserve(
    shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device, group_name: str, graphs: int = 1
) -> None:
    """Reserve staging memory before capturing `graphs` graphs that exchange Q/K/V of `shapes`
    (`[b, S, h_c, d]` each, the largest the graphs will see) and the matching output.

    Collective on a CUDA device: it sizes the IPC exchange buffers too, and sets up the group's
    communicator where `graphar.init` was not called for it (`set_up.serving`)."""
    p = world_size(group_name)
    b, s_local, _, d = shapes[0]
    heads = pack.packed_heads([s[2] for s in shapes], p)
    chunk = (p, b, s_local, heads, d)
    pool.reserve(_QKV_SEND, chunk, dtype, device, graphs)
    if b > 1:
        pool.reserve(_QKV_RECV, chunk, dtype, device, graphs)
    out_chunk = (p, b, s_local, shapes[0][2] // p, d)
    if b > 1:  # for b == 1 a contiguous attention output is sent as it is
        pool.reserve(_OUT_SEND, out_chunk, dtype, device, graphs)
    pool.reserve(_OUT_RECV, out_chunk, dtype, device, graphs)
    ex = _ipc_exchange(group_name, torch.device(device))
    if ex is not None:  # one exchange buffer serves every graph; the Q/K/V exchange is the larger
        ex.reserve(pool.nbytes(chunk, dtype))

