"""What the Q/K/V pass reads of one exchange in the graph: the match that `passes/qkv.py` finds and
groups, and `passes/qkv_rewrite.py` rewrites (a module of its own, so that neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .layout import Size, shape_of


class Relayout(NamedTuple):
    """An all-to-all read as a Ulysses relayout: the 4-D X before it, and the nodes after it equal to X
    relaid out (the rewrite replaces the last)."""

    source: torch.fx.Node
    results: tuple[torch.fx.Node, ...]


@dataclass
class AllToAllMatch:
    """One all_to_all_single + wait_tensor with equal splits, and what it means."""

    all_to_all: torch.fx.Node
    wait: torch.fx.Node
    group_name: str
    world_size: int
    # When it is a Ulysses relayout, by the dim of X it scatters (1 or 2; it gathers the other): the
    # farthest X read that way and the last result. Both can hold, through a transpose on either side.
    relayouts: dict[int, Relayout] = field(default_factory=dict)

    @property
    def sent(self) -> torch.fx.Node:
        """The all_to_all's input."""
        return self.all_to_all.args[0]

    @property
    def scatter_dim(self) -> int:
        """The reading packed exchanges use: heads at dim 2 when both hold (no transposes)."""
        return 2 if 2 in self.relayouts else 1

    @property
    def relayout(self) -> Relayout | None:
        return self.relayouts[self.scatter_dim] if self.relayouts else None

    @property
    def dtype(self) -> torch.dtype:
        return self.all_to_all.meta["val"].dtype

    @property
    def heads(self) -> Size:
        """The scattered dim of X: the heads of a Ulysses relayout."""
        return shape_of(self.relayout.source)[self.scatter_dim]

    @property
    def rewrite_input(self) -> torch.fx.Node:
        """The node the rewrite reads: X for a relayout, the all_to_all's input otherwise."""
        return self.relayout.source if self.relayout is not None else self.sent

    def packing_key(self) -> tuple:
        """Exchanges may be packed together only with equal keys (relayouts: and equal `sizes_but_heads`)."""
        if self.relayout is None:
            return (self.group_name, self.dtype)
        return (self.group_name, self.dtype, self.scatter_dim)

    def sizes_but_heads(self) -> tuple[Size, ...]:
        """X's sizes but the heads: Q, K and V must share them to be packed."""
        shape = list(shape_of(self.relayout.source))
        del shape[self.scatter_dim]
        return tuple(shape)

    def erase(self, last: torch.fx.Node) -> list[torch.fx.Node]:
        """Erase the receive side from `last` back to the all_to_all, up to a node something else still
        reads (it keeps the original exchange alive); returns the nodes erased."""
        graph, node, erased = last.graph, last, []
        while not node.users:
            previous = node.args[0] if node is not self.all_to_all else None
            graph.erase_node(node)
            erased.append(node)
            if previous is None:
                break
            node = previous
        return erased
