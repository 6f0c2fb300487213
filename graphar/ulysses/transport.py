"""All-to-all over CUDA IPC: the Ulysses exchanges of a group that has a graphar communicator.

`run(out, plan)` runs a plan the op body made whole beforehand (graphar.ulysses.stages: data, no
call goes back to it), packing with graphar's kernel (graphar.ulysses.pack). It moves one chunk per
destination rank in one of two ways (`GRAPHAR_ALLTOALL_ALGO`, equal on every rank):
- pull: the pack writes the chunks destination-major into this rank's exchange buffer, then every
  rank reads chunk `rank` of every rank's buffer over the link straight into its output;
- push: the pack stores chunk j straight into rank j's buffer, at this rank's slot (the link crossed
  by stores, which need no round trip, and no separate transfer after the pack), then every rank
  copies its own buffer into its output.
Either way the copy places rows by stride, so the receive side needs no relayout
(csrc/all_to_all.cuh). With several stages (slices of the sequence), stage k's copy runs on a side
stream while stage k+1 packs.

Exchange buffers are one per rank and communicator, grow-only. Growing is collective: it happens in
an op outside any capture, and every rank calls the op with the same shapes, so every rank grows at
the same call. Inside a capture a buffer that is too small cannot grow; the op falls back to NCCL
(`reserve` before capturing avoids that). A buffer a captured graph used is retired, not freed, when
it grows: the graph keeps reading and writing it. Like the all-reduce's registered buffer, it is
shared by every graph and eager call of the communicator, so they must not run concurrently: eager
calls on different streams are ordered by the communicator; a replay beside an eager call or another
replay on an unordered stream is caught. Each exchange first takes a lease on the communicator (a
one-thread kernel), which its last copy gives back, and every pack is graphar's kernel, which reads
the communicator's failed flag before it stores: an exchange that meets another kernel of the
communicator writes nothing shared, its result and the other's are NaN, and the next call raises
(csrc/all_to_all.cuh, exchange_lease). A stage the kernel cannot pack uses NCCL.

The exchange reaches its communicator (graphar.allreduce.communicator) only through `TransportCalls`.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphar import settings
from graphar.abi import A2A_LAST, A2A_OWN_PLACED, A2A_PUSHED, PATH_CAPTURED_COPY, PATH_EAGER, AllToAllCopy
from graphar.allreduce.rendezvous import first_reason
from graphar.errors import GrapharCommError, GrapharCudaError
from graphar.ulysses import pack, pool
from graphar.ulysses.stages import Placement, Plan, Stage

logger = logging.getLogger("graphar")


def pull_blocks() -> int:
    """Blocks of a pull: GRAPHAR_PULL_BLOCKS, default every Signal slot (64). On 2 x H200, 64 blocks of
    256 threads pulled 252 MB and 1.16 GB exchanges as fast as 96 and 3-7% faster than 128."""
    return settings.PULL_BLOCKS.get()


def copyable(p: Placement) -> bool:
    """Whether the copy kernel can place it: 16-byte packs throughout."""
    values = (p.chunk_bytes, p.row_bytes, p.dst_row_stride, p.dst_chunk_stride)
    return p.chunk_bytes > 0 and p.chunk_bytes % p.row_bytes == 0 and all(v % 16 == 0 for v in values)


def _one_run(p: Placement) -> bool:
    """Whether a chunk lands as one run of bytes."""
    return p.chunk_bytes == p.row_bytes or p.dst_row_stride == p.row_bytes


@dataclass(frozen=True)
class Destination:
    """Where a stage's pack writes its P chunks (chunk j for rank j), from byte `offset` of the
    exchange buffers: pulled, destination-major in this rank's `buffer`; pushed, chunk j at this
    rank's slot of rank j's buffer (`addresses`: every rank's buffer, as this process maps it). With
    `own` (bytes of the output), this rank's own chunk goes straight there instead."""

    buffer: torch.Tensor  # uint8: this rank's exchange buffer
    offset: int
    rank: int
    addresses: Sequence[int] = ()
    own: torch.Tensor | None = None
    guard: torch.Tensor | None = None  # the pack kernel's (graphar.ulysses.pack.relayout): the failed flag

    def fill(self, stage: Stage) -> None:
        """Pack `stage`'s sources into their chunks here (graphar's kernel wherever `chunks` is shifted)."""
        pack.pack_chunks(stage.sources, self.chunks(stage.chunks, stage.sources[0].dtype), self.guard)

    def chunks(self, shape: Sequence[int], dtype: torch.dtype) -> pack.Dst:
        """The chunks as `shape` `[P, ...]` of `dtype`: a tensor when they lie destination-major in this
        rank's buffer, else shifted views that only the pack kernel writes."""
        if not self.addresses and self.own is None:
            return _typed(self.buffer, self.offset, shape, dtype)
        chunk_bytes = math.prod(shape[1:]) * dtype.itemsize
        if self.addresses:
            starts = [a + self.offset + self.rank * chunk_bytes for a in self.addresses]
        else:
            starts = [self.buffer.data_ptr() + self.offset + j * chunk_bytes for j in range(shape[0])]
        if self.own is not None:
            base = _typed(self.own, 0, shape[1:], dtype)
            starts[self.rank] = base.data_ptr()
        else:
            base = _typed(self.buffer, self.offset + self.rank * chunk_bytes, shape[1:], dtype)
        return pack.Shifted(base, tuple((a - base.data_ptr()) // dtype.itemsize for a in starts))


def _typed(buffer: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`shape` of `dtype` at byte `offset` of a uint8 buffer."""
    return buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(tuple(shape))


def memory_from(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes [start, start + nbytes) counted from t's first element, whatever t's strides: the memory
    the copy kernel addresses from `t.data_ptr()` (the output may be a run of heads of a larger tensor)."""
    offset = t.storage_offset() * t.element_size() + start
    return t.new_empty(0, dtype=torch.uint8).set_(t.untyped_storage(), offset, (nbytes,))


def own_chunk(out: torch.Tensor, stage: Stage, rank: int) -> torch.Tensor | None:
    """The bytes of `out` where this rank's own chunk of `stage` lands, when its pack (graphar's kernel,
    which places chunks anywhere) can write them directly: one run of bytes there; else None."""
    p = stage.placement
    if not _one_run(p):
        return None
    return memory_from(out, stage.out_offset + rank * p.dst_chunk_stride, p.chunk_bytes)


class _DeviceMemory:
    """Raw device memory seen by torch through the CUDA array interface (no copy, no ownership):
    `count` elements of `typestr` (numpy's: bytes by default)."""

    def __init__(self, ptr: int, count: int, typestr: str = "|u1") -> None:
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class TransportCalls(Protocol):
    """What the exchange needs of its communicator, all of it (tests/test_communicator_calls.py holds it so)."""

    group_name: str
    rank: int
    device: int

    def check(self) -> None: ...
    def mark_broken(self, reason: str) -> None: ...
    def all_gather(self, obj: Any, what: str) -> list[Any]: ...
    def take_exchange_lease(self, mode: int, stream: int) -> int: ...  # eager: after the previous op
    def launch_all_to_all(self, copy: AllToAllCopy, output: int, lease: int, stream: int) -> None: ...
    def failed_flag(self) -> int: ...  # device address of the flag the group's kernels set when one gives up
    def alloc_exchange(self, nbytes: int, keep_old: bool, what: str) -> tuple[int, bytes]: ...  # collective
    def open_exchange(self, nbytes: int, handles: Sequence[bytes], what: str) -> list[int]: ...  # collective


_transports: weakref.WeakKeyDictionary[Any, IpcTransport] = weakref.WeakKeyDictionary()
_transports_lock = threading.Lock()


def of(comm: TransportCalls) -> IpcTransport:
    """The IPC transport of a communicator, made at its first exchange: the Ulysses room attaches it, so
    the all-reduce's communicator knows nothing of it (one-way calls)."""
    found = _transports.get(comm)  # every exchange asks: the lock only where one is made
    if found is None:
        with _transports_lock:
            found = _transports.setdefault(comm, IpcTransport(comm))
    return found


class IpcTransport:
    """The exchange buffers of one communicator (`of(comm)`)."""

    def __init__(self, comm: TransportCalls) -> None:
        self.comm = comm
        # Push or pull: GRAPHAR_ALLTOALL_ALGO, agreed at set-up. A benchmark or test that flips it must
        # flip it on every rank between the same two calls.
        self.push = settings.ALLTOALL_ALGO.get() == "push"
        self._buffer: torch.Tensor | None = None
        self._addresses: list[int] = []  # every rank's buffer, as this process maps them (for a push)
        self._captured = False  # a capture used the current buffer: retire it rather than free it
        self._guard: torch.Tensor | None = None  # the communicator's failed flag, made at the first growth
        self._told: set[str] = set()  # the reasons for NCCL logged so far
        self._blocks = pull_blocks()
        self._side: torch.cuda.Stream | None = None  # made at the first growth, always outside capture

    @property
    def capacity(self) -> int:
        """Bytes of this rank's exchange buffer (equal on every rank); 0 before the first growth."""
        return 0 if self._buffer is None else self._buffer.numel()

    def serves(self, t: torch.Tensor) -> bool:
        """Whether `t` lives on this communicator's GPU."""
        return t.device.type == "cuda" and t.device.index == self.comm.device

    def run(self, out: torch.Tensor, plan: Plan) -> bool:
        """Exchange every stage of `plan` into `out`, pushed when the setting asks, else pulled; this
        stream continues after the last copy. False, with nothing done, when the plan cannot run here
        (`out` on another device, a placement the kernel cannot copy, a pack that is not graphar's
        kernel, or a capture the buffer is too small for): the caller then uses NCCL. Collective when
        the buffer grows."""
        if not self.serves(out):
            return False
        self.comm.check()
        stages, nbytes = plan.stages, plan.nbytes
        if not all(copyable(stage.placement) for stage in stages):
            return False
        # Dtypes, layouts and Triton: equal on every rank. The kernel alone places chunks anywhere (the
        # peers' buffers, this rank's own chunk in `out`) and respects the exchange's lease.
        if not pack.kernel_serves([src for stage in stages for src in stage.sources]):
            self._tell_once(
                "pack",
                "its pack is not graphar's kernel (no Triton, or a dtype or layout it does not "
                "take), which alone respects the exchange's lease",
            )
            return False
        capturing = torch.cuda.is_current_stream_capturing()
        if nbytes > self.capacity:
            if capturing:
                self._tell_once(
                    "capacity",
                    f"{nbytes} bytes per rank were captured with exchange buffers of "
                    f"{self.capacity}: run it once before capturing, or graphar.ulysses.reserve(...)",
                )
                return False
            self._grow(nbytes)
        if capturing:
            self._captured = True
        mode = PATH_CAPTURED_COPY if capturing else PATH_EAGER
        main = torch.cuda.current_stream(self.comm.device)
        lease = self.comm.take_exchange_lease(mode, _stream(self.comm.device))  # eager: after the previous op
        try:
            side = main if len(stages) > 1 else None
            for i, stage in enumerate(stages):
                self._exchange(out, stage, mode, lease, last=i == len(stages) - 1, side=side)
        except BaseException as e:  # the lease is held and the peers wait at this exchange's copies
            self.comm.mark_broken(
                f"graphar all_to_all of group {self.comm.group_name!r} stopped halfway on rank {self.comm.rank}: {e}"
            )
            raise
        if len(stages) > 1:
            main.wait_stream(self._side)
        return True

    def _exchange(
        self, out: torch.Tensor, stage: Stage, mode: int, lease: int, last: bool, side: torch.cuda.Stream | None
    ) -> None:
        """Pack one stage, then copy it into `out`: on the side stream, forked from `side`, when given.
        The own chunk skips the buffer when the pack kernel can place it in `out` directly (one run of
        bytes there; only this rank reads or writes it, so ranks need not agree on it)."""
        own = own_chunk(out, stage, self.comm.rank)
        addresses = self._addresses if self.push else ()
        Destination(self._buffer, stage.src_offset, self.comm.rank, addresses, own, self._guard).fill(stage)
        flags = (A2A_PUSHED if self.push else 0) | (A2A_OWN_PLACED if own is not None else 0)
        flags |= A2A_LAST if last else 0
        p = stage.placement
        copy = AllToAllCopy(
            mode,
            stage.src_offset,
            p.chunk_bytes,
            p.row_bytes,
            p.dst_row_stride,
            p.dst_chunk_stride,
            flags,
            self._blocks,
        )
        output = out.data_ptr() + stage.out_offset
        if side is None:
            self.comm.launch_all_to_all(copy, output, lease, _stream(self.comm.device))
            return
        self._side.wait_stream(side)  # in a capture this forks the side stream into it
        with torch.cuda.stream(self._side):
            self.comm.launch_all_to_all(copy, output, lease, _stream(self.comm.device))

    def reserve(self, nbytes: int) -> None:
        """Collective, outside capture: grow the buffer to at least `nbytes` now."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("graphar exchange buffers cannot be reserved during a CUDA-graph capture")
        self.comm.check()
        if nbytes > self.capacity:
            self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        comm = self.comm
        what = f"graphar all_to_all exchange buffer of group {comm.group_name!r}"
        capacity = pool.capacity(nbytes, self.capacity)
        self._buffer, self._addresses = None, []
        ptr, handle, error = 0, b"", None
        try:
            ptr, handle = comm.alloc_exchange(capacity, self._captured, what)
        except GrapharCudaError as e:  # every rank must hear of it, or the others wait for this one
            error = str(e)
        gathered = comm.all_gather((handle, error), what)
        failed = first_reason([e for _, e in gathered])
        if failed is not None:
            raise GrapharCommError(f"{what}: allocation failed on {failed}")
        try:
            self._addresses = comm.open_exchange(capacity, [h for h, _ in gathered], what)
        except Exception as e:  # the peers opened theirs: the ranks' buffers differ from now on
            comm.mark_broken(f"{what}: opening the peers' buffers failed on rank {comm.rank}: {e}")
            raise
        device = torch.device("cuda", comm.device)
        self._buffer = torch.as_tensor(_DeviceMemory(ptr, capacity), device=device)
        if self._side is None:  # high priority: a pull's blocks go first when the next pack leaves room
            self._side = torch.cuda.Stream(device, priority=-1)
            self._guard = torch.as_tensor(_DeviceMemory(comm.failed_flag(), 1, "<i4"), device=device)
        self._captured = False
        logger.info("graphar: exchange buffers of group %r grown to %d MiB", comm.group_name, capacity >> 20)

    def _tell_once(self, key: str, why: str) -> None:
        if key not in self._told:
            self._told.add(key)
            logger.warning("graphar: an all-to-all on group %r uses NCCL: %s", self.comm.group_name, why)


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)
