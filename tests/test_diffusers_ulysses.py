"""Ulysses attention as HuggingFace diffusers writes it, in its native context parallelism: the pass
must find it without help, on the fake process group (graph) and on two gloo processes (values).

`diffusers_ulysses` performs the tensor ops of diffusers' `TemplatedUlyssesAttention.forward` and
its `_all_to_all_single` and `_wait_tensor` helpers (src/diffusers/models/attention_dispatch.py,
diffusers >= 0.35: the same in every version read, up to one with `ulysses_anything`), written anew:

- Q, K, V `[B, S, H, D]` -> view `[B, S, P, H/P, D]` -> permute (2, 1, 0, 3, 4) -> contiguous;
- the exchange: flatten to 1-D, funcol.all_to_all_single with no splits, reshape back to the 5-D
  shape, then wait (`.wait()` only on an AsyncCollectiveTensor: eager; traced code has no such tensor);
- flatten(0, 1) -> permute (1, 0, 2, 3) -> contiguous: `[B, P*S, H/P, D]`;
- the backend's forward op: transposes to `[B, H/P, P*S, D]` around the kernel; the native backend
  as views, the cuDNN and native-flash backends as contiguous copies;
- the output: view `[B, P, S, H/P, D]` -> permute (1, 3, 0, 2, 4) -> contiguous, the same exchange,
  flatten(0, 1) -> permute (1, 2, 0, 3) -> contiguous: `[B, S, H, D]`.

The whole runs inside a torch.autograd.Function, as diffusers' does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from expecttest import TestCase

import graphar  # noqa: F401  (registers the ops)
from graphar import processes
from graphar.config import Config
from tests._graphs import init_fake_world, post_grad_graphs

WORLD = 2
ONLY_QKV = Config(all_reduce=False)
PIPELINE = Config(all_reduce=False, attention_chunks=2)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """diffusers' all-to-all: flat, equal splits, reshaped before the wait."""
    shape = x.shape
    x = funcol.all_to_all_single(x.flatten(), None, None, group).reshape(shape)
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _ulysses_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, contiguous_kernel_inputs: bool) -> torch.Tensor:
    group = dist.group.WORLD
    p = dist.get_world_size(group)
    b, s_q, h, d = q.shape
    q, k, v = (x.reshape(b, x.shape[1], p, h // p, d).permute(2, 1, 0, 3, 4).contiguous() for x in (q, k, v))
    q, k, v = (_exchange(x, group) for x in (q, k, v))
    q, k, v = (x.flatten(0, 1).permute(1, 0, 2, 3).contiguous() for x in (q, k, v))
    if contiguous_kernel_inputs:  # the cuDNN and native-flash forward ops (they call the aten kernel itself)
        o = F.scaled_dot_product_attention(*(x.transpose(1, 2).contiguous() for x in (q, k, v)))
        o = o.transpose(1, 2).contiguous()
    else:  # the native forward op
        o = F.scaled_dot_product_attention(*(x.permute(0, 2, 1, 3) for x in (q, k, v))).permute(0, 2, 1, 3)
    o = o.reshape(b, p, s_q, h // p, d).permute(1, 3, 0, 2, 4).contiguous()
    return _exchange(o, group).flatten(0, 1).permute(1, 2, 0, 3).contiguous()


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, contiguous_kernel_inputs: bool
    ) -> torch.Tensor:
        ctx.contiguous_kernel_inputs = contiguous_kernel_inputs
        return _ulysses_forward(q, k, v, contiguous_kernel_inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise NotImplementedError("inference only")


def diffusers_ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _UlyssesAttention.apply(q, k, v, False)


def diffusers_ulysses_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _UlyssesAttention.apply(q, k, v, True)


def _qkv(b: int = 1, s: int = 6, s_kv: int | None = None, h: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, 16, generator=gen) for n in (s, s_kv or s, s_kv or s)]


class DiffusersUlyssesGraphTest(TestCase):
    def setUp(self) -> None:
        init_fake_world(WORLD)

    def tearDown(self) -> None:
        dist.destroy_process_group()

    def test_exchanges_are_rewritten(self) -> None:
        _, after, counts = post_grad_graphs(diffusers_ulysses, *_qkv(), config=ONLY_QKV)
        self.assertEqual(counts, {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1})
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[1, 6, 8, 16]", arg1_1: "f32[1, 6, 8, 16]", arg2_1: "f32[1, 6, 8, 16]"):
        qkv_all_to_all_default: "f32[1, 12, 12, 16]" = torch.ops.graphar.qkv_all_to_all.default(arg0_1, arg1_1, arg2_1, '0');  arg0_1 = arg1_1 = arg2_1 = None
        slice_tensor: "f32[1, 12, 4, 16]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 0, 4)
        slice_tensor_1: "f32[1, 12, 4, 16]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 4, 8)
        slice_tensor_2: "f32[1, 12, 4, 16]" = torch.ops.aten.slice.Tensor(qkv_all_to_all_default, 2, 8, 12);  qkv_all_to_all_default = None
        permute_6: "f32[1, 4, 12, 16]" = torch.ops.aten.permute.default(slice_tensor, [0, 2, 1, 3]);  slice_tensor = None
        permute_7: "f32[1, 4, 12, 16]" = torch.ops.aten.permute.default(slice_tensor_1, [0, 2, 1, 3]);  slice_tensor_1 = None
        permute_8: "f32[1, 4, 12, 16]" = torch.ops.aten.permute.default(slice_tensor_2, [0, 2, 1, 3]);  slice_tensor_2 = None
        _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(permute_6, permute_7, permute_8);  permute_6 = permute_7 = permute_8 = None
        getitem: "f32[1, 4, 12, 16]" = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
        permute_9: "f32[1, 12, 4, 16]" = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
        heads_to_seq_all_to_all_default: "f32[1, 6, 8, 16]" = torch.ops.graphar.heads_to_seq_all_to_all.default(permute_9, '0');  permute_9 = None
        return (heads_to_seq_all_to_all_default,)
""",
        )

    def test_pipelined_for_both_kernel_input_forms(self) -> None:
        for fn in (diffusers_ulysses, diffusers_ulysses_cudnn):
            with self.subTest(fn.__name__):
                _, after, counts = post_grad_graphs(fn, *_qkv(b=2), config=PIPELINE)
                self.assertEqual(counts, {"ulysses_attention": 1})  # no exchange left: they are in it
                call = "graphar.ulysses_attention.default(arg0_1, arg1_1, arg2_1, '0', False, None, 2, 'flash')"
                self.assertIn(call, after)

    def test_dynamic_sequence_and_batch(self) -> None:
        qkv = _qkv(b=2)
        for t in qkv:
            torch._dynamo.mark_dynamic(t, (0, 1))
        _, _, counts = post_grad_graphs(diffusers_ulysses, *qkv, config=PIPELINE)
        self.assertEqual(counts, {"ulysses_attention": 1})

    def test_counts_name_the_ops_the_graph_holds(self) -> None:
        # Two attention layers: with the pipeline on, its ops hold all four exchanges, none is left.
        def two_layers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            x = diffusers_ulysses(q, k, v) + q  # a residual between the layers, as in a transformer block
            return diffusers_ulysses(x, x, x)

        for config, expected in (
            (ONLY_QKV, {"qkv_all_to_all": 2, "heads_to_seq_all_to_all": 2}),
            (PIPELINE, {"ulysses_attention": 2}),
        ):
            with self.subTest(attention_chunks=config.attention_chunks):
                _, after, counts = post_grad_graphs(two_layers, *_qkv(), config=config)
                self.assertEqual(counts, expected)
                self.assertEqual(after.count("torch.ops.graphar."), 2 * len(expected))
                self.assertNotIn("all_to_all_single", after)

    def test_cross_attention_lengths_leave_qkv_unpacked(self) -> None:
        # diffusers lets K/V be shorter than Q; Q/K/V are then no triplet, the output still is rewritten.
        with self.assertLogs("graphar", "INFO") as logs:
            _, after, counts = post_grad_graphs(diffusers_ulysses, *_qkv(s_kv=4), config=PIPELINE)
        self.assertEqual(counts, {"heads_to_seq_all_to_all": 1})
        self.assertNotIn("graphar.qkv_all_to_all", after)
        self.assertIn("alone, an exchange scattering dim 2 gains nothing", "\n".join(logs.output))


def _worker(rank: int, world_size: int) -> None:
    from torch._dynamo.utils import counters

    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass under test
    try:
        qkv = _qkv(b=2, seed=rank)
        with torch.no_grad():
            for fn, chunks in ((diffusers_ulysses, 0), (diffusers_ulysses, 2), (diffusers_ulysses_cudnn, 2)):
                torch._dynamo.reset()
                counters.clear()
                got = torch.compile(fn, backend="graphar", options={"attention_chunks": chunks}, fullgraph=True)(*qkv)
                # The graphar ops in the compiled code, as the compile-end callback reports them.
                exchanges = {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1}
                expected = {"ulysses_attention": 1} if chunks > 1 else exchanges
                assert counters["graphar"] == expected, (fn.__name__, chunks, dict(counters["graphar"]))
                torch.testing.assert_close(got, fn(*qkv), rtol=1e-5, atol=1e-5, msg=f"rank {rank} {fn.__name__}")
    finally:
        dist.destroy_process_group()


def test_compiled_equals_eager_on_gloo() -> None:
    processes.run(_worker, WORLD, collective_timeout_s=120)
