"""The Ulysses exchanges as model code writes them (yunchang's all_to_all_4D): permute,
`all_to_all_single`, permute, one tensor at a time.

The pattern the Q/K/V pass recognises: the demo writes its Ulysses block with them, the tests their
models and references, and the benchmarks (bench/) time graphar against them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def seq_to_heads_unpacked(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """One tensor's sequence -> heads exchange: `[b, S, h, d] -> [b, P*S, h/P, d]`."""
    p = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, p, h // p, d).transpose(0, 2).contiguous()  # [P, S, b, h/P, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(p * s, b, h // p, d).transpose(0, 1).contiguous().reshape(b, p * s, h // p, d)


def heads_to_seq_unpacked(o: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The output exchange: `[b, P*S, h, d] -> [b, S, P*h, d]`."""
    p = dist.get_world_size(group)
    b, s_global, h, d = o.shape
    s = s_global // p
    send = o.reshape(b, p, s, h, d).transpose(0, 3).transpose(0, 1).contiguous()  # [P, h, S, b, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(p * h, s, b, d).transpose(0, 2).contiguous().reshape(b, s, p * h, d)
