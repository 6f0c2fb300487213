"""The rewrites of the Q/K/V pass (`passes/qkv.py` reads the exchanges and groups them), each shown
as the graph before and after."""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence

import torch

from .layout import HEADS_SWAP, accepts_strides, new_node, same, shape_of
from .qkv_match import AllToAllMatch

log = logging.getLogger("graphar")

aten = torch.ops.aten


def _returned(node: torch.fx.Node) -> bool:
    """Whether the graph returns `node` or a view of it."""
    return any(
        user.op == "output"
        or (isinstance(user.meta.get("val"), torch.Tensor) and user.meta["val"]._is_view() and _returned(user))
        for user in node.users
    )


class Rewriter:
    """Applies rewrites one after another. A later rewrite may read a node an earlier one replaced or
    erased (an exchange of an exchange's result): through `replaced`, what now holds its values."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        self.erased: set[torch.fx.Node] = set()

    def current(self, node: torch.fx.Node) -> torch.fx.Node:
        """`node`, or what replaced it."""
        while node in self.replaced:
            node = self.replaced[node]
        return node

    def after_last(self, nodes: Sequence[torch.fx.Node]) -> torch.fx.Node:
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        return max(nodes, key=position.__getitem__).next

    def readable(self, nodes: Sequence[torch.fx.Node], match: AllToAllMatch) -> bool:
        """Whether the nodes a rewrite reads still exist (an earlier rewrite may have erased one that
        held other values than its replacement: the exchange then stays as it is)."""
        if any(node in self.erased for node in nodes):
            log.info("graphar qkv: %s left alone: it reads a node an earlier rewrite removed", match.all_to_all.name)
            return False
        return True

    def replace(self, match: AllToAllMatch, results: Sequence[torch.fx.Node], new: torch.fx.Node) -> None:
        """Point the users of old = results[-1] at new, then erase the receive side from old back to
        the all_to_all; the erased `results`, equal to old, read as new from then on. Where new is a
        view with other strides than old, a copy replaces it if a user's view needs strides it lacks,
        or if the graph returns it (the compiled function must return eager's strides, which Inductor
        gives a copy but not a view)."""
        old, val = results[-1], new.meta["val"]
        restride = val._is_view() and not same(val.stride(), old.meta["val"].stride()) and _returned(old)
        if restride or not all(accepts_strides(user, val) for user in old.users):
            with self.graph.inserting_after(new):
                new = new_node(self.graph, aten.clone.default, new, memory_format=torch.contiguous_format)
        old.replace_all_uses_with(new)
        self.erased.update(match.erase(old))
        for node in results:
            if node in self.erased:
                self.replaced[node] = new

    def qkv(self, triplet: list[AllToAllMatch]) -> bool:
        """Three sequence -> heads relayouts (Q, K, V) as one packed exchange, sliced back by heads::

            before:  q2 = clone(permute(view(q, [b, S, P, hq/P, d]), [2, 1, 0, 3, 4]))   # [P, S, b, hq/P, d]
                     w_q = wait_tensor(all_to_all_single(q2, ...))
                     y_q = permute(view(w_q, [P*S, b, hq/P, d]), [1, 0, 2, 3])         # [b, P*S, hq/P, d]
                     ... (x3: q, k, v)
            after:   packed = graphar.qkv_all_to_all(q, k, v, group)          # [b, P*S, (hq+2*hkv)/P, d]
                     y_q = slice(packed, 2, 0, hq/P); y_k = slice(packed, 2, hq/P, (hq+hkv)/P); ...

        With heads at dim 1 (`[b, h, S, d] -> [b, h/P, P*S, d]`) the op's inputs and the slices are
        permuted by [0, 2, 1, 3]: the op takes heads at dim 2.
        """
        first, p = triplet[0], triplet[0].world_size
        sources = [self.current(m.relayout.source) for m in triplet]
        if not self.readable(sources, first):
            return False
        with self.graph.inserting_before(self.after_last(sources)):
            swap = first.scatter_dim == 1
            xs = [new_node(self.graph, aten.permute.default, x, HEADS_SWAP) if swap else x for x in sources]
            packed = new_node(self.graph, torch.ops.graphar.qkv_all_to_all.default, *xs, first.group_name)
            ys, start = [], 0
            for x in xs:
                heads = shape_of(x)[2] // p
                y = new_node(self.graph, aten.slice.Tensor, packed, 2, start, start + heads)
                ys.append(new_node(self.graph, aten.permute.default, y, HEADS_SWAP) if swap else y)
                start += heads
        for match, y in zip(triplet, ys):
            self.replace(match, match.relayout.results, y)
        log.info(
            "graphar qkv: %s packed into %s on group %r",
            [m.all_to_all.name for m in triplet],
            packed.name,
            first.group_name,
        )
        return True

    def output(self, match: AllToAllMatch) -> bool:
        """The heads -> sequence relayout of the attention output (scatters dim 1, gathers dim 2)::

            before:  o2 = clone(permute(view(o, [b, P, S, h, d]), [1, 3, 2, 0, 4]))    # o: [b, P*S, h, d]
                     w = wait_tensor(all_to_all_single(o2, ...))
                     y = permute(view(w, [P*h, S, b, d]), [2, 1, 0, 3])                  # [b, S, P*h, d]
            after:   y = graphar.heads_to_seq_all_to_all(o, group)

        Heads at dim 1 (o: [b, h, P*S, d], y: [b, P*h, S, d]; it scatters dim 2), through transposes:
            after:   y = permute(graphar.heads_to_seq_all_to_all(permute(o, [0, 2, 1, 3]), group), [0, 2, 1, 3])
        """
        heads_at_1 = 1 not in match.relayouts
        relayout = match.relayouts[2 if heads_at_1 else 1]
        x = self.current(relayout.source)
        if not self.readable([x], match):
            return False
        with self.graph.inserting_before(x.next):
            if heads_at_1:
                x = new_node(self.graph, torch.ops.aten.permute.default, x, HEADS_SWAP)
            out = new_node(self.graph, torch.ops.graphar.heads_to_seq_all_to_all.default, x, match.group_name)
            if heads_at_1:
                out = new_node(self.graph, torch.ops.aten.permute.default, out, HEADS_SWAP)
        self.replace(match, relayout.results, out)
        log.info("graphar qkv: %s rewritten into %s on group %r", match.all_to_all.name, out.name, match.group_name)
        return True

    def packed(self, triplet: list[AllToAllMatch]) -> bool:
        """Three all-to-alls that are no relayout, as one exchange of the three buffers::

        before:  w_i = wait_tensor(all_to_all_single(t_i, splits_i, splits_i, group))   # i = 0, 1, 2
        after:   packed = graphar.packed_all_to_all_single([t_0, t_1, t_2], group)
                 w_i = packed[i]
        """
        inputs = [self.current(m.sent) for m in triplet]
        if not self.readable(inputs, triplet[0]):
            return False
        with self.graph.inserting_before(self.after_last(inputs)):
            packed = new_node(
                self.graph, torch.ops.graphar.packed_all_to_all_single.default, inputs, triplet[0].group_name
            )
            outs = [new_node(self.graph, operator.getitem, packed, i) for i in range(len(triplet))]
        for match, out in zip(triplet, outs):
            self.replace(match, [match.wait], out)
        log.info(
            "graphar qkv: %s packed into %s on group %r",
            [m.all_to_all.name for m in triplet],
            packed.name,
            triplet[0].group_name,
        )
        return True
