"""graphar's options: checked where they enter (Config, the backend, install), naming what is wrong."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from graphar.config import Config
from graphar.errors import SettingError


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_all_reduce_bytes": "8MB"}, "max_all_reduce_bytes='8MB': expected a positive multiple of 16"),
        ({"max_all_reduce_bytes": -1}, "max_all_reduce_bytes=-1"),
        ({"max_all_reduce_bytes": 8.5}, "max_all_reduce_bytes=8.5"),
        ({"max_all_reduce_bytes": 24}, "max_all_reduce_bytes=24"),
        ({"max_all_reduce_bytes": True}, "max_all_reduce_bytes=True"),
        ({"all_reduce": "False"}, "all_reduce='False': expected True or False"),
        ({"qkv_all_to_all": 0}, "qkv_all_to_all=0: expected True or False"),
        ({"fuse_norm": "yes"}, "fuse_norm='yes': expected True or False"),
        ({"attention_chunks": -1}, "attention_chunks=-1: expected an int >= 0"),
        ({"attention_chunks": 2.0}, "attention_chunks=2.0"),
        ({"attention_chunks": True}, "attention_chunks=True"),
        ({"attention_chunks": "Auto"}, "attention_chunks='Auto': expected an int >= 0 \\(0 or 1: off\\) or 'auto'"),
        ({"exclude_groups": [3]}, "exclude_groups: 3 is neither a process group nor a group name"),
        ({"exclude_groups": 3}, "exclude_groups=3"),
        ({"max_all_reduce_byte": 4096}, r"options \['max_all_reduce_byte'\] are neither graphar's"),
    ],
)
def test_bad_options_are_named(options, message) -> None:
    with pytest.raises(SettingError, match=message):
        Config.from_options(options)


def test_attention_chunks_takes_a_count_or_auto() -> None:
    assert [Config(attention_chunks=c).pipelines_attention for c in (0, 1, 2, "auto")] == [False, False, True, True]


def test_options_split_between_graphar_and_inductor() -> None:
    config = Config.from_options({"max_all_reduce_bytes": 4096, "exclude_groups": ["3"], "max_autotune": False})
    assert config.max_all_reduce_bytes == 4096
    assert config.exclude_groups == ("3",)
    assert config.inductor == (("max_autotune", False),)


def test_exclude_groups_takes_groups_or_names() -> None:
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        world = dist.group.WORLD
        assert Config(exclude_groups=[world, "7"]).exclude_groups == (world.group_name, "7")
        assert Config(exclude_groups=world).exclude_groups == (world.group_name,)
        assert Config(exclude_groups="7").exclude_groups == ("7",)
        # Names, not groups, go into the cache key: it pickles, and equals across processes.
        assert "ProcessGroup" not in Config(exclude_groups=[world]).cache_key()
    finally:
        dist.destroy_process_group()


def test_default_limit_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("GRAPHAR_MAX_ALLREDUCE_BYTES", "4096")
    assert Config().max_all_reduce_bytes == 4096
    monkeypatch.setenv("GRAPHAR_MAX_ALLREDUCE_BYTES", "8MB")
    with pytest.raises(SettingError, match="GRAPHAR_MAX_ALLREDUCE_BYTES='8MB'"):
        Config()
