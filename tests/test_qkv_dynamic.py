"""Snapshots of the Q/K/V rewrite on graphs traced with dynamic shapes (fake process group, no GPU).

A symbolic sequence length or batch must not turn the rewrite off: each Ulysses form of
test_qkv_pass.py is compiled with `mark_dynamic` (what automatic dynamic gives a recompile) or
`dynamic=True` and must be rewritten into the same ops as at a static shape, adding no guard but the
one that ties Q, K and V's symbols to each other. Exchanges whose sizes cannot be proved right
(a dim 0 not provably divisible by the world size, a permutation that is no Ulysses relayout,
Q and K of different lengths) stay as they are. Symbols are renamed s0, s1, ... in order of
appearance, so the snapshots do not depend on how torch numbers them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import graphar  # noqa: F401  (registers the ops)
from graphar.ulysses.unpacked import heads_to_seq_unpacked
from tests._graphs import all_post_grad_graphs
from tests.test_qkv_pass import (
    ONLY_QKV,
    WORLD,
    FakeWorldTestCase,
    _qkv,
    normalise,
    three_exchanges,
    ulysses_dim1,
    ulysses_dim2,
)


def _symbols(texts: list[str]) -> list[str]:
    """Rename symbols s<n> to s0, s1, ... in order of first appearance across `texts`."""
    names: dict[str, str] = {}
    for name in re.findall(r"\bs\d+\b", "\n".join(texts)):
        names.setdefault(name, f"s{len(names)}")
    return [re.sub(r"\bs\d+\b", lambda m: names[m.group(0)], text) for text in texts]


def _marked(dim: int | tuple[int, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    for t in tensors:
        torch._dynamo.mark_dynamic(t, dim)
    return tensors


def graphs(
    fn: Callable[..., Any], *args: Any, dynamic: bool | None = None
) -> tuple[str, str, dict[str, int], list[str]]:
    """(before, after, graphar ops made, guards and asserts graphar's pass added) of the one graph `fn`
    compiles to."""
    recorders: list[Any] = []
    ((before, after, counts),) = all_post_grad_graphs(fn, *args, config=ONLY_QKV, dynamic=dynamic, recorders=recorders)
    before, after, *facts = _symbols([normalise(before), normalise(after), *recorders[0].new_facts])
    return before, after, dict(counts), facts


def seq_to_heads_rank_minor(x: torch.Tensor) -> torch.Tensor:
    """Like `seq_to_heads_unpacked`, but token s of rank i lands at s*P + i: no Ulysses relayout."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, WORLD, h // WORLD, d).permute(2, 1, 0, 3, 4).contiguous()  # [P, S, b, h/P, d]
    recv = funcol.all_to_all_single(send, None, None, dist.group.WORLD)
    return recv.permute(2, 1, 0, 3, 4).reshape(b, s * WORLD, h // WORLD, d)


class DynamicQkvPassTest(FakeWorldTestCase):
    def test_heads_at_dim_2_dynamic_sequence(self) -> None:
        # Q, K and V as separate inputs: one symbol each, tied by the pass's one guard.
        before, after, made, facts = graphs(ulysses_dim2, *_marked(1, *_qkv(s=8)))
        self.assertEqual(made, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertEqual(facts, ["Eq(s0, s1)", "Eq(s1, s2)"])  # symbols to each other, never to a number
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s0)", arg1_1: "f32[1, s0, 4, 8]", arg2_1: "Sym(s1)", arg3_1: "f32[1, s1, 4, 8]", arg4_1: "Sym(s2)", arg5_1: "f32[1, s2, 4, 8]"):
        view: "f32[1, s0, 2, 2, 8]" = torch.ops.aten.view.default(arg1_1, [1, arg0_1, 2, 2, 8]);  arg1_1 = None
        permute: "f32[2, s0, 1, 2, 8]" = torch.ops.aten.permute.default(view, [2, 1, 0, 3, 4]);  view = None
        clone: "f32[2, s0, 1, 2, 8]" = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format);  permute = None
        all_to_all_single: "f32[2, s0, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone, [1, 1], [1, 1], '0');  clone = None
        view_1: "f32[1, s1, 2, 2, 8]" = torch.ops.aten.view.default(arg3_1, [1, arg2_1, 2, 2, 8]);  arg3_1 = None
        permute_1: "f32[2, s1, 1, 2, 8]" = torch.ops.aten.permute.default(view_1, [2, 1, 0, 3, 4]);  view_1 = None
        clone_1: "f32[2, s1, 1, 2, 8]" = torch.ops.aten.clone.default(permute_1, memory_format = torch.contiguous_format);  permute_1 = None
        all_to_all_single_1: "f32[2, s1, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_1, [1, 1], [1, 1], '0');  clone_1 = None
        view_2: "f32[1, s2, 2, 2, 8]" = torch.ops.aten.view.default(arg5_1, [1, arg4_1, 2, 2, 8]);  arg5_1 = None
        permute_2: "f32[2, s2, 1, 2, 8]" = torch.ops.aten.permute.default(view_2, [2, 1, 0, 3, 4]);  view_2 = None
        clone_2: "f32[2, s2, 1, 2, 8]" = torch.ops.aten.clone.default(permute_2, memory_format = torch.contiguous_format);  permute_2 = None
        all_to_all_single_2: "f32[2, s2, 1, 2, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_2, [1, 1], [1, 1], '0');  clone_2 = None
        empty: "f32[2, s0, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, arg0_1, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty = None
        wait_tensor: "f32[2, s0, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
        mul: "Sym(2*s0)" = 2 * arg0_1
        view_3: "f32[2*s0, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor, [mul, 1, 2, 8]);  wait_tensor = mul = None
        permute_3: "f32[1, 2*s0, 2, 8]" = torch.ops.aten.permute.default(view_3, [1, 0, 2, 3]);  view_3 = None
        permute_4: "f32[1, 2, 2*s0, 8]" = torch.ops.aten.permute.default(permute_3, [0, 2, 1, 3]);  permute_3 = None
        empty_1: "f32[2, s1, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, arg2_1, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty_1 = None
        wait_tensor_1: "f32[2, s1, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
        mul_1: "Sym(2*s1)" = 2 * arg2_1;  arg2_1 = None
        view_4: "f32[2*s1, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor_1, [mul_1, 1, 2, 8]);  wait_tensor_1 = mul_1 = None
        permute_5: "f32[1, 2*s1, 2, 8]" = torch.ops.aten.permute.default(view_4, [1, 0, 2, 3]);  view_4 = None
        permute_6: "f32[1, 2, 2*s1, 8]" = torch.ops.aten.permute.default(permute_5, [0, 2, 1, 3]);  permute_5 = None
        empty_2: "f32[2, s2, 1, 2, 8]" = torch.ops.aten.empty.memory_format([2, arg4_1, 1, 2, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty_2 = None
        wait_tensor_2: "f32[2, s2, 1, 2, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2);  all_to_all_single_2 = None
        mul_2: "Sym(2*s2)" = 2 * arg4_1;  arg4_1 = None
        view_5: "f32[2*s2, 1, 2, 8]" = torch.ops.aten.view.default(wait_tensor_2, [mul_2, 1, 2, 8]);  wait_tensor_2 = mul_2 = None
        permute_7: "f32[1, 2*s2, 2, 8]" = torch.ops.aten.permute.default(view_5, [1, 0, 2, 3]);  view_5 = None
        permute_8: "f32[1, 2, 2*s2, 8]" = torch.ops.aten.permute.default(permute_7, [0, 2, 1, 3]);  permute_7 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute_4, permute_6, permute_8);  permute_4 = permute_6 = permute_8 = None
        getitem: "f32[1, 2, 2*s0, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_9: "f32[1, 2*s0, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        view_6: "f32[1, 2, s0, 2, 8]" = torch.ops.aten.view.default(permute_9, [1, 2, arg0_1, 2, 8]);  permute_9 = None
        permute_10: "f32[2, 2, s0, 1, 8]" = torch.ops.aten.permute.default(view_6, [3, 1, 2, 0, 4]);  view_6 = None
        permute_11: "f32[2, 2, s0, 1, 8]" = torch.ops.aten.permute.default(permute_10, [1, 0, 2, 3, 4]);  permute_10 = None
        clone_3: "f32[2, 2, s0, 1, 8]" = torch.ops.aten.clone.default(permute_11, memory_format = torch.contiguous_format);  permute_11 = None
        all_to_all_single_3: "f32[2, 2, s0, 1, 8]" = torch.ops._c10d_functional.all_to_all_single.default(clone_3, [1, 1], [1, 1], '0');  clone_3 = None
        empty_3: "f32[2, 2, s0, 1, 8]" = torch.ops.aten.empty.memory_format([2, 2, arg0_1, 1, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False);  empty_3 = None
        wait_tensor_3: "f32[2, 2, s0, 1, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_3);  all_to_all_single_3 = None
        view_7: "f32[4, s0, 1, 8]" = torch.ops.aten.view.default(wait_tensor_3, [4, arg0_1, 1, 8]);  wait_tensor_3 = arg0_1 = None
        permute_12: "f32[1, s0, 4, 8]" = torch.ops.aten.permute.default(view_7, [2, 1, 0, 3]);  view_7 = None
        clone_4: "f32[1, s0, 4, 8]" = torch.ops.aten.clone.default(permute_12, memory_format = torch.contiguous_format);  permute_12 = None
        return (clone_4,)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s1)", arg1_1: "f32[1, s1, 4, 8]", arg2_1: "Sym(s1)", arg3_1: "f32[1, s1, 4, 8]", arg4_1: "Sym(s1)", arg5_1: "f32[1, s1, 4, 8]"):
        qkv_all_to_all_default: "f32[1, 2*s1, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(arg1_1, arg3_1, arg5_1, '0');  arg1_1 = arg3_1 = arg5_1 = None
        slice_tensor: "f32[1, 2*s1, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[1, 2*s1, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        slice_tensor_2: "f32[1, 2*s1, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        permute: "f32[1, 2, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_1: "f32[1, 2, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_2: "f32[1, 2, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute, permute_1, permute_2);  permute = permute_1 = permute_2 = None
        getitem: "f32[1, 2, 2*s1, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_3: "f32[1, 2*s1, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[1, s1, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_3, '0');  permute_3 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_heads_at_dim_1_dynamic_sequence(self) -> None:
        q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv(s=8))  # [b, h, S, d]
        _, after, made, facts = graphs(ulysses_dim1, *_marked(2, q, k, v))
        self.assertEqual(made, {"qkv_all_to_all": 1})
        self.assertEqual(facts, ["Eq(s0, s1)", "Eq(s0, s2)"])
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s0)", arg1_1: "f32[1, 4, s0, 8]", arg2_1: "Sym(s0)", arg3_1: "f32[1, 4, s0, 8]", arg4_1: "Sym(s0)", arg5_1: "f32[1, 4, s0, 8]"):
        permute_default: "f32[1, s0, 4, 8]" = torch.ops.aten.permute.default(arg1_1, [0, 2, 1, 3]);  arg1_1 = None
        permute_default_1: "f32[1, s0, 4, 8]" = torch.ops.aten.permute.default(arg3_1, [0, 2, 1, 3]);  arg3_1 = None
        permute_default_2: "f32[1, s0, 4, 8]" = torch.ops.aten.permute.default(arg5_1, [0, 2, 1, 3]);  arg5_1 = None
        qkv_all_to_all_default: "f32[1, 2*s0, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(permute_default, permute_default_1, permute_default_2, '0');  permute_default = permute_default_1 = permute_default_2 = None
        slice_tensor: "f32[1, 2*s0, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        permute_default_3: "f32[1, 2, 2*s0, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        slice_tensor_1: "f32[1, 2*s0, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        permute_default_4: "f32[1, 2, 2*s0, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        slice_tensor_2: "f32[1, 2*s0, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        permute_default_5: "f32[1, 2, 2*s0, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute_default_3, permute_default_4, permute_default_5);  permute_default_3 = permute_default_4 = permute_default_5 = None
        getitem: "f32[1, 2, 2*s0, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        return (getitem,)
""",
        )

    def test_gqa_dynamic_sequence(self) -> None:
        _, after, made, facts = graphs(ulysses_dim2, *_marked(1, *_qkv(s=8, h_kv=2)))
        self.assertEqual(made, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertEqual(facts, ["Eq(s0, s1)", "Eq(s1, s2)"])
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s1)", arg1_1: "f32[1, s1, 4, 8]", arg2_1: "Sym(s1)", arg3_1: "f32[1, s1, 2, 8]", arg4_1: "Sym(s1)", arg5_1: "f32[1, s1, 2, 8]"):
        qkv_all_to_all_default: "f32[1, 2*s1, 4, 8]" = torch.ops.graphar.qkv_all_to_all.default(arg1_1, arg3_1, arg5_1, '0');  arg1_1 = arg3_1 = arg5_1 = None
        slice_tensor: "f32[1, 2*s1, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[1, 2*s1, 1, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 3)
        slice_tensor_2: "f32[1, 2*s1, 1, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 3, 4);  qkv_all_to_all_default = None
        permute: "f32[1, 2, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_1: "f32[1, 1, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_2: "f32[1, 1, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute, permute_1, permute_2);  permute = permute_1 = permute_2 = None
        getitem: "f32[1, 2, 2*s1, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_3: "f32[1, 2*s1, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[1, s1, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_3, '0');  permute_3 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_dynamic_batch(self) -> None:
        _, after, made, facts = graphs(ulysses_dim2, *_marked(0, *_qkv(b=2)))
        self.assertEqual(made, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertEqual(facts, [])
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s0)", arg1_1: "f32[s0, 4, 4, 8]", arg2_1: "f32[s0, 4, 4, 8]", arg3_1: "Sym(s0)", arg4_1: "f32[s0, 4, 4, 8]"):
        qkv_all_to_all_default: "f32[s0, 8, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(arg1_1, arg2_1, arg4_1, '0');  arg1_1 = arg2_1 = arg4_1 = None
        slice_tensor: "f32[s0, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[s0, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        slice_tensor_2: "f32[s0, 8, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        permute: "f32[s0, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_1: "f32[s0, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_2: "f32[s0, 2, 8, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute, permute_1, permute_2);  permute = permute_1 = permute_2 = None
        getitem: "f32[s0, 2, 8, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_3: "f32[s0, 8, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[s0, 4, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_3, '0');  permute_3 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_dynamic_true_one_hidden_state(self) -> None:
        def block(x: torch.Tensor) -> torch.Tensor:  # Q, K and V of one hidden state share its symbols
            b, s, _ = x.shape
            return ulysses_dim2(*((x + i).view(b, s, 4, 8) for i in range(3)))

        _, after, made, facts = graphs(block, torch.randn(2, 8, 32), dynamic=True)
        self.assertEqual(made, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertEqual(facts, [])
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s0)", arg1_1: "Sym(s1)", arg2_1: "f32[s0, s1, 32]"):
        add: "f32[s0, s1, 32]" = torch.ops.aten.add.Tensor(arg2_1, 0)
        view: "f32[s0, s1, 4, 8]" = torch.ops.aten.view.default(add, [arg0_1, arg1_1, 4, 8]);  add = None
        add_1: "f32[s0, s1, 32]" = torch.ops.aten.add.Tensor(arg2_1, 1)
        view_1: "f32[s0, s1, 4, 8]" = torch.ops.aten.view.default(add_1, [arg0_1, arg1_1, 4, 8]);  add_1 = None
        add_2: "f32[s0, s1, 32]" = torch.ops.aten.add.Tensor(arg2_1, 2);  arg2_1 = None
        view_2: "f32[s0, s1, 4, 8]" = torch.ops.aten.view.default(add_2, [arg0_1, arg1_1, 4, 8]);  add_2 = arg0_1 = arg1_1 = None
        qkv_all_to_all_default: "f32[s0, 2*s1, 6, 8]" = torch.ops.graphar.qkv_all_to_all.default(view, view_1, view_2, '0');  view = view_1 = view_2 = None
        slice_tensor: "f32[s0, 2*s1, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 2)
        slice_tensor_1: "f32[s0, 2*s1, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 2, 4)
        slice_tensor_2: "f32[s0, 2*s1, 2, 8]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 6);  qkv_all_to_all_default = None
        permute: "f32[s0, 2, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_1: "f32[s0, 2, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_2: "f32[s0, 2, 2*s1, 8]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute, permute_1, permute_2);  permute = permute_1 = permute_2 = None
        getitem: "f32[s0, 2, 2*s1, 8]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_3: "f32[s0, 2*s1, 2, 8]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[s0, s1, 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_3, '0');  permute_3 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_output_exchange_dynamic_sequence(self) -> None:
        # The sequence is divided by the world size in the user's reshape: Dynamo's guard proves it.
        _, after, made, facts = graphs(heads_to_seq_unpacked, *_marked(1, torch.randn(2, 8, 2, 8)))
        self.assertEqual(made, {"heads_to_seq_all_to_all": 1})
        self.assertEqual(facts, [])
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s0)", arg1_1: "f32[2, s0, 2, 8]"):
        heads_to_seq_all_to_all_default: "f32[2, (s0//2), 4, 8]" = torch.ops.graphar.heads_to_seq_all_to_all.default(arg1_1, '0');  arg1_1 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_dim_0_not_provably_divisible_is_left_alone(self) -> None:
        args = _marked(0, torch.randn(6, 3), torch.randn(6), torch.randn(6, 5))
        before, after, made, facts = graphs(three_exchanges, *args)
        self.assertEqual((made, facts), ({}, []))
        self.assertEqual(before, after)
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s0)", arg1_1: "f32[s0, 3]", arg2_1: "Sym(s1)", arg3_1: "f32[s1]", arg4_1: "Sym(s2)", arg5_1: "f32[s2, 5]"):
        mul: "f32[s0, 3]" = torch.ops.aten.mul.Tensor(arg1_1, 2);  arg1_1 = None
        floordiv: "Sym((s0//2))" = arg0_1 // 2;  arg0_1 = None
        all_to_all_single: "f32[2*((s0//2)), 3]" = torch.ops._c10d_functional.all_to_all_single.default(mul, [floordiv, floordiv], [floordiv, floordiv], '0');  mul = floordiv = None
        mul_1: "f32[s1]" = torch.ops.aten.mul.Tensor(arg3_1, 2);  arg3_1 = None
        floordiv_1: "Sym((s1//2))" = arg2_1 // 2;  arg2_1 = None
        all_to_all_single_1: "f32[2*((s1//2))]" = torch.ops._c10d_functional.all_to_all_single.default(mul_1, [floordiv_1, floordiv_1], [floordiv_1, floordiv_1], '0');  mul_1 = floordiv_1 = None
        mul_2: "f32[s2, 5]" = torch.ops.aten.mul.Tensor(arg5_1, 2);  arg5_1 = None
        floordiv_2: "Sym((s2//2))" = arg4_1 // 2;  arg4_1 = None
        all_to_all_single_2: "f32[2*((s2//2)), 5]" = torch.ops._c10d_functional.all_to_all_single.default(mul_2, [floordiv_2, floordiv_2], [floordiv_2, floordiv_2], '0');  mul_2 = floordiv_2 = None
        wait_tensor: "f32[2*((s0//2)), 3]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
        add: "f32[2*((s0//2)), 3]" = torch.ops.aten.add.Tensor(wait_tensor, 1);  wait_tensor = None
        wait_tensor_1: "f32[2*((s1//2))]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
        add_1: "f32[2*((s1//2))]" = torch.ops.aten.add.Tensor(wait_tensor_1, 1);  wait_tensor_1 = None
        wait_tensor_2: "f32[2*((s2//2)), 5]" = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2);  all_to_all_single_2 = None
        add_2: "f32[2*((s2//2)), 5]" = torch.ops.aten.add.Tensor(wait_tensor_2, 1);  wait_tensor_2 = None
        return (add, add_1, add_2)
""",
        )

        def checked(a, b, c):  # the same, with the divisibility stated: now provable, so packed
            for t in (a, b, c):
                torch._check(t.shape[0] % WORLD == 0)
            return three_exchanges(a, b, c)

        _, after, made, facts = graphs(checked, *args)
        self.assertEqual((made, facts), ({"packed_all_to_all_single": 1}, []))
        self.assertIn("graphar.packed_all_to_all_single", after)

    def test_not_a_relayout_is_left_alone(self) -> None:
        before, after, made, facts = graphs(seq_to_heads_rank_minor, *_marked(1, _qkv(s=8)[0]))
        self.assertEqual((made, facts), ({}, []))
        self.assertEqual(before, after)

    def test_q_and_k_of_different_lengths_are_not_tied(self) -> None:
        q, _, _ = _qkv(s=8)
        _, k, v = _qkv(s=6)
        _, after, made, facts = graphs(ulysses_dim2, *_marked(1, q, k, v))
        self.assertEqual((made, facts), ({"heads_to_seq_all_to_all": 1}, []))  # the output exchange alone; no guard
        self.assertNotIn("graphar.qkv_all_to_all", after)
        self.assertIn("graphar.heads_to_seq_all_to_all", after)
