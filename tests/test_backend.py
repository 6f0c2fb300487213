"""The "graphar" backend, its cache key, `install()` and the entry point (fake process group, CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import fresh_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

import graphar
from graphar.config import Config
from graphar.passes import GrapharPass


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


def test_uuid_follows_previous_pass() -> None:
    assert GrapharPass(Config(), _Recorder()).uuid() != GrapharPass(Config()).uuid()
    # A previous pass with no cache key makes the graph uncacheable rather than wrongly cached.
    assert GrapharPass(Config(), lambda graph: None).uuid() is None


def test_options_split_between_graphar_and_inductor() -> None:
    config = Config.from_options({"max_all_reduce_bytes": 4096, "exclude_groups": ["3"], "max_autotune": False})
    assert config.max_all_reduce_bytes == 4096
    assert config.exclude_groups == ("3",)
    assert config.inductor == (("max_autotune", False),)


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


def test_install_serves_backend_inductor_and_restores(fake_world) -> None:
    before = inductor_config.post_grad_custom_post_pass
    counters.clear()
    torch._dynamo.reset()
    with graphar.install(max_all_reduce_bytes=1 << 20) as installed:
        assert inductor_config.post_grad_custom_post_pass is installed
        torch.compile(_layer, backend="inductor")(torch.randn(4, 8), torch.randn(8, 8))
    assert inductor_config.post_grad_custom_post_pass is before
    assert counters["graphar"]["all_reduce"] == 1


def test_second_compile_hits_fx_graph_cache(fake_world) -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True):
        for _ in range(2):
            counters.clear()
            torch._dynamo.reset()
            torch.compile(_layer, backend="graphar")(x, w)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1


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
