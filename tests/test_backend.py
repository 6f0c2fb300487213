"""The "graphar" backend, its cache key, `install()` and the entry point (fake process group, CPU)."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import fresh_cache
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import graphar
from graphar.backend import graphar_backend
from graphar.config import Config
from graphar.errors import SettingError
from graphar.passes import GrapharPass, manager
from graphar.ulysses import shapes


@pytest.fixture
def fake_world():
    def init(world_size: int = 2) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())

    init()
    # Counting rewrites needs the pass to run: no FX-graph cache hits from earlier runs.
    with inductor_config.patch(fx_graph_cache=False):
        yield init
    dist.destroy_process_group()


def _layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w
    dist.all_reduce(y)
    return torch.relu(y)


class _Recorder(CustomGraphPass):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1

    def uuid(self) -> str:
        return "recorder"


def test_uuid_is_stable_and_follows_config_and_world_size(fake_world) -> None:
    assert GrapharPass(Config()).uuid() == GrapharPass(Config()).uuid()
    assert GrapharPass(Config()).uuid() != GrapharPass(Config(max_all_reduce_bytes=1 << 10)).uuid()
    assert GrapharPass(Config()).uuid() != GrapharPass(Config(qkv_all_to_all=False)).uuid()
    two = GrapharPass(Config()).uuid()
    fake_world(4)
    assert GrapharPass(Config()).uuid() != two


def test_uuid_follows_the_forced_kernel(monkeypatch) -> None:
    """The norm fusion leaves a norm alone when GRAPHAR_ALLREDUCE_ALGO forces a kernel with no fused form."""
    monkeypatch.delenv("GRAPHAR_ALLREDUCE_ALGO", raising=False)
    table = GrapharPass(Config()).uuid()
    monkeypatch.setenv("GRAPHAR_ALLREDUCE_ALGO", "1stage")
    assert GrapharPass(Config()).uuid() != table


def test_uuid_covers_every_file_that_defines_an_op_or_a_fake() -> None:
    root = Path(graphar.__file__).parent
    defining = {str(p) for p in root.rglob("*.py") if re.search(r"custom_op\(|register_fake", p.read_text())}
    assert defining and defining <= set(manager.hashed_files())


def test_uuid_changes_when_a_hashed_file_changes(tmp_path, monkeypatch) -> None:
    originals = manager.hashed_files()

    def copies(edited: int | None, folder: Path) -> tuple[str, ...]:
        """The hashed files copied into `folder` (torch caches hashes by path), file `edited` changed."""
        folder.mkdir()
        for i, path in enumerate(originals):
            (folder / f"{i}.py").write_text(Path(path).read_text() + ("# edited\n" if i == edited else ""))
        return tuple(str(folder / f"{i}.py") for i in range(len(originals)))

    def uuid(files: tuple[str, ...]) -> bytes:
        monkeypatch.setattr(manager, "hashed_files", lambda: files)
        return GrapharPass(Config()).uuid()

    before = uuid(copies(None, tmp_path / "same"))
    assert uuid(copies(None, tmp_path / "same-again")) == before
    for i in range(len(originals)):
        assert uuid(copies(i, tmp_path / f"edit{i}")) != before, originals[i]


def _defined(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The imported modules of graphar that one import statement names (`from p import m`: p.m)."""
    if isinstance(node, ast.Import):
        found = {alias.name for alias in node.names}
    else:
        base = node.module or ""
        found = {f"{base}.{a.name}" if f"{base}.{a.name}" in sys.modules else base for a in node.names}
    return {name for name in found if name.split(".")[0] == "graphar" and name in sys.modules}


def _files_the_fakes_import() -> set[str]:
    """graphar/ops.py, home of the fakes, and the modules the fakes name (through the helpers they
    call in ops.py), with every graphar module those import, transitively. Read from the source, so
    a branch no test call takes counts too."""
    tree = ast.parse(Path(graphar.ops.__file__).read_text())
    helpers = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    todo: list[ast.AST] = [
        call.args[2]
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "_define"
    ]
    seen: set[str] = set()
    modules: list[str] = []
    while todo:
        for name in {n.id for n in ast.walk(todo.pop()) if isinstance(n, ast.Name)} - seen:
            seen.add(name)
            if name in helpers:
                todo.append(helpers[name])
            elif (module := inspect.getmodule(vars(graphar.ops).get(name))) and module.__name__.startswith("graphar."):
                modules.append(module.__name__)
    closure = {"graphar.ops"}
    while modules:
        name = modules.pop()
        if name not in closure:
            closure.add(name)
            tree = ast.parse(Path(sys.modules[name].__file__).read_text())
            modules += [m for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for m in _defined(n)]
    return {str(Path(sys.modules[name].__file__).resolve()) for name in closure}


def _files_the_fakes_run() -> set[str]:
    """The files of graphar and passes whose code runs while every op's fake runs (traced)."""
    group, ops = dist.group.WORLD.group_name, torch.ops.graphar
    with FakeTensorMode():
        qkv = [torch.empty(1, 4, 4, 8), torch.empty(1, 4, 2, 8), torch.empty(1, 4, 2, 8)]
        x = torch.empty(4, 8)
        calls = {
            "all_reduce": lambda: ops.all_reduce(x, group),
            "qkv_all_to_all": lambda: ops.qkv_all_to_all(*qkv, group),
            "heads_to_seq_all_to_all": lambda: ops.heads_to_seq_all_to_all(torch.empty(1, 8, 2, 8), group),
            "packed_all_to_all_single": lambda: ops.packed_all_to_all_single([x, torch.empty(2, 3)], group),
            "ulysses_attention": lambda: ops.ulysses_attention(*qkv, group, True, None, 2, None),
            "all_reduce_add_rms_norm": lambda: ops.all_reduce_add_rms_norm(x, x, torch.empty(8), 1e-6, group),
        }
        # The library's own record of the ops it defined: a new op needs a call here.
        assert {f"graphar::{name}" for name in calls} == graphar.ops._lib._op_defs, "give every op a call here"
        ran: set[str] = set()
        previous = sys.gettrace()
        sys.settrace(lambda frame, event, arg: ran.add(frame.f_code.co_filename))  # calls only: no local trace
        try:
            for call in calls.values():
                call()
        finally:
            sys.settrace(previous)
    root = Path(graphar.__file__).resolve().parent.parent
    ours = {Path(f).resolve() for f in ran if Path(f).is_file()}
    return {str(f) for f in ours if f.is_relative_to(root / "graphar") or f.is_relative_to(root / "passes")}


def test_uuid_changes_when_a_file_that_decides_an_output_shape_changes(fake_world, tmp_path, monkeypatch) -> None:
    """Every file the fakes import or run is hashed: the cache key changes when any of them is edited."""
    files = _files_the_fakes_import() | _files_the_fakes_run()
    assert {str(Path(m.__file__).resolve()) for m in (graphar.ops, shapes)} <= files  # found what it must
    hashed = manager.hashed_files
    before = GrapharPass(Config()).uuid()
    for i, path in enumerate(sorted(files)):
        edited = tmp_path / f"{i}.py"
        edited.write_text(Path(path).read_text() + "# edited\n")
        monkeypatch.setattr(
            manager,
            "hashed_files",
            lambda: tuple(str(edited) if str(Path(f).resolve()) == path else f for f in hashed()),
        )
        assert GrapharPass(Config()).uuid() != before, f"{path} decides an op's output shape and is not hashed"


def test_uuid_follows_previous_pass() -> None:
    assert GrapharPass(Config(), _Recorder()).uuid() != GrapharPass(Config()).uuid()
    # A previous pass with no cache key makes the graph uncacheable rather than wrongly cached.
    assert GrapharPass(Config(), lambda graph: None).uuid() is None


def test_backend_rewrites_and_runs_with_reduce_overhead(fake_world) -> None:
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(_layer, backend="graphar", mode="reduce-overhead", fullgraph=True)
    out = compiled(torch.randn(4, 8), torch.randn(8, 8))
    assert out.shape == (4, 8)
    assert counters["graphar"]["all_reduce"] == 1


def test_backend_options_reach_the_pass(fake_world) -> None:
    counters.clear()
    torch._dynamo.reset()
    torch.compile(_layer, backend="graphar", options={"max_all_reduce_bytes": 16})(torch.randn(4, 8), torch.randn(8, 8))
    assert counters["graphar"]["all_reduce"] == 0


def test_backend_composes_with_an_installed_pass(fake_world) -> None:
    recorder = _Recorder()
    counters.clear()
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=recorder):
        torch.compile(_layer, backend="graphar")(torch.randn(4, 8), torch.randn(8, 8))
    assert recorder.calls == 1
    assert counters["graphar"]["all_reduce"] == 1


def test_install_serves_models_compiled_before_their_first_call(fake_world) -> None:
    before = inductor_config.post_grad_custom_post_pass
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(_layer, backend="inductor")  # compiles at its first call, below
    graphar.install(max_all_reduce_bytes=1 << 20)
    try:
        compiled(torch.randn(4, 8), torch.randn(8, 8))
    finally:
        graphar.uninstall()
    assert inductor_config.post_grad_custom_post_pass is before
    assert counters["graphar"]["all_reduce"] == 1


def test_install_again_replaces_options_and_keeps_the_earlier_pass() -> None:
    recorder = _Recorder()
    with inductor_config.patch(post_grad_custom_post_pass=recorder):
        graphar.install(all_reduce=False)
        graphar.install(qkv_all_to_all=False)
        installed = inductor_config.post_grad_custom_post_pass
        assert installed.config == Config(qkv_all_to_all=False) and installed.previous is recorder
        graphar.uninstall()
        assert inductor_config.post_grad_custom_post_pass is recorder


def test_install_is_not_a_context_manager() -> None:
    # `with install(): model = torch.compile(model)` would remove the pass before the first call.
    try:
        with pytest.raises(TypeError, match="not a context manager.*first call"):
            with graphar.install():
                pass
    finally:
        graphar.uninstall()


def test_reduce_overhead_with_graphar_options(fake_world) -> None:
    """torch.compile refuses mode= with options=: options={"mode": ...} gives both."""
    seen = []

    class Probe(_Recorder):
        def __call__(self, graph: torch.fx.Graph) -> None:
            seen.append(inductor_config.triton.cudagraphs)

    counters.clear()
    torch._dynamo.reset()
    options = {"mode": "reduce-overhead", "max_all_reduce_bytes": 16}
    with inductor_config.patch(post_grad_custom_post_pass=Probe()):
        torch.compile(_layer, backend="graphar", options=options)(torch.randn(4, 8), torch.randn(8, 8))
    assert seen == [True]  # Inductor's CUDA graphs are on...
    assert counters["graphar"]["all_reduce"] == 0  # ...and graphar's option applies (128 bytes > 16)
    with pytest.raises(SettingError, match="mode='fast'"):
        graphar_backend(None, [], options={"mode": "fast"})


def test_cache_hit_reports_the_rewrites(fake_world, caplog) -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    reports = []
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True), caplog.at_level("INFO", logger="graphar"):
        for _ in range(2):
            counters.clear()
            torch._dynamo.reset()
            caplog.clear()
            torch.compile(_layer, backend="graphar")(x, w)
            summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("graphar rewrites")]
            reports.append((dict(counters["graphar"]), summary))
    assert counters["inductor"]["fxgraph_cache_hit"] == 1
    assert reports[0] == ({"all_reduce": 1}, ["graphar rewrites: {'all_reduce': 1}"])
    assert reports[1] == (
        {"all_reduce": 1},
        ["graphar rewrites: {'all_reduce': 1} (compiled graph served from Inductor's cache)"],
    )


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "graphar" for ep in entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not _entry_point_installed(), reason="graphar is on the path, not installed: no entry point")
def test_entry_point_serves_backend_without_import() -> None:
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "fn = lookup_backend('graphar')\n"
        "assert 'graphar' in sys.modules, 'entry point did not import graphar'\n"
        "print(fn.__module__ + '.' + fn.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "graphar.backend.graphar_backend"
