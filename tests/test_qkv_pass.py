"""Snapshots of the Q/K/V all-to-all rewrite on the post-grad graph, on the fake process group (no GPU).

Each form of Ulysses code the pass must see (yunchang/DeepSpeed heads at dim 2 with in-place c10d
calls, xDiT heads at dim 1 with functional collectives, GQA) and each case it must leave unpacked
(members that depend on each other, different groups, different dtypes, a graph break between them)
is compiled the way Inductor does and snapshotted before and after graphar's pass. Node names are
renumbered in order of appearance, so the snapshots do not depend on how many nodes a torch version
creates and discards before the post-grad graph.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from expecttest import TestCase

import graphar  # noqa: F401  (registers the ops)
from graphar.config import Config
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked
from tests._graphs import all_post_grad_graphs, init_fake_world, post_grad_graphs
from tests._ulysses import seq_to_heads_dim1

WORLD = 2
ONLY_QKV = Config(all_reduce=False)


def _init_fake_world(rank: int = 0) -> None:
    init_fake_world(WORLD, rank)


def normalise(text: str) -> str:
    """Rename nodes `<base>_<n>` to `<base>_<k>`, k counting per base in order of definition."""
    names: dict[str, str] = {}
    counts: dict[str, int] = {}
    for name in re.findall(r"^\s+(\w+)(?::[^=]*)? = ", text, flags=re.M):
        base = re.sub(r"_\d+$", "", name)
        counts[base] = counts.get(base, -1) + 1
        names[name] = base if counts[base] == 0 else f"{base}_{counts[base]}"
    if not names:
        return text
    return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: names[m.group(1)], text)


def ulysses_dim2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q, k, v = (seq_to_heads_unpacked(t).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
    return heads_to_seq_unpacked(o.transpose(1, 2))


def ulysses_dim1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(*(seq_to_heads_dim1(t) for t in (q, k, v)))


def three_exchanges(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
    """Three independent all-to-alls that are no Ulysses relayout."""
    outs = [funcol.all_to_all_single(t * 2, None, None, dist.group.WORLD) for t in (a, b, c)]
    return [o + 1 for o in outs]


def _qkv(b: int = 1, s: int = 4, h: int = 4, h_kv: int | None = None, d: int = 8, dtype=torch.float32):
    """Q, K and V `[b, s, h, d]` (K and V with `h_kv` heads)."""
    return tuple(torch.randn(b, s, heads, d, dtype=dtype) for heads in (h, h_kv or h, h_kv or h))


def graphs(fn: Callable[..., Any], *args: Any) -> tuple[str, str, dict[str, int]]:
    """(before, after, the graphar ops the pass made, by name)."""
    before, after, counts = post_grad_graphs(fn, *args, config=ONLY_QKV)
    return normalise(before), normalise(after), dict(counts)


def graphs_with_breaks(fn: Callable[..., Any], *args: Any) -> list[tuple[str, str, dict[str, int]]]:
    """(before, after, ops made) for every graph `fn` compiles to (graph breaks allowed)."""
    return [
        (normalise(before), normalise(after), dict(counts))
        for before, after, counts in all_post_grad_graphs(fn, *args, config=ONLY_QKV, fullgraph=False)
    ]


class FakeWorldTestCase(TestCase):
    """Each test on a fresh fake process group of WORLD ranks."""

    def setUp(self) -> None:
        _init_fake_world()

    def tearDown(self) -> None:
        dist.destroy_process_group()


class QkvPassTest(FakeWorldTestCase):
    def test_heads_at_dim_2_in_place_c10d(self) -> None:
        before, after, made = graphs(ulysses_dim2, *_qkv())
        self.assertEqual(made, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[1, 4, 4, 8]", arg1_1: "f32[1, 4, 4, 8]", arg2_1: "f32[1, 4, 4, 8]"):
        view: "f32[1, 4, 2, 2, 8]" = torch.ops.aten.view.default(arg0_1, [1, 4, 2, 2, 8]);  arg0_1 = None
        permute: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.permute.default(view, [2, 1, 0, 3, 4]);  view = None
        clone: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format);  permute = None
        all_to_all_single: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone, [1, 1], [1, 1], '0');  clone = None
        view_1: "f32[1, 4, 2, 2, 8]" = torch.ops.aten.view.default(arg1_1, [1, 4, 2, 2, 8]);  arg1_1 = None
        permute_1: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.permute.default(view_1, [2, 1, 0, 3, 4]);  view_1 = None
        clone_1: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.clone.default(permute_1, memory_format = torch.contiguous_format);  permute_1 = None
        all_to_all_single_1: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_1, [1, 1], [1, 1], '0');  clone_1 = None
        view_2: "f32[1, 4, 2, 2, 8]" = torch.ops.aten.view.default(arg2_1, [1, 4, 2, 2, 8]);  arg2_1 = None
        permute_2: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.permute.default(view_2, [2, 1, 0, 3, 4]);  view_2 = None
        clone_2: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.clone.default(permute_2, memory_format = torch.contiguous_format);  permute_2 = None
        all_to_all_single_2: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_2, [1, 1], [1, 1], '0');  clone_2 = None
        empty: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, 4, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty = None
        wait_tensor: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
        view_3: "f32[8, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor, [8, 1, 2, 8]);  wait_tensor = None
        permute_3: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(view_3, [1, 0, 2, 3]);  view_3 = None
        permute_4: "f32[1, 2, 8, 8]" = torch.ops.aten.permute.default(permute_3, [0, 2, 1, 3]);  permute_3 = None
        empty_1: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, 4, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty_1 = None
        wait_tensor_1: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
        view_4: "f32[8, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor_1, [8, 1, 2, 8]);  wait_tensor_1 = None
        permute_5: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(view_4, [1, 0, 2, 3]);  view_4 = None
        permute_6: "f32[1, 2, 8, 8]" = torch.ops.aten.permute.default(permute_5, [0, 2, 1, 3]);  permute_5 = None
        empty_2: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, 4, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty_2 = None
        wait_tensor_2: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2);  all_to_all_single_2 = None
        view_5: "f32[8, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor_2, [8, 1, 2, 8]);  wait_tensor_2 = None
        permute_7: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(view_5, [1, 0, 2, 3]);  view_5 = None
        permute_8: "f32[1, 2, 8, 8]" = torch.ops.aten.permute.default(permute_7, [0, 2, 1, 3]);  permute_7 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute_4, permute_6, permute_8);  permute_4 = permute_6 = permute_8 = None
        getitem: "f32[1, 2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_9: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        view_6: "f32[1, 2, 4, 2, 8]" = torch.ops.aten.view.default(permute_9, [1, 2, 4, 2, 8]);  permute_9 = None
        permute_10: "f32[2, 2, 4, 1, 8]" = torch.ops.aten.permute.default(view_6, [3, 1, 2, 0, 4]);  view_6 = None
        permute_11: "f32[2, 2, 4, 1, 8]" = torch.ops.aten.permute.default(permute_10, [1, 0, 2, 3, 4]);  permute_10 = None
        clone_3: "f32[2, 2, 4, 1, 8]" = torch.ops.aten.clone.default(permute_11, memory_format = torch.contiguous_format);  permute_11 = None
        all_to_all_single_3: "f32[2, 2, 4, 1, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_3, [1, 1], [1, 1], '0');  clone_3 = None
        empty_3: "f32[2, 2, 4, 1, 8]" = torch.ops.aten.empty.memory_format([2, 2, 4, 1, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty_3 = None
        wait_tensor_3: "f32[2, 2, 4, 1, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_3);  all_to_all_single_3 = None
        view_7: "f32[4, 4, 1, 8]" = torch.ops.aten.view.default(wait_tensor_3, [4, 4, 1, 8]);  wait_tensor_3 = None
        permute_12: "f32[1, 4, 4, 8]" = torch.ops.aten.permute.default(view_7, [2, 1, 0, 3]);  view_7 = None
        clone_4: "f32[1, 4, 4, 8]" = torch.ops.aten.clone.default(permute_12, memory_format = torch.contiguous_format);  permute_12 = None
        return (clone_4,)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[1, 4, 4, 8]", arg1_1: "f32[1, 4, 4, 8]", arg2_1: "f32[1, 4, 4, 8]"):
        qkv_all_to_all_default: "f32[1, 8, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(arg0_1, arg1_1, arg2_1, '0');  arg0_1 = arg1_1 = arg2_1 = None
        slice_tensor: "f32[1, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[1, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        slice_tensor_2: "f32[1, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        permute: "f32[1, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_1: "f32[1, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_2: "f32[1, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute, permute_1, permute_2);  permute = permute_1 = permute_2 = None
        getitem: "f32[1, 2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_3: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[1, 4, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_3, '0');  permute_3 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_heads_at_dim_2_batch_2(self) -> None:
        _, after, made = graphs(ulysses_dim2, *_qkv(b=2))
        self.assertEqual(made, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 4, 4, 8]", arg1_1: "f32[2, 4, 4, 8]", arg2_1: "f32[2, 4, 4, 8]"):
        qkv_all_to_all_default: "f32[2, 8, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(arg0_1, arg1_1, arg2_1, '0');  arg0_1 = arg1_1 = arg2_1 = None
        slice_tensor: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        slice_tensor_2: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        permute: "f32[2, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_1: "f32[2, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_2: "f32[2, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute, permute_1, permute_2);  permute = permute_1 = permute_2 = None
        getitem: "f32[2, 2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_3: "f32[2, 8, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[2, 4, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_3, '0');  permute_3 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_heads_at_dim_1_functional(self) -> None:
        before, after, made = graphs(ulysses_dim1, *(t.transpose(1, 2).contiguous() for t in _qkv(b=2)))
        self.assertEqual(made, {"qkv_all_to_all": 1})
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 4, 4, 8]", arg1_1: "f32[2, 4, 4, 8]", arg2_1: "f32[2, 4, 4, 8]"):
        view: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.view.default(arg0_1, [2, 2, 2, 4, 8]);  arg0_1 = None
        permute: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.permute.default(view, [1, 0, 2, 3, 4]);  view = None
        clone: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format);  permute = None
        all_to_all_single: "f32[2, 2, 2, 4, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone, [1, 1], [1, 1], '0');  clone = None
        view_1: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.view.default(arg1_1, [2, 2, 2, 4, 8]);  arg1_1 = None
        permute_1: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.permute.default(view_1, [1, 0, 2, 3, 4]);  view_1 = None
        clone_1: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.clone.default(permute_1, memory_format = torch.contiguous_format);  permute_1 = None
        all_to_all_single_1: "f32[2, 2, 2, 4, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_1, [1, 1], [1, 1], '0');  clone_1 = None
        view_2: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.view.default(arg2_1, [2, 2, 2, 4, 8]);  arg2_1 = None
        permute_2: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.permute.default(view_2, [1, 0, 2, 3, 4]);  view_2 = None
        clone_2: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.clone.default(permute_2, memory_format = torch.contiguous_format);  permute_2 = None
        all_to_all_single_2: "f32[2, 2, 2, 4, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_2, [1, 1], [1, 1], '0');  clone_2 = None
        wait_tensor: "f32[2, 2, 2, 4, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
        permute_3: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.permute.default(wait_tensor, [1, 2, 0, 3, 4]);  wait_tensor = None
        clone_3: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.clone.default(permute_3, memory_format = torch.contiguous_format);  permute_3 = None
        view_3: "f32[2, 2, 8, 8]" = torch.ops.aten.view.default(clone_3, [2, 2, 8, 8]);  clone_3 = None
        wait_tensor_1: "f32[2, 2, 2, 4, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
        permute_4: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.permute.default(wait_tensor_1, [1, 2, 0, 3, 4]);  wait_tensor_1 = None
        clone_4: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.clone.default(permute_4, memory_format = torch.contiguous_format);  permute_4 = None
        view_4: "f32[2, 2, 8, 8]" = torch.ops.aten.view.default(clone_4, [2, 2, 8, 8]);  clone_4 = None
        wait_tensor_2: "f32[2, 2, 2, 4, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2);  all_to_all_single_2 = None
        permute_5: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.permute.default(wait_tensor_2, [1, 2, 0, 3, 4]);  wait_tensor_2 = None
        clone_5: "f32[2, 2, 2, 4, 8]" = torch.ops.aten.clone.default(permute_5, memory_format = torch.contiguous_format);  permute_5 = None
        view_5: "f32[2, 2, 8, 8]" = torch.ops.aten.view.default(clone_5, [2, 2, 8, 8]);  clone_5 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(view_3, view_4, view_5);  view_3 = view_4 = view_5 = None
        getitem: "f32[2, 2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        return (getitem,)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 4, 4, 8]", arg1_1: "f32[2, 4, 4, 8]", arg2_1: "f32[2, 4, 4, 8]"):
        permute_default: "f32[2, 4, 4, 8]" = torch.ops.aten.permute.default(arg0_1, [0, 2, 1, 3]);  arg0_1 = None
        permute_default_1: "f32[2, 4, 4, 8]" = torch.ops.aten.permute.default(arg1_1, [0, 2, 1, 3]);  arg1_1 = None
        permute_default_2: "f32[2, 4, 4, 8]" = torch.ops.aten.permute.default(arg2_1, [0, 2, 1, 3]);  arg2_1 = None
        qkv_all_to_all_default: "f32[2, 8, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(permute_default, permute_default_1, permute_default_2, '0');  permute_default = permute_default_1 = permute_default_2 = None
        slice_tensor: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        permute_default_3: "f32[2, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        slice_tensor_1: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        permute_default_4: "f32[2, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        slice_tensor_2: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        permute_default_5: "f32[2, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute_default_3, permute_default_4, permute_default_5);  permute_default_3 = permute_default_4 = permute_default_5 = None
        getitem: "f32[2, 2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        return (getitem,)
""",
        )

    def test_gqa(self) -> None:
        _, after, made = graphs(ulysses_dim2, *_qkv(h=4, h_kv=2))
        self.assertEqual(made, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[1, 4, 4, 8]", arg1_1: "f32[1, 4, 2, 8]", arg2_1: "f32[1, 4, 2, 8]"):
        qkv_all_to_all_default: "f32[1, 8, 4, 8]" = torch.ops.graphar.qkv_all_to_all.default(arg0_1, arg1_1, arg2_1, '0');  arg0_1 = arg1_1 = arg2_1 = None
        slice_tensor: "f32[1, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[1, 8, 1, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 3)
        slice_tensor_2: "f32[1, 8, 1, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 3, 4);  qkv_all_to_all_default = None
        permute: "f32[1, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_1: "f32[1, 1, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_2: "f32[1, 1, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute, permute_1, permute_2);  permute = permute_1 = permute_2 = None
        getitem: "f32[1, 2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_3: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[1, 4, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_3, '0');  permute_3 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_not_a_relayout_becomes_packed_all_to_all(self) -> None:
        before, after, made = graphs(three_exchanges, torch.randn(4, 3), torch.randn(6), torch.randn(2, 5, 2))
        self.assertEqual(made, {"packed_all_to_all_single": 1})
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 3]", arg1_1: "f32[6]", arg2_1: "f32[2, 5, 2]"):
        mul: "f32[4, 3]" = torch.ops.aten.mul.Tensor(arg0_1, 2);  arg0_1 = None
        all_to_all_single: "f32[4, 3]" = torch.ops._c10d_functional.all_to_all_single.default(mul, [2, 2], [2, 2], '0');  mul = None
        mul_1: "f32[6]" = torch.ops.aten.mul.Tensor(arg1_1, 2);  arg1_1 = None
        all_to_all_single_1: "f32[6]" = torch.ops._c10d_functional.all_to_all_single.default(mul_1, [3, 3], [3, 3], '0');  mul_1 = None
        mul_2: "f32[2, 5, 2]" = torch.ops.aten.mul.Tensor(arg2_1, 2);  arg2_1 = None
        all_to_all_single_2: "f32[2, 5, 2]" = torch.ops._c10d_functional.all_to_all_single.default(mul_2, [1, 1], [1, 1], '0');  mul_2 = None
        wait_tensor: "f32[4, 3]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
        add: "f32[4, 3]" = torch.ops.aten.add.Tensor(wait_tensor, 1);  wait_tensor = None
        wait_tensor_1: "f32[6]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
        add_1: "f32[6]" = torch.ops.aten.add.Tensor(wait_tensor_1, 1);  wait_tensor_1 = None
        wait_tensor_2: "f32[2, 5, 2]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2);  all_to_all_single_2 = None
        add_2: "f32[2, 5, 2]" = torch.ops.aten.add.Tensor(wait_tensor_2, 1);  wait_tensor_2 = None
        return (add, add_1, add_2)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 3]", arg1_1: "f32[6]", arg2_1: "f32[2, 5, 2]"):
        mul: "f32[4, 3]" = torch.ops.aten.mul.Tensor(arg0_1, 2);  arg0_1 = None
        mul_1: "f32[6]" = torch.ops.aten.mul.Tensor(arg1_1, 2);  arg1_1 = None
        mul_2: "f32[2, 5, 2]" = torch.ops.aten.mul.Tensor(arg2_1, 2);  arg2_1 = None
        packed_all_to_all_single_default = torch.ops.graphar.packed_all_to_all_single.default([mul, mul_1, mul_2], '0');  mul = mul_1 = mul_2 = None
        getitem: "f32[4, 3]" = packed_all_to_all_single_default[0]
        getitem_1: "f32[6]" = packed_all_to_all_single_default[1]
        getitem_2: "f32[2, 5, 2]" = packed_all_to_all_single_default[2];  packed_all_to_all_single_default = None
        add: "f32[4, 3]" = torch.ops.aten.add.Tensor(getitem, 1);  getitem = None
        add_1: "f32[6]" = torch.ops.aten.add.Tensor(getitem_1, 1);  getitem_1 = None
        add_2: "f32[2, 5, 2]" = torch.ops.aten.add.Tensor(getitem_2, 1);  getitem_2 = None
        return (add, add_1, add_2)
""",
        )

    def assert_untouched(self, fn: Callable[..., Any], *args: Any) -> None:
        before, after, made = graphs(fn, *args)
        self.assertEqual(made, {})
        self.assertEqual(before, after)
        self.assertIn("_c10d_functional.all_to_all_single", after)

    def test_dependent_members_are_not_packed(self) -> None:
        def dependent(q, k, v):
            q = seq_to_heads_unpacked(q)
            k = seq_to_heads_unpacked(k * q.sum())  # K's exchange needs Q's result
            return q, k, seq_to_heads_unpacked(v)

        self.assert_untouched(dependent, *_qkv())

    def test_different_groups_are_not_packed(self) -> None:
        other = dist.new_group(list(range(WORLD)))

        def two_groups(q, k, v):
            return seq_to_heads_unpacked(q), seq_to_heads_unpacked(k), seq_to_heads_unpacked(v, group=other)

        self.assert_untouched(two_groups, *_qkv())

    def test_different_dtypes_are_not_packed(self) -> None:
        q, k, v = _qkv()
        self.assert_untouched(lambda q, k, v: [seq_to_heads_unpacked(t) for t in (q, k, v)], q, k.half(), v)

    def test_graph_break_between_members(self) -> None:
        def broken(q, k, v):
            q, k = seq_to_heads_unpacked(q), seq_to_heads_unpacked(k)
            torch._dynamo.graph_break()
            return q, k, seq_to_heads_unpacked(v)

        results = graphs_with_breaks(broken, *_qkv())
        self.assertEqual([made for _, _, made in results], [{}, {}])
        self.assertTrue(all(before == after for before, after, _ in results))
        self.assertExpectedInline(
            results[0][1],
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[1, 4, 4, 8]", arg1_1: "f32[1, 4, 4, 8]"):
        view: "f32[1, 4, 2, 2, 8]" = torch.ops.aten.view.default(arg0_1, [1, 4, 2, 2, 8]);  arg0_1 = None
        permute: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.permute.default(view, [2, 1, 0, 3, 4]);  view = None
        clone: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format);  permute = None
        all_to_all_single: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone, [1, 1], [1, 1], '0');  clone = None
        view_1: "f32[1, 4, 2, 2, 8]" = torch.ops.aten.view.default(arg1_1, [1, 4, 2, 2, 8]);  arg1_1 = None
        permute_1: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.permute.default(view_1, [2, 1, 0, 3, 4]);  view_1 = None
        clone_1: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.clone.default(permute_1, memory_format = torch.contiguous_format);  permute_1 = None
        all_to_all_single_1: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_1, [1, 1], [1, 1], '0');  clone_1 = None
        empty: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, 4, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty = None
        wait_tensor: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
        view_2: "f32[8, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor, [8, 1, 2, 8]);  wait_tensor = None
        permute_2: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(view_2, [1, 0, 2, 3]);  view_2 = None
        empty_1: "f32[2, 4, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, 4, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty_1 = None
        wait_tensor_1: "f32[2, 4, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
        view_3: "f32[8, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor_1, [8, 1, 2, 8]);  wait_tensor_1 = None
        permute_3: "f32[1, 8, 2, 8]" = torch.ops.aten.permute.default(view_3, [1, 0, 2, 3]);  view_3 = None
        return (permute_2, permute_3)
""",
        )

    def test_an_exchange_of_exchanged_tensors_reads_the_first_packed_result(self) -> None:
        def two_levels(q, k, v):
            q, k, v = (seq_to_heads_unpacked(seq_to_heads_unpacked(t)) for t in (q, k, v))
            return q - 3 * k + v

        _, after, made = graphs(two_levels, *_qkv(b=2))
        self.assertEqual(made, {"qkv_all_to_all": 2})
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 4, 4, 8]", arg1_1: "f32[2, 4, 4, 8]", arg2_1: "f32[2, 4, 4, 8]"):
        qkv_all_to_all_default: "f32[2, 8, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(arg0_1, arg1_1, arg2_1, '0');  arg0_1 = arg1_1 = arg2_1 = None
        slice_tensor: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        slice_tensor_2: "f32[2, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        qkv_all_to_all_default_1: "f32[2, 16, 3, 8]" = torch.ops.graphar.qkv_all_to_all.default(slice_tensor, slice_tensor_1, slice_tensor_2, '0');  slice_tensor = slice_tensor_1 = slice_tensor_2 = None
        slice_tensor_3: "f32[2, 16, 1, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default_1, 2, 0, 1)
        slice_tensor_4: "f32[2, 16, 1, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default_1, 2, 1, 2)
        slice_tensor_5: "f32[2, 16, 1, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default_1, 2, 2, 3);  qkv_all_to_all_default_1 = None
        mul: "f32[2, 16, 1, 8]" = torch.ops.aten.mul.Tensor(slice_tensor_4, 3);  slice_tensor_4 = None
        sub: "f32[2, 16, 1, 8]" = torch.ops.aten.sub.Tensor(slice_tensor_3, mul);  slice_tensor_3 = mul = None
        add: "f32[2, 16, 1, 8]" = torch.ops.aten.add.Tensor(sub, slice_tensor_5);  sub = slice_tensor_5 = None
        return (add,)
""",
        )

    def test_single_output_exchange(self) -> None:
        _, after, made = graphs(heads_to_seq_unpacked, torch.randn(2, 8, 2, 8))
        self.assertEqual(made, {"heads_to_seq_all_to_all": 1})
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[2, 8, 2, 8]"):
        heads_to_seq_all_to_all_default: "f32[2, 4, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(arg0_1, '0');  arg0_1 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_excluded_group_is_left_alone(self) -> None:
        before, after, made = post_grad_graphs(
            ulysses_dim2, *_qkv(), config=Config(all_reduce=False, exclude_groups=("0",))
        )
        self.assertEqual(made, {})
        self.assertEqual(before, after)

    def test_ops_the_model_calls_itself_are_not_counted(self) -> None:
        _, after, made = graphs(lambda q, k, v: torch.ops.graphar.qkv_all_to_all(q, k, v, "0"), *_qkv())
        self.assertEqual(made, {})
        self.assertIn("graphar.qkv_all_to_all", after)

    def test_every_rank_rewrites_alike(self) -> None:
        _, after_rank0, _ = graphs(ulysses_dim2, *_qkv(b=2))
        _init_fake_world(rank=1)
        _, after_rank1, _ = graphs(ulysses_dim2, *_qkv(b=2))
        self.assertEqual(after_rank0, after_rank1)
