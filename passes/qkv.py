"""Rewrite Ulysses all-to-alls in the post-grad graph into graphar's packed exchanges (hand-written).

Each `_c10d_functional.all_to_all_single` + `wait_tensor` with equal splits is read semantically: the
layout ops around it (view/reshape, permute/transpose, clone/contiguous, squeeze/unsqueeze) are
composed into one index map from a 4-D tensor X to the result Y, in which rank i's X is the i-th slice
of a virtual global tensor. The exchange is a Ulysses relayout when Y equals X with one dim split over
the ranks (scatter) and another gathered from them (gather), for any order of the ops in between:

- three independent relayouts of one kind on one group and dtype, with equal shapes apart from the
  heads, become one `graphar::qkv_all_to_all` (sequence -> heads: Q, K, V);
- a relayout left over that scatters dim 1 (the attention output, `[b, s, h, d] -> [b, s/P, h*P, d]`)
  becomes `graphar::heads_to_seq_all_to_all`; one scattering dim 2 stays as it is (the op would read
  it transposed, one copy more than the original);
- three independent all-to-alls that are not relayouts become one `graphar::packed_all_to_all_single`.

Only graph structure decides (shapes, dtypes, groups, order), so every rank rewrites alike. The
nodes after the rewrite are views of the new op's result: the receive side for b == 1 costs nothing.

Sizes may be symbolic (SymInts, when torch.compile traces with dynamic shapes: sequence and batch
vary, heads and head dims stay numbers). The algebra computes with them as with ints, and decides
(divisible, equal, one) only on facts proved from the graph's shape environment without a guard
(`statically_known_true`), so one compiled graph keeps serving every length; what cannot be proved
is left alone. The one guard the pass may add ties Q, K and V's sizes to each other (`_tie`).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import sympy
import torch
import torch.distributed as dist
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from graphar.config import Config

log = logging.getLogger("graphar")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# A size is an int, or a SymInt when the graph was traced with dynamic shapes.
Size = int | torch.SymInt
# A layout maps logical indices to offsets in a source's contiguous storage. Each logical dim is a
# row-major tuple of (size, stride) modes, so a reshape can always regroup modes without copying.
Mode = tuple[Size, Size]
Layout = tuple[tuple[Mode, ...], ...]

# Ops that keep the row-major order of the elements: their result is the input reshaped.
_ORDER_KEEPING = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
    aten.alias.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.flatten.using_ints, aten.unflatten.int,
}
_PERMUTING = {aten.permute.default, aten.transpose.int, aten.t.default}
_HEADS_SWAP = [0, 2, 1, 3]


def _known(cond: bool | torch.SymBool) -> bool:
    """Whether `cond` holds for every size the graph accepts, proved from the shape environment
    without adding a guard; False when it cannot be proved. Plain bools pass through."""
    return statically_known_true(cond)


def _one(n: Size) -> bool:
    return _known(n == 1)


def _divides(p: Size, n: Size) -> bool:
    return _known(n % p == 0)


def _same(a: Sequence[Size], b: Sequence[Size]) -> bool:
    """Sizes provably equal one for one."""
    return len(a) == len(b) and all(_known(x == y) for x, y in zip(a, b))


def _same_modes(a: Sequence[Mode], b: Sequence[Mode]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _shape(node: torch.fx.Node) -> tuple[Size, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _size_arg(arg: object) -> Size:
    """A size argument of a node: an int, or the node that computes a SymInt."""
    return arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg


def _contiguous(shape: Sequence[Size]) -> Layout:
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return tuple(((n, s),) for n, s in zip(shape, strides))


def _flat(layout: Layout | Sequence[Sequence[Mode]]) -> list[Mode]:
    return [m for dim in layout for m in dim if not _one(m[0])]


def _canonical(modes: Iterable[Mode]) -> tuple[Mode, ...]:
    """Modes with those of size 1 dropped and neighbours that are one run merged. Unproved merges are
    skipped: the result still maps alike, it only compares unequal to more layouts."""
    out: list[Mode] = []
    for size, stride in modes:
        if _one(size):
            continue
        if out and _known(out[-1][1] == size * stride):
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


def _reshape(modes: Sequence[Mode], shape: Sequence[Size]) -> Layout | None:
    """Regroup row-major modes into dims of `shape`, splitting a mode where a dim ends inside it.
    None unless every division is proved exact, so the regrouping holds for every size."""
    rest = [m for m in modes if not _one(m[0])]
    dims = []
    for n in shape:
        dim: list[Mode] = []
        while not _known(n <= 1):
            if not rest:
                return None
            size, stride = rest[0]
            if _divides(size, n):
                dim.append(rest.pop(0))
                n //= size
            elif _divides(n, size):
                dim.append((n, stride * (size // n)))
                rest[0] = (size // n, stride)
                n = 1
            else:
                return None
        dims.append(tuple(dim))
    return tuple(dims) if not rest else None


def _apply(layout: Layout, node: torch.fx.Node) -> Layout | None:
    """The layout of `node`'s result, given the layout of its input; None if `node` is not a layout op."""
    shape = _shape(node)
    if shape is None:
        return None
    if node.target in _ORDER_KEEPING:
        return _reshape(_flat(layout), shape)
    if node.target in _PERMUTING:
        rank = len(layout)
        if node.target is aten.permute.default:
            order = [d % rank for d in node.args[1]]
        else:
            a, b = (node.args[1], node.args[2]) if node.target is aten.transpose.int else (0, 1)
            order = list(range(rank))
            order[a % rank], order[b % rank] = order[b % rank], order[a % rank]
        return tuple(layout[d] for d in order)
    return None


def _is_layout_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _ORDER_KEEPING | _PERMUTING


@dataclass
class _Exchange:
    """One all_to_all_single + wait_tensor, and what it means."""

    a2a: torch.fx.Node
    wait: torch.fx.Node
    group_name: str
    world_size: int
    # When it is a Ulysses relayout, by the dim of X it scatters (1 or 2; it gathers the other):
    # the farthest 4-D X before the exchange read that way, and the last node Y after it that equals
    # the relayout of X. Both readings can hold, through a transpose on either side.
    kinds: dict[int, tuple[torch.fx.Node, torch.fx.Node]] = field(default_factory=dict)

    @property
    def a2a_input(self) -> torch.fx.Node:
        return self.a2a.args[0]

    @property
    def scatter(self) -> int:
        """The reading packed exchanges use: heads at dim 2 when both hold (no transposes)."""
        return 2 if 2 in self.kinds else 1

    @property
    def x(self) -> torch.fx.Node | None:
        return self.kinds[self.scatter][0] if self.kinds else None

    @property
    def y(self) -> torch.fx.Node | None:
        return self.kinds[self.scatter][1] if self.kinds else None

    @property
    def dtype(self) -> torch.dtype:
        return self.a2a.meta["val"].dtype

    @property
    def heads(self) -> Size:
        """The scattered dim of X: the heads of a Ulysses relayout."""
        return _shape(self.x)[self.scatter]

    @property
    def source(self) -> torch.fx.Node:
        """The node the rewrite reads: X for a relayout, the all_to_all's input otherwise."""
        return self.x if self.x is not None else self.a2a_input

    def key(self) -> tuple:
        """Exchanges may be packed together only with equal keys (relayouts: and equal `others`)."""
        return (self.group_name, self.dtype) if self.x is None else (self.group_name, self.dtype, self.scatter)

    def others(self) -> tuple[Size, ...]:
        """X's sizes but the heads: Q, K and V must share them to be packed."""
        shape = list(_shape(self.x))
        del shape[self.scatter]
        return tuple(shape)


def _equal_splits(a2a: torch.fx.Node, world_size: int) -> bool:
    shape = _shape(a2a.args[0])
    if shape is None or not shape or not _divides(world_size, shape[0]):
        return False
    out_splits, in_splits = a2a.args[1], a2a.args[2]
    if out_splits is None and in_splits is None:
        return True
    equal = [shape[0] // world_size] * world_size
    return all(splits is not None and _same([_size_arg(n) for n in splits], equal)
               for splits in (out_splits, in_splits))


def _find_exchanges(graph: torch.fx.Graph, config: Config) -> list[_Exchange]:
    found = []
    for a2a in graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default):
        group_name = a2a.args[3]
        users = list(a2a.users)
        if group_name in config.exclude_groups:
            log.info("graphar qkv: %s left alone: group %r is excluded", a2a.name, group_name)
            continue
        if len(users) != 1 or users[0].target is not c10d.wait_tensor.default:
            log.info("graphar qkv: %s left alone: its result is used other than by one wait_tensor", a2a.name)
            continue
        try:
            world_size = dist.distributed_c10d._resolve_process_group(group_name).size()
        except (RuntimeError, ValueError, KeyError) as e:
            log.info("graphar qkv: %s left alone: group %r not found (%s)", a2a.name, group_name, e)
            continue
        if not _equal_splits(a2a, world_size):
            log.info("graphar qkv: %s left alone: splits are not provably equal", a2a.name)
            continue
        exchange = _Exchange(a2a, users[0], group_name, world_size)
        _read_relayout(exchange)
        found.append(exchange)
    return found


def _expected(x_shape: Sequence[Size], p: int, scatter: int) -> tuple[tuple[Size, ...], tuple[Mode, ...]]:
    """Shape and canonical modes of X with dim `scatter` split over p ranks and the other of dims 1, 2
    gathered, over the virtual global tensor in which rank i's X starts at offset i * numel(X)."""
    gather = 3 - scatter
    strides = [dim[0][1] for dim in _contiguous(x_shape)]
    shape, modes = [], []
    for k, n in enumerate(x_shape):
        if k == scatter:
            shape.append(n // p)
            modes.append((n // p, strides[k]))
        elif k == gather:
            shape.append(n * p)
            modes += [(p, math.prod(x_shape)), (n, strides[k])]
        else:
            shape.append(n)
            modes.append((n, strides[k]))
    return tuple(shape), _canonical(modes)


def _read_relayout(ex: _Exchange) -> None:
    """Fill ex.kinds with the ways the exchange reads as a Ulysses relayout of a 4-D tensor."""
    chain = [ex.a2a_input]
    while _is_layout_op(chain[0]) and isinstance(chain[0].args[0], torch.fx.Node):
        chain.insert(0, chain[0].args[0])
    receive = [ex.wait]
    while len(receive[-1].users) == 1 and _is_layout_op(user := next(iter(receive[-1].users))):
        receive.append(user)
    for start, x in enumerate(chain):  # the farthest X first: the rewrite then skips the most copies
        for scatter, y in _relayouts(ex, chain[start:], receive).items():
            ex.kinds.setdefault(scatter, (x, y))
    if not ex.kinds:
        log.info("graphar qkv: %s is not a Ulysses relayout of a 4-D tensor", ex.a2a.name)


def _relayouts(ex: _Exchange, send: list[torch.fx.Node], receive: list[torch.fx.Node]) -> dict[int, torch.fx.Node]:
    """For X = send[0] (then the send-side ops up to the all_to_all's input): by scattered dim, the
    last node of `receive` that equals the relayout of X."""
    x_shape, p = _shape(send[0]), ex.world_size
    if x_shape is None or len(x_shape) != 4:
        return {}
    layout: Layout | None = _contiguous(x_shape)
    for node in send[1:]:
        layout = _apply(layout, node) if layout is not None else None
    sent = _flat(layout) if layout is not None else []
    if not sent or not _divides(p, sent[0][0]):
        return {}
    (n0, s0), rest = sent[0], sent[1:]
    dest_stride = s0 * (n0 // p)  # rank j receives the block at offset j * dest_stride of every X
    received = _reshape([(p, math.prod(x_shape)), (n0 // p, s0), *rest], _shape(ex.wait))
    found = {}
    for node in receive:
        if node is not ex.wait:
            received = _apply(received, node)
        if received is None:
            break
        for scatter in (1, 2):
            shape, modes = _expected(x_shape, p, scatter)
            block = (x_shape[scatter] // p) * math.prod(x_shape[scatter + 1:])
            if (_divides(p, x_shape[scatter]) and _known(dest_stride == block) and _same(_shape(node), shape)
                    and _same_modes(_canonical(_flat(received)), modes)):
                found[scatter] = node
    return found


class _Order:
    """Graph positions and ancestor queries, for independence checks."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.index = {n: i for i, n in enumerate(graph.nodes)}

    def depends_on(self, node: torch.fx.Node, ancestor: torch.fx.Node) -> bool:
        floor = self.index[ancestor]
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n is ancestor:
                return True
            if n in seen or self.index[n] < floor:
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return False

    def independent(self, members: Sequence[_Exchange]) -> bool:
        return not any(self.depends_on(a.source, b.wait) for a in members for b in members if a is not b)


def _same_key(a: _Exchange, b: _Exchange) -> bool:
    return a.key() == b.key()


def _qkv_packable(a: _Exchange, b: _Exchange) -> bool:
    """Relayouts of one kind, group and dtype, whose heads are numbers (the slices of the packed
    result need them) and whose other sizes are equal, or may be tied (`_tieable`)."""
    return (a.key() == b.key() and isinstance(a.heads, int) and isinstance(b.heads, int)
            and all(_known(x == y) or _tieable(x, y) for x, y in zip(a.others(), b.others())))


def _tieable(a: Size, b: Size) -> bool:
    """Whether `_tie` may guard a == b: each is a symbol of its own, and they are equal in this
    compile's inputs (shapes, equal on every rank).

    Dynamo gives Q, K and V passed as separate inputs a symbol each, though self-attention makes
    them equal. A guard between two symbols pins no number, so the graph still serves every length;
    a size against a number (s == 8) would recompile per length, and is never tied."""
    sizes = (a, b)
    if not all(isinstance(n, torch.SymInt) and isinstance(n.node.expr, sympy.Symbol) for n in sizes):
        return False
    return all(n.node.has_hint() for n in sizes) and a.node.hint == b.node.hint


def _tie(group: Sequence[_Exchange]) -> None:
    """Guard equal the sizes of a Q/K/V triplet that are tieable but not proved equal: the pass's one
    guard, and a needed one: nothing in the graph relates separate inputs' symbols, and the packed op
    needs them equal. Inputs of unequal lengths then recompile, into a graph that leaves them unpacked."""
    for e in group[1:]:
        for a, b in zip(group[0].others(), e.others()):
            if not _known(a == b) and not guard_or_false(a == b):
                raise AssertionError(f"graphar qkv: {a} == {b} was tieable but its guard failed")


def _triplets(exchanges: list[_Exchange], order: _Order, packable: Callable[[_Exchange, _Exchange], bool]
              ) -> tuple[list[list[_Exchange]], list[_Exchange]]:
    """Greedy, in graph order: each exchange joins the first two later ones it can be packed with."""
    exchanges = sorted(exchanges, key=lambda e: order.index[e.a2a])
    groups, used = [], set()
    for i, first in enumerate(exchanges):
        if id(first) in used:
            continue
        group = [first]
        for other in exchanges[i + 1:]:
            if id(other) in used or not packable(first, other):
                continue
            if order.independent([*group, other]):
                group.append(other)
                if len(group) == 3:
                    break
            else:
                log.info("graphar qkv: %s and %s not packed: one depends on the other",
                         group[-1].a2a.name, other.a2a.name)
        if len(group) == 3:
            groups.append(group)
            used.update(id(e) for e in group)
    return groups, [e for e in exchanges if id(e) not in used]


def _call(graph: torch.fx.Graph, target: Callable, *args: object, **kwargs: object) -> torch.fx.Node:
    """A new node computing target(*args, **kwargs), with its fake value for the passes after this one."""
    node = graph.call_function(target, args, kwargs)
    vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    tensors = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    with detect_fake_mode(tensors):
        node.meta["val"] = target(*vals, **kwargs)
    return node


def _can_read(user: torch.fx.Node, new: torch.fx.Node) -> bool:
    """Whether `user` accepts new's strides in place of its input's: only a view can refuse."""
    if user.target not in (aten.view.default, aten._unsafe_view.default):
        return True
    return _viewable(new.meta["val"], _shape(user))


def _viewable(t: torch.Tensor, shape: Sequence[Size]) -> bool:
    """Whether `t.view(shape)` exists for every size, proved without a guard (trying the view on
    symbolic sizes would guard): each dim of `shape` must take modes of t that merge into one run."""
    if _known(t.numel() == 0):
        return True
    layout = _reshape(list(zip(t.shape, t.stride())), shape)
    return layout is not None and all(len(_canonical(dim)) <= 1 for dim in layout)


class _Rewriter:
    """Applies rewrites one after another; a node a rewrite replaced is read through `replaced`."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.replaced: dict[torch.fx.Node, torch.fx.Node] = {}

    def current(self, node: torch.fx.Node) -> torch.fx.Node:
        while node in self.replaced:
            node = self.replaced[node]
        return node

    def after_last(self, nodes: Sequence[torch.fx.Node]) -> torch.fx.Node:
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        return max(nodes, key=position.__getitem__).next

    def replace(self, ex: _Exchange, old: torch.fx.Node, new: torch.fx.Node) -> None:
        """Point old's users at new, then erase the receive side back to the all_to_all.

        Erasing stops at a node something else still reads (it keeps the original exchange alive).
        """
        if not all(_can_read(user, new) for user in old.users):  # a view needs strides new lacks
            with self.graph.inserting_after(new):
                new = _call(self.graph, aten.clone.default, new, memory_format=torch.contiguous_format)
        old.replace_all_uses_with(new)
        self.replaced[old] = new
        node = old
        while not node.users:
            previous = node.args[0] if node is not ex.a2a else None
            self.graph.erase_node(node)
            if previous is None:
                break
            node = previous

    def qkv(self, group: list[_Exchange]) -> None:
        first, p = group[0], group[0].world_size
        sources = [self.current(e.x) for e in group]
        with self.graph.inserting_before(self.after_last(sources)):
            # qkv_all_to_all takes [b, S, h, d]: scatter dim 2, gather dim 1; the other kind is its transpose.
            swap = first.scatter == 1
            xs = [_call(self.graph, aten.permute.default, x, _HEADS_SWAP) if swap else x for x in sources]
            packed = _call(self.graph, torch.ops.graphar.qkv_all_to_all.default, *xs, first.group_name)
            ys, start = [], 0
            for x in xs:
                heads = _shape(x)[2] // p
                y = _call(self.graph, aten.slice.Tensor, packed, 2, start, start + heads)
                ys.append(_call(self.graph, aten.permute.default, y, _HEADS_SWAP) if swap else y)
                start += heads
        for e, y in zip(group, ys):
            self.replace(e, e.y, y)
        log.info("graphar qkv: %s packed into %s on group %r", [e.a2a.name for e in group], packed.name,
                 first.group_name)

    def output(self, e: _Exchange) -> None:
        """heads_to_seq_all_to_all for an exchange scattering dim 1 and gathering dim 2, as the op does."""
        x, y = e.kinds[1]
        x = self.current(x)
        with self.graph.inserting_before(x.next):
            out = _call(self.graph, torch.ops.graphar.heads_to_seq_all_to_all.default, x, e.group_name)
        self.replace(e, y, out)
        log.info("graphar qkv: %s rewritten into %s on group %r", e.a2a.name, out.name, e.group_name)

    def packed(self, group: list[_Exchange]) -> None:
        inputs = [self.current(e.a2a_input) for e in group]
        with self.graph.inserting_before(self.after_last(inputs)):
            packed = _call(self.graph, torch.ops.graphar.packed_all_to_all_single.default, inputs,
                           group[0].group_name)
            outs = [_call(self.graph, operator.getitem, packed, i) for i in range(len(group))]
        for e, out in zip(group, outs):
            self.replace(e, e.wait, out)
        log.info("graphar qkv: %s packed into %s on group %r", [e.a2a.name for e in group], packed.name,
                 group[0].group_name)


def rewrite_qkv_triplets(graph: torch.fx.Graph, config: Config) -> int:
    """Rewrite the graph's Ulysses exchanges and packable all-to-all triplets; returns the rewrites."""
    exchanges = _find_exchanges(graph, config)
    if not exchanges:
        return 0
    order = _Order(graph)
    qkv_groups, singles = _triplets([e for e in exchanges if e.x is not None], order, _qkv_packable)
    packed_groups, _ = _triplets([e for e in exchanges if e.x is None], order, _same_key)
    outputs = []
    for e in singles:
        if 1 in e.kinds:
            outputs.append(e)
        else:  # heads_to_seq_all_to_all would read X transposed: one copy more than the original
            log.info("graphar qkv: %s left alone: alone, an exchange scattering dim 2 gains nothing", e.a2a.name)
    rewriter = _Rewriter(graph)
    for group in qkv_groups:
        _tie(group)
        rewriter.qkv(group)
    for e in outputs:
        rewriter.output(e)
    for group in packed_groups:
        rewriter.packed(group)
    count = len(qkv_groups) + len(outputs) + len(packed_groups)
    if count:
        stable_topological_sort(graph)
    return count
