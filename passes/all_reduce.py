"""Rewrite `_c10d_functional.all_reduce(x, 'sum', group) + wait_tensor` into `graphar::all_reduce`.

Every decision here reads only facts that are equal on every rank (op, dtype, shape, group, config),
so all ranks rewrite the same graph. A group with no graphar communicator is still rewritten: the op
falls back to the original collective at run time. So is an all-reduce whose size is symbolic
(dynamic shapes) unless it is provably over the limit: the op checks the size of each call against
its communicator's limit and uses the collective above it, and every rank sees the same size.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphar import settings
from graphar.allreduce.registry import communicator
from graphar.allreduce.set_up import sets_up_later
from graphar.config import Config

log = logging.getLogger("graphar")

c10d = torch.ops._c10d_functional
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _AllReduceMatch:
    all_reduce: torch.fx.Node
    wait: torch.fx.Node

    @property
    def x(self) -> torch.fx.Node:
        return self.all_reduce.args[0]

    @property
    def reduce_op(self) -> str:
        return self.all_reduce.args[1]

    @property
    def group_name(self) -> str:
        return self.all_reduce.args[2]

    @property
    def nbytes(self) -> int | torch.SymInt:
        """The input's size in bytes; symbolic under dynamic shapes."""
        val = self.x.meta["val"]
        return val.numel() * val.element_size()

    def replace_with_graphar(self) -> None:
        graph = self.wait.graph
        with graph.inserting_before(self.wait):
            new = graph.call_function(torch.ops.graphar.all_reduce.default, (self.x, self.group_name))
        # Only the value and provenance carry over: the wait's other meta (eager_input_vals) describes its args.
        new.meta.update({k: self.wait.meta[k] for k in ("val", "stack_trace") if k in self.wait.meta})
        self.wait.replace_all_uses_with(new)
        self.erase()

    def erase(self) -> None:
        graph = self.wait.graph
        graph.erase_node(self.wait)
        graph.erase_node(self.all_reduce)


def _find_matches(graph: torch.fx.Graph) -> list[_AllReduceMatch]:
    matches = []
    for node in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        users = list(node.users)
        if len(users) == 1 and users[0].target == c10d.wait_tensor.default:
            matches.append(_AllReduceMatch(node, users[0]))
        else:
            log.debug("graphar: %s left alone: its result is used other than by one wait_tensor", node.name)
    return matches


def _group_spans_one_node(group_name: str) -> bool:
    """Whether every rank of the group is on this node, judged from facts equal on all ranks.

    With torchrun's LOCAL_WORLD_SIZE, ranks r and s share a node iff r // local == s // local.
    Without it (a single-node launcher, tests), the group is taken to be node-local.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local:
        return True
    from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

    ranks = get_process_group_ranks(_resolve_process_group(group_name))
    return len({r // int(local) for r in ranks}) == 1


def _reason_to_skip(match: _AllReduceMatch, config: Config) -> str | None:
    """Why this all-reduce must stay on its original collective, or None to rewrite it."""
    if match.reduce_op != "sum":
        return f"reduce op {match.reduce_op!r} is not 'sum'"
    if match.group_name in config.exclude_groups:
        return f"group {match.group_name!r} is excluded by config"
    val = match.x.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "input has no tensor metadata"
    if val.dtype not in SUPPORTED_DTYPES:
        return f"dtype {val.dtype} is not supported"
    if statically_known_true(match.nbytes > config.max_all_reduce_bytes):
        return f"size {match.nbytes} bytes is over max_all_reduce_bytes={config.max_all_reduce_bytes}"
    if not _group_spans_one_node(match.group_name):
        return f"group {match.group_name!r} spans more than one node"
    return None


def _warn_over_communicator_limit(match: _AllReduceMatch) -> None:
    """The communicator's buffers (`graphar.init(max_bytes=)`, or GRAPHAR_MAX_ALLREDUCE_BYTES for a group
    that sets up at its first call) bound what the kernels serve at run time; say so when this
    all-reduce is over them, rather than let every call fall back without a word."""
    comm = communicator(match.group_name)
    if comm is not None:
        limit = comm.max_bytes
    elif sets_up_later(match.group_name, match.x.meta["val"].device):
        limit = settings.MAX_ALLREDUCE_BYTES.get()
    else:
        return  # no communicator will serve these calls: nothing to compare with
    if statically_known_true(match.nbytes > limit):
        log.warning(
            "graphar: %s (%s bytes) is over the IPC buffers of group %r (%d bytes; graphar.init(max_bytes=) or "
            "GRAPHAR_MAX_ALLREDUCE_BYTES): it will run on the collective",
            match.all_reduce.name,
            match.nbytes,
            match.group_name,
            limit,
        )


# Collectives graphar has no op for (sequence parallelism's, FSDP's): named in the log, so that a user
# reading it sees why they stay on the process group's collective.
_NO_GRAPHAR_OP = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)


def rewrite_all_reduces(graph: torch.fx.Graph, config: Config) -> int:
    """Rewrite every eligible all-reduce in `graph`; returns how many were rewritten."""
    for target in _NO_GRAPHAR_OP:
        for node in graph.find_nodes(op="call_function", target=target):
            log.info("graphar: %s left on its collective: graphar has no op for it", node.name)
    count = 0
    for match in _find_matches(graph):
        reason = _reason_to_skip(match, config)
        if reason is not None:
            log.info("graphar: %s left on its collective: %s", match.all_reduce.name, reason)
            continue
        checked = "" if isinstance(match.nbytes, int) else "; its size is symbolic, checked at each call"
        log.info("graphar: %s -> graphar::all_reduce (group %r%s)", match.all_reduce.name, match.group_name, checked)
        _warn_over_communicator_limit(match)
        match.replace_with_graphar()
        count += 1
    return count
