"""Rewrite Ulysses all-to-alls in the post-grad graph into graphar's packed exchanges (hand-written).

Each `_c10d_functional.all_to_all_single` + `wait_tensor` with equal splits is read semantically: the
layout ops around it (view/reshape, permute/transpose, clone/contiguous, squeeze/unsqueeze) are
composed into one index map (`passes/layout.py`) from a 4-D tensor X to the result Y, in which rank
i's X is the i-th slice of a virtual global tensor. The exchange is a Ulysses relayout when Y equals
X with one dim split over the ranks (scatter) and another gathered from them (gather), for any order
of the ops in between:

- three independent relayouts of one kind on one group and dtype, with equal shapes apart from the
  heads, become one `graphar::qkv_all_to_all` (sequence -> heads: Q, K, V);
- a relayout left over that scatters dim 1 (the attention output, `[b, s, h, d] -> [b, s/P, h*P, d]`)
  becomes `graphar::heads_to_seq_all_to_all`; one scattering dim 2 stays as it is (the op would read
  it transposed, one copy more than the original);
- three independent all-to-alls that are not relayouts become one `graphar::packed_all_to_all_single`.

Only graph structure decides (shapes, dtypes, groups, order), so every rank rewrites alike. The
nodes after the rewrite are views of the new op's result: the receive side for b == 1 costs nothing.

Why not Inductor's pattern matcher: it replaces a fixed sequence of ops with one output, one match at
a time. Here three exchanges must be matched together that Inductor has already moved apart (sends
first, waits later, other work between), and between each exchange and its tensors lie chains of
layout ops whose form varies with the model and the torch version (a reshape may come as a view, or
as a clone and an _unsafe_view; a transpose as a permute): they are read as index maps, not as op
sequences, so any chain that computes the same map matches.

Sizes may be symbolic (SymInts, when torch.compile traces with dynamic shapes: sequence and batch
vary, heads and head dims stay numbers). The layout algebra decides only on facts proved without a
guard, so one compiled graph keeps serving every length; what cannot be proved is left alone. The
one guard the pass may add ties Q, K and V's sizes to each other (`_tie`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import guard_or_false

from graphar.config import Config

from .attention import is_attention_output
from .layout import (
    all_to_all_received,
    apply,
    compose,
    contiguous,
    divides,
    flat,
    is_layout_op,
    is_ulysses_relayout,
    known,
    same,
    shape_of,
    tieable,
)
from .qkv_match import AllToAllMatch, Relayout
from .qkv_rewrite import Rewriter

log = logging.getLogger("graphar")

c10d = torch.ops._c10d_functional


def _equal_splits(all_to_all: torch.fx.Node, world_size: int) -> bool:
    """Whether the all_to_all provably sends and receives dim 0 in `world_size` equal parts."""
    shape = shape_of(all_to_all.args[0])
    if shape is None or not shape or not divides(world_size, shape[0]):
        return False
    out_splits, in_splits = all_to_all.args[1], all_to_all.args[2]
    if out_splits is None and in_splits is None:
        return True
    equal = [shape[0] // world_size] * world_size
    sizes = [
        [n.meta["val"] if isinstance(n, torch.fx.Node) else n for n in splits]  # ints, or nodes of SymInts
        for splits in (out_splits, in_splits)
        if splits is not None
    ]
    return len(sizes) == 2 and all(same(split, equal) for split in sizes)


def _find_matches(graph: torch.fx.Graph, config: Config) -> list[AllToAllMatch]:
    found = []
    for all_to_all in graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default):
        group_name, users = all_to_all.args[3], list(all_to_all.users)
        if group_name in config.exclude_groups:
            log.info("graphar qkv: %s left alone: group %r is excluded", all_to_all.name, group_name)
            continue
        if len(users) != 1 or users[0].target is not c10d.wait_tensor.default:
            log.info("graphar qkv: %s left alone: its result is used other than by one wait_tensor", all_to_all.name)
            continue
        try:
            world_size = dist.distributed_c10d._resolve_process_group(group_name).size()
        except (RuntimeError, ValueError, KeyError) as e:
            log.info("graphar qkv: %s left alone: group %r not found (%s)", all_to_all.name, group_name, e)
            continue
        if not _equal_splits(all_to_all, world_size):
            log.info("graphar qkv: %s left alone: splits are not provably equal", all_to_all.name)
            continue
        match = AllToAllMatch(all_to_all, users[0], group_name, world_size)
        _read_relayouts(match)
        found.append(match)
    return found


def _read_relayouts(match: AllToAllMatch) -> None:
    """Fill match.relayouts with the ways the exchange reads as a Ulysses relayout of a 4-D tensor."""
    send_chain = [match.sent]  # the layout ops before the all_to_all, and their first input
    while is_layout_op(send_chain[0]) and isinstance(send_chain[0].args[0], torch.fx.Node):
        send_chain.insert(0, send_chain[0].args[0])
    receive_chain = [match.wait]  # the wait and the layout ops that alone read it, one after another
    while len(receive_chain[-1].users) == 1 and is_layout_op(user := next(iter(receive_chain[-1].users))):
        receive_chain.append(user)
    for start, x in enumerate(send_chain):  # the farthest X first: the rewrite then skips the most copies
        for scatter_dim, ys in _relayout_results(match, send_chain[start:], receive_chain).items():
            match.relayouts.setdefault(scatter_dim, Relayout(x, tuple(ys)))
    if not match.relayouts:
        log.info("graphar qkv: %s is not a Ulysses relayout of a 4-D tensor", match.all_to_all.name)


def _relayout_results(
    match: AllToAllMatch, send: list[torch.fx.Node], receive: list[torch.fx.Node]
) -> dict[int, list[torch.fx.Node]]:
    """For X = send[0] (then the send-side ops up to the all_to_all's input): by scattered dim, the
    nodes of `receive` that equal the relayout of X, in order."""
    x_shape, p = shape_of(send[0]), match.world_size
    if x_shape is None or len(x_shape) != 4:
        return {}
    layout = compose(contiguous(x_shape), send[1:])
    exchanged = layout and all_to_all_received(flat(layout), math.prod(x_shape), p, shape_of(match.wait))
    if not exchanged:  # the send side is no layout of X, or its dim 0 does not split over the ranks
        return {}
    received, block_stride = exchanged
    found: dict[int, list[torch.fx.Node]] = {}
    for node in receive:
        if node is not match.wait:
            received = apply(received, node)
        if received is None:
            break
        for scatter_dim in (1, 2):
            if is_ulysses_relayout(received, shape_of(node), x_shape, p, scatter_dim, block_stride):
                found.setdefault(scatter_dim, []).append(node)
    return found


class _GraphOrder:
    """Graph positions, and which exchanges each node is computed from, for independence checks."""

    def __init__(self, graph: torch.fx.Graph, matches: Sequence[AllToAllMatch]) -> None:
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        # One pass in graph order: each node's mask of the waits it is computed from. A graph search per
        # pair tried grew with the cube of the layers: each DiT output exchange is packable with every
        # later one, and each of those depends on it through the whole graph between them.
        self.bit = {m.wait: 1 << i for i, m in enumerate(matches)}
        self.upstream: dict[torch.fx.Node, int] = {}
        for node in graph.nodes:
            mask = self.bit.get(node, 0)
            for n in node.all_input_nodes:
                mask |= self.upstream[n]
            self.upstream[node] = mask

    def independent(self, members: Sequence[AllToAllMatch]) -> bool:
        return not any(
            self.upstream[a.rewrite_input] & self.bit[b.wait] for a in members for b in members if a is not b
        )


def _qkv_packable(a: AllToAllMatch, b: AllToAllMatch) -> bool:
    """Relayouts of one kind, group and dtype, whose heads are numbers (the slices of the packed
    result need them) and whose other sizes are equal, or may be tied (`tieable`)."""
    return (
        a.packing_key() == b.packing_key()
        and isinstance(a.heads, int)
        and isinstance(b.heads, int)
        and all(known(x == y) or tieable(x, y) for x, y in zip(a.sizes_but_heads(), b.sizes_but_heads()))
    )


def _tie(triplet: Sequence[AllToAllMatch]) -> None:
    """Guard equal the sizes of a Q/K/V triplet that are `tieable` but not proved equal: the pass's one
    guard, and a needed one: nothing in the graph relates separate inputs' symbols, and the packed op
    needs them equal. Inputs of unequal lengths then recompile, into a graph that leaves them unpacked."""
    for match in triplet[1:]:
        for a, b in zip(triplet[0].sizes_but_heads(), match.sizes_but_heads()):
            if not known(a == b) and not guard_or_false(a == b):
                raise AssertionError(f"graphar qkv: {a} == {b} was tieable but its guard failed")


def _form_triplets(
    matches: list[AllToAllMatch], order: _GraphOrder, packable: Callable[[AllToAllMatch, AllToAllMatch], bool]
) -> tuple[list[list[AllToAllMatch]], list[AllToAllMatch]]:
    """Greedy, in graph order: each match joins the first two later ones it can be packed with.
    Returns the triplets and the matches left out of them."""
    matches = sorted(matches, key=lambda m: order.position[m.all_to_all])
    triplets, used = [], set()
    for i, first in enumerate(matches):
        if id(first) in used:
            continue
        triplet = [first]
        for candidate in matches[i + 1 :]:
            if id(candidate) in used or not packable(first, candidate):
                continue
            if order.independent([*triplet, candidate]):
                triplet.append(candidate)
                if len(triplet) == 3:
                    break
            else:
                log.info(
                    "graphar qkv: %s and %s not packed: one depends on the other",
                    triplet[-1].all_to_all.name,
                    candidate.all_to_all.name,
                )
        if len(triplet) == 3:
            triplets.append(triplet)
            used.update(id(m) for m in triplet)
    return triplets, [m for m in matches if id(m) not in used]


def rewrite_qkv_triplets(graph: torch.fx.Graph, config: Config) -> int:
    """Rewrite the graph's Ulysses exchanges and packable all-to-all triplets; returns the rewrites."""
    matches = _find_matches(graph, config)
    if not matches:
        return 0
    order = _GraphOrder(graph, matches)
    relayouts = [m for m in matches if m.relayout is not None]
    qkv_triplets, unpacked = _form_triplets(relayouts, order, _qkv_packable)
    non_relayouts = [m for m in matches if m.relayout is None]
    packed_triplets, _ = _form_triplets(non_relayouts, order, lambda a, b: a.packing_key() == b.packing_key())
    # Scattering dim 2 (heads at dim 1), heads_to_seq_all_to_all reads X transposed: one copy more,
    # worth it only for an attention's output that passes/attention.py then folds into the pipelined op.
    overlap = config.pipelines_attention
    outputs = [
        m
        for m in unpacked
        if 1 in m.relayouts or (overlap and 2 in m.relayouts and is_attention_output(m.relayouts[2].source))
    ]
    for match in unpacked:
        if match not in outputs:
            log.info(
                "graphar qkv: %s left alone: alone, an exchange scattering dim 2 gains nothing", match.all_to_all.name
            )
    rewriter = Rewriter(graph)
    count = 0
    for triplet in qkv_triplets:
        _tie(triplet)
        count += rewriter.qkv(triplet)
    for match in outputs:
        count += rewriter.output(match)
    for triplet in packed_triplets:
        count += rewriter.packed(triplet)
    if count:
        stable_topological_sort(graph)
    return count
