"""The staging pool's rules, on CPU with a fake CUDA runtime that can pretend to capture.

The hazards the Ulysses seed names, and the ones its bypass leaves open, each have a test: a first
allocation during a capture; eager reuse of a buffer a captured graph uses, from the same or another
stream; memory that lands outside graphar's pool; growth while a graph holds the old buffer; memory
that grows with every new shape. tests/gpu/test_ulysses.py repeats the capture cases on CUDA.
"""

from __future__ import annotations

import gc
import unittest

import torch

from graphar.ulysses.pool import StagingPool

CUDA0 = torch.device("cuda", 0)  # only a key here: the fake runtime allocates on the CPU
MB = 1 << 20


class FakeGraph:
    """Stands for a torch.cuda.CUDAGraph being captured."""


class FakeRuntime:
    def __init__(self) -> None:
        self.graph: FakeGraph | None = None
        self.stream_id = 7
        self.lands_in_pool = True
        self.allocations: list[tuple[int, bool]] = []  # (bytes, during a capture)

    def capturing(self, device: torch.device) -> bool:
        return self.graph is not None

    def capturing_graph(self, device: torch.device) -> FakeGraph | None:
        return self.graph

    def stream(self, device: torch.device) -> int:
        return self.stream_id

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        self.allocations.append((nbytes, self.graph is not None))
        return torch.empty(nbytes, dtype=torch.uint8) if self.lands_in_pool else None

    def transient(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def _base(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class StagingPoolTest(unittest.TestCase):
    def setUp(self) -> None:
        self.runtime = FakeRuntime()
        self.pool = StagingPool(self.runtime)

    def test_eager_reuse_is_grow_only_not_per_shape(self) -> None:
        first = self.pool.get("send", 3 * MB, CUDA0)
        self.assertEqual(first.numel(), 3 * MB)
        for nbytes in (1 * MB, 2 * MB + 5, 3 * MB):
            self.assertEqual(_base(self.pool.get("send", nbytes, CUDA0)), _base(first))
        self.assertEqual(len(self.runtime.allocations), 1)
        # Growth over many sizes: a handful of allocations (x1.25 steps), never one per shape.
        for nbytes in range(4 * MB, 40 * MB, MB // 2):
            self.pool.get("send", nbytes, CUDA0)
        self.assertLess(len(self.runtime.allocations), 12)
        self.assertEqual(self.pool.stats()["eager"], 1)

    def test_roles_and_streams_never_share(self) -> None:
        send = self.pool.get("send", MB, CUDA0)
        recv = self.pool.get("recv", MB, CUDA0)
        self.runtime.stream_id = 8
        other_stream = self.pool.get("send", MB, CUDA0)
        self.assertEqual(len({_base(send), _base(recv), _base(other_stream)}), 3)

    def test_first_allocation_during_capture_belongs_to_the_graph(self) -> None:
        graph = FakeGraph()
        self.runtime.graph = graph
        captured = self.pool.get("send", MB, CUDA0)
        self.assertEqual(self.runtime.allocations, [(2 * MB, True)])  # in graphar's pool, kept
        self.assertEqual(_base(self.pool.get("send", MB // 2, CUDA0)), _base(captured))  # a hit in the capture
        self.runtime.graph = None
        eager = self.pool.get("send", MB, CUDA0)
        self.runtime.stream_id = 8
        other_stream = self.pool.get("send", MB, CUDA0)
        # Eager code, on any stream, never writes what the captured graph reads at replay.
        self.assertNotIn(_base(captured), {_base(eager), _base(other_stream)})
        self.assertEqual(self.pool.stats()["graph_buffers"], 1)

    def test_buffer_used_eagerly_then_captured_is_not_shared(self) -> None:
        eager = self.pool.get("send", MB, CUDA0)
        self.runtime.graph = FakeGraph()
        captured = self.pool.get("send", MB, CUDA0)
        self.runtime.graph = None
        self.assertNotEqual(_base(eager), _base(captured))
        self.assertEqual(_base(self.pool.get("send", MB, CUDA0)), _base(eager))

    def test_two_graphs_have_their_own_buffers(self) -> None:
        self.runtime.graph = FakeGraph()
        first = self.pool.get("send", MB, CUDA0)
        self.runtime.graph = FakeGraph()
        second = self.pool.get("send", MB, CUDA0)
        self.assertNotEqual(_base(first), _base(second))

    def test_growth_during_capture_retires_the_old_buffer(self) -> None:
        self.runtime.graph = FakeGraph()
        small = self.pool.get("send", MB, CUDA0)
        large = self.pool.get("send", 8 * MB, CUDA0)
        self.assertNotEqual(_base(small), _base(large))
        self.assertEqual(self.pool.stats()["retired"], 1)
        retired = self.pool._owned[id(self.runtime.graph)].retired[0]
        self.assertEqual(_base(retired), _base(small))  # alive: kernels captured earlier read it

    def test_graph_buffers_are_released_with_the_graph(self) -> None:
        self.runtime.graph = FakeGraph()
        self.pool.get("send", MB, CUDA0)
        self.pool.get("send", 8 * MB, CUDA0)
        self.runtime.graph = None
        gc.collect()
        self.assertEqual(self.pool.stats()["graphs"], 0)

    def test_memory_outside_graphars_pool_is_used_once_not_kept(self) -> None:
        # What happens on a torch that ignores use_mem_pool inside a capture or a cudagraph-tree warm-up.
        self.runtime.lands_in_pool = False
        for graph in (None, FakeGraph()):
            self.runtime.graph = graph
            a = self.pool.get("send", MB, CUDA0)
            b = self.pool.get("send", MB, CUDA0)
            self.assertNotEqual(_base(a), _base(b))
        self.assertEqual(self.pool.stats()["transient"], 4)
        self.assertEqual(self.pool.stats()["eager"] + self.pool.stats()["graph_buffers"], 0)

    def test_capture_torch_does_not_track_gets_transient_memory(self) -> None:
        self.runtime.capturing_graph = lambda device: None
        self.runtime.graph = FakeGraph()
        self.pool.get("send", MB, CUDA0)
        self.assertEqual(self.pool.stats()["transient"], 1)
        self.assertEqual(self.runtime.allocations, [])

    def test_reserve_lets_a_capture_hit_without_allocating(self) -> None:
        self.pool.reserve("send", 4 * MB, CUDA0, count=2)
        self.pool.reserve("send", 4 * MB, CUDA0, count=2)  # idempotent
        self.assertEqual(len(self.runtime.allocations), 2)
        bases = set()
        for _ in range(2):
            self.runtime.graph = FakeGraph()
            bases.add(_base(self.pool.get("send", 3 * MB, CUDA0)))
        self.assertEqual(len(bases), 2)
        self.assertFalse(any(during for _, during in self.runtime.allocations))
        self.assertEqual(self.pool.stats()["spares"], 0)

    def test_reserve_during_capture_is_an_error(self) -> None:
        self.runtime.graph = FakeGraph()
        with self.assertRaisesRegex(RuntimeError, "during a CUDA-graph capture"):
            self.pool.reserve("send", MB, CUDA0)

    def test_cpu_tensors_are_plain(self) -> None:
        t = self.pool.get("send", 100, torch.device("cpu"))
        self.assertEqual((t.numel(), t.dtype), (100, torch.uint8))
        self.assertEqual(self.runtime.allocations, [])


if __name__ == "__main__":
    unittest.main()
