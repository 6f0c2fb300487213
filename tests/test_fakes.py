"""Every graphar op's fake returns the sizes, strides and dtype its real implementation returns.

Inductor compiles against the fakes and checks the real outputs' strides at run time, so a fake that
keeps an input's strides where the real op returns a contiguous tensor crashes a compiled model
(transposed, sliced or expanded inputs). Real ops run on the fake process group (shapes only).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import graphar  # noqa: F401  (registers the ops)
from tests._graphs import init_fake_world

WORLD = 2
ops = torch.ops.graphar


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    init_fake_world(WORLD)
    yield
    dist.destroy_process_group()


def _variants(shape: tuple[int, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """One tensor of `shape` laid out in several ways."""
    *lead, last = shape
    return {
        "contiguous": lambda: torch.randn(shape),
        "transposed": lambda: torch.randn(*lead[:-1], last, lead[-1]).transpose(-1, -2),
        "sliced": lambda: torch.randn(*lead, last + 3)[..., 1 : last + 1],
        "expanded": lambda: torch.randn(1, *shape[1:]).expand(shape),
    }


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


def _assert_fake_matches_real(op: Callable, *args) -> None:
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
        fake = op(*fake_args)
    reals = real if isinstance(real, (list, tuple)) else [real]
    fakes = fake if isinstance(fake, (list, tuple)) else [fake]
    assert [_meta(t) for t in fakes] == [_meta(t) for t in reals]


@pytest.mark.parametrize("layout", list(_variants((4, 8))))
@pytest.mark.parametrize("shape", [(4, 8), (2, 1, 8)])
def test_all_reduce(shape, layout) -> None:
    x = _variants(shape)[layout]()
    _assert_fake_matches_real(ops.all_reduce, x, "0")


@pytest.mark.parametrize("layout", list(_variants((1, 4, 4, 8))))
@pytest.mark.parametrize("b", [1, 2])
def test_qkv_all_to_all(b, layout) -> None:
    make = _variants((b, 4, 4, 8))[layout]
    k_v = _variants((b, 4, 2, 8))[layout]
    _assert_fake_matches_real(ops.qkv_all_to_all, make(), k_v(), k_v(), "0")


@pytest.mark.parametrize("layout", list(_variants((1, 8, 2, 8))))
@pytest.mark.parametrize("b", [1, 2])
def test_heads_to_seq_all_to_all(b, layout) -> None:
    _assert_fake_matches_real(ops.heads_to_seq_all_to_all, _variants((b, 8, 2, 8))[layout](), "0")


@pytest.mark.parametrize("layout", list(_variants((4, 6))))
def test_packed_all_to_all_single(layout) -> None:
    xs = [_variants(shape)[layout]() for shape in ((4, 6), (4, 3, 2), (2, 8))]
    _assert_fake_matches_real(ops.packed_all_to_all_single, xs, "0")


@pytest.mark.parametrize("layout", list(_variants((1, 4, 4, 8))))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ulysses_attention(kv_heads, layout) -> None:
    q = _variants((2, 4, 4, 8))[layout]()
    k, v = (_variants((2, 4, kv_heads, 8))[layout]() for _ in range(2))
    _assert_fake_matches_real(ops.ulysses_attention, q, k, v, "0", True, None, 2)


@pytest.mark.parametrize("layout", list(_variants((4, 8))))
@pytest.mark.parametrize("form", ["residual and weight", "residual", "weight", "neither", "bf16 with fp32 weight"])
def test_all_reduce_add_rms_norm(form, layout) -> None:
    x, residual = _variants((4, 8))[layout](), _variants((4, 8))[layout]()
    weight: torch.Tensor | None = torch.randn(8)
    if form == "bf16 with fp32 weight":
        x, residual = x.bfloat16(), residual.bfloat16()
    if form in ("weight", "neither"):
        residual = None
    if form in ("residual", "neither"):
        weight = None
    _assert_fake_matches_real(ops.all_reduce_add_rms_norm, x, residual, weight, 1e-6, "0")
