"""The pass manager: one object owns the pass list, its config and its cache key; and the report of
what it rewrote, which holds also when Inductor serves a compiled graph from its cache.

The report counts the graphar ops the pass leaves in the graph, by op name, once all its rewrites
ran: a rewrite that absorbs another's ops (the attention pipeline absorbs the exchanges) lowers their
count. The pass adds them to `counters["inductor"]` under `graphar_<op>`: Inductor stores those
deltas with each compiled graph and adds them again when its FX-graph or AOTAutograd cache serves
it, though our pass does not run then. At the end of every Dynamo compile, `report()` moves what
arrived there into `counters["graphar"]` and logs it, so a rank that hit the cache reports what a
rank that compiled reports.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters, dynamo_timed
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from graphar import settings
from graphar.config import Config

from .all_reduce import rewrite_all_reduces
from .attention import rewrite_ulysses_attention
from .norm import fuse_all_reduce_norms
from .qkv import rewrite_qkv_triplets

log = logging.getLogger("graphar")
_PREFIX = "graphar_"
# The pass's own time, per call, goes to torch._dynamo.utils.compilation_time_metrics under this key
# (and into torch's compile-time reports and traces beside Inductor's phases).
TIMER = "graphar_pass"
# Before/after graphs, compact, at DEBUG (the demo shows them; TORCH_LOGS="+graphar" prints them).
graph_log = logging.getLogger("graphar.passes.graphs")

_PASS_FILES = tuple(sorted(str(p) for p in Path(__file__).parent.glob("*.py")))


def compact(graph: torch.fx.Graph) -> str:
    """One line per op: `name = op(args)`."""
    return "\n".join(
        f"{node.name} = {node.target}({', '.join(map(str, node.args))})"
        for node in graph.nodes
        if node.op == "call_function"
    )


def _graphar_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's calls of graphar's ops."""
    return [n for n in graph.nodes if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "graphar"]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class GrapharPass(CustomGraphPass):
    """Rewrites collectives into graphar's ops, after any pass that was already installed.

    `counts` holds, for the last call, the graphar ops the pass left in the graph by op name (e.g.
    `qkv_all_to_all`, `ulysses_attention`); the totals add up in `torch._dynamo.utils.counters["graphar"]`.
    """

    def __init__(self, config: Config | None = None, previous: Callable[[torch.fx.Graph], Any] | None = None):
        self.config = config or Config()
        self.previous = previous
        self.passes: list[Callable[[torch.fx.Graph, Config], int]] = []
        if self.config.all_reduce:
            self.passes.append(rewrite_all_reduces)
            if self.config.fuse_norm:  # it fuses graphar::all_reduce, which the rewrite above makes
                self.passes.append(fuse_all_reduce_norms)
        if self.config.qkv_all_to_all:
            self.passes.append(rewrite_qkv_triplets)
            if self.config.pipelines_attention:  # it pipelines the exchanges the rewrite above makes
                self.passes.append(rewrite_ulysses_attention)
        self.counts: Counter[str] = Counter()

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        with dynamo_timed(TIMER):
            self._rewrite(graph)

    def _rewrite(self, graph: torch.fx.Graph) -> None:
        show = graph_log.isEnabledFor(logging.DEBUG)
        before = compact(graph) if show else ""
        already = set(_graphar_nodes(graph))  # not the pass's: a model may call graphar's ops itself
        changed = [rewrite(graph, self.config) for rewrite in self.passes]
        if any(changed):
            graph.eliminate_dead_code()
            graph.lint()
        self.counts = Counter(n.target.overloadpacket.__name__ for n in _graphar_nodes(graph) if n not in already)
        for name, count in self.counts.items():
            counters["inductor"][_PREFIX + name] += count
        _report.passes_run += 1
        watch_compiles()
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

        keys = [
            graphar.__version__,
            torch.__version__,
            self.config.cache_key(),
            str(_world_size()),
            repr(previous_key),
            str(settings.ALLREDUCE_ALGO.get()),
        ]  # the norm fusion reads the forced kernel (passes/norm.py)
        return get_hash_for_files(hashed_files(), extra="|".join(keys))


def hashed_files() -> tuple[str, ...]:
    """The files whose contents key the compiled graph: the passes and the rules they read (the chunk
    rule, graphar.ulysses.overlap; what the fused norm kernel takes, graphar.allreduce.fused_norm, with its
    row bound in graphar._cuda and its largest message in graphar.allreduce.policy), and every file that
    decides an op's output: the ops and their fakes (graphar.ops) and the shapes the fakes give
    (graphar.ulysses.shapes). A fake's sizes and strides shape the graph Inductor compiles; the
    ops' bodies do not (tests/test_backend.py finds the files the fakes reach, and edits each)."""
    import graphar._cuda
    import graphar.allreduce.fused_norm
    import graphar.allreduce.policy
    import graphar.ops
    import graphar.ulysses.overlap
    import graphar.ulysses.shapes

    rules = (graphar.ulysses.overlap, graphar.allreduce.fused_norm, graphar._cuda, graphar.allreduce.policy)
    return _PASS_FILES + (graphar.ops.__file__, graphar.ulysses.shapes.__file__, *(m.__file__ for m in rules))


class _Report:
    """What `report()` has moved from counters["inductor"] into counters["graphar"] so far."""

    def __init__(self) -> None:
        self.source: Any = None  # the counters["inductor"] Counter the marks refer to
        self.moved: dict[str, int] = {}
        self.passes_run = 0


_report = _Report()


def report(*_: Any) -> None:
    """Move new graphar counts into counters["graphar"] and log them (a Dynamo compile-end callback)."""
    inductor = counters["inductor"]
    if inductor is not _report.source:  # counters.clear() made a new Counter: start over
        _report.source, _report.moved = inductor, {}
    new = {}
    for key, total in inductor.items():
        if key.startswith(_PREFIX) and total != _report.moved.get(key, 0):
            new[key[len(_PREFIX) :]] = total - _report.moved.get(key, 0)
            _report.moved[key] = total
    if new:
        for name, count in new.items():
            counters["graphar"][name] += count
        cached = " (compiled graph served from Inductor's cache)" if _report.passes_run == 0 else ""
        log.info("graphar rewrites: %s%s", new, cached)
    _report.passes_run = 0


def watch_compiles() -> None:
    """Run `report()` at the end of every Dynamo compile. Idempotent; called again wherever graphar
    may compile, because `torch._dynamo.reset()` drops every compile callback."""
    from torch._dynamo.callback import callback_handler

    if report not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(report)
