"""The layout algebra of the Q/K/V pass: chains of layout ops read as index maps, for every size.

A layout maps a tensor's logical indices to offsets in the contiguous storage of a source tensor it
was computed from by layout ops (view/reshape, permute/transpose, clone/contiguous, squeeze/unsqueeze,
flatten/unflatten). Each logical dim is a row-major tuple of modes `(size, stride)`: index i of a dim
with modes ((n1, s1), (n2, s2)) is i1 * n2 + i2 and lies at offset i1 * s1 + i2 * s2. A dim may need
several modes (a reshape of a permuted tensor), so every layout op maps a layout to a layout
(`apply`), and a clone keeps the map: any two chains computing the same map compare equal
(`canonical`), however they are written.

    contiguous((2, 3))         == (((2, 3),), ((3, 1),))
    permuted [1, 0]            -> (((3, 1),), ((2, 3),))
    then reshaped to (6,)      -> (((3, 1), (2, 3)),)     # canonical: two runs, no copy-free view
    contiguous((6,))           == (((6, 1),),)            # canonical((2, 3), (3, 1)) == ((6, 1),)

An all-to-all is read in the same terms (`all_to_all_received`), over a virtual global tensor in
which rank i's source starts at offset i * numel: a Ulysses relayout is then a map to compare
(`ulysses_relayout`, `is_ulysses_relayout`).

Sizes may be SymInts (torch.compile with dynamic shapes). The algebra computes with them as with
ints, and decides (equal, one, divisible) only on facts proved from the shape environment without
adding a guard (`known`): what cannot be proved for every size the graph accepts counts as false, so
a regrouping that needs an unproved division gives None and the caller leaves the graph alone. The
one exception is explicit: `tieable` says when two symbols may be guarded equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import sympy
import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

# A size is an int, or a SymInt when the graph was traced with dynamic shapes.
Size = int | torch.SymInt
# One run of a dim: (size, stride) in the source's contiguous storage.
Mode = tuple[Size, Size]
# By logical dim, its modes, row-major.
Layout = tuple[tuple[Mode, ...], ...]

# Ops that keep the row-major order of the elements: their result is the input reshaped.
ORDER_KEEPING = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.clone.default,
    aten.alias.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.flatten.using_ints,
    aten.unflatten.int,
}
# Ops that reorder the dims.
PERMUTING = {aten.permute.default, aten.transpose.int, aten.t.default}
# [b, S, h, d] <-> [b, h, S, d]: heads and sequence swapped, its own inverse.
HEADS_SWAP = [0, 2, 1, 3]


def known(cond: bool | torch.SymBool) -> bool:
    """Whether `cond` holds for every size the graph accepts, proved from the shape environment
    without adding a guard; False when it cannot be proved. Plain bools pass through."""
    return statically_known_true(cond)


def is_one(n: Size) -> bool:
    """n == 1, proved."""
    return known(n == 1)


def divides(p: Size, n: Size) -> bool:
    """p divides n, proved."""
    return known(n % p == 0)


def same(a: Sequence[Size], b: Sequence[Size]) -> bool:
    """Sizes provably equal one for one."""
    return len(a) == len(b) and all(known(x == y) for x, y in zip(a, b))


def same_modes(a: Sequence[Mode], b: Sequence[Mode]) -> bool:
    """Modes provably equal one for one."""
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def tieable(a: Size, b: Size) -> bool:
    """Whether a guard a == b may be added (the one guard the Q/K/V pass adds, `qkv._tie`): each is a
    symbol of its own, and they are equal in this compile's inputs (shapes, equal on every rank).

    Dynamo gives Q, K and V passed as separate inputs a symbol each, though self-attention makes
    them equal. A guard between two symbols pins no number, so the graph still serves every length;
    a size against a number (s == 8) would recompile per length, and is never tied."""
    sizes = (a, b)
    if not all(isinstance(n, torch.SymInt) and isinstance(n.node.expr, sympy.Symbol) for n in sizes):
        return False
    return all(n.node.has_hint() for n in sizes) and a.node.hint == b.node.hint


def shape_of(node: torch.fx.Node) -> tuple[Size, ...] | None:
    """The shape of a node's tensor value; None for a node that is not a tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def contiguous(shape: Sequence[Size]) -> Layout:
    """The layout of a contiguous tensor of `shape` over its own storage: one mode a dim."""
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return tuple(((n, s),) for n, s in zip(shape, strides))


def flat(layout: Layout | Sequence[Sequence[Mode]]) -> list[Mode]:
    """All modes, row-major over the dims, those of size 1 dropped: the layout read as one dim."""
    return [m for dim in layout for m in dim if not is_one(m[0])]


def canonical(modes: Iterable[Mode]) -> tuple[Mode, ...]:
    """Modes with those of size 1 dropped and neighbours that are one run merged. Unproved merges are
    skipped: the result still maps alike, it only compares unequal to more layouts."""
    out: list[Mode] = []
    for size, stride in modes:
        if is_one(size):
            continue
        if out and known(out[-1][1] == size * stride):
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


def reshape(modes: Sequence[Mode], shape: Sequence[Size]) -> Layout | None:
    """Regroup row-major modes into dims of `shape`, splitting a mode where a dim ends inside it.
    None unless every division is proved exact, so the regrouping holds for every size."""
    rest = [m for m in modes if not is_one(m[0])]
    dims = []
    for n in shape:
        dim: list[Mode] = []
        while not known(n <= 1):
            if not rest:
                return None
            size, stride = rest[0]
            if divides(size, n):
                dim.append(rest.pop(0))
                n //= size
            elif divides(n, size):
                dim.append((n, stride * (size // n)))
                rest[0] = (size // n, stride)
                n = 1
            else:
                return None
        dims.append(tuple(dim))
    return tuple(dims) if not rest else None


def is_layout_op(node: torch.fx.Node) -> bool:
    """Whether `node` is an op `apply` reads."""
    return node.op == "call_function" and node.target in ORDER_KEEPING | PERMUTING


def apply(layout: Layout, node: torch.fx.Node) -> Layout | None:
    """The layout of `node`'s result, given the layout of its input; None if `node` is not a layout op
    (or its result cannot be proved a regrouping of the input's modes)."""
    shape = shape_of(node)
    if shape is None:
        return None
    if node.target in ORDER_KEEPING:
        return reshape(flat(layout), shape)
    if node.target in PERMUTING:
        rank = len(layout)
        if node.target is aten.permute.default:
            order = [d % rank for d in node.args[1]]
        else:
            a, b = (node.args[1], node.args[2]) if node.target is aten.transpose.int else (0, 1)
            order = list(range(rank))
            order[a % rank], order[b % rank] = order[b % rank], order[a % rank]
        return tuple(layout[d] for d in order)
    return None


def compose(layout: Layout | None, nodes: Iterable[torch.fx.Node]) -> Layout | None:
    """`layout` through the layout ops `nodes`, one after another; None once one is not read."""
    for node in nodes:
        layout = apply(layout, node) if layout is not None else None
    return layout


def ulysses_relayout(x_shape: Sequence[Size], p: int, scatter_dim: int) -> tuple[tuple[Size, ...], tuple[Mode, ...]]:
    """Shape and canonical modes of X with dim `scatter_dim` split over p ranks and the other of dims
    1, 2 gathered, over the virtual global tensor in which rank i's X starts at offset i * numel(X)."""
    gather_dim = 3 - scatter_dim
    strides = [dim[0][1] for dim in contiguous(x_shape)]
    shape, modes = [], []
    for k, n in enumerate(x_shape):
        if k == scatter_dim:
            shape.append(n // p)
            modes.append((n // p, strides[k]))
        elif k == gather_dim:
            shape.append(n * p)
            modes += [(p, math.prod(x_shape)), (n, strides[k])]
        else:
            shape.append(n)
            modes.append((n, strides[k]))
    return tuple(shape), canonical(modes)


def all_to_all_received(
    sent: Sequence[Mode], source_numel: Size, p: int, shape: Sequence[Size]
) -> tuple[Layout, Size] | None:
    """What an equal-split all_to_all_single over p ranks receives, given the flat modes `sent` of what
    each rank sends over its source X: the layout of the result (of `shape`) over the global tensor in
    which rank i's X starts at offset i * source_numel, and the stride in X between the blocks sent to
    successive ranks (rank j receives block j of every X: an offset of j * stride the layout leaves
    out). None unless dim 0 of what is sent provably splits over the ranks."""
    if not sent or not divides(p, sent[0][0]):
        return None
    (n0, s0), rest = sent[0], sent[1:]
    layout = reshape([(p, source_numel), (n0 // p, s0), *rest], shape)  # dim 0 of the result: the senders
    return (layout, s0 * (n0 // p)) if layout is not None else None


def is_ulysses_relayout(
    layout: Layout, shape: Sequence[Size], x_shape: Sequence[Size], p: int, scatter_dim: int, block_stride: Size
) -> bool:
    """Whether a result of `shape` and `layout`, received at offset j * block_stride of every X by rank
    j (`all_to_all_received`), is X with dim `scatter_dim` split over the ranks and the other of dims
    1, 2 gathered from them: rank j gets the j-th block of X's `scatter_dim`."""
    expected_shape, modes = ulysses_relayout(x_shape, p, scatter_dim)
    block = (x_shape[scatter_dim] // p) * math.prod(x_shape[scatter_dim + 1 :])
    return (
        divides(p, x_shape[scatter_dim])
        and known(block_stride == block)
        and same(shape, expected_shape)
        and same_modes(canonical(flat(layout)), modes)
    )


def viewable(t: torch.Tensor, shape: Sequence[Size]) -> bool:
    """Whether `t.view(shape)` exists for every size, proved without a guard (trying the view on
    symbolic sizes would guard): each dim of `shape` must take modes of t that merge into one run."""
    if known(t.numel() == 0):
        return True
    layout = reshape(list(zip(t.shape, t.stride())), shape)
    return layout is not None and all(len(canonical(dim)) <= 1 for dim in layout)


def accepts_strides(user: torch.fx.Node, t: torch.Tensor) -> bool:
    """Whether `user` still works reading `t` (of its input's shape, other strides) in place of its
    input: only a view can refuse, when `t` cannot be viewed as the view's shape for every size."""
    if user.target not in (aten.view.default, aten._unsafe_view.default):
        return True
    return viewable(t, shape_of(user))


# Graph helpers the passes share.


def new_node(graph: torch.fx.Graph, target: Callable, *args: object, **kwargs: object) -> torch.fx.Node:
    """A new node computing target(*args, **kwargs), with its fake value for the passes after this one."""
    node = graph.call_function(target, args, kwargs)
    vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    tensors = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    with detect_fake_mode(tensors):
        node.meta["val"] = target(*vals, **kwargs)
    return node


def depends_on(node: torch.fx.Node, ancestor: torch.fx.Node) -> bool:
    """Whether `node` is computed from `ancestor`."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is ancestor:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False
