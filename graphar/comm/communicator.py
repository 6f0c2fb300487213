"""A group's IPC communicator: buffers shared over CUDA IPC, the set-up that proves them, one registry.

`init(group)` is collective over the group. It returns a `Communicator` only where the custom paths
are safe (one node, even world size <= 8, P2P confirmed by a real IPC store and load, NVLink between
every pair above 2 ranks); otherwise None on every rank, with the reason logged once. Every step
whose outcome can differ between ranks ends in an exchange of verdicts (`rendezvous`), so all ranks
decide alike.

The communicator owns what every collective of the group shares: the CUDA library's handle, the
barrier flags and registered buffers mapped on every peer, the error record its kernels write, and
its collectives: `allreduce` (graphar.comm.allreduce) and `exchange`, the all-to-all's IPC exchange
buffers (graphar.comm.exchange). Each raises GrapharCommError when the communicator cannot go on,
and GrapharTimeoutError after a peer failed to arrive.
"""

from __future__ import annotations

import ctypes
import logging
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from graphar import _cuda, native_op, settings
from graphar.comm import abi, policy
from graphar.comm.allreduce import GRAPH_SLOTS, AllReduce, block_limit
from graphar.comm.exchange import IpcExchange
from graphar.comm.rendezvous import StoreExchange, agree, first_reason
from graphar.errors import GrapharCommError, GrapharTimeoutError
from graphar.kernels import pack

logger = logging.getLogger("graphar")

_WORLD_SIZES = (2, 4, 6, 8)


class Communicator:
    """The IPC communicator of one process group on this process's GPU; built by `init`."""

    def __init__(self, *, group_name: str, rank: int, world_size: int, device: int, max_bytes: int,
                 timeout_s: float, blocks: int, forced_algo: str | None, capability_major: int,
                 store: StoreExchange) -> None:  # fmt: skip
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._store = store
        self._lib = _cuda.library()
        self._launch = self._lib.graphar_comm_all_reduce
        self._launch_norm = self._lib.graphar_comm_all_reduce_norm
        self._broken: str | None = None
        handle = ctypes.c_void_p()
        self._call("create", "graphar_comm_create", rank, world_size, max_bytes, blocks, int(timeout_s * 1e9),
                   GRAPH_SLOTS, ctypes.byref(handle), handle=False)  # fmt: skip
        self._handle: int | None = handle.value
        record, one_shot, two_shot = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
        try:
            self._call("create", "graphar_comm_error_record", ctypes.byref(record))
            self._call("create", "graphar_comm_push_limits", ctypes.byref(one_shot), ctypes.byref(two_shot))
        except BaseException:  # nobody else holds the handle yet: free its buffers here
            self.close()
            raise
        self._record = abi.ErrorRecord.from_address(record.value)
        limits = policy.Limits(max_bytes=min(max_bytes, two_shot.value), push_one_shot=one_shot.value)
        self.allreduce = AllReduce(self, policy.Policy(capability_major, world_size, limits, forced_algo))
        self.exchange = IpcExchange(self)

    # ---- the collectives, as users call them ------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, algo: str | None = None) -> torch.Tensor:
        """Sum of `x` over the group, as a new tensor (see `AllReduce.all_reduce`)."""
        return self.allreduce.all_reduce(x, algo)

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` runs on the custom kernels; otherwise use NCCL."""
        return self.allreduce.eligible(x)

    # ---- state --------------------------------------------------------------------------------

    @property
    def handle(self) -> int | None:
        """The CUDA library's handle of this communicator; None once closed."""
        return self._handle

    @property
    def usable(self) -> bool:
        """Open, and no kernel of it timed out (host read, no sync): it can take calls."""
        return self._handle is not None and self._broken is None and not self._record.failed

    def check(self) -> None:
        """Raise if a kernel of this communicator timed out (host read, no sync) or it is unusable."""
        if self._handle is None:
            raise GrapharCommError(f"graphar communicator of group {self.group_name!r} is closed")
        if self._broken is None and self._record.failed:
            r = self._record
            self._broken = (
                f"graphar op on group {self.group_name!r} (rank {self.rank}) timed out: rank {r.peer} did "
                f"not reach the {abi.WHERE.get(r.where, '?')} (block {r.block}) within {self.timeout_s} s "
                "(GRAPHAR_TIMEOUT_S); the communicator is unusable from now on"
            )
        if self._broken is not None:
            raise (GrapharTimeoutError if self._record.failed else GrapharCommError)(self._broken)

    def mark_broken(self, reason: str) -> None:
        """From now on every call raises GrapharCommError(reason): the ranks may be out of step."""
        self._broken = reason
        self._withdraw()  # the Python kernel raises it

    def close(self) -> None:
        """Wait for the device, then release the buffers and the peers' mappings. Idempotent."""
        if self._handle is None:
            return
        self._withdraw()
        if _communicators.get(self.group_name) is self:
            del _communicators[self.group_name]
        try:
            self._call("close", "graphar_comm_destroy")
        finally:  # the library frees everything even when it reports an error
            self._handle = None

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's `obj`, in rank order, over the group's store (collective, bounded wait)."""
        return self._store.all_gather(obj, what)

    # ---- typed calls into the CUDA library (graphar_cuda.h states each one's contract) ------------

    def launch_all_reduce(self, args: bytes) -> None:
        """Launch one all-reduce; `args` is graphar.comm.abi.ALL_REDUCE_ARGS, packed."""
        # Every eager all-reduce comes here: the bound function, its arguments in one struct.
        if self._launch(self._handle, args) != 0:
            self._raise("all_reduce")

    def launch_all_reduce_norm(self, args: bytes) -> None:
        """Launch the fused all-reduce + residual add + RMSNorm; `args` is graphar.comm.abi.NORM_ARGS, packed."""
        if self._launch_norm(self._handle, args) != 0:  # a decode step's path too: the bound function
            self._raise("all_reduce_add_rms_norm")

    def publish_eager(self, segments: policy.Segments, fused_norm_max: int, pdl: bool) -> None:
        """Hand the all-reduce's eager kernel choice and launch settings to the ops' C++ kernels (built
        on first use; when they cannot be, the Python kernels serve every call). Only the group's
        registered, healthy communicator publishes: a closed or broken one stays withdrawn."""
        if not (self.usable and _communicators.get(self.group_name) is self) or native_op.library() is None:
            return
        native_op.publish(self.group_name, native_op.group_state(
            comm=self._handle, lib=self._lib, failed=ctypes.addressof(self._record), max_bytes=self.max_bytes,
            device=self.device, rank=self.rank, segments=segments, fused_norm_max=fused_norm_max, pdl=pdl,
        ))  # fmt: skip

    def _withdraw(self) -> None:
        """Every later eager call of the group goes to the Python kernel (which knows why)."""
        if _communicators.get(self.group_name) is self:
            native_op.publish(self.group_name, None)

    def native_calls(self) -> int:
        """Calls of this group the C++ kernel served (graphar.native_op)."""
        return native_op.calls(self.group_name)

    def order(self, stream: int) -> None:
        """Eager: make `stream` wait for this communicator's previous op when it ran on another stream."""
        self._call("all_to_all", "graphar_comm_order", stream)

    def launch_all_to_all(self, mode: int, output: int, src_offset: int, chunk_bytes: int, row_bytes: int,
                          dst_row_stride: int, dst_chunk_stride: int, flags: int, blocks: int,
                          stream: int) -> None:  # fmt: skip
        """Copy a stage's chunks into the output (csrc graphar_comm_all_to_all; flags: abi.A2A_*)."""
        self._call("all_to_all", "graphar_comm_all_to_all", mode, output, src_offset, chunk_bytes, row_bytes,
                   dst_row_stride, dst_chunk_stride, flags, blocks, stream)  # fmt: skip

    def alloc_exchange(self, nbytes: int, keep_old: bool, what: str) -> tuple[int, bytes]:
        """Collective: this rank's new exchange buffer (device pointer, IPC handle)."""
        ptr, handle = ctypes.c_uint64(), ctypes.create_string_buffer(_cuda.IPC_HANDLE_BYTES)
        self._call(what, "graphar_comm_exchange_alloc", nbytes, int(keep_old), ctypes.byref(ptr), handle)
        return ptr.value, handle.raw

    def open_exchange(self, nbytes: int, handles: Sequence[bytes], what: str) -> list[int]:
        """Collective: map the peers' new exchange buffers; every rank's buffer as this process sees it."""
        ptrs = (ctypes.c_uint64 * self.world_size)()
        self._call(what, "graphar_comm_exchange_open", nbytes, b"".join(handles), ptrs)
        return list(ptrs)

    def pointer_info(self, ptr: int) -> tuple[int, bool]:
        """The start of the allocation holding `ptr`, and whether legacy IPC can share it."""
        base, size, capable = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
        self._call("all_reduce (capture)", "graphar_pointer_info", ptr, ctypes.byref(base), ctypes.byref(size),
                   ctypes.byref(capable), handle=False)  # fmt: skip
        return base.value, bool(capable.value)

    def ipc_handle(self, base: int) -> bytes:
        """The IPC handle of the allocation starting at `base`."""
        out = ctypes.create_string_buffer(_cuda.IPC_HANDLE_BYTES)
        self._call("graph registration", "graphar_ipc_handle", base, out, handle=False)
        return out.raw

    def fill_graph_slots(self, slots: Sequence[int], handles: bytes, offsets: Sequence[int], staged: Sequence[bool],
                         own_ptrs: Sequence[int]) -> None:  # fmt: skip
        """After a capture: point `slots` (one per call) at every rank's inputs (call-major entries)."""
        n = len(own_ptrs)
        self._call("graph registration", "graphar_comm_register_graph", (ctypes.c_int32 * n)(*slots), n, handles,
                   (ctypes.c_uint64 * len(offsets))(*offsets), (ctypes.c_uint8 * len(staged))(*staged),
                   (ctypes.c_uint64 * n)(*own_ptrs))  # fmt: skip

    def _call(self, op: str, name: str, *args: Any, handle: bool = True) -> None:
        """Call `name` of the library (with this communicator's handle first unless handle=False);
        a failure raises GrapharCudaError naming the op, the group and the rank."""
        if getattr(self._lib, name)(*((self._handle,) if handle else ()), *args) != 0:
            self._raise(op)

    def _raise(self, op: str) -> None:
        raise _cuda.GrapharCudaError(
            f"graphar {op} on group {self.group_name!r} (rank {self.rank}): {_cuda.last_error()}"
        )

    # ---- set-up steps, driven by init() -----------------------------------------------------------

    def _ipc_handles(self) -> bytes:
        out = ctypes.create_string_buffer(2 * _cuda.IPC_HANDLE_BYTES)
        self._call("IPC handle export", "graphar_comm_handles", out)
        return out.raw

    def _open_peers(self, handles: Sequence[bytes]) -> None:
        self._call("IPC open", "graphar_comm_open", b"".join(handles))

    def _probe(self, phase: int) -> str | None:
        bad = ctypes.c_int(-1)
        self._call("P2P probe", "graphar_comm_probe", phase, ctypes.byref(bad))
        return None if bad.value < 0 else f"P2P store/load with rank {bad.value} did not round-trip"


# ---- the registry: one communicator per group ----------------------------------------------------

_communicators: dict[str, Communicator] = {}
_generations: dict[str, int] = {}
_logged: set[str] = set()
# Groups whose set-up is settled: `init` ran for them (set up or not), or the automatic set-up does not
# apply. Kept with the group itself: torch reuses a name after destroy_process_group, and the new
# group must set up anew.
_settled: dict[str, dist.ProcessGroup] = {}
_captured_first: set[str] = set()  # groups whose first collective was captured, before any set-up


def communicator(group_name: str) -> Communicator | None:
    """The communicator of a group, if `init` set one up; a dict lookup."""
    return _communicators.get(group_name)


def _is_settled(group_name: str) -> bool:
    group = _settled.get(group_name)
    return group is not None and group in dist.distributed_c10d._world.pg_map  # a destroyed group has left it


def serving(group_name: str, device: torch.device) -> Communicator | None:
    """The communicator that serves a collective of the group on `device`. Where `init` never ran for
    the group, the group's first eager collective on a CUDA device runs it (GRAPHAR_AUTO_INIT, which
    every rank must set alike), so that backend="graphar" alone turns the custom paths on. Every rank
    makes the same call at the same point of the same program, so the ranks set up together, as
    `init` requires. A capture cannot exchange IPC handles: a first call inside one keeps NCCL, and
    the next eager call sets up. Cheap once settled: two dict lookups."""
    comm = _communicators.get(group_name)
    if comm is not None or device.type != "cuda" or _is_settled(group_name):
        return comm
    group = dist.distributed_c10d._resolve_process_group(group_name)
    skip = _not_worth_setting_up(group)
    if skip is not None:
        _settled[group_name] = group
        logger.info("graphar: group %r is not set up at its first collective: %s", group_name, skip)
        return None
    if torch.cuda.is_current_stream_capturing():
        if group_name not in _captured_first:
            _captured_first.add(group_name)
            logger.warning("graphar: group %r's first collective is inside a CUDA-graph capture, which cannot set it "
                           "up: NCCL serves it in this graph; call graphar.init(group) (or run a step eagerly) "
                           "before capturing", group_name)  # fmt: skip
        return None
    logger.info("graphar: setting up group %r at its first collective (graphar.init was not called for it)", group_name)
    with torch.cuda.device(device):
        return init(group)


def sets_up_later(group_name: str) -> bool:
    """Whether a group with no communicator yet will set one up at its first eager CUDA collective."""
    if group_name in _communicators or _is_settled(group_name):
        return False
    return _not_worth_setting_up(dist.distributed_c10d._resolve_process_group(group_name)) is None


def _not_worth_setting_up(group: dist.ProcessGroup) -> str | None:
    """Why the automatic set-up leaves a group alone (None: it sets up): facts equal on every rank."""
    if not settings.AUTO_INIT.get():
        return "GRAPHAR_AUTO_INIT=0"
    if dist.get_world_size(group) == 1:
        return "one rank: nothing to exchange"
    if "nccl" not in str(dist.get_backend(group)):
        return f"backend {dist.get_backend(group)!r} is not NCCL"  # gloo on CUDA tensors: its own choice
    return None


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


def init(
    group: dist.ProcessGroup | None = None, *, max_bytes: int | None = None, timeout_s: float | None = None
) -> Communicator | None:
    """Set up graphar's IPC communicator for `group` (default: the world) on the current CUDA device.

    Collective: every rank of the group calls it. Optional: a group without it sets up at its first
    eager collective (`serving`); call it to choose the moment, the buffers' size or the timeout, or
    before a capture that would be the group's first collective. Returns None on every rank (and
    logs why, once) when the group cannot use it. `max_bytes` (default GRAPHAR_MAX_ALLREDUCE_BYTES, 8 MiB) sizes the
    all-reduce's IPC buffers and bounds eligible calls; `timeout_s` (default GRAPHAR_TIMEOUT_S, 60;
    0 = unbounded) bounds every spin wait on a peer.
    """
    if not dist.is_initialized():
        raise RuntimeError("graphar.init needs torch.distributed to be initialized")
    group = group if group is not None else dist.group.WORLD
    name = group.group_name
    if name in _communicators:
        comm = _communicators[name]
        asked = {"max_bytes": max_bytes, "timeout_s": timeout_s}
        differ = {k: v for k, v in asked.items() if v is not None and float(v) != float(getattr(comm, k))}
        if differ:  # set up already (by an earlier init or at the group's first collective)
            logger.warning("graphar.init of group %r: its communicator is set up already (max_bytes=%d, timeout_s=%g), "
                           "so %s are not applied; graphar.shutdown() first to set it up anew", name, comm.max_bytes,
                           comm.timeout_s, differ)  # fmt: skip
        return comm
    max_bytes = settings.MAX_ALLREDUCE_BYTES.get() if max_bytes is None else int(max_bytes)
    timeout_s = settings.TIMEOUT_S.get() if timeout_s is None else float(timeout_s)
    if max_bytes <= 0 or max_bytes % 16 != 0:
        raise ValueError(f"max_bytes must be a positive multiple of 16, got {max_bytes}")
    if timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0 (0 = unbounded), got {timeout_s}")
    _settled[name] = group
    reason = _uniform_reason(group)
    if reason is None and not torch.cuda.is_available():
        reason = "CUDA is not available"  # NCCL groups imply CUDA on every rank
    comm = None
    if reason is None:
        comm, reason = _set_up(group, name, max_bytes, timeout_s)
    if comm is None:
        _disabled(name, reason or "unknown")
        return None
    _communicators[name] = comm
    comm.allreduce.publish()
    return comm


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


def _local_facts(device: int, settings: tuple[Any, ...]) -> dict[str, Any]:
    facts: dict[str, Any] = {"host": socket.gethostname(), "settings": settings, "bus": None, "error": None}
    try:
        facts["bus"] = _cuda.pci_bus_id(device)
    except (_cuda.GrapharUnavailable, _cuda.GrapharCudaError) as e:
        facts["error"] = str(e)
    return facts


def _shared_reason(facts: Sequence[dict[str, Any]]) -> str | None:
    """Verdict from every rank's facts; every rank computes the same one."""
    reason = first_reason([f["error"] for f in facts])
    if reason is not None:
        return reason
    if len({f["host"] for f in facts}) != 1:
        return f"the group spans several hosts: {sorted({f['host'] for f in facts})}"
    buses = [f["bus"] for f in facts]
    if len(set(buses)) != len(buses):
        return f"ranks share a GPU: {buses}"
    if len({f["settings"] for f in facts}) != 1:
        return (f"ranks differ in (max_bytes, block limit, GRAPHAR_ALLREDUCE_ALGO, GRAPHAR_ALLTOALL_ALGO, "
                f"GRAPHAR_PULL_BLOCKS, Triton, GPU architecture): {[f['settings'] for f in facts]}")
    return None


def _nvlink_reason(buses: Sequence[str], rank: int) -> str | None:
    try:
        missing = [r for r, bus in enumerate(buses) if r != rank and not _cuda.nvlink_between(buses[rank], bus)]
    except _cuda.GrapharUnavailable as e:
        return f"cannot confirm NVLink ({e})"
    return f"no NVLink to ranks {missing}" if missing else None


def _set_up(
    group: dist.ProcessGroup, name: str, max_bytes: int, timeout_s: float
) -> tuple[Communicator | None, str | None]:
    """The set-up agreement: facts, then IPC handles, then open and store (probe 0), then load back
    (probe 1); every step's verdicts shared, so every rank returns alike."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.cuda.current_device()
    generation = _generations.get(name, 0)
    _generations[name] = generation + 1
    store = dist.distributed_c10d._world.pg_map[group][1]
    exchange = StoreExchange(store, f"graphar/allreduce/{name}/{generation}", rank, world_size,
                             settings.EXCHANGE_TIMEOUT_S.get())  # fmt: skip
    what = f"graphar.init of group {name!r}"

    capability_major = torch.cuda.get_device_capability(device)[0]
    blocks = block_limit(capability_major)
    forced = settings.ALLREDUCE_ALGO.get()
    # Every rank must launch alike: the same kernels, block counts (barriers meet block by block) and
    # transport, which a Triton-less rank would choose differently (its Ulysses packs could not push).
    shared = (max_bytes, blocks, forced, settings.ALLTOALL_ALGO.get(), settings.PULL_BLOCKS.get(),
              pack.triton_available(), capability_major)  # fmt: skip
    facts = exchange.all_gather(_local_facts(device, shared), what)
    reason = _shared_reason(facts)
    if reason is None and world_size > 2:
        reason = first_reason(exchange.all_gather(_nvlink_reason([f["bus"] for f in facts], rank), what))
    if reason is not None:
        return None, reason

    comm: Communicator | None = None
    local: str | None = None
    handles = b""
    try:
        comm = Communicator(group_name=name, rank=rank, world_size=world_size, device=device, max_bytes=max_bytes,
                            timeout_s=timeout_s, blocks=blocks, forced_algo=forced,
                            capability_major=capability_major, store=exchange)  # fmt: skip
        handles = comm._ipc_handles()
    except (_cuda.GrapharUnavailable, _cuda.GrapharCudaError) as e:
        local = str(e)
    gathered = exchange.all_gather((handles, local), what)
    reason = first_reason([error for _, error in gathered])
    if reason is None:
        reason = agree(exchange, what, lambda: comm._open_peers([h for h, _ in gathered]) or comm._probe(0))
    if reason is None:  # every rank has stored into every peer: load it all back
        reason = agree(exchange, what, lambda: comm._probe(1))
    if reason is not None:
        if comm is not None:
            comm.close()
        return None, reason
    return comm, None
