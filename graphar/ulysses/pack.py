"""Data movement of the Ulysses exchanges: one strided copy kernel and the four layouts built on it.

Every relayout here is a copy between 5-D views `[P, b, s, h, d]` (P: peer rank, b: batch, s: sequence
block, h: heads, d: head dim, d contiguous): `relayout(pairs)` copies up to three (dst, src) pairs of
such views in one Triton launch on CUDA tensors (and on CPU tensors under `TRITON_INTERPRET=1`), and
with `Tensor.copy_` elsewhere. Both only move bits, so both give the same result. A destination may
also be `Shifted`: chunk j lies `shifts[j]` elements from a `[b, s, h, d]` view, anywhere the GPU can
store: in rank j's buffer mapped over CUDA IPC (which torch cannot hold as a tensor of this GPU), or
in the exchange's output. Only the kernel writes it: so a pushing exchange packs chunk j straight
into rank j's buffer over the link, and a rank's own chunk goes straight into its result.

The layouts (P = world size, S = local sequence length, h_c = heads of tensor c):
- `pack_heads`: send side of sequence -> heads. `packed[j, bi, si, o_c + l, e] = X_c[bi, si, j*h_c/P + l, e]`,
  with `o_c` the heads of the earlier tensors over P: Q, K and V (K/V may have fewer heads) side by side
  (`pack_chunks`, which packs any `[P, b, s, h_c, d]` views so: an IPC exchange's stages).
- `gather_sequence`: receive side for b > 1, `[P, b, S, H, d] -> [b, P*S, H, d]` (for b == 1 it is a view).
- `pack_sequence`: send side of heads -> sequence, `[b, P*S, h, d] -> [P, b, S, h, d]`.
- `gather_heads`: receive side of heads -> sequence, `[P, b, S, h, d] -> [b, S, P*h, d]`.
Each returns True when the Triton kernel did the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphar.triton_common import interpreting, on_device

try:
    import triton
    import triton.language as tl
except ImportError:  # graphar works without Triton; the copies then run through torch
    triton = None

# Elements a program moves: enough bytes in flight per SM without spilling registers.
_TILE_ELEMENTS = 4096
_INT32_MAX = 2**31 - 1
# The kernel's dtypes; others move through torch (same bits, slower). int32: the packed exchange's
# 16-byte words (graphar.ulysses.stages).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32)

_MAX_PEERS = 8  # the chunk shifts the kernel takes


@dataclass(frozen=True)
class Shifted:
    """P chunks like `base` (`[b, s, h, d]`): chunk j starts `shifts[j]` elements after `base`'s start."""

    base: torch.Tensor
    shifts: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.shifts), *self.base.shape)

    def stride(self) -> tuple[int, ...]:
        """As a `[P, ...]` view of `base`; the shifts place each chunk."""
        return (0, *self.base.stride())


Dst = torch.Tensor | Shifted  # a relayout's destination `[P, b, s, h, d]`
Pair = tuple[Dst, torch.Tensor]


if triton is not None:

    @triton.jit
    def _copy_tile(
        dst, src, heads, row_block, head_block, j, shift, live,
        s_j, s_b, s_s, s_h, d_j, d_b, d_s, d_h,
        rows, seq,
        D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, IDX64: tl.constexpr,
        SHIFTED: tl.constexpr,
    ):  # fmt: skip  # arguments in rows: pointers, strides, sizes, constexprs
        r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
        l = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        e = tl.arange(0, D_PAD)
        if IDX64:
            r = r.to(tl.int64)
            l = l.to(tl.int64)
            j = j.to(tl.int64)
        bi = r // seq
        si = r - bi * seq
        src_row = j * s_j + bi * s_b + si * s_s
        dst_row = j * d_j + bi * d_b + si * d_s
        if SHIFTED:  # chunk j lives elsewhere (another rank's buffer): `shift` elements from dst
            dst_row = dst_row + shift
        mask = (r < rows * live)[:, None, None] & (l < heads)[None, :, None] & (e < D)[None, None, :]
        src_off = src_row[:, None, None] + (l * s_h)[None, :, None] + e[None, None, :]
        dst_off = dst_row[:, None, None] + (l * d_h)[None, :, None] + e[None, None, :]
        tl.store(dst + dst_off, tl.load(src + src_off, mask=mask), mask=mask)

    # A new sequence length or batch must not recompile (the first call at that length may be inside
    # a CUDA-graph capture). The constexprs come from the head dim and head counts, fixed in a model
    # (IDX64 flips once, at 2**31 elements). rows and seq are not specialised at all. Strides are
    # specialised only on divisibility by 16 (aligned vector loads): a stride that grows with the
    # sequence, S*h*d, keeps it for every S when h*d is a multiple of 16, as with any real head dim.
    # The shifts are distances between allocations (the ranks' buffers, the output), so they change
    # with every output: typed int64, not by value (a distance past 2**31 elements would flip the
    # type and recompile), and specialised only on divisibility, which keeps the stores vectorised.
    @triton.jit(do_not_specialize=["rows", "seq"])
    def _relayout_kernel(
        dst0, src0, heads0, s0_j, s0_b, s0_s, s0_h, d0_j, d0_b, d0_s, d0_h,
        dst1, src1, heads1, s1_j, s1_b, s1_s, s1_h, d1_j, d1_b, d1_s, d1_h,
        dst2, src2, heads2, s2_j, s2_b, s2_s, s2_h, d2_j, d2_b, d2_s, d2_h,
        shift0: tl.int64, shift1: tl.int64, shift2: tl.int64, shift3: tl.int64,
        shift4: tl.int64, shift5: tl.int64, shift6: tl.int64, shift7: tl.int64,
        guard, rows, seq,
        D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, IDX64: tl.constexpr,
        SHIFTED: tl.constexpr, FENCE: tl.constexpr, GUARDED: tl.constexpr,
    ):  # fmt: skip  # arguments in rows: one per tensor, the shifts, sizes, constexprs
        row_block = tl.program_id(0)
        j = tl.program_id(1)
        block = tl.program_id(2)
        live = 1  # 0: no row is copied
        if GUARDED:  # the communicator's failed flag (graphar.ulysses.transport): once set, store nothing
            live = (tl.load(guard, volatile=True) == 0).to(tl.int32)
        shift = 0
        if SHIFTED:  # shift_j without indexing the arguments by a runtime j
            shift = tl.where(j == 0, shift0, tl.where(j == 1, shift1, tl.where(j == 2, shift2, tl.where(
                j == 3, shift3, tl.where(j == 4, shift4, tl.where(j == 5, shift5, tl.where(j == 6, shift6, shift7)))))))  # fmt: skip  # a flat chain of 8 cases
        blocks0 = tl.cdiv(heads0, BLOCK_H)
        blocks1 = tl.cdiv(heads1, BLOCK_H)
        if block < blocks0:
            _copy_tile(dst0, src0, heads0, row_block, block, j, shift, live,
                       s0_j, s0_b, s0_s, s0_h, d0_j, d0_b, d0_s, d0_h,
                       rows, seq, D, D_PAD, BLOCK_R, BLOCK_H, IDX64, SHIFTED)  # fmt: skip  # rows as in the signature
        elif block < blocks0 + blocks1:
            _copy_tile(dst1, src1, heads1, row_block, block - blocks0, j, shift, live,
                       s1_j, s1_b, s1_s, s1_h, d1_j, d1_b, d1_s, d1_h,
                       rows, seq, D, D_PAD, BLOCK_R, BLOCK_H, IDX64, SHIFTED)  # fmt: skip  # rows as in the signature
        else:
            _copy_tile(dst2, src2, heads2, row_block, block - blocks0 - blocks1, j, shift, live,
                       s2_j, s2_b, s2_s, s2_h, d2_j, d2_b, d2_s, d2_h,
                       rows, seq, D, D_PAD, BLOCK_R, BLOCK_H, IDX64, SHIFTED)  # fmt: skip  # rows as in the signature
        if FENCE:
            # Stores into a peer's buffer are announced by the next kernel (the all-to-all's entry barrier),
            # whose release orders only what its own thread has seen. fence.sc.sys (membar.sys) holds this
            # thread until its stores, over the link too, are performed for the whole system, so they
            # precede that announcement by the memory model, not only by how kernel completion drains the
            # link today.
            tl.inline_asm_elementwise(
                "fence.sc.sys; mov.u32 $0, $1;", "=r,r", [row_block], dtype=tl.int32, is_pure=False, pack=1
            )


def _base(dst: Dst) -> torch.Tensor:
    return dst.base if isinstance(dst, Shifted) else dst


def _shifts(pairs: Sequence[Pair]) -> tuple[int, ...] | None:
    """The chunk shifts every pair shares; () for tensor destinations; None when they differ."""
    shifts = {dst.shifts if isinstance(dst, Shifted) else () for dst, _ in pairs}
    return shifts.pop() if len(shifts) == 1 else None


def kernel_serves(srcs: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel copies from these sources (so it can write a `Shifted` destination)."""
    if triton is None or not srcs or srcs[0].dtype not in KERNEL_DTYPES:
        return False
    return all((t.is_cuda or interpreting()) and t.stride(-1) == 1 for t in srcs)


def _use_triton(pairs: Sequence[Pair]) -> bool:
    if not 1 <= len(pairs) <= 3 or not kernel_serves([src for _, src in pairs]):
        return False
    shifts = _shifts(pairs)
    return shifts is not None and len(shifts) <= _MAX_PEERS and all(_base(dst).stride(-1) == 1 for dst, _ in pairs)


def _max_offset(shape: Sequence[int], strides: Sequence[int]) -> int:
    """The largest element offset the kernel computes for a view (relative to its first element)."""
    return sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)


def _check_pairs(pairs: Sequence[Pair]) -> None:
    if not pairs:
        raise ValueError("relayout needs at least one (dst, src) pair")
    p, b, s, _, d = pairs[0][0].shape
    device = _base(pairs[0][0]).device
    for dst, src in pairs:
        if _base(dst).device != device or src.device != device:
            raise ValueError(f"relayout: all tensors must be on {device}")
        if len(dst.shape) != 5 or tuple(dst.shape) != tuple(src.shape) or _base(dst).dtype != src.dtype:
            raise ValueError(
                f"relayout: dst {tuple(dst.shape)}/{_base(dst).dtype} and src {tuple(src.shape)}/"
                f"{src.dtype} must be equal 5-D [P, b, s, h, d] views"
            )
        if (dst.shape[0], dst.shape[1], dst.shape[2], dst.shape[4]) != (p, b, s, d):
            raise ValueError("relayout: all pairs must share P, b, s and d")


def relayout(pairs: Sequence[Pair], guard: torch.Tensor | None = None) -> bool:
    """`dst.copy_(src)` for each (dst, src) pair of 5-D views `[P, b, s, h_c, d]`; one launch on CUDA.

    Returns True when the Triton kernel did the copy, False when torch did. A `Shifted` destination
    needs the kernel (`kernel_serves`): ValueError otherwise. `guard` (one int32, kernel only): the
    kernel stores nothing once it is nonzero, read when the kernel runs (an exchange passes its
    communicator's failed flag: graphar.ulysses.transport).
    """
    _check_pairs(pairs)
    if not _use_triton(pairs):
        if guard is not None or any(isinstance(dst, Shifted) for dst, _ in pairs):
            raise ValueError(
                "relayout: only the Triton kernel writes shifted chunks or reads a guard (see kernel_serves)"
            )
        for dst, src in pairs:
            dst.copy_(src)
        return False
    launch = _launch(pairs, guard)
    if launch is None:
        return True
    grid, args, constants = launch
    with on_device(_base(pairs[0][0]).device):
        _relayout_kernel[grid](*args, **constants, num_warps=4)
    return True


def _launch(
    pairs: Sequence[Pair], guard: torch.Tensor | None
) -> tuple[tuple[int, int, int], list[object], dict[str, object]] | None:
    """The kernel's grid, runtime arguments and constexprs for `pairs`; None when there is nothing to copy."""
    p, b, s, _, d = pairs[0][0].shape
    rows = b * s
    heads = [dst.shape[3] for dst, _ in pairs]
    if rows == 0 or p == 0 or d == 0 or not any(heads):
        return None
    d_pad = triton.next_power_of_2(d)
    # The largest power of two dividing every head count: no program is mostly masked out.
    common = 0
    for h in heads:
        common |= h
    block_h = min(common & -common if common else 1, max(1, _TILE_ELEMENTS // d_pad // 4))
    block_r = max(1, _TILE_ELEMENTS // (block_h * d_pad))
    idx64 = any(_max_offset(t.shape, t.stride()) > _INT32_MAX for pair in pairs for t in pair)
    args: list[object] = []
    for i in range(3):
        dst, src = pairs[min(i, len(pairs) - 1)]
        h = dst.shape[3] if i < len(pairs) else 0
        args += [_base(dst), src, h, *src.stride()[:4], *dst.stride()[:4]]
    shifts = _shifts(pairs) or ()
    grid = (triton.cdiv(rows, block_r), p, sum(triton.cdiv(h, block_h) for h in heads))
    # The interpreter runs no PTX: there the kernel runs on one device and needs no fence.
    constants = dict(
        D=d,
        D_PAD=d_pad,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        IDX64=idx64,
        SHIFTED=bool(shifts),
        FENCE=bool(shifts) and not interpreting(),
        GUARDED=guard is not None,
    )
    return grid, [*args, *shifts, *[0] * (_MAX_PEERS - len(shifts)), guard, rows, s], constants


def _heads(out: Dst, start: int, stop: int) -> Dst:
    """Heads [start, stop) of every chunk of `out` `[P, b, S, H, d]`."""
    if isinstance(out, Shifted):
        return Shifted(out.base[:, :, start:stop], out.shifts)
    return out[:, :, :, start:stop]


def pack_chunks(srcs: Sequence[torch.Tensor], out: Dst, guard: torch.Tensor | None = None) -> bool:
    """Copy `[P, b, S, h_c, d]` sources side by side along the heads into `out` `[P, b, S, sum(h_c), d]`
    (`guard`: relayout's): what every stage of an IPC exchange packs (graphar.ulysses.transport)."""
    offset = 0
    pairs: list[Pair] = []
    for src in srcs:
        pairs.append((_heads(out, offset, offset + src.shape[3]), src))
        offset += src.shape[3]
    return relayout(pairs, guard)


def pack_heads(xs: Sequence[torch.Tensor], world_size: int, out: Dst, guard: torch.Tensor | None = None) -> bool:
    """Pack `[b, S, h_c, d]` tensors destination-major into `out` `[P, b, S, sum(h_c)/P, d]` (`guard`: relayout's)."""
    return pack_chunks(
        [x.unflatten(2, (world_size, x.shape[2] // world_size)).permute(2, 0, 1, 3, 4) for x in xs], out, guard
    )


def gather_sequence(recv: torch.Tensor, out: torch.Tensor) -> bool:
    """`recv` `[P, b, S, H, d]` (chunk i from rank i) into `out` `[b, P*S, H, d]`."""
    p = recv.shape[0]
    return relayout([(out.unflatten(1, (p, recv.shape[2])).permute(1, 0, 2, 3, 4), recv)])


def pack_sequence(o: torch.Tensor, world_size: int, out: torch.Tensor) -> bool:
    """`o` `[b, P*S, h, d]` into `out` `[P, b, S, h, d]`: sequence block j goes to rank j."""
    return relayout([(out, o.unflatten(1, (world_size, o.shape[1] // world_size)).permute(1, 0, 2, 3, 4))])


def gather_heads(recv: torch.Tensor, out: torch.Tensor) -> bool:
    """`recv` `[P, b, S, h, d]` (heads block i from rank i) into `out` `[b, S, P*h, d]`."""
    p, h = recv.shape[0], recv.shape[3]
    return relayout([(out.unflatten(2, (p, h)).permute(2, 0, 1, 3, 4), recv)])
