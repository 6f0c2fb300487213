"""graphar.graph's end of capture, with a fake communicator and a fake memory pool (no GPU):
registration order, and what keeps the tensors read in place at every replay allocated: the graph's
pool for its own activations, the tensor itself for any other input, as long as the graph and then
until the peers let go."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from graphar import GrapharCommError, GrapharTimeoutError
from graphar.allreduce import graphs


class _FakeComm:
    def __init__(self, name: str, registered: list) -> None:
        self.group_name = name
        self.registered = registered
        self.released: list[int] = []
        self.held: list[tuple] = []
        self.lost: list[list[int]] = []

    def register_graph(self, calls: list, lost: list[int]) -> int:
        self.registered.append((self.group_name, len(calls)))  # no tensor: the test watches their lifetime
        self.lost.append(list(lost))
        return len(self.registered) - 1

    def release_slots(self, slots: list[int]) -> None:
        self.released += slots

    def release_graph(self, registration: int, slots: list[int], held: tuple) -> None:
        self.released += slots
        self.held.append(held)  # what AllReduce keeps until every peer closed its mappings


class _Call:  # a graphar.allreduce.kernels.GraphCall's fields that graphs reads
    def __init__(self, tensor: torch.Tensor, slot: int = 1, staged: bool = False) -> None:
        self.tensor = weakref.ref(tensor)
        self.base = tensor.data_ptr()
        self.slot = slot
        self.staged = staged


class _Graph:  # stands in for torch.cuda.CUDAGraph, which takes attributes the same way
    def pool(self) -> tuple[int, int]:
        return (0, 7)


class _Pool:
    """The graph's memory pool: its segments, and the uses graphar takes of it (made, released)."""

    def __init__(self, monkeypatch) -> None:
        self.segments: list[tuple[int, int]] = []
        self.uses: list[str] = []
        monkeypatch.setattr(graphs, "segments", lambda pool_id: self.segments if pool_id == (0, 7) else [])
        pool = self

        class _Use:
            def __init__(self, pool_id: tuple[int, int]) -> None:
                pool.uses.append("made")
                weakref.finalize(self, pool.uses.append, "released")

        monkeypatch.setattr(graphs, "_PoolUse", _Use)

    def holds(self, t: torch.Tensor) -> None:
        self.segments.append((t.data_ptr(), t.nbytes))


@pytest.fixture
def memory_pool(monkeypatch) -> _Pool:
    return _Pool(monkeypatch)


def test_finish_registers_by_group_name_and_keeps_inputs_alive(memory_pool: _Pool) -> None:
    # x and y come from outside the graph's pool (static inputs): they are held themselves.
    registered: list = []
    capture = graphs.Capture()
    x, y = torch.randn(4), torch.randn(4)
    b = _FakeComm("b", registered)
    capture.record(b, _Call(x, slot=7))
    capture.record(_FakeComm("a", registered), _Call(y))
    cuda_graph = _Graph()
    graphs.finish(cuda_graph, capture)
    assert [name for name, _ in registered] == ["a", "b"]  # every rank registers in one order

    alive = weakref.ref(x)
    del x, capture, registered
    gc.collect()
    assert alive() is not None, "a tensor the graph reads in place was freed while the graph lives"
    assert b.released == []
    del cuda_graph
    gc.collect()
    assert b.released == [7]  # the graph's slots go back when it is gone, its inputs to the communicator
    assert alive() is not None and b.held[0][0] is alive()
    b.held.clear()
    assert alive() is None


def test_a_graph_captured_again_hands_back_its_earlier_slots_and_inputs(memory_pool: _Pool) -> None:
    # torch captures into a CUDAGraph again only after reset(): the earlier capture's exec is gone.
    comm, cuda_graph, x = _FakeComm("a", []), _Graph(), torch.randn(4)
    first = graphs.Capture()
    first.record(comm, _Call(x, slot=3))
    graphs.finish(cuda_graph, first)
    alive = weakref.ref(x)
    del x, first
    second = graphs.Capture()
    second.record(comm, _Call(torch.randn(4), slot=5))
    graphs.finish(cuda_graph, second)
    comm.held.clear()
    gc.collect()
    assert comm.released == [3] and alive() is None
    del cuda_graph
    gc.collect()
    assert comm.released == [3, 5]


def test_a_failed_registration_hands_back_every_slot(memory_pool: _Pool) -> None:
    class _Refusing(_FakeComm):
        def register_graph(self, calls: list, lost: list[int]) -> int:
            raise RuntimeError("ranks disagree")

    capture, registered = graphs.Capture(), []
    a, b, c = _FakeComm("a", registered), _Refusing("b", registered), _FakeComm("c", registered)
    for slot, comm in enumerate((a, b, c), start=1):
        capture.record(comm, _Call(torch.randn(4), slot=slot))
    cuda_graph = _Graph()
    with pytest.raises(RuntimeError, match="disagree"):
        graphs.finish(cuda_graph, capture)
    assert (a.released, b.released, c.released) == ([1], [2], [3]) and cuda_graph._graphar_release is None


def test_activations_in_the_graphs_pool_are_kept_by_one_use_of_the_pool(memory_pool: _Pool) -> None:
    """An all-reduce input made during the capture lives in the graph's pool: it is not held (its block
    is the pool's to reuse, in this capture or a later one sharing the pool), one use of the pool keeps
    its segment allocated, and that use goes only when the communicator lets the dead graph go."""
    comm, cuda_graph = _FakeComm("a", []), _Graph()
    x, y = torch.randn(4), torch.randn(4)
    memory_pool.holds(x)
    memory_pool.holds(y)
    capture = graphs.Capture()
    capture.record(comm, _Call(x, slot=1))
    capture.record(comm, _Call(y, slot=2))
    graphs.finish(cuda_graph, capture)
    alive = weakref.ref(x)
    del x, y, capture
    gc.collect()
    assert alive() is None, "an activation in the graph's pool was held"
    assert memory_pool.uses == ["made"] and comm.lost == [[]]
    del cuda_graph
    gc.collect()
    assert comm.released == [1, 2] and memory_pool.uses == ["made"]  # the peers may still map it
    comm.held.clear()
    gc.collect()
    assert memory_pool.uses == ["made", "released"]


def test_an_input_freed_outside_the_pool_is_reported_and_staged_inputs_are_not_held(memory_pool: _Pool) -> None:
    comm, cuda_graph = _FakeComm("a", []), _Graph()
    gone, staged = torch.randn(4), torch.randn(4)
    capture = graphs.Capture()
    capture.record(comm, _Call(staged, slot=1, staged=True))  # copied locally at every replay: no peer maps it
    capture.record(comm, _Call(gone, slot=2))
    alive = weakref.ref(staged)
    del gone, staged
    gc.collect()
    graphs.finish(cuda_graph, capture)
    assert comm.lost == [[1]] and alive() is None and memory_pool.uses == []


def test_batch_graphs_warm_up_and_capture_every_size_on_one_stream(monkeypatch) -> None:
    """cuBLAS keeps a workspace for every stream it ran on: a stream per size would leave one per size."""
    made, used = [], []

    class _Stream:
        def __init__(self, device: int | None = None) -> None:
            made.append(self)

        def wait_stream(self, other: object) -> None:
            pass

    @contextlib.contextmanager
    def capture(cuda_graph: object, pool: object = None, stream: object = None):
        used.append(stream)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: object.__new__(_Stream))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: used.append(stream) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(graphs, "graph", capture)
    monkeypatch.setattr(graphs, "_side_streams", {})
    graphs.BatchGraphs(lambda x: x * 2, lambda b: (torch.ones(b, 4),), [1, 2, 4, 8])
    assert len(made) == 1 and len(used) == 8 and all(s is made[0] for s in used)


def test_a_stream_outside_the_capture_is_not_part_of_it(monkeypatch) -> None:
    monkeypatch.setattr(graphs._state, "capture", graphs.Capture())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graphs.current_capture() is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert graphs.current_capture() is graphs._state.capture


def test_cuda_graph_objects_take_the_reference() -> None:
    # torch.cuda.CUDAGraph is a Python subclass of the C++ graph: its instances have a __dict__.
    assert torch.cuda.CUDAGraph.__dictoffset__ != 0


def test_timeout_is_a_comm_error() -> None:
    # The README promises GrapharCommError from a communicator that cannot go on; a timed-out one
    # raises GrapharTimeoutError on every later call, which is one.
    assert issubclass(GrapharTimeoutError, GrapharCommError)
