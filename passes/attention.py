"""Rewrite a Ulysses attention, exchange -> attention -> exchange, into `graphar::ulysses_attention`,
which pipelines the three over chunks of heads (graphar.ulysses.overlap) so that the exchanges hide
behind the attention.

It runs after passes/qkv.py, on what that pass leaves for a Ulysses attention with heads at dim 2:

    packed = graphar.qkv_all_to_all(q, k, v, group)
    qh = slice(packed, 2, 0, a); kh = slice(packed, 2, a, a + b); vh = slice(packed, 2, a + b, a + 2b)
    o = sdpa(qh.permute(0, 2, 1, 3), kh.permute(0, 2, 1, 3), vh.permute(0, 2, 1, 3), is_causal=c, scale=s)[0]
    out = graphar.heads_to_seq_all_to_all(o.permute(0, 2, 1, 3), group)   # or of its contiguous copy

becomes

    out = graphar.ulysses_attention(q, k, v, group, c, s, chunks)

(chunks: the option attention_chunks, or graphar.ulysses.overlap.AUTO_CHUNKS for "auto", which lets the
op pick per shape), where sdpa is any of the attention kernels Inductor lowers `scaled_dot_product_attention` to (flash,
efficient, cudnn, the CPU flash). Heads are independent in attention, so the result is the same bits.
K and V may reach the kernel repeated for GQA as HF's repeat_kv writes it (the op then attends with
fewer K/V heads, which reads the same values), and any input as a contiguous copy (diffusers' cuDNN
and native-flash backends copy before the kernel). Anything else is left alone with the reason
logged: a mask or dropout, an attention output other than the first used, an intermediate used
elsewhere, another group, V with other heads than K, or head counts that do not split into two
chunks per rank.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch

from graphar.config import AUTO, Config
from graphar.ulysses.overlap import AUTO_CHUNKS, AUTO_MAX_CHUNKS, chunk_count

from .layout import HEADS_SWAP, same

log = logging.getLogger("graphar")

aten = torch.ops.aten
graphar_ops = torch.ops.graphar
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


# Inductor's attention kernels, by the name graphar.ulysses.overlap gives their SDPA backend.
_KERNEL_NAMES = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
}


def _sdpa_kernels() -> dict[Any, dict[str, int]]:
    """Inductor's attention kernels: where each takes its mask or bias, dropout and is_causal
    (positional index, or absent), as their schemas say."""
    kernels = {}
    for name in _KERNEL_NAMES:
        op = getattr(aten, name, None)
        if op is None:
            continue
        args = [a.name for a in op.default._schema.arguments]
        kernels[op.default] = {
            key: args.index(key) for key in ("attn_bias", "attn_mask", "dropout_p", "is_causal", "scale") if key in args
        }
    return kernels


SDPA_KERNELS = _sdpa_kernels()


def _arg(node: torch.fx.Node, index: int | None, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if index is not None and index < len(node.args) else default


@dataclass
class _AttentionMatch:
    exchange: torch.fx.Node  # graphar.qkv_all_to_all
    sdpa: torch.fx.Node
    output: torch.fx.Node  # graphar.heads_to_seq_all_to_all
    between: list[torch.fx.Node]  # slices, permutes, K/V repeats, the getitem: erased with the match
    slices: list[torch.fx.Node]  # Q, K and V in the exchange's result

    @property
    def group_name(self) -> str:
        return self.output.args[1]

    def option(self, name: str, default: Any = None) -> Any:
        return _arg(self.sdpa, SDPA_KERNELS[self.sdpa.target].get(name), name, default)

    @property
    def kernel(self) -> str:
        """The attention kernel the graph runs, which the op runs too: the same kernel on each head
        gives the same bits, whichever kernel SDPA would pick for a chunk's shapes."""
        return _KERNEL_NAMES[self.sdpa.target._schema.name.removeprefix("aten::")]

    def replace_with_graphar(self, chunks: int) -> None:
        graph = self.output.graph
        q, k, v, group = self.exchange.args
        with graph.inserting_before(self.output):
            new = graph.call_function(
                graphar_ops.ulysses_attention.default,
                (q, k, v, group, bool(self.option("is_causal", False)), self.option("scale"), chunks, self.kernel),
            )
        new.meta.update({key: self.output.meta[key] for key in ("val", "stack_trace") if key in self.output.meta})
        self.output.replace_all_uses_with(new)
        position = {node: i for i, node in enumerate(graph.nodes)}
        for node in sorted([self.output, *self.between, self.sdpa, self.exchange], key=position.get, reverse=True):
            graph.erase_node(node)  # users first


def is_attention_output(node: Any) -> bool:
    """Whether `node` is the first output of one of Inductor's attention kernels."""
    return (
        isinstance(node, torch.fx.Node)
        and node.target == operator.getitem
        and node.args[1] == 0
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target in SDPA_KERNELS
    )


def _is_permute(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.target == aten.permute.default and list(node.args[1]) == HEADS_SWAP


def _match(output: torch.fx.Node) -> _AttentionMatch | str:
    """The attention that feeds this output exchange, or why there is none to rewrite."""
    permuted, copied = output.args[0], []
    if permuted.target == aten.clone.default and len(permuted.users) == 1:  # `.contiguous()` before the exchange
        permuted, copied = permuted.args[0], [permuted]
    if not _is_permute(permuted) or not is_attention_output(permuted.args[0]):
        return "its input is not the first output of an attention kernel, heads moved to dim 2"
    getitem = permuted.args[0]
    sdpa = getitem.args[0]
    if len(sdpa.users) != 1 or len(permuted.users) != 1 or len(getitem.users) != 1:
        return "the attention's outputs are used elsewhere too"
    between = [getitem, permuted, *copied]
    sources = []
    for i, arg in enumerate(sdpa.args[:3]):
        copy = []
        if arg.target == aten.clone.default and len(arg.users) == 1:  # `.contiguous()` before the kernel
            arg, copy = arg.args[0], [arg]
        repeat = _repeated_kv(arg) if i > 0 else None  # K and V may be repeated for GQA, as HF does
        arg, repeats = (arg, []) if repeat is None else repeat
        if not _is_permute(arg) or len(arg.users) != 1 or arg.args[0].target != aten.slice.Tensor:
            return "an attention input is not a slice of a Q/K/V exchange with heads moved to dim 1"
        sliced = arg.args[0]
        if len(sliced.users) != 1:
            return "a Q/K/V slice is used elsewhere too"
        if sliced.args[4:] not in ((), (1,)):
            return "a Q/K/V slice has a step: it takes every n-th head"
        between += [*copy, *repeats, arg, sliced]
        sources.append(sliced)
    exchange = sources[0].args[0]
    if exchange.target != graphar_ops.qkv_all_to_all.default or any(s.args[0] is not exchange for s in sources):
        return "the attention's inputs do not come from one graphar Q/K/V exchange"
    if len(exchange.users) != 3 or exchange.args[3] != output.args[1]:
        return "the exchange is used elsewhere too, or the two exchanges are on different groups"
    return _AttentionMatch(exchange, sdpa, output, between, sources)


def _repeated_kv(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """HF's repeat_kv of a K/V input, as it decomposes (`repeat_interleave(x, r, dim=1)` decomposes
    alike): a view or reshape of (a copy of) expand(unsqueeze(x, 2)) to [b, h * r, S, d]; (x, the
    repeat's nodes) or None. Each K/V head repeated r times in a row is what attention with fewer K/V
    heads (GQA) reads, so the op computes the same."""
    chain = []
    for targets in (_RESHAPES, (aten.clone.default,), (aten.expand.default,), (aten.unsqueeze.default,)):
        if node.target not in targets or len(node.users) != 1:
            if targets[0] is aten.clone.default:  # the copy is there only when the expand is not viewable
                continue
            return None
        chain.append(node)
        node = node.args[0]
    b, h, s, d = node.meta["val"].shape
    r = chain[-2].meta["val"].shape[2]
    if chain[-1].args[1] % 5 != 2 or not same(chain[0].meta["val"].shape, (b, h * r, s, d)):  # 2 or -3
        return None
    return node, chain


def _reason_to_skip(match: _AttentionMatch, world_size: int, chunks: int) -> str | None:
    if match.option("attn_bias") is not None or match.option("attn_mask") is not None:
        return "the attention has a mask or bias"
    if match.option("dropout_p", 0.0) != 0.0:
        return "the attention has dropout"
    starts = [(s.args[1], s.args[2], s.args[3]) for s in match.slices]
    q, k, v = (x.meta["val"] for x in match.exchange.args[:3])
    heads = [q.shape[2] // world_size, k.shape[2] // world_size, v.shape[2] // world_size]
    bounds = [sum(heads[:i]) for i in range(4)]
    if starts != [(2, bounds[i], bounds[i + 1]) for i in range(3)]:
        return f"the slices {starts} are not Q, K and V of the exchange"
    if v.shape[2] != k.shape[2]:  # graphar.ulysses.overlap splits V's heads as K's
        return f"V's {v.shape[2]} heads differ from K's {k.shape[2]}"
    if chunk_count(q.shape[2], k.shape[2], world_size, chunks) < 2:
        return f"{q.shape[2]} Q and {k.shape[2]} K/V heads do not split into 2 or more chunks per rank"
    return None


def rewrite_ulysses_attention(graph: torch.fx.Graph, config: Config) -> int:
    """Rewrite every Ulysses attention that graphar can pipeline; returns how many were rewritten."""
    if not config.pipelines_attention:
        return 0
    auto = config.attention_chunks == AUTO
    # "auto": the op picks per shape at run time, up to AUTO_MAX_CHUNKS; a match must split that far
    # into two chunks at least.
    most, chunks = (AUTO_MAX_CHUNKS, AUTO_CHUNKS) if auto else (config.attention_chunks, config.attention_chunks)
    from graphar.ulysses.shapes import world_size

    graph.eliminate_dead_code()  # the Q/K/V rewrite leaves its old relayouts for this: users that are gone
    count = 0
    for output in list(graph.find_nodes(op="call_function", target=graphar_ops.heads_to_seq_all_to_all.default)):
        match = _match(output)
        reason = match if isinstance(match, str) else _reason_to_skip(match, world_size(output.args[1]), most)
        if reason is not None:
            log.info("graphar: attention before %s left unpipelined: %s", output.name, reason)
            continue
        log.info(
            "graphar: %s + %s + %s -> graphar::ulysses_attention (group %r, up to %s chunks)",
            match.exchange.name,
            match.sdpa.name,
            output.name,
            match.group_name,
            config.attention_chunks,
        )
        match.replace_with_graphar(chunks)
        count += 1
    return count
