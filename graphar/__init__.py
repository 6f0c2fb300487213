"""graphar: fast collectives for tensor- and sequence-parallel models under torch.compile and CUDA graphs.

    model = torch.compile(model, backend="graphar")       # all-reduces and Q/K/V all-to-alls rewritten

A group's IPC communicator is set up at its first eager collective (GRAPHAR_AUTO_INIT), or by
`graphar.init(group)` on every rank of it, to choose the moment or the buffers' size.

Public API:
    init(group=None, ...)  set up graphar's custom all-reduce for a process group now (collective)
    shutdown()             release every communicator
    graph(cuda_graph, ...) torch.cuda.graph with zero-copy all-reduces (pointers filled after capture)
    BatchGraphs            capture a decode step for several batch sizes, replay by batch size
    install(...)           add graphar's pass to backend="inductor" until uninstall()
    uninstall()            remove it
    Config                 what the pass rewrites, and its limits
    GrapharError           the base of every error graphar raises of its own (graphar.errors)
    GrapharCommError       a communicator cannot serve the call (closed, broken, misuse, timed out)
    GrapharTimeoutError    a GrapharCommError: a peer never arrived within GRAPHAR_TIMEOUT_S
    GrapharCudaError       a GrapharCommError: a call into the CUDA library failed
    SettingError           a bad option, argument or GRAPHAR_* variable (a ValueError)

Beside it, the module `graphar.ulysses` (imported on its own): seq_to_heads, heads_to_seq,
split_heads and reserve, for code that calls the Ulysses exchanges by hand.

`import graphar` validates every GRAPHAR_* variable that is set (graphar.settings).
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib.util
import sys
from pathlib import Path

import torch._logging


def _import_passes_from_checkout() -> None:
    """Make `graphar.passes` importable from a source checkout.

    passes/ is a top-level folder that setup.py installs as the subpackage graphar.passes: wheels and
    editable installs whose finder maps it (setuptools >= 64) find it by the normal import. Two ways
    of running graphar do not: a checkout on PYTHONPATH with no install (how the GPU machines run the
    tests), and editable installs in setuptools' "compat" mode, which only add the checkout to
    sys.path. There passes/ sits beside graphar/, so load it from there under its installed name.
    """
    if importlib.util.find_spec("graphar.passes") is not None:
        return
    init = Path(__file__).resolve().parent.parent / "passes" / "__init__.py"
    spec = importlib.util.spec_from_file_location("graphar.passes", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["graphar.passes"] = module
    spec.loader.exec_module(module)
    sys.modules[__name__].passes = module


_import_passes_from_checkout()

from graphar import ops as _ops  # noqa: F401  (registers graphar's custom ops)
from graphar import settings
from graphar.allreduce.graphs import BatchGraphs, graph
from graphar.allreduce.registry import shutdown
from graphar.allreduce.set_up import init
from graphar.backend import graphar_backend, install, uninstall
from graphar.backend import register as _register_backend
from graphar.config import Config
from graphar.errors import GrapharCommError, GrapharCudaError, GrapharError, GrapharTimeoutError, SettingError
from graphar.passes.manager import watch_compiles as _watch_compiles

settings.check_all()
torch._logging._internal.register_log("graphar", "graphar")
_register_backend()
_watch_compiles()

__all__ = [
    "BatchGraphs",
    "Config",
    "GrapharCommError",
    "GrapharCudaError",
    "GrapharError",
    "GrapharTimeoutError",
    "SettingError",
    "graph",
    "graphar_backend",
    "init",
    "install",
    "shutdown",
    "uninstall",
]
