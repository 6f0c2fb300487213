"""Two gloo processes on the CPU: tensor-parallel code compiled with backend="graphar" as users run it.

- shape changes under default `torch.compile` (automatic dynamic), `dynamic=True` and `mark_dynamic`:
  every compiled graph keeps its all-reduces rewritten, and outputs equal eager;
- all-reduce inputs that are not contiguous (an einsum's permuted result, a transpose);
- two ranks sharing one Inductor cache folder: the rank that hits the cache reports the rewrites the
  rank that compiled reports.

Values are small integers, so every sum is exact in any order and outputs are compared bit for bit.
"""

from __future__ import annotations

import os
import tempfile
from unittest import mock

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from graphar import processes

WORLD = 2


def _integers(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


class RowParallelMLP(torch.nn.Module):
    """Two row-parallel projections, each summed with an in-place dist.all_reduce."""

    def __init__(self, rank: int, hidden: int = 16) -> None:
        super().__init__()
        self.w1 = _integers(hidden, hidden, seed=rank)
        self.w2 = _integers(hidden, hidden, seed=rank + 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in (self.w1, self.w2):
            y = x @ w
            dist.all_reduce(y)
            x = torch.relu(y) - x
        return x


def _einsum_layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.einsum("bsh,hd->bds", x, w)  # a permuted, non-contiguous result
    dist.all_reduce(y)
    return y


def _transposed_layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return dist._functional_collectives.all_reduce((x[0] @ w).t(), "sum", dist.group.WORLD) + 1


def _run_shapes(rank: int, name: str, batches: list[int], **compile_kwargs) -> None:
    """Call one compiled model with each batch size: every compiled graph rewrote both all-reduces."""
    model = RowParallelMLP(rank)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="graphar", **compile_kwargs)
    for i, b in enumerate(batches):
        x = _integers(b, 16, seed=100 * rank + i)
        if compile_kwargs.get("dynamic") is None and name == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        if not torch.equal(compiled(x), model(x)):
            raise AssertionError(f"rank {rank} {name}: batch {b}: compiled differs from eager")
    graphs = counters["stats"]["unique_graphs"]
    rewrites = counters["graphar"]["all_reduce"]
    if rewrites != 2 * graphs:
        raise AssertionError(f"rank {rank} {name} {batches}: {rewrites} rewrites in {graphs} graphs, expected 2 each")


def _strided_inputs(rank: int) -> None:
    x, w = _integers(2, 3, 4, seed=rank), _integers(4, 5, seed=rank + 1)
    for layer in (_einsum_layer, _transposed_layer):
        torch._dynamo.reset()
        counters.clear()
        actual = torch.compile(layer, backend="graphar", fullgraph=True)(x, w)
        expected = layer(x, w)
        if counters["graphar"]["all_reduce"] != 1 or not torch.equal(actual, expected):
            raise AssertionError(f"rank {rank} {layer.__name__}: not rewritten, or differs from eager")


def _shared_cache(rank: int, cache_dir: str) -> None:
    """Rank 0 compiles into the shared cache first, rank 1 then hits it (the other rank runs the same
    collectives eagerly meanwhile). Both report alike."""
    x = _integers(4, 16, seed=rank)
    model = RowParallelMLP(rank)
    reports = []
    for turn in range(WORLD):
        if turn != rank:
            model(x)
            continue
        torch._dynamo.reset()
        counters.clear()
        with (
            torch._inductor.config.patch(fx_graph_cache=True),
            mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache_dir}),
        ):
            torch.compile(model, backend="graphar", fullgraph=True)(x)
        reports.append(dict(counters["graphar"]))
        hits = counters["inductor"]["fxgraph_cache_hit"]
    if reports != [{"all_reduce": 2}] or hits != rank:
        raise AssertionError(f"rank {rank}: reported {reports} with {hits} cache hits")


def _worker(rank: int, world_size: int, cache_dir: str) -> None:
    import graphar  # noqa: F401  (registers the backend and the ops)

    torch._inductor.config.fx_graph_cache = False  # counting rewrites needs the pass to run
    try:
        with torch.no_grad():
            _run_shapes(rank, "automatic dynamic", [1, 2, 3, 4])
            _run_shapes(rank, "automatic dynamic", [8, 4, 2, 1])
            _run_shapes(rank, "dynamic=True", [2, 3, 5], dynamic=True)
            _run_shapes(rank, "mark_dynamic", [3, 6, 9])
        with torch.inference_mode():  # how serving loops run (vLLM's, for one)
            _run_shapes(rank, "inference_mode", [1, 2, 3])
        with torch.no_grad():
            _strided_inputs(rank)
            _shared_cache(rank, cache_dir)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_compiles_as_users_run_it() -> None:
    with tempfile.TemporaryDirectory() as cache_dir:
        processes.run(_worker, WORLD, cache_dir, collective_timeout_s=120)
