"""The stage plans of the Ulysses exchanges over CUDA IPC: what each stage packs and where its chunks land.

An exchange (graphar.comm.exchange) runs a list of `Stage`s; each packs its chunks with graphar's
kernel (graphar.kernels.pack) and says, by a `Placement`, where the chunk from each rank lands in the
output. Large exchanges are cut into slices of the local sequence, each slice's copy pipelined
behind the next one's pack. The plans depend only on shapes, dtypes and the world size, equal on
every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from graphar.comm import exchange
from graphar.kernels import pack

# Stages of an IPC exchange: slices of the local sequence of about this much send data, at most this
# many; each pipelines its pull behind the next one's pack (graphar.comm.exchange).
_STAGE_BYTES = 16 << 20
_MAX_STAGES = 8


def _slices(length: int, nbytes: int) -> list[tuple[int, int]]:
    """[s0, s1) slices of a local sequence of `length` tokens, one per stage of an exchange of `nbytes`."""
    k = max(1, min(_MAX_STAGES, length, nbytes // _STAGE_BYTES))
    bounds = [length * i // k for i in range(k + 1)]
    return list(zip(bounds, bounds[1:]))


def _pack_heads_at(
    xs: Sequence[torch.Tensor], world_size: int, shape: Sequence[int], dest: exchange.Destination
) -> None:
    pack.pack_heads(xs, world_size, dest.chunks(shape, xs[0].dtype), dest.guard)


def _relayout_at(src: torch.Tensor, dest: exchange.Destination) -> None:
    pack.relayout([(dest.chunks(src.shape, src.dtype), src)], dest.guard)


def qkv_stages(xs: Sequence[torch.Tensor], p: int, heads: int) -> list[exchange.Stage]:
    """Sequence -> heads of `[b, S, h_c, d]` xs into `heads` packed heads: a stage per sequence slice
    [s0, s1); chunk i, `[b, n, heads, d]`, lands at tokens i*S + s0.. of each batch row."""
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


def output_stages(o: torch.Tensor, p: int, token_bytes: int) -> list[exchange.Stage]:
    """Heads -> sequence of `o` `[b, P*S, h, d]`: a stage per sequence slice (one stage for b > 1, whose
    rows are not evenly spaced across slices); row (bb, s) of chunk i, `h` heads, lands at heads
    i*h.. of token (bb, s); tokens of the output are `token_bytes` apart."""
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


def packed_stage(send: torch.Tensor, row: int) -> exchange.Stage:
    """The packed exchange's one stage: row j of `send` (`row` bytes) is chunk j. The pack kernel
    copies it as 16-byte words (the only pack an IPC exchange takes), whatever the dtype."""
    p = send.shape[0]
    words = send.view(torch.uint8).view(torch.int32).view(p, 1, row // 16, 1, 4) if row % 16 == 0 else None
    return exchange.Stage(
        functools.partial(_relayout_at, words),
        exchange.Placement(row, row, p * row, row),
        0,
        0,
        kernel_pack=words is not None and pack.kernel_serves([words]),
    )
