"""graphar.graph's end of capture, with a fake communicator (no GPU): registration order, and the
tensors read in place at every replay kept alive as long as the graph."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from graphar import GrapharCommError, GrapharTimeoutError, graphs


class _FakeComm:
    def __init__(self, name: str, registered: list) -> None:
        self.group_name = name
        self.registered = registered
        self.released: list[int] = []
        self.held: list[tuple] = []

    def register_graph(self, calls: list) -> int:
        self.registered.append((self.group_name, len(calls)))  # no tensor: the test watches their lifetime
        return len(self.registered) - 1

    def release_slots(self, slots: list[int]) -> None:
        self.released += slots

    def release_graph(self, registration: int, slots: list[int], inputs: tuple) -> None:
        self.released += slots
        self.held.append(inputs)  # what AllReduce keeps until every peer closed its mappings


class _Call:
    def __init__(self, tensor: torch.Tensor, slot: int = 1) -> None:
        self.tensor = tensor
        self.slot = slot


class _Graph:  # stands in for torch.cuda.CUDAGraph, which takes attributes the same way
    pass


def test_finish_registers_by_group_name_and_keeps_inputs_alive() -> None:
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


def test_a_graph_captured_again_hands_back_its_earlier_slots_and_inputs() -> None:
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


def test_a_failed_registration_hands_back_every_slot() -> None:
    class _Refusing(_FakeComm):
        def register_graph(self, calls: list) -> int:
            raise RuntimeError("ranks disagree")

    capture, registered = graphs.Capture(), []
    a, b, c = _FakeComm("a", registered), _Refusing("b", registered), _FakeComm("c", registered)
    for slot, comm in enumerate((a, b, c), start=1):
        capture.record(comm, _Call(torch.randn(4), slot=slot))
    cuda_graph = _Graph()
    with pytest.raises(RuntimeError, match="disagree"):
        graphs.finish(cuda_graph, capture)
    assert (a.released, b.released, c.released) == ([1], [2], [3]) and cuda_graph._graphar_release is None


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
