"""Snapshots of the Ulysses attention rewrite on the post-grad graph (fake process group, no GPU):
exchange -> attention -> exchange becomes one `graphar::ulysses_attention`, and what is left alone."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import TestCase

import graphar  # noqa: F401  (registers the ops)
from graphar.config import Config
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked
from tests._graphs import init_fake_world, post_grad_graphs
from tests._ulysses import UlyssesBlock, heads_to_seq_dim1, seq_to_heads_dim1

PIPELINE = Config(attention_chunks=2)


def _weight(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))


def _attention(q, k, v, **sdpa):
    """Ulysses attention as yunchang writes it, with SDPA's options passed through."""
    qh, kh, vh = (seq_to_heads_unpacked(x).transpose(1, 2) for x in (q, k, v))
    return heads_to_seq_unpacked(F.scaled_dot_product_attention(qh, kh, vh, **sdpa).transpose(1, 2))


def _qkv(heads: int = 8, kv_heads: int = 8):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 6, h, 16, generator=gen) for h in (heads, kv_heads, kv_heads)]


class AttentionPassTest(TestCase):
    def setUp(self) -> None:
        init_fake_world(2)

    def tearDown(self) -> None:
        dist.destroy_process_group()

    def _left_alone(self, fn, reason: str, *args, config: Config = PIPELINE) -> None:
        with self.assertLogs("graphar", "INFO") as logs:
            _, after, counts = post_grad_graphs(fn, *args, config=config)
        self.assertEqual(counts.get("ulysses_attention", 0), 0)
        self.assertIn(f"left unpipelined: {reason}", "\n".join(logs.output))
        self.assertIn("graphar.heads_to_seq_all_to_all.default", after)

    def test_block_attention_becomes_one_pipelined_op(self) -> None:
        block = UlyssesBlock(8, 8, 16, _weight, exact=False)
        _, after, counts = post_grad_graphs(block, torch.randn(1, 6, 128), config=PIPELINE)
        self.assertEqual(counts, {"ulysses_attention": 1})  # no exchange left: they are in it
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[1, 6, 128]", arg1_1: "f32[128, 128]", arg2_1: "f32[128, 128]", arg3_1: "f32[128, 128]"):
        view: "f32[6, 128]" = torch.ops.aten.view.default(arg0_1, [6, 128])
        mm: "f32[6, 128]" = torch.ops.aten.mm.default(view, arg1_1);  view = arg1_1 = None
        view_1: "f32[1, 6, 128]" = torch.ops.aten.view.default(mm, [1, 6, 128]);  mm = None
        view_2: "f32[1, 6, 8, 16]" = torch.ops.aten.view.default(view_1, [1, 6, 8, 16]);  view_1 = None
        view_8: "f32[6, 128]" = torch.ops.aten.view.default(arg0_1, [6, 128])
        mm_1: "f32[6, 128]" = torch.ops.aten.mm.default(view_8, arg2_1);  view_8 = arg2_1 = None
        view_9: "f32[1, 6, 128]" = torch.ops.aten.view.default(mm_1, [1, 6, 128]);  mm_1 = None
        view_10: "f32[1, 6, 8, 16]" = torch.ops.aten.view.default(view_9, [1, 6, 8, 16]);  view_9 = None
        view_16: "f32[6, 128]" = torch.ops.aten.view.default(arg0_1, [6, 128]);  arg0_1 = None
        mm_2: "f32[6, 128]" = torch.ops.aten.mm.default(view_16, arg3_1);  view_16 = arg3_1 = None
        view_17: "f32[1, 6, 128]" = torch.ops.aten.view.default(mm_2, [1, 6, 128]);  mm_2 = None
        view_18: "f32[1, 6, 8, 16]" = torch.ops.aten.view.default(view_17, [1, 6, 8, 16]);  view_17 = None
        ulysses_attention_default: "f32[1, 6, 8, 16]" = torch.ops.graphar.ulysses_attention.default(view_2, view_10, view_18, '0', False, None, 2, 'flash');  view_2 = view_10 = view_18 = None
        view_41: "f32[1, 6, 128]" = torch.ops.aten.view.default(ulysses_attention_default, [1, 6, 128]);  ulysses_attention_default = None
        return (view_41,)
""",
        )

    def test_causal_and_scale_travel_with_the_op(self) -> None:
        _, after, counts = post_grad_graphs(
            lambda q, k, v: _attention(q, k, v, is_causal=True, scale=0.25), *_qkv(), config=PIPELINE
        )
        self.assertEqual(counts, {"ulysses_attention": 1})
        self.assertIn("graphar.ulysses_attention.default(arg0_1, arg1_1, arg2_1, '0', True, 0.25, 2, 'flash')", after)

    def test_gqa_with_a_kernel_that_takes_it(self) -> None:
        # The CPU flash kernel takes fewer K/V heads itself; the op runs SDPA with enable_gqa.
        _, after, counts = post_grad_graphs(
            lambda q, k, v: _attention(q, k, v, enable_gqa=True), *_qkv(8, 4), config=PIPELINE
        )
        self.assertEqual(counts, {"ulysses_attention": 1})
        self.assertIn("graphar.ulysses_attention.default(arg0_1, arg1_1, arg2_1, '0', False, None, 2, 'flash')", after)

    def test_contiguous_output_as_diffusers_writes_it(self) -> None:
        def contiguous(q, k, v):
            qh, kh, vh = (seq_to_heads_unpacked(x).transpose(1, 2) for x in (q, k, v))
            return heads_to_seq_unpacked(F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).contiguous())

        _, after, counts = post_grad_graphs(contiguous, *_qkv(), config=PIPELINE)
        self.assertEqual(counts, {"ulysses_attention": 1})

    def test_the_benchmark_block_gets_the_op(self) -> None:
        # QK-norm and RoPE before the exchange, a contiguous output and a projection after it.
        from attention import Block

        block = Block((1, 12, 8, 16), rank=0, world_size=2, exchange=True, device="cpu")
        with torch.no_grad():
            _, after, counts = post_grad_graphs(block, torch.randn(1, 6, 128, dtype=torch.bfloat16), config=PIPELINE)
        self.assertEqual(counts, {"ulysses_attention": 1})

    def test_heads_at_dim_1_as_xdit_writes_it(self) -> None:
        def xdit(q, k, v):  # [b, h, S, d] in and out, functional collectives
            qh, kh, vh = (seq_to_heads_dim1(x) for x in (q, k, v))
            return heads_to_seq_dim1(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))

        gen = torch.Generator().manual_seed(0)
        qkv = [torch.randn(1, 8, 6, 16, generator=gen) for _ in range(3)]
        _, after, counts = post_grad_graphs(xdit, *qkv, config=PIPELINE)
        self.assertEqual(counts, {"ulysses_attention": 1})
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[1, 8, 6, 16]", arg1_1: "f32[1, 8, 6, 16]", arg2_1: "f32[1, 8, 6, 16]"):
        permute_default: "f32[1, 6, 8, 16]" = torch.ops.aten.permute.default(arg0_1, [0, 2, 1, 3]);  arg0_1 = None
        permute_default_1: "f32[1, 6, 8, 16]" = torch.ops.aten.permute.default(arg1_1, [0, 2, 1, 3]);  arg1_1 = None
        permute_default_2: "f32[1, 6, 8, 16]" = torch.ops.aten.permute.default(arg2_1, [0, 2, 1, 3]);  arg2_1 = None
        ulysses_attention_default: "f32[1, 6, 8, 16]" = torch.ops.graphar.ulysses_attention.default(permute_default, permute_default_1, permute_default_2, '0', True, None, 2, 'flash');  permute_default = permute_default_1 = permute_default_2 = None
        permute_default_7: "f32[1, 8, 6, 16]" = torch.ops.aten.permute.default(ulysses_attention_default, [0, 2, 1, 3]);  ulysses_attention_default = None
        clone_default: "f32[1, 8, 6, 16]" = torch.ops.aten.clone.default(permute_default_7, memory_format = torch.contiguous_format);  permute_default_7 = None
        return (clone_default,)
""",
        )
        _, after, counts = post_grad_graphs(xdit, *qkv)  # without the overlap, the output stays on NCCL
        self.assertEqual(counts, {"qkv_all_to_all": 1})

    def test_gqa_with_kv_repeated_as_hf_writes_it(self) -> None:
        def repeat_kv(x, n):  # HF's repeat_kv
            b, h, s, d = x.shape
            return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

        # The same repeat as other code writes it: repeat_interleave, and the new dim counted from the end.
        for repeat in (
            repeat_kv,
            lambda x, n: x.repeat_interleave(n, dim=1),
            lambda x, n: x.unsqueeze(-3).expand(-1, -1, n, -1, -1).flatten(1, 2),
        ):

            def hf(q, k, v):
                qh, kh, vh = (seq_to_heads_unpacked(x).transpose(1, 2) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qh, repeat(kh, 2), repeat(vh, 2)).transpose(1, 2)
                return heads_to_seq_unpacked(o)

            _, after, counts = post_grad_graphs(hf, *_qkv(8, 4), config=PIPELINE)
            self.assertEqual(counts, {"ulysses_attention": 1})
            self.assertIn(
                "graphar.ulysses_attention.default(arg0_1, arg1_1, arg2_1, '0', False, None, 2, 'flash')", after
            )

    def test_dynamic_sequence_and_batch(self) -> None:
        # A second shape under default torch.compile recompiles with symbolic sizes: the rewrite holds.
        qkv = _qkv()
        for t in qkv:
            torch._dynamo.mark_dynamic(t, (0, 1))
        _, after, counts = post_grad_graphs(lambda q, k, v: _attention(q, k, v, is_causal=True), *qkv, config=PIPELINE)
        self.assertEqual(counts, {"ulysses_attention": 1})
        self.assertExpectedInline(
            after,
            """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s25)", arg1_1: "f32[1, s25, 8, 16]", arg2_1: "Sym(s25)", arg3_1: "f32[1, s25, 8, 16]", arg4_1: "Sym(s25)", arg5_1: "f32[1, s25, 8, 16]"):
        ulysses_attention_default: "f32[1, s25, 8, 16]" = torch.ops.graphar.ulysses_attention.default(arg1_1, arg3_1, arg5_1, '0', True, None, 2, 'flash');  arg1_1 = arg3_1 = arg5_1 = None
        return (ulysses_attention_default,)
""",
        )

    def test_exchanges_not_around_an_attention_stay_as_they_were(self) -> None:
        # Every size symbolic (heads too): Q, K and V cannot be packed; with the option on, their
        # exchanges (heads at dim 1 read as scattering dim 2) must not become output exchanges.
        with self.assertLogs("graphar", "INFO") as logs:
            _, after, counts = post_grad_graphs(
                lambda q, k, v: _attention(q, k, v, is_causal=True), *_qkv(), config=PIPELINE, dynamic=True
            )
        self.assertEqual(counts.get("ulysses_attention", 0), 0)
        self.assertEqual(after.count("graphar.heads_to_seq_all_to_all.default("), 1)
        self.assertIn("left alone: alone, an exchange scattering dim 2 gains nothing", "\n".join(logs.output))

    def test_auto_lets_the_op_pick_the_chunks(self) -> None:
        # attention_chunks="auto": the op gets AUTO_CHUNKS and applies the measured rule at run time.
        _, after, counts = post_grad_graphs(_attention, *_qkv(), config=Config(attention_chunks="auto"))
        self.assertEqual(counts, {"ulysses_attention": 1})
        self.assertIn("graphar.ulysses_attention.default(arg0_1, arg1_1, arg2_1, '0', False, None, -1, 'flash')", after)

    def test_off_by_default(self) -> None:
        _, after, counts = post_grad_graphs(_attention, *_qkv())
        self.assertNotIn("ulysses_attention", counts)
        self.assertIn("graphar.heads_to_seq_all_to_all.default", after)

    def test_mask_is_left_alone(self) -> None:
        mask = torch.ones(12, 12, dtype=torch.bool).tril()
        self._left_alone(
            lambda q, k, v: _attention(q, k, v, attn_mask=mask), "the attention has a mask or bias", *_qkv()
        )

    def test_strided_slices_of_the_exchange_are_left_alone(self) -> None:
        def every_other_kv_head(q, k, v):  # hand-written: K and V take every other head of theirs
            packed = torch.ops.graphar.qkv_all_to_all(q, k, v, "0")
            qh, kh, vh = (x.transpose(1, 2) for x in (packed[:, :, 0:4], packed[:, :, 4:8:2], packed[:, :, 8:12:2]))
            return heads_to_seq_unpacked(F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True).transpose(1, 2))

        self._left_alone(every_other_kv_head, "a Q/K/V slice has a step: it takes every n-th head", *_qkv())

    def test_kv_tiled_rather_than_repeated_per_head_is_left_alone(self) -> None:
        # unsqueeze(1): K/V heads tiled (h0 h1 h0 h1), which GQA does not read; same shape as repeat_kv.
        def tiled(q, k, v):
            qh, kh, vh = (seq_to_heads_unpacked(x).transpose(1, 2) for x in (q, k, v))
            kh, vh = (x.unsqueeze(1).expand(-1, 2, -1, -1, -1).flatten(1, 2) for x in (kh, vh))
            return heads_to_seq_unpacked(F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2))

        self._left_alone(
            tiled, "an attention input is not a slice of a Q/K/V exchange with heads moved to dim 1", *_qkv(8, 4)
        )

    def test_heads_that_do_not_split_are_left_alone(self) -> None:
        self._left_alone(_attention, "2 Q and 2 K/V heads do not split into 2 or more chunks per rank", *_qkv(2, 2))

    def test_attention_output_used_twice_is_left_alone(self) -> None:
        def twice(q, k, v):
            qh, kh, vh = (seq_to_heads_unpacked(x).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2)
            return heads_to_seq_unpacked(o), o.sum()

        self._left_alone(twice, "the attention's outputs are used elsewhere too", *_qkv())
