"""The custom all-reduce of a group's communicator: eligibility, kernel choice, launch, graph registration.

Kernels (graphar.allreduce.policy picks one per call from a measured table):
- the v1 pull kernels, 1stage and 2stage, behind a spin barrier. Eager, or inside a capture graphar
  does not own, the kernel copies the input into the rank's registered buffer itself, then reduces
  (the buffers never move, so a captured call stays valid). Inside `graphar.graph` they read the
  caller's tensors through a slot filled on every rank when the capture ends (a rank whose tensor
  legacy IPC cannot share stages it);
- the push kernels, push-oneshot and push-twoshot: no barrier, the input read in place in every
  mode, so no registration either.
All paths are bitwise equal across ranks.

The all-reduce reaches its communicator (graphar.allreduce.communicator) only through `CommCalls`, the
seam tests fake.
"""

from __future__ import annotations

import heapq
import logging
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from graphar import _cuda, settings
from graphar.abi import (
    ALGO_CODES,
    ALL_REDUCE_ARGS,
    DTYPE_CODES,
    MAX_ROWS,
    NORM_ARGS,
    PATH_STAGED,
    PATH_ZERO_COPY,
    PLAN_GRAPHAR_GRAPH,
    PLAN_STREAM,
    PUSH_ALGOS,
    Kernels,
    Plan,
    describe,
)
from graphar.allreduce import graphs, policy
from graphar.errors import GrapharCommError

logger = logging.getLogger("graphar")

# Blocks per launch by compute capability major. 36 is the v1 grid search (Ampere and older); on
# 2 x H200 64 blocks pull peers' data faster from 512 KB up (8 MB zero-copy: 34.8 -> 30.0 us,
# bench/results/allreduce-h200-ws2.md) and change nothing below, where the grid is smaller anyway.
_BLOCK_LIMITS = {8: 36, 9: 64}
_DEFAULT_BLOCK_LIMIT = 36
_FIRST_GRAPH_SLOT, GRAPH_SLOTS = 1, 1 << 16  # slot 0 holds the registered buffers
_PUSH_CODES = frozenset(ALGO_CODES[a] for a in PUSH_ALGOS)


def block_limit(capability_major: int) -> int:
    """Blocks per launch: GRAPHAR_BLOCK_LIMIT, else the table by architecture."""
    limit = settings.BLOCK_LIMIT.get()
    return limit if limit is not None else _BLOCK_LIMITS.get(capability_major, _DEFAULT_BLOCK_LIMIT)


def kernel_table(kernels: policy.Policy, pdl: bool) -> Kernels:
    """struct graphar_kernels of a policy: what the CUDA library picks every call's kernel from."""
    table = Kernels(pdl=int(pdl), fused_norm_max=kernels.fused_norm_max)
    for m, mode in enumerate(policy.MODES):
        rows = kernels.segments(mode)
        if len(rows) > MAX_ROWS:
            raise ValueError(f"{len(rows)} {mode} kernel rows: the CUDA library takes at most {MAX_ROWS}")
        table.rows[m] = len(rows)
        for i, (bound, algo) in enumerate(rows):
            table.bounds[m][i], table.algos[m][i] = bound, 0 if algo is None else ALGO_CODES[algo]
    return table


class GraphSlots(NamedTuple):
    """A registration's graph slots and what they point at (csrc graphar_comm_register_graph): `slots`,
    one per recorded call; every rank's input of each call as an entry, call-major ([call 0: rank 0,
    rank 1, ...][call 1: ...]): its allocation's IPC handle, its offset there, whether it is staged."""

    slots: Sequence[int]
    handles: bytes  # the entries' handles, joined
    offsets: Sequence[int]
    staged: Sequence[bool]
    own_ptrs: Sequence[int]  # this rank's input of each call


class CommCalls(Protocol):
    """What the all-reduce needs of its communicator, all of it (tests/test_communicator_calls.py holds it so)."""

    group_name: str
    device: int

    @property
    def usable(self) -> bool: ...  # open and healthy: a host read, no sync
    def check(self) -> None: ...
    def mark_broken(self, reason: str) -> None: ...
    def all_gather(self, obj: Any, what: str) -> list[Any]: ...
    def set_kernels(self, kernels: Kernels) -> None: ...
    def plan(self, x: bytes, stream: int, how: int, algo: int) -> Plan: ...
    def plan_norm(self, x: bytes, residual: bytes, weight: bytes, row_bytes: int) -> str | None: ...
    def launch_all_reduce(self, args: bytes) -> None: ...  # graphar.abi.ALL_REDUCE_ARGS, packed
    def launch_all_reduce_norm(self, args: bytes) -> None: ...  # graphar.abi.NORM_ARGS, packed
    def native_calls(self) -> int: ...
    def pointer_info(self, ptr: int) -> tuple[int, bool]: ...
    def ipc_handle(self, base: int) -> bytes: ...
    def fill_graph_slots(self, fill: GraphSlots) -> None: ...
    def forget_graph_slots(self, slots: Sequence[int]) -> None: ...  # no CUDA call: safe from a finalizer
    def close_unused_mappings(self) -> None: ...  # waits for the device when there is any


@dataclass
class GraphCall:
    """One all-reduce recorded during a graphar.graph capture (graphar.allreduce.graphs keeps its input allocated
    for the peers: the capture's memory pool, or the tensor itself)."""

    slot: int
    tensor: weakref.ref[torch.Tensor]  # weak: an activation freed during the capture is the pool's to reuse
    ptr: int
    base: int  # start of the allocation holding the tensor
    staged: bool  # legacy IPC cannot share it: the call copies into the registered buffer
    signature: tuple[int, int, int]  # bytes, dtype code, algorithm code: equal on every rank


class _SharedCall(NamedTuple):
    """What a rank tells its peers about one recorded call."""

    staged: bool
    handle: bytes  # IPC handle of the allocation (zeros when staged)
    offset: int
    signature: tuple[int, int, int]


class AllReduce:
    """The custom all-reduce of one communicator; `calls` counts the calls its kernels served.

    Eager calls through the ops are served by their C++ kernels where they are built
    (graphar.allreduce.native_op); every other call comes here. Both ask the CUDA library which kernel serves a
    call, from the table this object hands it (`policy` and `pdl`: setting either hands it anew).
    """

    def __init__(self, comm: CommCalls, kernels: policy.Policy) -> None:
        self.comm = comm
        self._policy = kernels
        self._pdl = settings.PDL.get()
        comm.set_kernels(kernel_table(kernels, self._pdl))
        self._next_slot = _FIRST_GRAPH_SLOT  # never handed out yet, from here up
        self._free_slots: list[int] = []  # handed back by destroyed graphs (a heap)
        self._recorded = 0
        # Graph registrations so far (collective: the same count on every rank), and for the graphs that
        # died: their inputs, held until every rank has closed its mappings of them (an allocation
        # freed while a peer still maps it is undefined in CUDA), and who has said so at a registration.
        self._registrations = 0
        self._held: dict[int, tuple[Any, ...]] = {}
        self._released: list[int] = []  # registrations whose graph died here since the last one
        self._closed_by: dict[int, set[int]] = {}
        self._calls = 0
        self._native_calls_before = comm.native_calls()  # the C++ kernel counts per group name
        # Why the last call `try_all_reduce` refused runs on no kernel: decided there, once, and read by
        # the op's log and `all_reduce`'s error. Set only on a refusal, so a served call pays nothing.
        self.refusal: str | None = None
        self._fallbacks_seen: set[str] = set()
        self._fallbacks_said: set[str] = set()
        self.tuned: Any = None  # the tuner's table (graphar.allreduce.tuner.Table) where it chose the kernels

    @property
    def policy(self) -> policy.Policy:
        """The kernel per size and capture mode."""
        return self._policy

    @policy.setter
    def policy(self, kernels: policy.Policy) -> None:
        self.comm.set_kernels(kernel_table(kernels, self._pdl))
        self._policy = kernels

    @property
    def pdl(self) -> bool:
        """Whether the kernels launch with programmatic dependent launch (GRAPHAR_PDL)."""
        return self._pdl

    @pdl.setter
    def pdl(self, on: bool) -> None:
        self.comm.set_kernels(kernel_table(self._policy, on))
        self._pdl = on

    @property
    def calls(self) -> int:
        """How many calls graphar's kernels served, through the ops' Python or C++ kernels."""
        return self._calls + self.comm.native_calls() - self._native_calls_before

    @property
    def group_name(self) -> str:
        return self.comm.group_name

    @property
    def graph_calls(self) -> int:
        """How many calls graphar.graph captures have recorded zero-copy so far."""
        return self._recorded

    @property
    def slots_in_use(self) -> int:
        """Graph slots held by live captures (a destroyed graph hands its slots back)."""
        return self._next_slot - _FIRST_GRAPH_SLOT - len(self._free_slots)

    def release_slots(self, slots: Sequence[int]) -> None:
        """Hand back the slots of a capture that registered nothing; they are reused. Slot numbers are
        this rank's own: each rank fills its own table, so ranks need not agree."""
        for slot in slots:
            heapq.heappush(self._free_slots, slot)

    def release_graph(self, registration: int, slots: Sequence[int], held: tuple[Any, ...]) -> None:
        """The graph of `registration` is gone (its finalizer): its slots are reused, the peers'
        allocations only it read are closed at the next idle point, and what keeps its inputs allocated
        (`held`: tensors, a use of its memory pool) is kept until every peer has closed its mappings of
        them (said at a later registration, or at close)."""
        self.release_slots(slots)
        self.comm.forget_graph_slots(slots)
        self._held[registration] = held
        self._released.append(registration)

    @property
    def held_graphs(self) -> int:
        """Dead graphs whose inputs wait for a peer to close its mappings of them."""
        return len(self._held)

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` (a sum) runs on the custom kernels; otherwise use NCCL.
        False once the communicator is closed or broken (a call would raise). The question
        `try_all_reduce` answers, asked without a call."""
        comm = self.comm
        if not comm.usable:
            return False
        return comm.plan(describe(x), torch._C._cuda_getCurrentRawStream(comm.device), PLAN_STREAM, 0).refusal is None

    def all_reduce(self, x: torch.Tensor, algo: str | None = None) -> torch.Tensor:
        """Sum of `x` over the group, as a new tensor; `algo` forces a kernel (graphar.abi.ALGO_CODES)."""
        out = self.try_all_reduce(x, algo)
        if out is None:
            raise ValueError(f"graphar all_reduce on group {self.group_name!r}: input not eligible: {self.refusal}")
        return out

    def say_why_not(self) -> None:
        """Log why the call `try_all_reduce` just refused runs on the collective instead (`refusal`), once
        per group and kind of reason (sizes aside): the op's fallback is never silent, and a loop of
        such calls is not noisy (it pays one set lookup)."""
        reason = self.refusal
        if reason is None or reason in self._fallbacks_seen:
            return
        self._fallbacks_seen.add(reason)
        kind = re.sub(r"\d+", "N", reason)
        if kind not in self._fallbacks_said:
            self._fallbacks_said.add(kind)
            logger.info(
                "graphar: all_reduce on group %r runs on the collective: %s (said once per kind)",
                self.group_name,
                reason,
            )

    def try_all_reduce(self, x: torch.Tensor, algo: str | None = None) -> torch.Tensor | None:
        """`all_reduce(x, algo)`, or None when no kernel can take `x` (the caller then uses NCCL), with
        the reason in `refusal`. The CUDA library's plan decides, for this path and the op's C++
        kernel alike; this adds what only Python knows: graphar.graph's captures, which record the
        v1 kernels' inputs for their graph slots.
        """
        comm = self.comm
        comm.check()
        forced = algo if algo is not None else self._policy.forced
        code = 0 if forced is None else ALGO_CODES.get(forced)
        if code is None:
            raise ValueError(f"all-reduce algorithm must be one of {sorted(ALGO_CODES)}, got {forced!r}")
        capture = graphs.current_capture()
        stream = torch._C._cuda_getCurrentRawStream(comm.device)
        how = PLAN_STREAM if capture is None else PLAN_GRAPHAR_GRAPH
        chosen, path, refusal = comm.plan(describe(x), stream, how, code)
        if refusal is not None:
            self.refusal = refusal
            return None
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        nbytes, dtype_code = x.nbytes, DTYPE_CODES[x.dtype]
        slot = 0
        if capture is not None and chosen not in _PUSH_CODES:
            path, slot = self._record_graph_call(capture, x, (nbytes, dtype_code, chosen))
        comm.launch_all_reduce(
            ALL_REDUCE_ARGS.pack(x.data_ptr(), out.data_ptr(), nbytes, stream, dtype_code, chosen, path, slot)
        )
        self._calls += 1
        return out

    def try_all_reduce_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        eps: float,
        weight_first: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(sum of x + residual) * weight, sum of x + residual) by the fused kernel, or None when
        it cannot take them (the caller then runs the all-reduce and the norm apart). The CUDA
        library's plan decides by dtypes, sizes and layout; x's shape and the weight's one row are
        checked here, where the shapes are known.
        """
        comm = self.comm
        comm.check()
        if x.dim() == 0 or (residual is not None and residual.shape != x.shape):
            return None
        if weight is not None and weight.dim() != 1:
            return None
        row_bytes = x.shape[-1] * x.element_size()
        if comm.plan_norm(describe(x), describe(residual), describe(weight), row_bytes) is not None:
            return None
        normed = torch.empty_like(x, memory_format=torch.contiguous_format)
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
        stream = torch._C._cuda_getCurrentRawStream(comm.device)
        comm.launch_all_reduce_norm(
            NORM_ARGS.pack(
                x.data_ptr(),
                0 if residual is None else residual.data_ptr(),
                0 if weight is None else weight.data_ptr(),
                normed.data_ptr(),
                summed.data_ptr(),
                x.nbytes,
                row_bytes,
                stream,
                eps,
                DTYPE_CODES[x.dtype],
                int(weight_first),
                0,
            )
        )
        self._calls += 1
        return normed, summed

    # ---- CUDA-graph capture (graphar.allreduce.graphs) --------------------------------------------------

    def _record_graph_call(
        self, capture: graphs.Capture, x: torch.Tensor, signature: tuple[int, int, int]
    ) -> tuple[int, int]:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        elif self._next_slot < GRAPH_SLOTS:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        else:
            raise GrapharCommError(
                f"graphar all_reduce on group {self.group_name!r}: all {GRAPH_SLOTS - 1} graph slots are held by "
                "live graphs (each zero-copy all-reduce captured by graphar.graph holds one until its graph is freed)"
            )
        base, capable = self.comm.pointer_info(x.data_ptr())
        call = GraphCall(slot, weakref.ref(x), x.data_ptr(), base, not capable, signature)
        self._recorded += 1
        capture.record(self, call)
        return (PATH_STAGED if call.staged else PATH_ZERO_COPY), call.slot

    def register_graph(self, calls: Sequence[GraphCall], lost: Sequence[int] = ()) -> int:
        """Collective after a capture: share the recorded inputs and fill their slots; returns the
        registration's number (equal on every rank), which `release_graph` takes when the graph dies.
        `lost`: the calls whose input this rank could not keep (graphar.allreduce.graphs): every rank raises."""
        self.comm.check()
        try:
            self._register_graph(calls, lost)
        except Exception as e:
            # The ranks' exchanges or slots may now be out of step: nothing later can be trusted.
            self.comm.mark_broken(f"graphar graph registration on group {self.group_name!r} failed: {e}")
            raise
        self._registrations += 1
        return self._registrations - 1

    def _register_graph(self, calls: Sequence[GraphCall], lost: Sequence[int]) -> None:
        # Mappings that only dead graphs read are closed before this rank says which graphs it let go.
        self.comm.close_unused_mappings()
        released, self._released = self._released, []
        everyone = self.comm.all_gather(
            (self._shared(calls), released, list(lost)), f"graph registration on group {self.group_name!r}"
        )
        self._drop_inputs_closed_everywhere([ids for _, ids, _ in everyone])
        for rank, (_, _, gone) in enumerate(everyone):
            if gone:
                raise GrapharCommError(
                    f"rank {rank} captured all-reduces {gone} of a graphar.graph on inputs that were freed during "
                    "the capture: a replay would read memory reused since; keep every tensor a captured "
                    "all-reduce reads alive while its graph lives"
                )
        counts = [len(shared) for shared, _, _ in everyone]
        if len(set(counts)) != 1:
            raise GrapharCommError(f"ranks recorded different numbers of all-reduces in one graph: {counts}")
        for i in range(len(calls)):
            signatures = {shared[i].signature for shared, _, _ in everyone}
            if len(signatures) != 1:
                raise GrapharCommError(f"ranks disagree on all-reduce {i} (bytes, dtype, algorithm): {signatures}")
        # Call-major, as the C ABI wants: [call 0: rank 0, rank 1, ...][call 1: ...].
        flat = [everyone[r][0][i] for i in range(len(calls)) for r in range(len(everyone))]
        self.comm.fill_graph_slots(
            GraphSlots(
                [c.slot for c in calls],
                b"".join(e.handle for e in flat),
                [e.offset for e in flat],
                [e.staged for e in flat],
                [c.ptr for c in calls],
            )
        )

    def _drop_inputs_closed_everywhere(self, released_by_rank: Sequence[Sequence[int]]) -> None:
        """Registrations every rank has let go of (and closed its mappings for): their inputs may go."""
        for rank, registrations in enumerate(released_by_rank):
            for registration in registrations:
                self._closed_by.setdefault(registration, set()).add(rank)
        for registration in [r for r, ranks in self._closed_by.items() if len(ranks) == len(released_by_rank)]:
            del self._closed_by[registration]
            self._held.pop(registration, None)

    def _shared(self, calls: Sequence[GraphCall]) -> list[_SharedCall]:
        handles: dict[int, bytes] = {}
        mine = []
        for c in calls:
            if c.staged:  # peers read this rank's registered buffer, which they have open already
                mine.append(_SharedCall(True, bytes(_cuda.IPC_HANDLE_BYTES), 0, c.signature))
                continue
            if c.base not in handles:
                handles[c.base] = self.comm.ipc_handle(c.base)
            mine.append(_SharedCall(False, handles[c.base], c.ptr - c.base, c.signature))
        return mine
