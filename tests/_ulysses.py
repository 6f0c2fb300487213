"""Ulysses attention as users write it: the one reference the gloo, GPU and snapshot tests compile.

- `UlyssesBlock`: Q/K/V projections, sequence -> heads (in-place c10d all-to-alls, heads at dim 2,
  as yunchang and DeepSpeed write it), attention or its exact stand-in, heads -> sequence;
- `exact_attention`: the stand-in, integer arithmetic that mixes Q with K and V head by head;
- `seq_to_heads_dim1`, `heads_to_seq_dim1`: the xDiT form, heads at dim 1 and functional collectives.

The pass must find the exchanges in this code itself. Weights are the caller's (`weight(rows, cols)`):
seeded on the CPU, random integers on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """2q + k - v over `[b, S, h, d]` tensors: exact in every dtype for small integers. With fewer K/V
    heads than query heads (GQA), each K/V head serves a group of query heads, as in attention."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    return 2 * q + k - v


class UlyssesBlock(torch.nn.Module):
    """Q/K/V projections, sequence -> heads, attention (or `exact_attention`), heads -> sequence."""

    def __init__(
        self, heads: int, kv_heads: int, d: int, weight: Callable[[int, int], torch.Tensor], exact: bool
    ) -> None:
        super().__init__()
        hidden = heads * d
        self.wq, self.wk, self.wv = (weight(hidden, h * d) for h in (heads, kv_heads, kv_heads))
        self.shape, self.exact = (heads, kv_heads, d), exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads, kv_heads, d = self.shape
        q = seq_to_heads_unpacked((x @ self.wq).view(b, s, heads, d))
        k = seq_to_heads_unpacked((x @ self.wk).view(b, s, kv_heads, d))
        v = seq_to_heads_unpacked((x @ self.wv).view(b, s, kv_heads, d))
        if self.exact:
            o = exact_attention(q, k, v)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=heads != kv_heads
            ).transpose(1, 2)
        return heads_to_seq_unpacked(o).reshape(b, s, heads * d)


def seq_to_heads_dim1(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """xDiT style with functional collectives: [b, h, S, d] -> [b, h/P, P*S, d]."""
    p = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, p, h // p, s, d).transpose(0, 1).contiguous()
    recv = funcol.all_to_all_single(send, None, None, group or dist.group.WORLD)
    return recv.reshape(p, b, h // p, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def heads_to_seq_dim1(o: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """xDiT style output exchange: [b, h/P, P*S, d] -> [b, h, S, d]."""
    p = dist.get_world_size(group)
    b, hp, s_global, d = o.shape
    send = o.reshape(b, hp, p, s_global // p, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = funcol.all_to_all_single(send, None, None, group or dist.group.WORLD)
    return recv.reshape(p, b, hp, s_global // p, d).permute(1, 0, 2, 3, 4).reshape(b, p * hp, s_global // p, d)
