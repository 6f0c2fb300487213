"""The plans of the Ulysses exchanges over CUDA IPC: what each stage packs and where its chunks land.

An op body (graphar.ulysses.exchanges) makes its exchange's whole `Plan` here and hands it to the IPC
exchange (graphar.ulysses.transport), which packs each stage's sources with graphar's kernel and copies
each stage's chunks into the output by its `Placement`. A plan is data: nothing here is called while
the exchange runs. Large exchanges are cut into slices of the local sequence, each slice's copy
pipelined behind the next one's pack. The plans depend only on shapes, dtypes and the world size,
equal on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Stages of an IPC exchange: slices of the local sequence of about this much send data, at most this
# many; each pipelines its pull behind the next one's pack (graphar.ulysses.transport).
_STAGE_BYTES = 16 << 20
_MAX_STAGES = 8


@dataclass(frozen=True)
class Placement:
    """Where the chunk from rank i lands in the output: `chunk_bytes / row_bytes` rows of `row_bytes`,
    row k at byte `i * dst_chunk_stride + k * dst_row_stride`."""

    chunk_bytes: int
    row_bytes: int
    dst_row_stride: int
    dst_chunk_stride: int


@dataclass(frozen=True)
class Stage:
    """One step of an exchange: its P chunks, `chunks` `[P, b, n, H, d]`, are `sources` (`[P, b, n, h_c, d]`
    views, chunk j for rank j) side by side along the heads, packed from byte `src_offset` of the
    exchange buffers; the copy places them from byte `out_offset` of the output."""

    sources: tuple[torch.Tensor, ...]
    chunks: tuple[int, ...]
    placement: Placement
    src_offset: int
    out_offset: int


@dataclass(frozen=True)
class Plan:
    """An exchange's stages, and the bytes of chunks each rank sends in all (what its buffer must hold)."""

    stages: tuple[Stage, ...]
    nbytes: int


def _slices(length: int, nbytes: int) -> list[tuple[int, int]]:
    """[s0, s1) slices of a local sequence of `length` tokens, one per stage of an exchange of `nbytes`."""
    k = max(1, min(_MAX_STAGES, length, nbytes // _STAGE_BYTES))
    bounds = [length * i // k for i in range(k + 1)]
    return list(zip(bounds, bounds[1:]))


def qkv_plan(xs: Sequence[torch.Tensor], p: int, heads: int) -> Plan:
    """Sequence -> heads of `[b, S, h_c, d]` xs into `heads` packed heads: a stage per sequence slice
    [s0, s1); chunk i, `[b, n, heads, d]`, lands at tokens i*S + s0.. of each batch row."""
    b, s_local, _, d = xs[0].shape
    unit = heads * d * xs[0].element_size()  # one token's packed heads
    stages, offset = [], 0
    for s0, s1 in _slices(s_local, p * b * s_local * unit):
        n = s1 - s0
        # [P, b, n, h_c/P, d]: head block j of the slice, for rank j
        sources = tuple(x[:, s0:s1].unflatten(2, (p, x.shape[2] // p)).permute(2, 0, 1, 3, 4) for x in xs)
        placement = Placement(b * n * unit, n * unit, p * s_local * unit, s_local * unit)
        stages.append(Stage(sources, (p, b, n, heads, d), placement, offset, s0 * unit))
        offset += p * b * n * unit
    return Plan(tuple(stages), offset)


def output_plan(o: torch.Tensor, p: int, token_bytes: int) -> Plan:
    """Heads -> sequence of `o` `[b, P*S, h, d]`: a stage per sequence slice (one stage for b > 1, whose
    rows are not evenly spaced across slices); row (bb, s) of chunk i, `h` heads, lands at heads
    i*h.. of token (bb, s); tokens of the output are `token_bytes` apart."""
    b, s_global, h, d = o.shape
    s_local = s_global // p
    unit = h * d * o.element_size()  # one token's heads
    chunks = o.unflatten(1, (p, s_local)).permute(1, 0, 2, 3, 4)  # [P, b, S, h, d]: sequence block j to rank j
    slices = _slices(s_local, p * b * s_local * unit) if b == 1 else [(0, s_local)]
    stages, offset = [], 0
    for s0, s1 in slices:
        n = s1 - s0
        placement = Placement(b * n * unit, unit, token_bytes, unit)
        stages.append(Stage((chunks[:, :, s0:s1],), (p, b, n, h, d), placement, offset, s0 * token_bytes))
        offset += p * b * n * unit
    return Plan(tuple(stages), offset)


def packed_plan(send: torch.Tensor, row: int) -> Plan:
    """The packed exchange's one stage: row j of `send` (`row` bytes) is chunk j. The pack kernel
    copies it as 16-byte words (the only pack an IPC exchange takes), whatever the dtype."""
    p = send.shape[0]
    placement = Placement(row, row, p * row, row)
    if row % 16:  # no words to pack, and a placement the exchange refuses: NCCL moves it
        return Plan((Stage((), (), placement, 0, 0),), p * row)
    words = send.view(torch.uint8).view(torch.int32).view(p, 1, row // 16, 1, 4)
    return Plan((Stage((words,), tuple(words.shape), placement, 0, 0),), p * row)
