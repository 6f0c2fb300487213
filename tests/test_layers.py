"""Imports go one way (docs/design.md, "Rooms"): every module of graphar/ and passes/ sits in a layer,
imports only from its own layer or below, and no chain of imports comes back to where it started.

Every import statement counts, read from the source with `ast`: module level, inside functions (lazy),
and under `if TYPE_CHECKING:` (a type that names a module above is a dependency on it all the same).
A package's `__init__` that Python runs before any of its modules is not counted: an edge is what the
code names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import from its own layer and every layer below it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # What everything reads: the settings (GRAPHAR_* and the pass's options) and the errors.
    ("settings and errors", ("graphar.settings", "graphar.errors", "graphar.config")),
    # The CUDA library, the C ABI's constants, what the Triton kernels share.
    ("library bindings", ("graphar._cuda", "graphar.abi", "graphar.triton_common")),
    # The all-reduce: the group's communicator, its set-up and kernel table, its kernels' calls,
    # graphar.graph, the fused norm, the op's C++ kernels.
    ("all-reduce", ("graphar.allreduce",)),
    # The Ulysses exchange, on the all-reduce's communicator (one way: the all-reduce knows nothing of it).
    ("ulysses", ("graphar.ulysses",)),
    # The public face of the runtime: the custom ops the passes put into graphs.
    ("ops", ("graphar.ops",)),
    ("passes", ("passes",)),
    # The package's own API: `import graphar` installs the backend and the pass.
    ("api", ("graphar", "graphar.backend")),
    # Above everything: the command line, the demo, the doctor, the process launcher.
    ("tools", ("graphar.__main__", "graphar.demo", "graphar.doctor", "graphar.doctor_probe", "graphar.processes")),
)  # fmt: skip  # a table: one layer a row

# Edges allowed against the rules above, each with its reason. Each must still exist (else remove it).
EXCEPTIONS: dict[tuple[str, str], str] = {
    # Reads graphar.__version__ for the compiled graph's cache key (lazily, at compile time, when the
    # package is long imported). passes/manager.py's cache-key hashing is another change's, in
    # progress (issue 32 item 5).
    ("passes.manager", "graphar"): "the version in the cache key",
}


def _modules() -> dict[str, Path]:
    """Module name -> file, for graphar/ and passes/ (passes/ as `passes`, its name inside the repo)."""
    modules = {}
    for top in ("graphar", "passes"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _normal(name: str) -> str:
    """graphar.passes (how the installed package names it) is passes/."""
    return "passes" + name[len("graphar.passes") :] if name.split(".")[:2] == ["graphar", "passes"] else name


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of graphar/ and passes/ that one import statement names."""
    if isinstance(node, ast.Import):
        names = [_normal(alias.name) for alias in node.names]
        return [n for n in names if n in MODULES]
    base = node.module or ""
    if node.level:  # relative: from the module's package (a package's __init__ is its own package)
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    base = _normal(base)
    found = []
    for alias in node.names:
        child = f"{base}.{alias.name}"
        found.append(child if child in MODULES else base)
    return [n for n in found if n in MODULES]


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[module] = {t for n in nodes for t in _targets(module, n) if t != module}
    return graph


GRAPH = _graph()


def _layer(module: str) -> int:
    """The index in LAYERS of the most specific prefix that names `module`."""
    best, level = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    assert level is not None, f"{module} is in no layer: place it in LAYERS (and in docs/design.md)"
    return level


def test_the_graph_reads_lazy_and_type_only_imports() -> None:
    """The reader sees what the rules are about: an import inside a function and one under TYPE_CHECKING."""
    assert "graphar.ops" in GRAPH["passes.norm"]
    assert "graphar.ulysses.shapes" in GRAPH["passes.attention"]  # inside a function
    assert "passes.manager" in GRAPH["graphar"]  # graphar.passes.manager, as the package names it


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_imports_go_down_the_layers() -> None:
    upward = [
        f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
        for a, targets in sorted(GRAPH.items())
        for b in sorted(targets)
        if _layer(b) > _layer(a) and (a, b) not in EXCEPTIONS
    ]
    assert upward == [], "\n".join(upward)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for b in graph[todo.pop()] - seen:
            seen.add(b)
            todo.append(b)
    return seen


def test_no_import_loop() -> None:
    graph = {a: {b for b in targets if (a, b) not in EXCEPTIONS} for a, targets in GRAPH.items()}
    reach = {a: _reach(graph, a) for a in graph}
    loops = {tuple(sorted(b for b in reach[a] if a in reach[b])) for a in graph if a in reach[a]}
    assert not loops, "modules that import each other (through the others listed with them):\n" + "\n".join(
        map(str, sorted(loops))
    )


@pytest.mark.parametrize("edge", sorted(EXCEPTIONS))
def test_each_exception_is_still_needed(edge: tuple[str, str]) -> None:
    a, b = edge
    assert b in GRAPH[a], f"{a} no longer imports {b}: remove the exception"


def test_setup_can_load_the_bottom_by_path() -> None:
    """setup.py loads graphar._cuda by path before the package can be imported (torch may not be there
    yet): it and what it loads import nothing of graphar but each other."""
    alone = {"graphar._cuda", "graphar.settings", "graphar.errors"}
    assert {m: GRAPH[m] - alone for m in alone} == {m: set() for m in alone}
