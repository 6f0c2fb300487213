"""Helpers for snapshot tests of graphar's pass on the post-grad graph, with no GPU and no codegen.

`post_grad_graphs(fn, *args)` compiles `fn` with Dynamo and AOT autograd as Inductor does (its
decompositions, input mutations kept in the graph), runs Inductor's post-grad passes with
graphar's pass installed, and returns the graph just before and just after graphar's pass.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import normalize_gm
from torch._guards import detect_fake_mode
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import post_grad_passes
from torch._inductor.virtualized import V

from graphar.config import Config
from graphar.passes import GrapharPass


def readable(graph: torch.fx.Graph) -> str:
    """A graph's code without comments, blank lines or stride annotations."""
    text = normalize_gm(graph.owning_module.print_readable(print_output=False))
    text = re.sub(r"\[\d+(, \d+)*\]cpu", "", text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


class _RecordingPass(GrapharPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before = readable(graph)
        super().__call__(graph)
        self.after = readable(graph)


def post_grad_graphs(fn: Callable[..., Any], *args: Any, config: Config | None = None, **compile_kwargs: Any):
    """Returns (before, after, counts) for the first graph `fn` compiles to."""
    recorder = _RecordingPass(config or Config())

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        if not hasattr(recorder, "after"):
            with inductor_config.patch(post_grad_custom_post_pass=recorder), V.set_fake_mode(
                detect_fake_mode(example_inputs)
            ):
                post_grad_passes(gm, is_inference=True)
        return gm

    backend = aot_autograd(
        fw_compiler=forward_compiler, decompositions=select_decomp_table(), keep_inference_input_mutations=True
    )
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, **compile_kwargs)(*args)
    return recorder.before, recorder.after, recorder.counts
