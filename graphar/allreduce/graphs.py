"""CUDA-graph capture with zero-copy all-reduces, and the decode-loop helper.

Inside `graph(...)`, every graphar all-reduce reads the caller's tensor in place: its kernel is
captured with a placeholder slot, and when the capture ends every rank shares the (allocation
handle, offset) of its recorded inputs and the slots are filled before `graph` returns, so no
replay can see an empty slot. What the peers map stays allocated as long as the graph lives, and
after it until every peer has closed its mappings (`_Keep`). Captures graphar does not own (a plain
`torch.cuda.graph`, Inductor's cudagraph trees) take the copy-in path instead: one local copy per
call, no registration.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


def segments(pool_id: tuple[int, int]) -> list[tuple[int, int]]:
    """(start, bytes) of every segment the caching allocator holds for the memory pool `pool_id`."""
    try:
        found = torch.cuda.memory_snapshot(pool_id, include_traces=False)  # fast where torch has the option
    except TypeError:
        found = torch.cuda.memory_snapshot(pool_id)
    return [(s["address"], s["total_size"]) for s in found if tuple(s.get("segment_pool_id", pool_id)) == pool_id]


class _State(threading.local):
    capture: Capture | None = None  # a class default: reading it costs no AttributeError when unset


_state = _State()


class Capture:
    """The all-reduces recorded during one `graph(...)` capture, per communicator's all-reduce (a
    graphar.allreduce.kernels.AllReduce, which registers its calls when the capture ends)."""

    def __init__(self) -> None:
        self.calls: dict[Any, list[Any]] = {}

    def record(self, allreduce: Any, call: Any) -> None:
        """One call (a graphar.allreduce.kernels.GraphCall) that `allreduce` captured zero-copy."""
        self.calls.setdefault(allreduce, []).append(call)


def current_capture() -> Capture | None:
    """The graphar capture that the current stream is part of, if any. A call inside `graph(...)` on a
    stream the capture does not cover runs at once, like any call outside it: a graph slot is filled
    only when the capture ends, too late for a kernel launched now."""
    capture = _state.capture
    return capture if capture is not None and torch.cuda.is_current_stream_capturing() else None


@contextmanager
def graph(
    cuda_graph: torch.cuda.CUDAGraph,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
) -> Iterator[None]:
    """`torch.cuda.graph` whose graphar all-reduces are zero-copy; collective on exit.

    Every rank of each group used inside must capture the same all-reduces: on exit they exchange
    what they recorded (a mismatch raises on every rank) and fill the slots before returning.
    """
    if _state.capture is not None:
        raise RuntimeError("graphar.graph captures cannot nest")
    capture = Capture()
    _state.capture = capture
    try:
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield
    except BaseException:
        _release(_slots(capture))  # nothing was registered: the recorded slots go back at once
        raise
    finally:
        _state.capture = None
    finish(cuda_graph, capture)


def finish(cuda_graph: torch.cuda.CUDAGraph, capture: Capture) -> None:
    """Register every recorded call (collective), and tie the tensors the graph reads in place to
    the graph's lifetime: freed and reused, their memory would feed other data to every replay.
    When the graph dies, its slots and the peers' mappings it alone read go, and its inputs stay
    until every peer has closed its mapping of them (graphar.allreduce.kernels.AllReduce.release_graph)."""
    # torch captures into a CUDAGraph again only after reset() dropped its earlier graph: that graph's
    # slots and inputs go now, not when the object dies.
    earlier = getattr(cuda_graph, "_graphar_release", None)
    if earlier is not None:
        earlier()
    cuda_graph._graphar_release = None
    registered: list[tuple[Any, int, list[int], tuple[Any, ...]]] = []
    # Group names are equal on every rank, so every rank registers its groups in the same order.
    allreduces = sorted(capture.calls, key=lambda c: c.group_name)
    keep = _Keep(cuda_graph) if allreduces else None
    try:
        for allreduce in allreduces:
            calls = capture.calls[allreduce]
            held, lost = keep.hold(calls)
            number = allreduce.register_graph(calls, lost)
            registered.append((allreduce, number, [c.slot for c in calls], held))
    except BaseException:  # the failed group is broken; every slot goes back
        _release_graphs(registered)
        unregistered = allreduces[len(registered) :]
        _release([(allreduce, [c.slot for c in capture.calls[allreduce]]) for allreduce in unregistered])
        raise
    if registered:  # the finalizer holds what keeps the inputs (and not the graph): as long as the graph, and then
        cuda_graph._graphar_release = weakref.finalize(cuda_graph, _release_graphs, registered)


class _Keep:
    """What keeps a graph's in-place inputs allocated for the peers that map them. An input in the
    graph's own memory pool (an activation made during the capture) needs no reference of its own:
    torch frees a pool's segments only once nothing uses the pool, so one more use of the pool keeps
    them all, and later captures into a shared pool still reuse its free blocks (a serving loop's
    graphs share one pool: holding each input instead grew it by every size's activations). An input
    from anywhere else (a static input, a weight) is held itself: its owner may free it."""

    def __init__(self, cuda_graph: torch.cuda.CUDAGraph) -> None:
        self._pool_id = cuda_graph.pool()
        self._segments = segments(self._pool_id)
        self._use: Any = None

    def hold(self, calls: Sequence[Any]) -> tuple[tuple[Any, ...], list[int]]:
        """(what to hold for `calls` from now until the peers let go, the indices of calls whose input
        is gone: freed during the capture outside the pool, so a replay would read reused memory)."""
        held: list[Any] = []
        lost: list[int] = []
        pooled = False
        for i, call in enumerate(calls):
            if call.staged:  # read locally, into the registered buffer: no peer maps it
                continue
            if any(start <= call.base < start + size for start, size in self._segments):
                pooled = True
            elif (tensor := call.tensor()) is not None:
                held.append(tensor)
            else:
                lost.append(i)
        if pooled:  # one use for the whole graph, shared by every group's registration
            if self._use is None:
                self._use = _PoolUse(self._pool_id)
            held.append(self._use)
        return tuple(held), lost


class _PoolUse:
    """One use of a memory pool, as a graph counts one: while this object lives the caching allocator
    frees none of the pool's segments. torch has no public call for it; these are the ones its own
    graph captures make (begin counts a use and routes this thread's allocations to the pool until
    end, between which nothing allocates), on torch 2.11 and 2.13 alike."""

    def __init__(self, pool_id: tuple[int, int]) -> None:
        device = torch.cuda.current_device()
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool_id)
        torch._C._cuda_endAllocateToPool(device, pool_id)
        weakref.finalize(self, torch._C._cuda_releasePool, device, pool_id).atexit = False


def _slots(capture: Capture) -> list[tuple[Any, list[int]]]:
    return [(allreduce, [call.slot for call in calls]) for allreduce, calls in capture.calls.items()]


def _release(slots: list[tuple[Any, list[int]]]) -> None:
    for allreduce, numbers in slots:
        allreduce.release_slots(numbers)


def _release_graphs(registered: list[tuple[Any, int, list[int], tuple[torch.Tensor, ...]]]) -> None:
    for allreduce, number, slots, inputs in registered:
        allreduce.release_graph(number, slots, inputs)


class BatchGraphs:
    """One callable captured for several batch sizes in one memory pool, replayed by batch size.

    `fn(*make_inputs(b))` is warmed up and captured under `graph(...)` for each b, largest first.
    A call pads dim 0 of its inputs to the next captured size (zero rows), copies them into the
    static inputs, replays, and returns the first b rows of the static output: a view that the
    next call overwrites.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        make_inputs: Callable[[int], tuple[torch.Tensor, ...]],
        batch_sizes: Sequence[int],
        *,
        warmup: int = 2,
        pool: Any = None,
    ) -> None:
        sizes = sorted({int(b) for b in batch_sizes}, reverse=True)
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._entries: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        stream = _side_stream()
        for b in sizes:
            inputs = tuple(make_inputs(b))
            if not inputs or any(x.shape[:1] != (b,) for x in inputs):
                raise ValueError(f"make_inputs({b}) must return tensors whose dim 0 is {b}")
            _warm_up(fn, inputs, warmup, stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with graph(cuda_graph, pool=self._pool, stream=stream):
                out = fn(*inputs)
            if not isinstance(out, torch.Tensor) or out.shape[:1] != (b,):
                raise ValueError(f"fn must return one tensor whose dim 0 is the batch size {b}")
            self._entries[b] = (cuda_graph, inputs, out)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._entries))

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        b = inputs[0].shape[0] if inputs else 0
        size = next((s for s in self.batch_sizes if s >= b), None)
        if size is None or b < 1:
            raise ValueError(f"batch size {b} is outside the captured sizes {self.batch_sizes}")
        cuda_graph, static, out = self._entries[size]
        if len(inputs) != len(static):
            raise ValueError(f"expected {len(static)} inputs, got {len(inputs)}")
        for dst, src in zip(static, inputs):
            if src.shape[0] != b or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
                raise ValueError(
                    f"input {tuple(src.shape)} {src.dtype} does not match the captured "
                    f"{(b, *dst.shape[1:])} {dst.dtype}"
                )
            dst[:b].copy_(src)
            if b < size:
                dst[b:].zero_()
        cuda_graph.replay()
        return out[:b]


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """The current device's one stream for every BatchGraphs warm-up and capture. cuBLAS keeps a
    workspace for each stream it has run on, for the life of the process: a fresh stream per size
    (torch's pool hands out up to 32) would leave up to 32 of them behind a serving loop's sizes."""
    device = torch.cuda.current_device()
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _warm_up(
    fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], iterations: int, side: torch.cuda.Stream
) -> None:
    """Run fn eagerly on the stream its capture will use, as capture needs (lazy init, cuBLAS
    workspaces, autotuning)."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
