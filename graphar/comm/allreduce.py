"""The custom all-reduce communicator: IPC buffers shared over the group's store, the v1 kernels.

`init(group)` is collective over the group. It returns a `CustomAllreduce` only where the custom
path is safe (one node, even world size <= 8, P2P confirmed by a real IPC store and load, NVLink
between every pair when the world size is above 2); otherwise None on every rank, with the reason
logged once. Every step that can differ between ranks ends in an exchange of verdicts, so all
ranks decide alike.

Input paths of `CustomAllreduce.all_reduce`, bitwise equal:
- eager, or inside a capture graphar does not own: the kernel copies the input into the rank's
  registered buffer itself, then reduces (the buffers never move, so a captured call stays valid);
- inside `graphar.graph`: zero copy; the kernel reads the caller's tensors through a slot that
  graphar.graphs fills after capture (a rank whose tensor legacy IPC cannot share stages it).
"""

from __future__ import annotations

import ctypes
import logging
import pickle
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from graphar import _cuda, graphs, settings
from graphar.errors import GrapharCommError, GrapharTimeoutError

logger = logging.getLogger("graphar")

KB = 1 << 10
ONE_STAGE, TWO_STAGE = "1stage", "2stage"
_ALGO_CODES = {ONE_STAGE: 1, TWO_STAGE: 2}
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Launch paths (GRAPHAR_EAGER ... of csrc/graphar_cuda.h).
EAGER, CAPTURED_COPY, ZERO_COPY, STAGED = 0, 1, 2, 3
_WORLD_SIZES = (2, 4, 6, 8)
# Above 2 ranks, 1stage (which reads ws x the message) wins below these sizes; ws == 2 always 1stage.
_ONE_STAGE_BELOW = {4: 512 * KB, 6: 256 * KB, 8: 256 * KB}
# Blocks per launch by compute capability major. 36 is the v1 grid search (Ampere and older); on
# 2 x H200 64 blocks pull peers' data faster from 512 KB up (8 MB zero-copy: 34.8 -> 30.0 us,
# bench/results/allreduce-h200-ws2.md) and change nothing below, where the grid is smaller anyway.
_BLOCK_LIMITS = {8: 36, 9: 64}
_DEFAULT_BLOCK_LIMIT = 36
MAX_BLOCKS = settings.MAX_BLOCKS
_GRAPH_SLOTS = 1 << 16
_WHERE = {1: "all_reduce 1stage entry", 2: "all_reduce 1stage exit", 3: "all_reduce 2stage entry",
          4: "all_reduce 2stage middle", 5: "all_to_all entry", 6: "all_to_all exit"}  # fmt: skip


def choose_algo(world_size: int, nbytes: int, forced: str | None = None) -> str:
    """The kernel for one call; depends only on facts equal on every rank."""
    if forced is not None:
        if forced not in _ALGO_CODES:
            raise ValueError(f"all-reduce algorithm must be '1stage' or '2stage', got {forced!r}")
        return forced
    if world_size == 2 or nbytes < _ONE_STAGE_BELOW[world_size]:
        return ONE_STAGE
    return TWO_STAGE


def block_limit(capability_major: int) -> int:
    """Blocks per launch: GRAPHAR_BLOCK_LIMIT, else the table by architecture."""
    limit = settings.BLOCK_LIMIT.get()
    return limit if limit is not None else _BLOCK_LIMITS.get(capability_major, _DEFAULT_BLOCK_LIMIT)


def ineligible_reason(x: torch.Tensor, device: int, max_bytes: int) -> str | None:
    """Why the custom kernels cannot sum `x` (None when they can)."""
    if x.dtype not in _DTYPE_CODES:
        return f"dtype {x.dtype} (float32, float16 and bfloat16 only)"
    if not x.is_contiguous():
        return "not contiguous"
    nbytes = x.numel() * x.element_size()
    if nbytes == 0 or nbytes % 16 != 0:
        return f"{nbytes} bytes is not a positive multiple of 16"
    if nbytes > max_bytes:
        return f"{nbytes} bytes is over the limit of {max_bytes}"
    if x.data_ptr() % 16 != 0:
        return "data pointer is not 16-byte aligned"
    if x.device.type != "cuda" or x.device.index != device:
        return f"on {x.device}, not on cuda:{device}"
    return None


class _ErrorRecord(ctypes.Structure):
    """ErrorRecord of csrc/custom_all_reduce.cuh, in host-mapped memory the kernels write."""

    _fields_ = [("failed", ctypes.c_uint32), ("where", ctypes.c_uint32), ("peer", ctypes.c_uint32),
                ("block", ctypes.c_uint32)]  # fmt: skip


class _StoreExchange:
    """All-gathers of small Python objects over the group's store, each with a bounded wait."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._timeout = timedelta(seconds=timeout_s)
        self._step = 0

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        keys = [f"{self._prefix}/{self._step}/{r}" for r in range(self._world_size)]
        self._step += 1
        self._store.set(keys[self._rank], pickle.dumps(obj))
        try:
            self._store.wait(keys, self._timeout)
        except Exception as e:  # noqa: BLE001  (store backends raise different types)
            raise GrapharCommError(
                f"{what}: not every rank arrived within {self._timeout.total_seconds():.0f} s "
                f"(GRAPHAR_EXCHANGE_TIMEOUT_S): {e}"
            ) from e
        return [pickle.loads(self._store.get(k)) for k in keys]


@dataclass
class GraphCall:
    """One all-reduce recorded during a graphar.graph capture; the graph keeps `tensor` alive."""

    slot: int
    tensor: torch.Tensor
    base: int  # start of the allocation holding the tensor
    staged: bool  # legacy IPC cannot share it: the call copies into the registered buffer
    signature: tuple[int, int, int]  # bytes, dtype code, algorithm code: equal on every rank


class _SharedCall(NamedTuple):
    """What a rank tells its peers about one recorded call."""

    staged: bool
    handle: bytes  # IPC handle of the allocation (zeros when staged)
    offset: int
    signature: tuple[int, int, int]


class CustomAllreduce:
    """The custom all-reduce of one process group on this process's GPU; built by `init`."""

    group_name: str
    rank: int
    world_size: int
    max_bytes: int

    def __init__(self, *, group_name: str, rank: int, world_size: int, device: int, max_bytes: int,
                 timeout_s: float, blocks: int, forced_algo: str | None, exchange: _StoreExchange) -> None:  # fmt: skip
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.device = device
        self.timeout_s = timeout_s
        self._forced_algo = forced_algo
        self._exchange = exchange
        self._lib = _cuda.library()
        self._broken: str | None = None
        self._next_slot = 1  # slot 0 holds the registered buffers
        handle = ctypes.c_void_p()
        self._check(
            self._lib.graphar_comm_create(rank, world_size, max_bytes, blocks, int(timeout_s * 1e9), _GRAPH_SLOTS,
                                          ctypes.byref(handle)),
            "create",
        )  # fmt: skip
        self._handle: int | None = handle.value
        record = ctypes.c_void_p()
        self._check(self._lib.graphar_comm_error_record(self._handle, ctypes.byref(record)), "create")
        self._record = _ErrorRecord.from_address(record.value)

    # ---- set-up steps, driven by init() -------------------------------------------------------

    def _ipc_handles(self) -> bytes:
        out = ctypes.create_string_buffer(2 * _cuda.IPC_HANDLE_BYTES)
        self._check(self._lib.graphar_comm_handles(self._handle, out), "IPC handle export")
        return out.raw

    def _open_peers(self, handles: Sequence[bytes]) -> None:
        self._check(self._lib.graphar_comm_open(self._handle, b"".join(handles)), "IPC open")

    def _probe(self, phase: int) -> str | None:
        bad = ctypes.c_int(-1)
        self._check(self._lib.graphar_comm_probe(self._handle, phase, ctypes.byref(bad)), "P2P probe")
        return None if bad.value < 0 else f"P2P store/load with rank {bad.value} did not round-trip"

    # ---- public API ---------------------------------------------------------------------------

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` (a sum) runs on the custom kernels; otherwise use NCCL."""
        return self._handle is not None and ineligible_reason(x, self.device, self.max_bytes) is None

    def all_reduce(self, x: torch.Tensor, algo: str | None = None) -> torch.Tensor:
        """Sum of `x` over the group, as a new tensor; `algo` forces '1stage' or '2stage'."""
        out = self.try_all_reduce(x, algo)
        if out is None:
            reason = ineligible_reason(x, self.device, self.max_bytes)
            raise ValueError(f"graphar all_reduce on group {self.group_name!r}: input not eligible: {reason}")
        return out

    def try_all_reduce(self, x: torch.Tensor, algo: str | None = None) -> torch.Tensor | None:
        """`all_reduce(x, algo)`, or None when `x` is not eligible (the caller then uses NCCL).

        The op's path: one eligibility check per call instead of `eligible` and then `all_reduce`.
        """
        self.check()
        if ineligible_reason(x, self.device, self.max_bytes) is not None:
            return None
        nbytes = x.numel() * x.element_size()
        dtype_code = _DTYPE_CODES[x.dtype]
        algo_code = _ALGO_CODES[choose_algo(self.world_size, nbytes, algo or self._forced_algo)]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        mode, slot = EAGER, 0
        if torch.cuda.is_current_stream_capturing():
            capture = graphs.current_capture()
            if capture is None:
                mode = CAPTURED_COPY
            else:
                mode, slot = self._record_graph_call(capture, x, nbytes, dtype_code, algo_code)
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        rc = self._lib.graphar_comm_all_reduce(
            self._handle, dtype_code, algo_code, mode, x.data_ptr(), out.data_ptr(), nbytes, slot, stream
        )
        self._check(rc, "all_reduce")
        return out

    def check(self) -> None:
        """Raise if a kernel of this communicator timed out (host read, no sync) or it is unusable."""
        if self._handle is None:
            raise GrapharCommError(f"graphar communicator of group {self.group_name!r} is closed")
        if self._broken is None and self._record.failed:
            r = self._record
            self._broken = (
                f"graphar op on group {self.group_name!r} (rank {self.rank}) timed out: rank {r.peer} did "
                f"not reach the {_WHERE.get(r.where, '?')} barrier (block {r.block}) within {self.timeout_s} s "
                "(GRAPHAR_TIMEOUT_S); the communicator is unusable from now on"
            )
        if self._broken is not None:
            raise (GrapharTimeoutError if self._record.failed else GrapharCommError)(self._broken)

    def close(self) -> None:
        """Wait for the device, then release the buffers and the peers' mappings. Idempotent."""
        if self._handle is None:
            return
        if _communicators.get(self.group_name) is self:
            del _communicators[self.group_name]
        handle, self._handle = self._handle, None
        self._check(self._lib.graphar_comm_destroy(handle), "close")

    # ---- for the other ops of this communicator (graphar.comm.exchange) --------------------------

    def native(self, op: str, name: str, *args: Any) -> None:
        """Call `name` of the CUDA library with this communicator's handle; raise naming `op` on failure."""
        self.check()
        self._check(getattr(self._lib, name)(self._handle, *args), op)

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's `obj`, in rank order, over the group's store (collective, bounded wait)."""
        return self._exchange.all_gather(obj, what)

    # ---- CUDA-graph capture (graphar.graphs) --------------------------------------------------

    def _record_graph_call(
        self, capture: graphs.Capture, x: torch.Tensor, nbytes: int, dtype_code: int, algo_code: int
    ) -> tuple[int, int]:
        if self._next_slot >= _GRAPH_SLOTS:
            raise GrapharCommError(
                f"graphar all_reduce on group {self.group_name!r}: all {_GRAPH_SLOTS - 1} graph slots are used"
            )
        base, size, capable = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
        rc = self._lib.graphar_pointer_info(x.data_ptr(), ctypes.byref(base), ctypes.byref(size), ctypes.byref(capable))
        self._check(rc, "all_reduce (capture)")
        call = GraphCall(self._next_slot, x, base.value, not capable.value, (nbytes, dtype_code, algo_code))
        self._next_slot += 1
        capture.record(self, call)
        return (STAGED if call.staged else ZERO_COPY), call.slot

    def register_graph(self, calls: Sequence[GraphCall]) -> None:
        """Collective after a capture: share the recorded inputs and fill their slots."""
        self.check()
        try:
            self._register_graph(calls)
        except Exception as e:
            # The ranks' exchanges or slots may now be out of step: nothing later can be trusted.
            self._broken = f"graphar graph registration on group {self.group_name!r} failed: {e}"
            raise

    def _register_graph(self, calls: Sequence[GraphCall]) -> None:
        slots = [c.slot for c in calls]
        if slots != list(range(slots[0], slots[0] + len(slots))):
            raise GrapharCommError("captures that interleave on one communicator are not supported")
        handles: dict[int, bytes] = {}
        mine = []
        for c in calls:
            if c.staged:  # peers read this rank's registered buffer, which they have open already
                mine.append(_SharedCall(True, bytes(_cuda.IPC_HANDLE_BYTES), 0, c.signature))
                continue
            if c.base not in handles:
                buf = ctypes.create_string_buffer(_cuda.IPC_HANDLE_BYTES)
                self._check(self._lib.graphar_ipc_handle(c.base, buf), "graph registration")
                handles[c.base] = buf.raw
            mine.append(_SharedCall(False, handles[c.base], c.tensor.data_ptr() - c.base, c.signature))
        everyone = self._exchange.all_gather(mine, f"graph registration on group {self.group_name!r}")
        counts = [len(shared) for shared in everyone]
        if len(set(counts)) != 1:
            raise GrapharCommError(f"ranks recorded different numbers of all-reduces in one graph: {counts}")
        for i in range(len(calls)):
            signatures = {shared[i].signature for shared in everyone}
            if len(signatures) != 1:
                raise GrapharCommError(f"ranks disagree on all-reduce {i} (bytes, dtype, algorithm): {signatures}")
        n, ws = len(calls), self.world_size
        flat = [everyone[r][i] for i in range(n) for r in range(ws)]  # call-major, as the C ABI wants
        offsets = (ctypes.c_uint64 * (n * ws))(*(e.offset for e in flat))
        staged = (ctypes.c_uint8 * (n * ws))(*(e.staged for e in flat))
        own = (ctypes.c_uint64 * n)(*(c.tensor.data_ptr() for c in calls))
        handle_bytes = b"".join(e.handle for e in flat)
        rc = self._lib.graphar_comm_register_graph(self._handle, slots[0], n, handle_bytes, offsets, staged, own)
        self._check(rc, "graph registration")

    # ---- tests --------------------------------------------------------------------------------

    def _set_barrier_counters(self, value: int) -> None:
        """Test only, collective: every barrier counter as if `value` barriers had passed."""
        torch.cuda.synchronize(self.device)
        self._exchange.all_gather(None, "barrier counter reset (idle)")
        self._check(self._lib.graphar_comm_set_barrier_counters(self._handle, value), "set barrier counters")
        self._exchange.all_gather(None, "barrier counter reset (done)")

    def _check(self, rc: int, op: str) -> None:
        if rc != 0:
            raise _cuda.GrapharCudaError(
                f"graphar {op} on group {self.group_name!r} (rank {self.rank}): {_cuda.last_error()}"
            )


_communicators: dict[str, CustomAllreduce] = {}
_generations: dict[str, int] = {}
_logged: set[str] = set()


def communicator(group_name: str) -> CustomAllreduce | None:
    """The communicator of a group, if `init` set one up; a dict lookup."""
    return _communicators.get(group_name)


def shutdown() -> None:
    """Close every communicator (each waits for its device first)."""
    errors = []
    for comm in list(_communicators.values()):
        try:
            comm.close()
        except Exception as e:  # noqa: BLE001  (close the rest, then report)
            errors.append(e)
    if errors:
        raise errors[0]


def _disabled(group_name: str, reason: str) -> None:
    if group_name not in _logged:
        _logged.add(group_name)
        logger.warning("graphar: custom all-reduce off for group %r, NCCL serves it: %s", group_name, reason)


def _uniform_reason(group: dist.ProcessGroup) -> str | None:
    """Checks whose answer is the same on every rank, so no exchange is needed."""
    if "nccl" not in str(dist.get_backend(group)):
        return f"backend {dist.get_backend(group)!r} is not NCCL"
    world_size = dist.get_world_size(group)
    if world_size not in _WORLD_SIZES:
        return f"world size {world_size} is not one of {_WORLD_SIZES}"
    return None


def _first_reason(reasons: Sequence[str | None]) -> str | None:
    for rank, reason in enumerate(reasons):
        if reason is not None:
            return f"rank {rank}: {reason}"
    return None


def _local_facts(device: int, settings: tuple[Any, ...]) -> dict[str, Any]:
    facts: dict[str, Any] = {"host": socket.gethostname(), "settings": settings, "bus": None, "error": None}
    try:
        facts["bus"] = _cuda.pci_bus_id(device)
    except (_cuda.GrapharUnavailable, _cuda.GrapharCudaError) as e:
        facts["error"] = str(e)
    return facts


def _shared_reason(facts: Sequence[dict[str, Any]]) -> str | None:
    """Verdict from every rank's facts; every rank computes the same one."""
    reason = _first_reason([f["error"] for f in facts])
    if reason is not None:
        return reason
    if len({f["host"] for f in facts}) != 1:
        return f"the group spans several hosts: {sorted({f['host'] for f in facts})}"
    buses = [f["bus"] for f in facts]
    if len(set(buses)) != len(buses):
        return f"ranks share a GPU: {buses}"
    if len({f["settings"] for f in facts}) != 1:
        return f"ranks differ in (max_bytes, block limit, GRAPHAR_ALLREDUCE_ALGO): {[f['settings'] for f in facts]}"
    return None


def _nvlink_reason(buses: Sequence[str], rank: int) -> str | None:
    try:
        missing = [r for r, bus in enumerate(buses) if r != rank and not _cuda.nvlink_between(buses[rank], bus)]
    except _cuda.GrapharUnavailable as e:
        return f"cannot confirm NVLink ({e})"
    return f"no NVLink to ranks {missing}" if missing else None


def init(
    group: dist.ProcessGroup | None = None, *, max_bytes: int | None = None, timeout_s: float | None = None
) -> CustomAllreduce | None:
    """Set up the custom all-reduce for `group` (default: the world) on the current CUDA device.

    Collective: every rank of the group calls it. Returns None on every rank (and logs why, once)
    when the group cannot use it. `max_bytes` (default GRAPHAR_MAX_ALLREDUCE_BYTES, 8 MiB) sizes the
    IPC buffers and bounds eligible calls; `timeout_s` (default GRAPHAR_TIMEOUT_S, 60; 0 =
    unbounded) bounds every spin wait on a peer.
    """
    if not dist.is_initialized():
        raise RuntimeError("graphar.init needs torch.distributed to be initialized")
    group = group if group is not None else dist.group.WORLD
    name = group.group_name
    if name in _communicators:
        return _communicators[name]
    max_bytes = settings.MAX_ALLREDUCE_BYTES.get() if max_bytes is None else int(max_bytes)
    timeout_s = settings.TIMEOUT_S.get() if timeout_s is None else float(timeout_s)
    if max_bytes <= 0 or max_bytes % 16 != 0:
        raise ValueError(f"max_bytes must be a positive multiple of 16, got {max_bytes}")
    if timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0 (0 = unbounded), got {timeout_s}")
    reason = _uniform_reason(group)
    if reason is None and not torch.cuda.is_available():
        reason = "CUDA is not available"  # NCCL groups imply CUDA on every rank
    if reason is not None:
        _disabled(name, reason)
        return None
    comm, reason = _set_up(group, name, max_bytes, timeout_s)
    if comm is None:
        _disabled(name, reason or "unknown")
        return None
    _communicators[name] = comm
    return comm


def _set_up(
    group: dist.ProcessGroup, name: str, max_bytes: int, timeout_s: float
) -> tuple[CustomAllreduce | None, str | None]:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.cuda.current_device()
    generation = _generations.get(name, 0)
    _generations[name] = generation + 1
    exchange_timeout = settings.EXCHANGE_TIMEOUT_S.get()
    store = dist.distributed_c10d._world.pg_map[group][1]
    exchange = _StoreExchange(store, f"graphar/allreduce/{name}/{generation}", rank, world_size, exchange_timeout)
    what = f"graphar.init of group {name!r}"

    blocks = block_limit(torch.cuda.get_device_capability(device)[0])
    forced = settings.ALLREDUCE_ALGO.get()
    facts = exchange.all_gather(_local_facts(device, (max_bytes, blocks, forced)), what)
    reason = _shared_reason(facts)
    if reason is None and world_size > 2:
        reason = _first_reason(exchange.all_gather(_nvlink_reason([f["bus"] for f in facts], rank), what))
    if reason is not None:
        return None, reason

    comm: CustomAllreduce | None = None
    local: str | None = None
    handles = b""
    try:
        comm = CustomAllreduce(group_name=name, rank=rank, world_size=world_size, device=device,
                               max_bytes=max_bytes, timeout_s=timeout_s, blocks=blocks, forced_algo=forced,
                               exchange=exchange)  # fmt: skip
        handles = comm._ipc_handles()
    except (_cuda.GrapharUnavailable, _cuda.GrapharCudaError) as e:
        local = str(e)
    gathered = exchange.all_gather((handles, local), what)
    reason = _first_reason([error for _, error in gathered])
    if reason is None:
        reason = _agree(exchange, what, lambda: comm._open_peers([h for h, _ in gathered]) or comm._probe(0))
    if reason is None:  # every rank has stored into every peer: load it all back
        reason = _agree(exchange, what, lambda: comm._probe(1))
    if reason is not None:
        if comm is not None:
            comm.close()
        return None, reason
    return comm, None


def _agree(exchange: _StoreExchange, what: str, step: Callable[[], str | None]) -> str | None:
    """Run a local step (its result: a reason to give up, or None), then share every rank's result."""
    try:
        local = step()
    except _cuda.GrapharCudaError as e:
        local = str(e)
    return _first_reason(exchange.all_gather(local, what))
