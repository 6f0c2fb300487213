"""Graph-safe staging buffers for graphar's collectives.

A staging buffer is scratch memory a collective writes and reads within one call, reused by the next
call of the same role. Reuse is where CUDA graphs bite: a buffer first allocated during a capture lives
in the graph's private pool, and a buffer a captured graph uses must never be written by eager code,
on any stream, while that graph may replay. The rules here:

- memory comes from a process-lifetime `torch.cuda.MemPool` that graphar owns, and every new backing is
  checked to lie in it; one that landed elsewhere (a capture or cudagraph-tree warm-up on a torch that
  ignores the routing) serves its call and is not kept;
- eager buffers are keyed by (device, stream, role): another stream never shares one;
- during a capture, buffers are keyed by the graph being captured (its owner): the graph keeps them
  for its lifetime, eager code never gets them, and when a role outgrows its buffer inside one
  capture the old one is retired (kept alive), not freed;
- `reserve()` makes spare buffers before capture, so that a capture takes a spare instead of allocating;
- every role holds one grow-only buffer per key, not one per shape.

Buffers are flat uint8 tensors; callers view them with the dtype and shape they need.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphar.allreduce.graphs import segments

_GRANULE = 2 << 20  # round capacities like the caching allocator's large segments
_GROWTH = 1.25  # a growing role over-allocates a little so that slowly growing shapes settle


class Runtime(Protocol):
    """What the pool asks of CUDA; tests substitute a fake to exercise capture logic on CPU."""

    def capturing(self, device: torch.device) -> bool: ...

    def capturing_graph(self, device: torch.device) -> Any | None: ...

    def stream(self, device: torch.device) -> int: ...

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor | None: ...

    def transient(self, nbytes: int, device: torch.device) -> torch.Tensor: ...


class CudaRuntime:
    """The real runtime: graphar's MemPool per device, the capturing graph as owner."""

    def __init__(self) -> None:
        self._pools: dict[int, torch.cuda.MemPool] = {}

    def capturing(self, device: torch.device) -> bool:
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def capturing_graph(self, device: torch.device) -> Any | None:
        get = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
        if get is None:
            return None
        try:
            with torch.cuda.device(device):
                graph = get()
        except RuntimeError:  # a capture torch does not track (not through torch.cuda.CUDAGraph)
            return None
        # Only a graph Python holds tells us when it dies; a bare binding object may be a temporary.
        return graph if isinstance(graph, torch.cuda.CUDAGraph) else None

    def stream(self, device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def mempool(self, device: torch.device) -> torch.cuda.MemPool:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._pools:
            with torch.cuda.device(index):
                self._pools[index] = torch.cuda.MemPool()
        return self._pools[index]

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        pool = self.mempool(device)
        with torch.cuda.use_mem_pool(pool, device):
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return t if _lies_in(t, pool) else None

    def transient(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Memory for one call, from wherever the allocator routes it now (a capture's own pool)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _lies_in(t: torch.Tensor, pool: torch.cuda.MemPool) -> bool:
    ptr = t.data_ptr()
    return any(start <= ptr < start + size for start, size in segments(pool.id))


def capacity(nbytes: int, previous: int = 0) -> int:
    """Bytes to allocate for `nbytes` when the buffer being replaced held `previous` (0: none)."""
    want = max(nbytes, int(previous * _GROWTH)) if previous else nbytes
    return -(-want // _GRANULE) * _GRANULE


@dataclass
class _Owned:
    """The buffers one captured graph uses: current backings by (device, role), and retired ones."""

    backings: dict[tuple[torch.device, str], torch.Tensor] = field(default_factory=dict)
    retired: list[torch.Tensor] = field(default_factory=list)


class StagingPool:
    def __init__(self, runtime: Runtime | None = None) -> None:
        self.runtime: Runtime = runtime or CudaRuntime()
        # Reentrant: a graph's finalizer may run (garbage collection) while this thread holds the lock.
        self._lock = threading.RLock()
        self._eager: dict[tuple[torch.device, int, str], torch.Tensor] = {}
        self._owned: dict[int, _Owned] = {}
        self._spares: dict[tuple[torch.device, str], list[torch.Tensor]] = {}
        self.transient = 0  # calls served by memory the pool could not keep

    def get(self, role: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of `nbytes` on `device` for `role`, valid until the next call of that role
        on the same stream (eager) or for the life of the graph being captured."""
        if device.type != "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            backing = self._get_locked(role, nbytes, device)
        if backing is None:
            self.transient += 1
            return self.runtime.transient(nbytes, device)
        return backing[:nbytes]

    def _get_locked(self, role: str, nbytes: int, device: torch.device) -> torch.Tensor | None:
        if not self.runtime.capturing(device):
            key = (device, self.runtime.stream(device), role)
            backing = self._eager.get(key)
            if backing is None or backing.numel() < nbytes:
                # The outgrown backing is freed in stream order: only this stream ever used it.
                backing = self._allocate(nbytes, device, backing)
                if backing is None:
                    return None
                self._eager[key] = backing
            return backing
        owned = self._owner(device)
        if owned is None:
            return None
        backing = owned.backings.get((device, role))
        if backing is not None and backing.numel() >= nbytes:
            return backing
        grown = self._take_spare(role, nbytes, device)
        if grown is None:
            grown = self._allocate(nbytes, device, backing)
        if grown is None:
            return None
        if backing is not None:
            owned.retired.append(backing)  # kernels captured earlier in this graph still use it
        owned.backings[(device, role)] = grown
        return grown

    def _owner(self, device: torch.device) -> _Owned | None:
        graph = self.runtime.capturing_graph(device)
        if graph is None:
            return None
        key = id(graph)
        if key not in self._owned:
            try:
                weakref.finalize(graph, self._release, key)
            except TypeError:  # cannot tell when this graph dies: do not pin memory for it
                return None
            self._owned[key] = _Owned()
        return self._owned[key]

    def _release(self, key: int) -> None:
        with self._lock:
            self._owned.pop(key, None)

    def _take_spare(self, role: str, nbytes: int, device: torch.device) -> torch.Tensor | None:
        spares = self._spares.get((device, role), [])
        fitting = [t for t in spares if t.numel() >= nbytes]
        if not fitting:
            return None
        best = min(fitting, key=torch.Tensor.numel)
        spares.remove(best)
        return best

    def _allocate(self, nbytes: int, device: torch.device, previous: torch.Tensor | None) -> torch.Tensor | None:
        return self.runtime.allocate(capacity(nbytes, previous.numel() if previous is not None else 0), device)

    def reserve(self, role: str, nbytes: int, device: torch.device, count: int = 1) -> None:
        """Make sure `count` spare buffers of at least `nbytes` exist for captures of `role`.

        Call outside any capture, once per graph that will be captured before the next call.
        """
        if device.type != "cuda":
            return
        if self.runtime.capturing(device):
            raise RuntimeError(f"graphar.ulysses.pool.reserve({role!r}) called during a CUDA-graph capture")
        with self._lock:
            spares = self._spares.setdefault((device, role), [])
            missing = count - sum(t.numel() >= nbytes for t in spares)
            for _ in range(missing):
                t = self._allocate(nbytes, device, None)
                if t is None:
                    raise RuntimeError(f"graphar.ulysses.pool.reserve({role!r}): memory did not land in graphar's pool")
                spares.append(t)

    def stats(self) -> dict[str, int]:
        with self._lock:
            owned = list(self._owned.values())
            return {
                "eager": len(self._eager),
                "graphs": len(owned),
                "graph_buffers": sum(len(o.backings) for o in owned),
                "retired": sum(len(o.retired) for o in owned),
                "spares": sum(len(s) for s in self._spares.values()),
                "transient": self.transient,
            }


_POOL: StagingPool | None = None


def pool() -> StagingPool:
    """The process's staging pool."""
    global _POOL
    if _POOL is None:
        _POOL = StagingPool()
    return _POOL


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def staging(role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A staging tensor of `shape` and `dtype` for `role` (see `StagingPool.get`)."""
    return pool().get(role, nbytes(shape, dtype), device).view(dtype).view(tuple(shape))


def reserve(role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, count: int = 1) -> None:
    """`StagingPool.reserve` for a tensor of `shape` and `dtype`."""
    pool().reserve(role, nbytes(shape, dtype), device, count)
