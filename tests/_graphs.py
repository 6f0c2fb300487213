"""Helpers for snapshot tests of graphar's pass on the post-grad graph, with no GPU and no codegen.

`post_grad_graphs(fn, *args)` compiles `fn` with Dynamo and AOT autograd as Inductor does (its
decompositions, input mutations kept in the graph), runs Inductor's post-grad passes with
graphar's pass installed, and returns the graph just before and just after graphar's pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import normalize_gm
from torch._guards import detect_fake_mode
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import post_grad_passes
from torch._inductor.virtualized import V
from torch.testing._internal.distributed.fake_pg import FakeStore

from graphar.config import Config
from graphar.passes import GrapharPass


def readable(graph: torch.fx.Graph) -> str:
    """A graph's code without comments, blank lines or stride annotations."""
    text = normalize_gm(graph.owning_module.print_readable(print_output=False))
    text = re.sub(r"\[\d+(, \d+)*\]cpu", "", text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def _shape_facts(shape_env: Any) -> list[str]:
    """The guards and deferred runtime asserts of a shape environment, as text."""
    if shape_env is None:
        return []
    asserts = [ra.expr for ras in shape_env.deferred_runtime_asserts.values() for ra in ras]
    return [str(g.expr) for g in shape_env.guards] + [str(e) for e in asserts]


class _RecordingPass(GrapharPass):
    """Records the graph before and after graphar's pass, and `new_facts`: the guards and runtime
    asserts the pass added to the shape environment (dynamic shapes)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before = readable(graph)
        shape_env = getattr(V.fake_mode, "shape_env", None)
        facts = _shape_facts(shape_env)
        super().__call__(graph)
        self.after = readable(graph)
        self.new_facts = _shape_facts(shape_env)[len(facts) :]


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """(Re)start the fake process group, whose collectives move no data: for graph structure only."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def all_post_grad_graphs(
    fn: Callable[..., Any],
    *args: Any,
    config: Config | None = None,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    recorders: list[Any] | None = None,
) -> list[tuple[str, str, dict[str, int]]]:
    """(before, after, counts) for every graph `fn` compiles to, in order (graph breaks allowed
    with fullgraph=False); counts: the graphar ops the pass left in the graph, by name. `dynamic`
    is torch.compile's; `torch._dynamo.mark_dynamic` on the arguments works too. `recorders`, when
    given, receives each graph's recording pass."""
    results = []

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        recorder = _RecordingPass(config or Config())
        with (
            inductor_config.patch(post_grad_custom_post_pass=recorder),
            V.set_fake_mode(detect_fake_mode(example_inputs)),
        ):
            post_grad_passes(gm, is_inference=True)
        results.append((recorder.before, recorder.after, recorder.counts))
        if recorders is not None:
            recorders.append(recorder)
        return gm

    backend = aot_autograd(
        fw_compiler=forward_compiler, decompositions=select_decomp_table(), keep_inference_input_mutations=True
    )
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=dynamic)(*args)
    return results


def post_grad_graphs(fn: Callable[..., Any], *args: Any, config: Config | None = None, dynamic: bool | None = None):
    """(before, after, counts) of the one graph `fn` compiles to."""
    (result,) = all_post_grad_graphs(fn, *args, config=config, dynamic=dynamic)
    return result
