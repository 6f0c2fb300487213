"""The pass manager: one object owns the pass list, its config and its cache key."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from graphar.config import Config

from .all_reduce import rewrite_all_reduces
from .qkv import rewrite_qkv_triplets

log = logging.getLogger("graphar")
# Before/after graphs, compact, at DEBUG (the demo shows them; TORCH_LOGS="+graphar" prints them).
graph_log = logging.getLogger("graphar.graphs")

_PASS_FILES = tuple(sorted(str(p) for p in Path(__file__).parent.glob("*.py")))


def compact(graph: torch.fx.Graph) -> str:
    """One line per op: `name = op(args)`."""
    return "\n".join(
        f"{node.name} = {node.target}({', '.join(map(str, node.args))})"
        for node in graph.nodes
        if node.op == "call_function"
    )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class GrapharPass(CustomGraphPass):
    """Rewrites collectives into graphar's ops, after any pass that was already installed.

    `counts` holds the number of rewrites of the last call, by rewrite name; the totals add up in
    `torch._dynamo.utils.counters["graphar"]`.
    """

    def __init__(self, config: Config | None = None, previous: Callable[[torch.fx.Graph], Any] | None = None):
        self.config = config or Config()
        self.previous = previous
        self.passes: list[tuple[str, Callable[[torch.fx.Graph, Config], int]]] = []
        if self.config.all_reduce:
            self.passes.append(("all_reduce", rewrite_all_reduces))
        if self.config.qkv_all_to_all:
            self.passes.append(("qkv_all_to_all", rewrite_qkv_triplets))
        self.counts: dict[str, int] = {}

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        show = graph_log.isEnabledFor(logging.DEBUG)
        before = compact(graph) if show else ""
        self.counts = {name: rewrite(graph, self.config) for name, rewrite in self.passes}
        if any(self.counts.values()):
            graph.eliminate_dead_code()
            graph.lint()
        for name, count in self.counts.items():
            counters["graphar"][name] += count
        log.info("graphar rewrites: %s", self.counts)
        if show:
            graph_log.debug("graph before graphar:\n%s\ngraph after graphar:\n%s", before, compact(graph))

    def uuid(self) -> bytes | None:
        previous = self.previous
        previous_key: Any = ""
        if previous is not None:
            previous_key = previous.uuid() if isinstance(previous, CustomGraphPass) else None
            if previous_key is None:
                return None  # an uncacheable pass before us makes the whole graph uncacheable
        import graphar
        import graphar.ops

        extra = "|".join(
            [graphar.__version__, torch.__version__, self.config.cache_key(), str(_world_size()), repr(previous_key)]
        )
        # graphar's ops file holds the fake implementations, which shape the compiled graph too.
        return get_hash_for_files(_PASS_FILES + (graphar.ops.__file__,), extra=extra)
