"""Ulysses sequence parallelism by hand: graphar's all-to-alls for code that calls them itself.

The pass finds Ulysses exchanges in compiled models without these; they serve code that wants the
packed exchange directly, and captures that must not grow buffers:

    from graphar.ulysses import heads_to_seq, reserve, seq_to_heads

    reserve([q.shape, k.shape, v.shape], q.dtype, q.device, group.group_name)  # before a capture, optional
    qh, kh, vh = seq_to_heads(q, k, v, group.group_name)         # [b, S, h, d] -> [b, P*S, h/P, d]
    out = heads_to_seq(attention(qh, kh, vh), group.group_name)  # [b, P*S, h/P, d] -> [b, S, h, d]

Each exchange is one graphar op (`graphar::qkv_all_to_all`, `graphar::heads_to_seq_all_to_all`), so
they compile and capture like the rewritten models do.
"""

from __future__ import annotations

import torch

from graphar.ulysses import shapes
from graphar.ulysses.exchanges import reserve
from graphar.ulysses.shapes import split_heads

__all__ = ["heads_to_seq", "reserve", "seq_to_heads", "split_heads"]


def _check_heads_dim(heads_dim: int) -> None:
    if heads_dim not in (1, 2):
        raise ValueError(f"heads_dim must be 1 or 2, got {heads_dim}")


def seq_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, heads_dim: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence -> heads for Q, K, V: `[b, S, h, d] -> [b, P*S, h/P, d]` (heads_dim=2) or
    `[b, h, S, d] -> [b, h/P, P*S, d]` (heads_dim=1). Returns views of one new tensor."""
    _check_heads_dim(heads_dim)
    xs = (q, k, v) if heads_dim == 2 else tuple(x.transpose(1, 2) for x in (q, k, v))
    p = shapes.world_size(group_name)
    packed = torch.ops.graphar.qkv_all_to_all(*xs, group_name)
    out = split_heads(packed, [x.shape[2] // p for x in xs])
    return out if heads_dim == 2 else tuple(x.transpose(1, 2) for x in out)


def heads_to_seq(o: torch.Tensor, group_name: str, heads_dim: int = 2) -> torch.Tensor:
    """Heads -> sequence for the attention output, in either layout (see `seq_to_heads`)."""
    _check_heads_dim(heads_dim)
    if heads_dim == 2:
        return torch.ops.graphar.heads_to_seq_all_to_all(o, group_name)
    return torch.ops.graphar.heads_to_seq_all_to_all(o.transpose(1, 2), group_name).transpose(1, 2)
