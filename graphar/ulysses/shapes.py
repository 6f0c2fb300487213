"""The Ulysses ops' input checks and output shapes: what the ops (graphar.ulysses.exchanges) and their
fakes (graphar.ops) share, so that a fake gives exactly the real op's sizes.

Everything an all-to-all's output shape depends on lives here: the group's size and the rules below.
A fake's sizes shape the graph Inductor compiles, so the compiled graph's cache key hashes this file
(passes/manager.py, `hashed_files`); code that does not decide a shape belongs elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def world_size(group_name: str) -> int:
    """The size of the group named `group_name`, as the ops name groups."""
    return dist.distributed_c10d._resolve_process_group(group_name).size()


def packed_heads(head_counts: Sequence[int], world_size: int) -> int:
    """Heads per token of the Q/K/V exchange's result: the sum of each tensor's heads over the world size."""
    return sum(h // world_size for h in head_counts)


def split_heads(packed: torch.Tensor, head_counts: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Views of Q, K and V in `qkv_all_to_all`'s result, given each one's local head count."""
    return tuple(packed.split(list(head_counts), dim=2))


def _require(cond: bool | torch.SymBool, message: Callable[[], str]) -> None:
    """Raise ValueError(message()) unless `cond`. On symbolic sizes (the fakes under dynamic shapes)
    a condition that is already proved adds nothing; one that is not becomes a guard (or a runtime
    assert for data-dependent sizes) on a relation the op needs, never on a size's value."""
    torch._check_with(ValueError, cond, message)


def _check_qkv(xs: Sequence[torch.Tensor], world_size: int, group_name: str) -> None:
    op = f"graphar::qkv_all_to_all on group {group_name!r}"
    first = xs[0]
    for x in xs:
        if x.dim() != 4:
            raise ValueError(f"{op}: expects [b, s_local, heads, d] tensors, got shape {tuple(x.shape)}")
        if x.dtype != first.dtype or x.device != first.device:
            raise ValueError(f"{op}: q, k and v must share dtype and device")
        for dim in (0, 1, 3):
            _require(
                x.shape[dim] == first.shape[dim],
                lambda: f"{op}: q, k and v must share b, s_local and d; got {[tuple(t.shape) for t in xs]}",
            )
        _require(
            x.shape[2] % world_size == 0, lambda x=x: f"{op}: {x.shape[2]} heads do not split over {world_size} ranks"
        )


def qkv_shape(xs: Sequence[torch.Tensor], world_size: int, group_name: str) -> tuple[int, int, int, int]:
    """The shape of the Q/K/V exchange's result, `[b, P*S, (hq + hk + hv)/P, d]`, after checking xs."""
    _check_qkv(xs, world_size, group_name)
    b, s, _, d = xs[0].shape
    return b, world_size * s, packed_heads([x.shape[2] for x in xs], world_size), d


def output_shape(o: torch.Tensor, world_size: int, group_name: str) -> tuple[int, int, int, int]:
    """The shape of the output exchange's result, `[b, P*S, h, d] -> [b, S, P*h, d]`, after checking o."""

    def message() -> str:
        return (
            f"graphar::heads_to_seq_all_to_all on group {group_name!r}: expects [b, s, heads, d] "
            f"with s divisible by {world_size}, got {tuple(o.shape)}"
        )

    if o.dim() != 4:
        raise ValueError(message())
    _require(o.shape[1] % world_size == 0, message)
    b, s_global, h, d = o.shape
    return b, s_global // world_size, world_size * h, d


def packed_shapes(xs: Sequence[torch.Tensor], world_size: int, group_name: str) -> list[tuple[int, ...]]:
    """The shapes of the packed exchange's results (those of xs), after checking xs."""
    op = f"graphar::packed_all_to_all_single on group {group_name!r}"
    if not xs:
        raise ValueError(f"{op}: needs at least one tensor")
    for x in xs:
        if x.dim() == 0:
            raise ValueError(f"{op}: dim 0 of {tuple(x.shape)} does not split equally over {world_size} ranks")
        _require(
            x.shape[0] % world_size == 0,
            lambda x=x: f"{op}: dim 0 of {tuple(x.shape)} does not split equally over {world_size} ranks",
        )
        if x.dtype != xs[0].dtype or x.device != xs[0].device:
            raise ValueError(f"{op}: all tensors must share dtype and device")
    return [tuple(x.shape) for x in xs]
