"""Fuse `graphar::all_reduce` + residual add + RMSNorm into `graphar::all_reduce_add_rms_norm`.

Runs after the all-reduce rewrite, on the post-grad graph, where an RMSNorm (HF's LlamaRMSNorm,
`F.rms_norm`, `nn.RMSNorm`) reads, after Inductor's decompositions:

    h = all_reduce(x) + residual          (either order; a cast may upcast the all-reduced x)
    v = convert(h, float32)               (absent when h is float32)
    n = v * rsqrt(mean(pow(v, 2), [-1], keepdim=True) + eps)
    out = weight * convert(n, h.dtype)    (or convert(n * weight), F.rms_norm's order: weight_first;
                                           the weight and the cast optional)

`h` may flow on (the next block's residual): it becomes the op's second result. An all-reduce that
feeds the norm with no add fuses as well (residual=None). Anything else is left alone, its reason
logged; so is a norm the fused kernel can be proven never to take (graphar.allreduce.fused_norm: dtypes,
static sizes over its bounds, GRAPHAR_ALLREDUCE_ALGO forcing a kernel with no fused form): the op
would run the all-reduce and the norm apart on every call, where Inductor compiles the norm into one
kernel of its own. Only graph structure, shapes, dtypes and GRAPHAR_ALLREDUCE_ALGO (equal on every
rank, checked at set-up; part of the cache key) decide, so every rank rewrites alike.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphar import settings
from graphar.allreduce import fused_norm, policy
from graphar.config import Config
from graphar.ops import add_rms_norm_dtypes

from .layout import depends_on, new_node, same

log = logging.getLogger("graphar")

aten = torch.ops.aten
_CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
_ADDS = (aten.add.Tensor, aten.add.Scalar)


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _cast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype a pure dtype cast converts to, or None when `node` is not one."""
    if node.target == _CASTS[0]:
        return node.args[1]
    if node.target == _CASTS[1] and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        return node.kwargs["dtype"]
    return None


def _other(node: torch.fx.Node, operand: torch.fx.Node) -> object:
    """The operand of a binary `node` that is not `operand` (either order)."""
    a, b = node.args[:2]
    return b if a is operand else a


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


@dataclass
class _Norm:
    """An RMSNorm of `h`: `nodes` from its float32 input to `out`, in graph order."""

    h: torch.fx.Node
    eps: float
    nodes: list[torch.fx.Node]
    weight: torch.fx.Node | None = None
    weight_first: bool = False  # the weight multiplies before the cast back (F.rms_norm's order)

    @property
    def out(self) -> torch.fx.Node:
        return self.nodes[-1]


def _square_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """`v` when `node` computes v ** 2 (a pow, or v * v)."""
    if node.target == aten.pow.Tensor_Scalar and node.args[1] == 2:
        return node.args[0]
    if node.target == aten.mul.Tensor and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _norm_input(h: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(v, square): the float32 `v` (h itself or its cast) whose square starts an RMSNorm of h."""
    inputs = [h] if h.meta["val"].dtype == torch.float32 else []
    inputs += [u for u in h.users if _cast_dtype(u) == torch.float32]
    for v in inputs:
        for square in v.users:
            if _square_of(square) is v:
                return v, square
    return None


def _mean_reason(mean: torch.fx.Node | None, ndim: int) -> str | None:
    if mean is None or mean.target != aten.mean.dim:
        return "the square is not followed by a mean alone"
    dims = [d % ndim for d in mean.args[1]]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if dims != [ndim - 1] or not keepdim:
        return f"the mean is over dims {mean.args[1]} (keepdim={keepdim}), not the last dim with keepdim"
    return None


EPS_NOT_CONSTANT = "eps is not a constant"


def _core(h: torch.fx.Node, v: torch.fx.Node, square: torch.fx.Node) -> _Norm | str:
    """v * rsqrt(mean(square, -1, keepdim) + eps), each step used only by the next."""
    mean = _only_user(square)
    reason = _mean_reason(mean, h.meta["val"].dim())
    if reason:
        return reason
    add_eps, rsqrt = _only_user(mean), None
    if add_eps is None or add_eps.target not in _ADDS or add_eps.args[0] is not mean:
        return "the mean is not followed by an add of eps alone"
    eps = add_eps.args[1]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return EPS_NOT_CONSTANT
    rsqrt = _only_user(add_eps)
    scale = _only_user(rsqrt) if rsqrt is not None and rsqrt.target == aten.rsqrt.default else None
    if scale is None or scale.target != aten.mul.Tensor or _other(scale, rsqrt) is not v:
        return "the mean's rsqrt does not scale the norm's input alone"
    if v is not h and set(v.users) != {square, scale}:
        return "the float32 input of the norm is used elsewhere"
    nodes = [n for n in (v, square, mean, add_eps, rsqrt, scale) if n is not h]
    return _Norm(h, float(eps), nodes)


def _extend_tail(norm: _Norm) -> None:
    """Take in the cast back to h's dtype and the weight multiply, in either order, while each is the
    only user of the norm so far."""
    hidden, dtype = norm.h.meta["val"].shape[-1], norm.h.meta["val"].dtype
    while (user := _only_user(norm.out)) is not None:
        if _cast_dtype(user) == dtype != norm.out.meta["val"].dtype:
            norm.nodes.append(user)
            continue
        weight = _other(user, norm.out) if user.target == aten.mul.Tensor else None
        val = _val(weight)
        if norm.weight is None and val is not None and same(val.shape, (hidden,)) and weight is not norm.out:
            norm.weight = weight
            norm.weight_first = norm.out.meta["val"].dtype != dtype  # a cast back is still to come
            norm.nodes.append(user)
            continue
        return


def _norm_of(h: torch.fx.Node) -> _Norm | str | None:
    """The RMSNorm of `h` over its last dim, a reason it cannot fuse, or None when no norm reads h."""
    found = _norm_input(h)
    if found is None:
        return None
    norm = _core(h, *found)
    if isinstance(norm, str):
        return norm
    _extend_tail(norm)
    return norm


@dataclass
class _NormMatch:
    all_reduce: torch.fx.Node
    norm: _Norm
    residual: torch.fx.Node | None = None
    # The residual add and any cast of the all-reduce's result before it, in graph order.
    add_nodes: list[torch.fx.Node] = field(default_factory=list)

    @property
    def x(self) -> torch.fx.Node:
        return self.all_reduce.args[0]

    def replace_with_fused(self) -> None:
        graph = self.all_reduce.graph
        x, group_name = self.all_reduce.args  # graphar::all_reduce's: the fused op takes them as they are
        args = (x, self.residual, self.norm.weight, self.norm.eps, group_name, self.norm.weight_first)
        with graph.inserting_before(self.norm.out):
            fused = new_node(graph, torch.ops.graphar.all_reduce_add_rms_norm.default, *args)
            normed, summed = (new_node(graph, operator.getitem, fused, i) for i in range(2))
        for new in (normed, summed):
            new.meta["stack_trace"] = self.norm.out.meta.get("stack_trace")
        self.norm.out.replace_all_uses_with(normed)
        self.norm.h.replace_all_uses_with(summed)
        # Erased by hand: the all-reduce is side-effectful, dead-code elimination would keep it.
        for node in reversed([self.all_reduce, *self.add_nodes, *self.norm.nodes]):
            graph.erase_node(node)


def _residual_add(ar: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node | None]:
    """([optional upcast, add], residual) when the all-reduce's result feeds an add, else ([], None)."""
    chain, node = [], ar
    for user in list(ar.users):
        cast = _cast_dtype(user)
        if cast is not None and cast == torch.promote_types(ar.meta["val"].dtype, cast):
            chain, node = [user], user
    for user in node.users:
        if user.target == aten.add.Tensor and len(user.args) == 2 and not user.kwargs:
            residual = _other(user, node)
            if isinstance(residual, torch.fx.Node) and residual is not node:
                return chain + [user], residual
    return [], None


def _with_residual(ar: torch.fx.Node) -> _NormMatch | str | None:
    add_nodes, residual = _residual_add(ar)
    if residual is None:
        return None
    norm = _norm_of(add_nodes[-1])
    if not isinstance(norm, _Norm):
        return norm
    if any(len(n.users) != 1 for n in [ar, *add_nodes[:-1]]):
        return "the all-reduced value before the residual add is used elsewhere"
    if _val(residual) is None or not same(_val(residual).shape, ar.meta["val"].shape):
        return "the residual's shape differs from the all-reduced value's (a broadcast add)"
    return _NormMatch(ar, norm, residual, add_nodes)


def _match(ar: torch.fx.Node) -> _NormMatch | str:
    """How `ar` fuses with the norm after it, or why it does not."""
    norm = _norm_of(ar)
    match = _NormMatch(ar, norm) if isinstance(norm, _Norm) else norm or _with_residual(ar)
    if match is None:
        return "not followed by a residual add or an RMSNorm"
    if isinstance(match, str):
        return match
    if match.norm.weight is not None and depends_on(match.norm.weight, match.norm.h):
        return "the norm's weight is computed from its input"
    # The op sums x from before any upcast, in promote(x, residual): a wider upcast changes h's dtype.
    normed, summed = add_rms_norm_dtypes(
        _val(match.x), _val(match.residual), _val(match.norm.weight), match.norm.weight_first
    )
    if match.norm.out.meta["val"].dtype != normed:
        return f"the norm's output is {match.norm.out.meta['val'].dtype}, the fused op's would be {normed}"
    if match.norm.h.meta["val"].dtype != summed:
        return f"the residual sum is {match.norm.h.meta['val'].dtype}, the fused op's would be {summed}"
    never = _never_fused(match)
    return match if never is None else f"the fused kernel would never take it: {never}"


def _never_fused(match: _NormMatch) -> str | None:
    """Why no call of `match` could run the fused kernel, as far as the graph and the settings prove
    it; None when some call may (a symbolic size is checked by the op at each call)."""
    forced = settings.ALLREDUCE_ALGO.get()
    if not policy.fuses_norm(forced):
        return f"GRAPHAR_ALLREDUCE_ALGO={forced!r} forces a kernel with no fused form"
    x = _val(match.x)
    dtypes = (None if t is None else _val(t).dtype for t in (match.residual, match.norm.weight))
    return fused_norm.refusal(
        x.dtype,
        *dtypes,
        x.shape[-1] * x.element_size(),
        x.numel() * x.element_size(),
        policy.FUSED_NORM_CEILING,
        statically_known_true,
    )


def fuse_all_reduce_norms(graph: torch.fx.Graph, config: Config) -> int:
    """Fuse every graphar::all_reduce that feeds an RMSNorm (through a residual add or not); returns
    how many were fused."""
    count, eps_inputs = 0, 0
    for ar in graph.find_nodes(op="call_function", target=torch.ops.graphar.all_reduce.default):
        match = _match(ar)
        if isinstance(match, str):
            level = logging.DEBUG if match.startswith("not followed") else logging.INFO
            log.log(level, "graphar: %s not fused with a norm: %s", ar.name, match)
            eps_inputs += match is EPS_NOT_CONSTANT
            continue
        form = "residual add + RMSNorm" if match.residual is not None else "RMSNorm"
        log.info("graphar: %s + %s -> graphar::all_reduce_add_rms_norm", ar.name, form)
        match.replace_with_fused()
        count += 1
    if eps_inputs:  # the user asked for fuse_norm: say once per graph why it did nothing, and the cure
        log.warning(
            "graphar: %d all-reduce + RMSNorm not fused: their eps is an input of the graph, not a constant "
            "(torch.compile(dynamic=True) passes float attributes as inputs); "
            "torch._dynamo.config.specialize_float = True keeps them constants",
            eps_inputs,
        )
    if count:
        # The sum's users that came before the norm's end now read the fused op placed there.
        stable_topological_sort(graph)
    return count
