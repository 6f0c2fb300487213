"""Snapshots of the all-reduce rewrite on the post-grad graph, on the fake process group (no GPU)."""

from __future__ import annotations

import os
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from expecttest import TestCase

import graphar  # noqa: F401  (registers the ops)
from graphar.config import Config
from tests._graphs import init_fake_world, post_grad_graphs

WORLD = 4


def _init_fake_world(rank: int = 0) -> None:
    init_fake_world(WORLD, rank)


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A row-parallel MLP as TP models write it: partial products summed with dist.all_reduce."""
    h = torch.relu(x @ w1)
    y = h @ w2
    dist.all_reduce(y)
    return y


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return torch.randn(4, 16, dtype=dtype), torch.randn(16, 32, dtype=dtype), torch.randn(32, 16, dtype=dtype)


class AllReducePassTest(TestCase):
    def setUp(self) -> None:
        _init_fake_world()

    def tearDown(self) -> None:
        dist.destroy_process_group()

    def test_one_all_reduce(self) -> None:
        before, after, counts = post_grad_graphs(_mlp, *_inputs())
        self.assertEqual(counts["all_reduce"], 1)
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 16]", arg1_1: "f32[16, 32]", arg2_1: "f32[32, 16]"):
        mm: "f32[4, 32]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        relu: "f32[4, 32]" = torch.ops.aten.relu.default(mm);  mm = None
        mm_1: "f32[4, 16]" = torch.ops.aten.mm.default(relu, arg2_1);  relu = arg2_1 = None
        all_reduce: "f32[4, 16]" = torch.ops._c10d_functional.all_reduce.default(mm_1, 'sum', '0');  mm_1 = None
        wait_tensor: "f32[4, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        return (wait_tensor,)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 16]", arg1_1: "f32[16, 32]", arg2_1: "f32[32, 16]"):
        mm: "f32[4, 32]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        relu: "f32[4, 32]" = torch.ops.aten.relu.default(mm);  mm = None
        mm_1: "f32[4, 16]" = torch.ops.aten.mm.default(relu, arg2_1);  relu = arg2_1 = None
        all_reduce_default: "f32[4, 16]" = torch.ops.graphar.all_reduce.default(mm_1, '0');  mm_1 = None
        return (all_reduce_default,)
""",
        )

    def test_several_all_reduces_functional_and_bf16(self) -> None:
        def two_layers(x, w1, w2):
            y = funcol.all_reduce(_mlp(x, w1, w2) @ w1, "sum", dist.group.WORLD)
            return funcol.all_reduce(torch.relu(y) @ w2, "sum", dist.group.WORLD)

        before, after, counts = post_grad_graphs(two_layers, *_inputs(torch.bfloat16))
        self.assertEqual(counts["all_reduce"], 3)
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 16]", arg1_1: "bf16[16, 32]", arg2_1: "bf16[32, 16]"):
        mm: "bf16[4, 32]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = None
        relu: "bf16[4, 32]" = torch.ops.aten.relu.default(mm);  mm = None
        mm_1: "bf16[4, 16]" = torch.ops.aten.mm.default(relu, arg2_1);  relu = None
        all_reduce_default: "bf16[4, 16]" = torch.ops.graphar.all_reduce.default(mm_1, '0');  mm_1 = None
        mm_2: "bf16[4, 32]" = torch.ops.aten.mm.default(all_reduce_default, arg1_1);  all_reduce_default = arg1_1 = None
        all_reduce_default_1: "bf16[4, 32]" = torch.ops.graphar.all_reduce.default(mm_2, '0');  mm_2 = None
        relu_1: "bf16[4, 32]" = torch.ops.aten.relu.default(all_reduce_default_1);  all_reduce_default_1 = None
        mm_3: "bf16[4, 16]" = torch.ops.aten.mm.default(relu_1, arg2_1);  relu_1 = arg2_1 = None
        all_reduce_default_2: "bf16[4, 16]" = torch.ops.graphar.all_reduce.default(mm_3, '0');  mm_3 = None
        return (all_reduce_default_2,)
""",
        )

    def test_in_place_on_graph_input_keeps_copy_epilogue(self) -> None:
        def in_place(x):
            dist.all_reduce(x)
            return x + 1

        before, after, counts = post_grad_graphs(in_place, torch.randn(8, 8))
        self.assertEqual(counts["all_reduce"], 1)
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 8]"):
        all_reduce: "f32[8, 8]" = torch.ops._c10d_functional.all_reduce.default(arg0_1, 'sum', '0')
        wait_tensor: "f32[8, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        add: "f32[8, 8]" = torch.ops.aten.add.Tensor(wait_tensor, 1)
        copy_: "f32[8, 8]" = torch.ops.aten.copy_.default(arg0_1, wait_tensor);  arg0_1 = wait_tensor = copy_ = None
        return (add,)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 8]"):
        all_reduce_default: "f32[8, 8]" = torch.ops.graphar.all_reduce.default(arg0_1, '0')
        add: "f32[8, 8]" = torch.ops.aten.add.Tensor(all_reduce_default, 1)
        copy_: "f32[8, 8]" = torch.ops.aten.copy_.default(arg0_1, all_reduce_default);  arg0_1 = all_reduce_default = copy_ = None
        return (add,)
""",
        )

    def test_subgroup(self) -> None:
        pair = dist.new_group([0, 1])

        def on_pair(x):
            dist.all_reduce(x, group=pair)
            return x * 2

        before, after, counts = post_grad_graphs(on_pair, torch.randn(8, 8))
        self.assertEqual(counts["all_reduce"], 1)
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 8]"):
        all_reduce_default: "f32[8, 8]" = torch.ops.graphar.all_reduce.default(arg0_1, '1')
        mul: "f32[8, 8]" = torch.ops.aten.mul.Tensor(all_reduce_default, 2)
        copy_: "f32[8, 8]" = torch.ops.aten.copy_.default(arg0_1, all_reduce_default);  arg0_1 = all_reduce_default = copy_ = None
        return (mul,)
""",
        )

    def test_non_sum_reduce_untouched(self) -> None:
        def maximum(x, w1, w2):
            y = x @ w1
            dist.all_reduce(y, op=dist.ReduceOp.MAX)
            return y

        before, after, counts = post_grad_graphs(maximum, *_inputs())
        self.assertEqual(counts["all_reduce"], 0)
        self.assertEqual(before, after)
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 16]", arg1_1: "f32[16, 32]"):
        mm: "f32[4, 32]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce: "f32[4, 32]" = torch.ops._c10d_functional.all_reduce.default(mm, 'max', '0');  mm = None
        wait_tensor: "f32[4, 32]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        return (wait_tensor,)
""",
        )

    def test_excluded_group_untouched(self) -> None:
        pair = dist.new_group([0, 1])

        def both(x):
            y = funcol.all_reduce(x, "sum", pair)
            return funcol.all_reduce(y * 2, "sum", dist.group.WORLD)

        config = Config(exclude_groups=(pair.group_name,))
        before, after, counts = post_grad_graphs(both, torch.randn(8, 8), config=config)
        self.assertEqual(counts["all_reduce"], 1)
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[8, 8]"):
        all_reduce: "f32[8, 8]" = torch.ops._c10d_functional.all_reduce.default(arg0_1, 'sum', '1');  arg0_1 = None
        wait_tensor: "f32[8, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        mul: "f32[8, 8]" = torch.ops.aten.mul.Tensor(wait_tensor, 2);  wait_tensor = None
        all_reduce_default: "f32[8, 8]" = torch.ops.graphar.all_reduce.default(mul, '0');  mul = None
        return (all_reduce_default,)
""",
        )

    def test_unsupported_dtype_and_size_over_limit_untouched(self) -> None:
        def ints_and_big(x, n):
            dist.all_reduce(n)
            dist.all_reduce(x)
            return x, n

        config = Config(max_all_reduce_bytes=1024)
        args = (torch.randn(16, 32), torch.randint(0, 9, (4,)))
        before, after, counts = post_grad_graphs(ints_and_big, *args, config=config)
        self.assertEqual(counts["all_reduce"], 0)
        self.assertEqual(before, after)

    def test_over_the_buffers_a_first_call_will_set_up_is_said_at_compile(self) -> None:
        """No communicator yet: a CUDA group sets up at its first call with GRAPHAR_MAX_ALLREDUCE_BYTES,
        so a rewritten all-reduce over that size is named at compile time; not for CPU tensors, nor
        for a group that will not set up."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from graphar.allreduce import set_up
        from passes import all_reduce as pass_module

        def match(device: str) -> pass_module._AllReduceMatch:
            graph = torch.fx.Graph()
            x = graph.placeholder("x")
            with FakeTensorMode():
                x.meta["val"] = torch.empty(16, 32, device=device)
            reduce = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
            return pass_module._AllReduceMatch(
                reduce, graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduce,))
            )

        with mock.patch.dict(os.environ, {"GRAPHAR_MAX_ALLREDUCE_BYTES": "1024"}):
            with (
                mock.patch.object(set_up, "_not_worth_setting_up", lambda group: None),
                self.assertLogs("graphar", "WARNING") as said,
            ):
                pass_module._warn_over_communicator_limit(match("cuda"))
            with self.assertNoLogs("graphar", level="WARNING"):
                pass_module._warn_over_communicator_limit(match("cpu"))
                pass_module._warn_over_communicator_limit(match("cuda"))  # the fake backend is not NCCL: no set-up
        self.assertIn("(2048 bytes) is over the IPC buffers of group '0' (1024 bytes", said.output[0])

    def test_symbolic_size_rewritten_unless_provably_over_limit(self) -> None:
        """Dynamic shapes: the op checks the size at each call, so only a size provably over the
        limit stays on the collective."""

        def layer(x, w):
            y = x @ w
            dist.all_reduce(y)
            return y

        w = torch.randn(16, 16)
        x = torch.randn(8, 16)
        torch._dynamo.mark_dynamic(x, 0)
        _, after, counts = post_grad_graphs(layer, x, w, config=Config(max_all_reduce_bytes=1 << 20))
        self.assertEqual(counts["all_reduce"], 1)
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s77)", arg1_1: "f32[s77, 16]", arg2_1: "f32[16, 16]"):
        mm: "f32[s77, 16]" = torch.ops.aten.mm.default(arg1_1, arg2_1);  arg1_1 = arg2_1 = None
        all_reduce_default: "f32[s77, 16]" = torch.ops.graphar.all_reduce.default(mm, '0');  mm = None
        return (all_reduce_default,)
""",
        )

        x = torch.randn(20000, 16)  # 64 bytes a row: over 1 MiB from 16385 rows
        torch._dynamo.mark_dynamic(x, 0, min=16385, max=1 << 20)
        _, after, counts = post_grad_graphs(layer, x, w, config=Config(max_all_reduce_bytes=1 << 20))
        self.assertEqual(counts["all_reduce"], 0)
        self.assertIn("_c10d_functional.all_reduce", after)

    def test_dtensor_tensor_parallel_mlp(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (WORLD,))
        mlp = torch.nn.Sequential(
            torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 16, bias=False)
        )
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        before, after, counts = post_grad_graphs(mlp, torch.randn(4, 16))
        self.assertEqual(counts["all_reduce"], 1)
        self.assertIn("graphar.all_reduce.default", after)
        if not torch.__version__.startswith("2.13"):
            return  # DTensor's graph signature differs between torch versions; the snapshots are 2.13's (CI's)
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 16]", arg1_1, arg2_1: "f32[8, 16]", arg3_1, arg4_1: "f32[16, 8]", arg5_1):
        permute: "f32[16, 8]" = torch.ops.aten.permute.default(arg2_1, [1, 0]);  arg2_1 = None
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(arg0_1, permute);  arg0_1 = permute = None
        relu: "f32[4, 8]" = torch.ops.aten.relu.default(mm);  mm = None
        permute_1: "f32[8, 16]" = torch.ops.aten.permute.default(arg4_1, [1, 0]);  arg4_1 = None
        mm_1: "f32[4, 16]" = torch.ops.aten.mm.default(relu, permute_1);  relu = permute_1 = None
        all_reduce: "f32[4, 16]" = torch.ops._c10d_functional.all_reduce.default(mm_1, 'sum', '0');  mm_1 = None
        wait_tensor: "f32[4, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        return (wait_tensor,)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 16]", arg1_1, arg2_1: "f32[8, 16]", arg3_1, arg4_1: "f32[16, 8]", arg5_1):
        permute: "f32[16, 8]" = torch.ops.aten.permute.default(arg2_1, [1, 0]);  arg2_1 = None
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(arg0_1, permute);  arg0_1 = permute = None
        relu: "f32[4, 8]" = torch.ops.aten.relu.default(mm);  mm = None
        permute_1: "f32[8, 16]" = torch.ops.aten.permute.default(arg4_1, [1, 0]);  arg4_1 = None
        mm_1: "f32[4, 16]" = torch.ops.aten.mm.default(relu, permute_1);  relu = permute_1 = None
        all_reduce_default: "f32[4, 16]" = torch.ops.graphar.all_reduce.default(mm_1, '0');  mm_1 = None
        return (all_reduce_default,)
""",
        )

    def test_every_rank_rewrites_the_same_graph(self) -> None:
        pair = dist.new_group([0, 1])

        def model(x, w1, w2):
            y = _mlp(x, w1, w2)
            return funcol.all_reduce(y, "sum", pair)

        graphs = []
        for rank in (0, 1):
            _init_fake_world(rank)
            pair = dist.new_group([0, 1])
            graphs.append(post_grad_graphs(model, *_inputs())[1])
        self.assertEqual(len(set(graphs)), 1)
        self.assertIn("graphar.all_reduce", graphs[0])
