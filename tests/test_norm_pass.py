"""Snapshots of the all-reduce + residual add + RMSNorm fusion on the post-grad graph (fake process
group, no GPU): every form a norm takes after Inductor's decompositions, and what is left alone."""

from __future__ import annotations

import os
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import TestCase

import graphar  # noqa: F401  (registers the ops)
from graphar import _cuda
from graphar.allreduce import policy
from graphar.config import Config
from tests._graphs import all_post_grad_graphs, init_fake_world, post_grad_graphs

FUSE = Config(fuse_norm=True)
NEVER = "the fused kernel would never take it: "  # the norms the pass can prove no call would fuse


def _hf_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float | torch.Tensor = 1e-6, dim: int = -1):
    """HF's LlamaRMSNorm.forward; `dim` other than -1 makes a norm graphar must not fuse."""
    v = h.to(torch.float32)
    v = v * torch.rsqrt(v.pow(2).mean(dim, keepdim=True) + eps)
    return weight * v.to(h.dtype)


def _row_parallel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w
    dist.all_reduce(y)
    return y


def _hf_block(x, w, residual, weight):
    """The residual flows on to the next block."""
    h = _row_parallel(x, w) + residual
    return _hf_rms_norm(h, weight), h


def _inputs(dtype: torch.dtype = torch.float32, residual_dtype: torch.dtype | None = None):
    return (
        torch.randn(4, 8, dtype=dtype),
        torch.randn(8, 16, dtype=dtype),
        torch.randn(4, 16, dtype=residual_dtype or dtype),
        torch.randn(16, dtype=dtype),
    )


class NormPassTest(TestCase):
    def setUp(self) -> None:
        init_fake_world(2)

    def tearDown(self) -> None:
        dist.destroy_process_group()

    def _fused(self, fn: Callable, *args: torch.Tensor) -> str:
        before, after, counts = post_grad_graphs(fn, *args, config=FUSE)
        self.assertEqual(counts, {"all_reduce_add_rms_norm": 1})  # the all-reduce is in it
        return after

    def _left_alone(self, fn: Callable, reason: str, *args: torch.Tensor) -> str:
        with self.assertLogs("graphar", "INFO") as logs:
            _, after, counts = post_grad_graphs(fn, *args, config=FUSE)
        self.assertEqual(counts, {"all_reduce": 1})
        self.assertIn(f"not fused with a norm: {reason}", "\n".join(logs.output))
        self.assertIn("graphar.all_reduce.default", after)
        return after

    def test_hf_block_bf16_residual_flows_on(self) -> None:
        before, after, counts = post_grad_graphs(_hf_block, *_inputs(torch.bfloat16), config=FUSE)
        self.assertEqual(counts, {"all_reduce_add_rms_norm": 1})
        self.assertExpectedInline(
            before,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 8]", arg1_1: "bf16[8, 16]", arg2_1: "bf16[4, 16]", arg3_1: "bf16[16]"):
        mm: "bf16[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce: "bf16[4, 16]" = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', '0');  mm = None
        wait_tensor: "bf16[4, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        add: "bf16[4, 16]" = torch.ops.aten.add.Tensor(wait_tensor, arg2_1);  wait_tensor = arg2_1 = None
        convert_element_type_2: "f32[4, 16]" = torch.ops.prims.convert_element_type.default(add, torch.float32)
        pow_1: "f32[4, 16]" = torch.ops.aten.pow.Tensor_Scalar(convert_element_type_2, 2)
        mean: "f32[4, 1]" = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
        add_1: "f32[4, 1]" = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
        rsqrt: "f32[4, 1]" = torch.ops.aten.rsqrt.default(add_1);  add_1 = None
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(convert_element_type_2, rsqrt);  convert_element_type_2 = rsqrt = None
        convert_element_type_3: "bf16[4, 16]" = torch.ops.prims.convert_element_type.default(mul, torch.bfloat16);  mul = None
        mul_1: "bf16[4, 16]" = torch.ops.aten.mul.Tensor(arg3_1, convert_element_type_3);  arg3_1 = convert_element_type_3 = None
        return (mul_1, add)
""",
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 8]", arg1_1: "bf16[8, 16]", arg2_1: "bf16[4, 16]", arg3_1: "bf16[16]"):
        mm: "bf16[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce_add_rms_norm_default = torch.ops.graphar.all_reduce_add_rms_norm.default(mm, arg2_1, arg3_1, 1e-06, '0', False);  mm = arg2_1 = arg3_1 = None
        getitem: "bf16[4, 16]" = all_reduce_add_rms_norm_default[0]
        getitem_1: "bf16[4, 16]" = all_reduce_add_rms_norm_default[1];  all_reduce_add_rms_norm_default = None
        return (getitem, getitem_1)
""",
        )

    def test_hf_norm_fp32_residual_not_returned(self) -> None:
        self.assertExpectedInline(
            self._fused(lambda *a: _hf_block(*a)[0], *_inputs()),
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 8]", arg1_1: "f32[8, 16]", arg2_1: "f32[4, 16]", arg3_1: "f32[16]"):
        mm: "f32[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce_add_rms_norm_default = torch.ops.graphar.all_reduce_add_rms_norm.default(mm, arg2_1, arg3_1, 1e-06, '0', False);  mm = arg2_1 = arg3_1 = None
        getitem: "f32[4, 16]" = all_reduce_add_rms_norm_default[0];  all_reduce_add_rms_norm_default = None
        return (getitem,)
""",
        )

    def test_f_rms_norm_residual_first_bf16(self) -> None:
        def block(x, w, residual, weight):
            h = residual + _row_parallel(x, w)
            return F.rms_norm(h, (16,), weight, 1e-5), h

        self.assertExpectedInline(
            self._fused(block, *_inputs(torch.bfloat16)),
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 8]", arg1_1: "bf16[8, 16]", arg2_1: "bf16[4, 16]", arg3_1: "bf16[16]"):
        mm: "bf16[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce_add_rms_norm_default = torch.ops.graphar.all_reduce_add_rms_norm.default(mm, arg2_1, arg3_1, 9.999999747378752e-06, '0', True);  mm = arg2_1 = arg3_1 = None
        getitem: "bf16[4, 16]" = all_reduce_add_rms_norm_default[0]
        getitem_1: "bf16[4, 16]" = all_reduce_add_rms_norm_default[1];  all_reduce_add_rms_norm_default = None
        return (getitem, getitem_1)
""",
        )

    def test_rms_norm_without_weight(self) -> None:
        def block(x, w, residual, weight):
            return F.rms_norm(residual + _row_parallel(x, w), (16,), None, 1e-5)

        self.assertExpectedInline(
            self._fused(block, *_inputs()),
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[4, 8]", arg1_1: "f32[8, 16]", arg2_1: "f32[4, 16]"):
        mm: "f32[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce_add_rms_norm_default = torch.ops.graphar.all_reduce_add_rms_norm.default(mm, arg2_1, None, 9.999999747378752e-06, '0', False);  mm = arg2_1 = None
        getitem: "f32[4, 16]" = all_reduce_add_rms_norm_default[0];  all_reduce_add_rms_norm_default = None
        return (getitem,)
""",
        )

    def test_no_residual_nn_rms_norm(self) -> None:
        norm = torch.nn.RMSNorm(16, eps=1e-5, dtype=torch.bfloat16)

        def block(x, w, residual, weight):
            y = _row_parallel(x, w)
            return norm(y), y

        self.assertExpectedInline(
            self._fused(block, *_inputs(torch.bfloat16)),
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 8]", arg1_1: "bf16[8, 16]", arg2_1: "bf16[16]"):
        mm: "bf16[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce_add_rms_norm_default = torch.ops.graphar.all_reduce_add_rms_norm.default(mm, None, arg2_1, 9.999999747378752e-06, '0', True);  mm = arg2_1 = None
        getitem: "bf16[4, 16]" = all_reduce_add_rms_norm_default[0]
        getitem_1: "bf16[4, 16]" = all_reduce_add_rms_norm_default[1];  all_reduce_add_rms_norm_default = None
        return (getitem, getitem_1)
""",
        )

    def test_upcast_all_reduce_into_fp32_residual(self) -> None:
        """The fused kernel takes a residual of the all-reduce's dtype only: fused, every call would run
        the all-reduce and the norm apart, where Inductor makes the norm one kernel of its own."""

        def block(x, w, residual, weight):
            h = _row_parallel(x, w).to(torch.float32) + residual
            return _hf_rms_norm(h, weight), h

        reason = NEVER + "the residual is torch.float32, the kernel takes only the input's dtype (torch.bfloat16)"
        self.assertExpectedInline(
            self._left_alone(block, reason, *_inputs(torch.bfloat16, torch.float32)),
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 8]", arg1_1: "bf16[8, 16]", arg2_1: "f32[4, 16]", arg3_1: "bf16[16]"):
        mm: "bf16[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce_default: "bf16[4, 16]" = torch.ops.graphar.all_reduce.default(mm, '0');  mm = None
        convert_element_type_2: "f32[4, 16]" = torch.ops.prims.convert_element_type.default(all_reduce_default, torch.float32);  all_reduce_default = None
        add: "f32[4, 16]" = torch.ops.aten.add.Tensor(convert_element_type_2, arg2_1);  convert_element_type_2 = arg2_1 = None
        pow_1: "f32[4, 16]" = torch.ops.aten.pow.Tensor_Scalar(add, 2)
        mean: "f32[4, 1]" = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
        add_1: "f32[4, 1]" = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
        rsqrt: "f32[4, 1]" = torch.ops.aten.rsqrt.default(add_1);  add_1 = None
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(add, rsqrt);  rsqrt = None
        mul_1: "f32[4, 16]" = torch.ops.aten.mul.Tensor(arg3_1, mul);  arg3_1 = mul = None
        return (mul_1, add)
""",
        )

    def test_weight_of_another_dtype(self) -> None:
        x, w, residual, weight = _inputs(torch.bfloat16)
        self._left_alone(
            _hf_block,
            NEVER + "the weight is torch.float32, the kernel takes only the input's dtype",
            x,
            w,
            residual,
            weight.float(),
        )

    def test_rows_not_a_multiple_of_16_bytes(self) -> None:
        x, w, residual, weight = (t[..., :12] for t in _inputs(torch.bfloat16))  # 24-byte rows
        self._left_alone(_hf_block, NEVER + "rows of 24 bytes are not a multiple of 16", x, w, residual, weight)

    def test_rows_over_the_kernel_bound(self) -> None:
        hidden, bound = _cuda.NORM_MAX_ROW_BYTES // 4 + 4, _cuda.NORM_MAX_ROW_BYTES
        args = torch.randn(2, 8), torch.randn(8, hidden), torch.randn(2, hidden), torch.randn(hidden)
        self._left_alone(_hf_block, NEVER + f"rows of {hidden * 4} bytes are over the kernel's {bound}", *args)

    @staticmethod
    def _over_the_largest_fused_norm() -> tuple[torch.Tensor, ...]:
        """float32 rows of 64 bytes, one more than any communicator's fused norm takes."""
        rows = policy.FUSED_NORM_CEILING // 64 + 1
        return torch.randn(rows, 8), torch.randn(8, 16), torch.randn(rows, 16), torch.randn(16)

    def test_static_size_over_the_largest_fused_norm(self) -> None:
        args = self._over_the_largest_fused_norm()
        reason = f"{args[2].nbytes} bytes are over the fused norm's {policy.FUSED_NORM_CEILING}"
        self._left_alone(_hf_block, NEVER + reason, *args)

    def test_symbolic_size_fuses_and_the_op_checks_each_call(self) -> None:
        """Prefill under dynamic shapes: some batch may fit, so it fuses; and nothing is guarded on the size."""
        args = self._over_the_largest_fused_norm()
        for t in (args[0], args[2]):
            torch._dynamo.mark_dynamic(t, 0)
        recorders: list = []
        ((_, _, counts),) = all_post_grad_graphs(_hf_block, *args, config=FUSE, recorders=recorders)
        self.assertEqual(counts, {"all_reduce_add_rms_norm": 1})
        self.assertEqual(recorders[0].new_facts, [])

    def test_forced_kernel_without_a_fused_form(self) -> None:
        with mock.patch.dict(os.environ, {"GRAPHAR_ALLREDUCE_ALGO": "1stage"}):
            self._left_alone(
                _hf_block,
                NEVER + "GRAPHAR_ALLREDUCE_ALGO='1stage' forces a kernel with no fused form",
                *_inputs(torch.bfloat16),
            )
        with mock.patch.dict(os.environ, {"GRAPHAR_ALLREDUCE_ALGO": "push-oneshot"}):  # the fused kernel's own
            self._fused(_hf_block, *_inputs(torch.bfloat16))

    def test_default_config_does_not_fuse(self) -> None:
        _, after, counts = post_grad_graphs(_hf_block, *_inputs(torch.bfloat16))
        self.assertEqual(counts, {"all_reduce": 1})
        self.assertIn("graphar.all_reduce.default", after)
        self.assertNotIn("all_reduce_add_rms_norm", after)

    def test_mean_not_over_the_last_dim(self) -> None:
        def block(x, w, residual, weight):
            return _hf_rms_norm(_row_parallel(x, w) + residual, weight, dim=0)

        self._left_alone(block, "the mean is over dims [0]", *_inputs())

    def test_norm_over_two_dims(self) -> None:
        def block(x, w, residual, weight):
            return F.rms_norm(_row_parallel(x, w) + residual, (4, 16), None, 1e-5)

        self._left_alone(block, "the mean is over dims [1, 0]", *_inputs())

    def test_pre_add_value_used_elsewhere(self) -> None:
        def block(x, w, residual, weight):
            y = _row_parallel(x, w)
            return _hf_rms_norm(y + residual, weight), y

        self._left_alone(block, "the all-reduced value before the residual add is used elsewhere", *_inputs())

    def test_upcast_all_reduce_into_narrower_residual(self) -> None:
        """The op would add x before its upcast: the sum h that flows on would be bf16, not f32."""

        def block(x, w, residual, weight):
            h = _row_parallel(x, w).to(torch.float32) + residual
            return _hf_rms_norm(h, weight), h

        x, w, residual, weight = _inputs(torch.bfloat16)
        after = self._left_alone(
            block,
            "the residual sum is torch.float32, the fused op's would be torch.bfloat16",
            x,
            w,
            residual,
            weight.float(),
        )
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "bf16[4, 8]", arg1_1: "bf16[8, 16]", arg2_1: "bf16[4, 16]", arg3_1: "f32[16]"):
        mm: "bf16[4, 16]" = torch.ops.aten.mm.default(arg0_1, arg1_1);  arg0_1 = arg1_1 = None
        all_reduce_default: "bf16[4, 16]" = torch.ops.graphar.all_reduce.default(mm, '0');  mm = None
        convert_element_type_2: "f32[4, 16]" = torch.ops.prims.convert_element_type.default(all_reduce_default, torch.float32);  all_reduce_default = None
        add: "f32[4, 16]" = torch.ops.aten.add.Tensor(convert_element_type_2, arg2_1);  convert_element_type_2 = arg2_1 = None
        pow_1: "f32[4, 16]" = torch.ops.aten.pow.Tensor_Scalar(add, 2)
        mean: "f32[4, 1]" = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
        add_1: "f32[4, 1]" = torch.ops.aten.add.Tensor(mean, 1e-06);  mean = None
        rsqrt: "f32[4, 1]" = torch.ops.aten.rsqrt.default(add_1);  add_1 = None
        mul: "f32[4, 16]" = torch.ops.aten.mul.Tensor(add, rsqrt);  rsqrt = None
        mul_1: "f32[4, 16]" = torch.ops.aten.mul.Tensor(arg3_1, mul);  arg3_1 = mul = None
        return (mul_1, add)
""",
        )

    def test_eps_not_a_constant(self) -> None:
        def block(x, w, residual, weight):
            return _hf_rms_norm(_row_parallel(x, w) + residual, weight, eps=weight[:1])

        self._left_alone(block, "eps is not a constant", *_inputs())

    def test_eps_made_an_input_by_dynamic_true_warns_once_with_the_cure(self) -> None:
        class Norm(torch.nn.Module):  # as HF writes it: eps a float attribute
            def __init__(self) -> None:
                super().__init__()
                self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(16)), 1e-6

            def forward(self, h: torch.Tensor) -> torch.Tensor:
                v = h.to(torch.float32)
                return self.weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

        norm = Norm()

        def two_blocks(x, w, residual, weight):
            h = _row_parallel(x, w) + residual
            h = _row_parallel(norm(h)[:, :8], w) + h
            return norm(h), h

        with self.assertLogs("graphar", "WARNING") as logs:
            _, _, counts = post_grad_graphs(two_blocks, *_inputs(), config=FUSE, dynamic=True)
        self.assertEqual(counts, {"all_reduce": 2})
        self.assertEqual(
            [line for line in logs.output if "specialize_float" in line],
            [
                "WARNING:graphar:graphar: 2 all-reduce + RMSNorm not fused: their eps is an input of the graph, not a "
                "constant (torch.compile(dynamic=True) passes float attributes as inputs); "
                "torch._dynamo.config.specialize_float = True keeps them constants"
            ],
        )


class UnfusedMathTest(TestCase):
    """The op's math rounds as the graph it replaces does, in both weight orders (fake process group:
    the all-reduce returns its input, so the references are plain PyTorch)."""

    def setUp(self) -> None:
        init_fake_world(2)

    def tearDown(self) -> None:
        dist.destroy_process_group()

    def test_rounds_as_hf_and_f_rms_norm_do(self) -> None:
        x, residual = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
        weight = torch.randn(64, dtype=torch.bfloat16)
        fused = torch.ops.graphar.all_reduce_add_rms_norm
        h = x + residual
        normed, summed = fused(x, residual, weight, 1e-6, "0", False)
        self.assertTrue(torch.equal(summed, h) and torch.equal(normed, _hf_rms_norm(h, weight)))
        normed, _ = fused(x, residual, weight, 1e-5, "0", True)
        self.assertTrue(torch.equal(normed, F.rms_norm(h, (64,), weight, 1e-5)))
