"""A group's IPC communicator.

`graphar.allreduce.set_up` makes them (`init`, or at a group's first collective) where the custom
paths are safe, and registers each (graphar.allreduce.registry, one per group). The communicator owns
what every collective of the group shares: the CUDA library's handle, the barrier flags and
registered buffers mapped on every peer, the error record its kernels write, and the all-reduce's
calls (`kernels`, graphar.allreduce.kernels). The Ulysses room attaches its IPC transport to it
(graphar.ulysses.transport.of), which this module knows nothing of. Each raises GrapharCommError when the communicator cannot go on, and GrapharTimeoutError after a peer
failed to arrive. Its life is one state (`Life`): open, broken, failed or closed.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from graphar import _cuda, abi
from graphar.allreduce import native_op, policy, registry
from graphar.allreduce.kernels import GRAPH_SLOTS, AllReduce, GraphSlots
from graphar.allreduce.rendezvous import Rendezvous
from graphar.errors import GrapharCommError, GrapharCudaError, GrapharTimeoutError

logger = logging.getLogger("graphar")


class Life(enum.Enum):
    """Where a communicator is in its life. Only an open one takes calls; the others never open again."""

    OPEN = "open"
    BROKEN = "broken"  # the host gave up on it (`mark_broken`): the ranks may be out of step
    FAILED = "failed"  # a kernel of it gave up on a peer, as its error record says
    CLOSED = "closed"  # its buffers are released


class State(NamedTuple):
    """A communicator's life, and why it ended where it did: one field, set as a whole."""

    life: Life
    reason: str = ""  # broken or failed: what every later call raises


class Communicator:
    """The IPC communicator of one process group on this process's GPU; built by `init`."""

    def __init__(
        self,
        *,
        group_name: str,
        rank: int,
        world_size: int,
        device: int,
        max_bytes: int,
        timeout_s: float,
        blocks: int,
        forced_algo: str | None,
        capability_major: int,
        store: Rendezvous,
    ) -> None:
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._store = store
        self._lib = _cuda.library()
        self._plan = self._lib.graphar_comm_plan
        self._plan_norm = self._lib.graphar_comm_plan_norm
        self._launch = self._lib.graphar_comm_all_reduce
        self._launch_norm = self._lib.graphar_comm_all_reduce_norm
        # The library's graph mappings are touched at registration, at an exchange buffer's growth and
        # from graphs' finalizers, which run in whichever thread collects them; ctypes calls drop the GIL.
        self._graph_lock = threading.RLock()
        handle = ctypes.c_void_p()
        self._ok(
            "create",
            self._lib.graphar_comm_create(
                rank, world_size, max_bytes, blocks, int(timeout_s * 1e9), GRAPH_SLOTS, ctypes.byref(handle)
            ),
        )
        # The library's handle, passed to every call; None once closed (the library refuses NULL).
        self._handle: int | None = handle.value
        self._state = State(Life.OPEN)
        record, one_shot, two_shot = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
        try:
            self._ok("create", self._lib.graphar_comm_error_record(self._handle, ctypes.byref(record)))
            self._ok(
                "create",
                self._lib.graphar_comm_push_limits(self._handle, ctypes.byref(one_shot), ctypes.byref(two_shot)),
            )
        except BaseException:  # nobody else holds the handle yet: free its buffers here
            self.close()
            raise
        self._record = abi.ErrorRecord.from_address(record.value)
        limits = policy.Limits(max_bytes=min(max_bytes, two_shot.value), push_one_shot=one_shot.value)
        self.kernels = AllReduce(self, policy.Policy(capability_major, world_size, limits, forced_algo))

    # ---- the collectives, as users call them ------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, algo: str | None = None) -> torch.Tensor:
        """Sum of `x` over the group, as a new tensor (see `AllReduce.all_reduce`)."""
        return self.kernels.all_reduce(x, algo)

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` runs on the custom kernels; otherwise use NCCL."""
        return self.kernels.eligible(x)

    # ---- state --------------------------------------------------------------------------------

    @property
    def handle(self) -> int | None:
        """The CUDA library's handle of this communicator; None once closed."""
        return self._handle

    @property
    def life(self) -> Life:
        """Where it is in its life, as the host knows it (a kernel's failure shows at the next `check`)."""
        return self._state.life

    @property
    def usable(self) -> bool:
        """Open, and no kernel of it timed out (host read, no sync): it can take calls."""
        return self._state.life is Life.OPEN and not self._record.failed

    def check(self) -> None:
        """Raise if it cannot take calls: closed, broken, or a kernel of it gave up (host read, no sync)."""
        if self._state.life is not Life.OPEN or self._record.failed:
            raise self._refusal()

    def _refusal(self) -> GrapharCommError:
        """What every call raises now; a kernel's failure turns an open communicator failed here."""
        life, reason = self._state
        if life is Life.CLOSED:  # its error record is gone with it
            return GrapharCommError(f"graphar communicator of group {self.group_name!r} is closed")
        if life is Life.OPEN:
            reason = (
                f"graphar op on group {self.group_name!r} (rank {self.rank}) failed: {self._failure()}; the "
                "communicator is unusable from now on"
            )
            self._state = State(Life.FAILED, reason)
        timed_out = self._record.failed and self._record.cause in (abi.TIMED_OUT, abi.PEER_GAVE_UP)
        return (GrapharTimeoutError if timed_out else GrapharCommError)(reason)

    def _failure(self) -> str:
        """What the error record says, in words."""
        r = self._record
        where = f"{abi.WHERE.get(r.where, '?')} (block {r.block})"
        unordered = (
            "its calls run on streams that are not ordered (a graph replay beside eager calls, or two "
            "replays): order them, e.g. one stream per communicator or events between the streams"
        )
        return {
            abi.TIMED_OUT: (
                f"timed out: rank {r.peer} did not reach the {where} within {self.timeout_s} s (GRAPHAR_TIMEOUT_S)"
            ),
            abi.PEER_GAVE_UP: (
                f"timed out: rank {r.peer} gave up at the {where} first (a peer of it did not arrive in time)"
            ),
            abi.CONCURRENT: f"two of its kernels ran at once on this rank (found at the {where}): {unordered}",
            abi.OUT_OF_STEP: (
                f"rank {r.peer} met the {where} in another call (a graph replay where this rank made "
                f"an eager call, or the reverse): {unordered}"
            ),
            abi.SWAPPED: (
                f"rank {r.peer} met the {where} in another captured launch: the ranks replayed their graphs "
                f"in different orders ({unordered}; or the program replays them so), or captured them in "
                "different orders (every rank must capture its graphar launches in one order)"
            ),
        }.get(r.cause, f"the kernels recorded an unknown failure {r.cause} at the {where}")

    def mark_broken(self, reason: str) -> None:
        """From now on every call raises GrapharCommError(reason): the ranks may be out of step."""
        if self._state.life is not Life.CLOSED:  # a closed one says it is closed
            self._state = State(Life.BROKEN, reason)
        self._withdraw()  # the Python kernel raises it

    def close(self) -> None:
        """Wait for the device, then release the buffers and the peers' mappings. Idempotent. If a CUDA
        graph captured any of its launches, they stay for the rest of the process instead, marked
        failed: a replay of that graph after close writes NaN rather than touching freed memory."""
        if self._state.life is Life.CLOSED:
            return
        self._withdraw()
        registry.discard(self)
        try:
            with self._graph_lock:
                self._ok("close", self._lib.graphar_comm_destroy(self._handle))
        finally:  # the library frees everything even when it reports an error
            self._state, self._handle = State(Life.CLOSED), None

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's `obj`, in rank order, over the group's store (collective, bounded wait)."""
        return self._store.all_gather(obj, what)

    # ---- typed calls into the CUDA library (graphar_cuda.h states each one's contract) ------------

    def set_kernels(self, kernels: abi.Kernels) -> None:
        """The kernel choice and launch settings every later plan and launch reads (graphar_comm_set_kernels)."""
        self._ok("set_kernels", self._lib.graphar_comm_set_kernels(self._handle, ctypes.byref(kernels)))

    def plan(self, x: bytes, stream: int, how: int, algo: int) -> abi.Plan:
        """The kernel of an all-reduce of `x` (graphar.abi.describe) on `stream` and its launch path, or
        why no kernel takes it (csrc graphar_comm_plan: the one place a call's kernel is chosen)."""
        chosen, path = ctypes.c_int32(), ctypes.c_int32()
        rc = self._plan(self._handle, x, stream, how, algo, ctypes.byref(chosen), ctypes.byref(path))
        if rc == abi.DECLINED:
            return abi.Plan(0, 0, _cuda.last_error())
        self._ok("all_reduce", rc)
        return abi.Plan(chosen.value, path.value)

    def plan_norm(self, x: bytes, residual: bytes, weight: bytes, row_bytes: int) -> str | None:
        """Why the fused norm cannot take these tensors (graphar.abi.describe), or None when it can."""
        rc = self._plan_norm(self._handle, x, residual, weight, row_bytes)
        if rc == abi.DECLINED:
            return _cuda.last_error()
        self._ok("all_reduce_add_rms_norm", rc)
        return None

    def launch_all_reduce(self, args: bytes) -> None:
        """Launch one all-reduce; `args` is graphar.abi.ALL_REDUCE_ARGS, packed."""
        if self._launch(self._handle, args) != 0:
            self._raise("all_reduce")

    def launch_all_reduce_norm(self, args: bytes) -> None:
        """Launch the fused all-reduce + residual add + RMSNorm; `args` is graphar.abi.NORM_ARGS, packed."""
        if self._launch_norm(self._handle, args) != 0:
            self._raise("all_reduce_add_rms_norm")

    def serve_native(self) -> None:
        """From now on the ops' C++ kernels serve the group's eager calls through this communicator
        (graphar.allreduce.native_op, loaded on first use; where it cannot be, the Python kernels serve every
        call). Only the group's registered, healthy communicator serves: a closed or broken one is
        withdrawn."""
        if not (self.usable and registry.serves(self)) or native_op.library() is None:
            return
        state = native_op.group_state(comm=self._handle, lib=self._lib, device=self.device, rank=self.rank)
        try:
            native_op.serve(self.group_name, state)
        except GrapharCudaError as e:  # e.g. c10d cannot resolve the name here: slower, still right
            logger.warning("graphar: group %r's eager all-reduces run the Python kernel: %s", self.group_name, e)
            self._withdraw()

    def _withdraw(self) -> None:
        """Every later eager call of the group goes to the Python kernel (which knows why)."""
        if registry.serves(self):
            native_op.serve(self.group_name, None)

    def native_calls(self) -> int:
        """Calls of this group the C++ kernel served (graphar.allreduce.native_op)."""
        return native_op.calls(self.group_name)

    def take_exchange_lease(self, mode: int, stream: int) -> int:
        """Before an exchange's first pack: its lease, which its copies carry (csrc graphar_comm_exchange_lease);
        eager, it also orders `stream` after this communicator's previous op."""
        lease = ctypes.c_uint64()
        self._ok("all_to_all", self._lib.graphar_comm_exchange_lease(self._handle, mode, stream, ctypes.byref(lease)))
        return lease.value

    def launch_all_to_all(self, copy: abi.AllToAllCopy, output: int, lease: int, stream: int) -> None:
        """Copy a stage's chunks into the output, which starts at device address `output` (csrc
        graphar_comm_all_to_all)."""
        self._ok(
            "all_to_all",
            self._lib.graphar_comm_all_to_all(
                self._handle,
                copy.mode,
                output,
                copy.src_offset,
                copy.chunk_bytes,
                copy.row_bytes,
                copy.dst_row_stride,
                copy.dst_chunk_stride,
                copy.flags,
                copy.blocks,
                lease,
                stream,
            ),
        )

    def failed_flag(self) -> int:
        """Device address of this rank's uint32 flag that the group's kernels set when one gives up."""
        flag = ctypes.c_void_p()
        self._ok("all_to_all", self._lib.graphar_comm_failed_flag(self._handle, ctypes.byref(flag)))
        return flag.value

    def alloc_exchange(self, nbytes: int, keep_old: bool, what: str) -> tuple[int, bytes]:
        """Collective: this rank's new exchange buffer (device pointer, IPC handle)."""
        ptr, handle = ctypes.c_uint64(), ctypes.create_string_buffer(_cuda.IPC_HANDLE_BYTES)
        with self._graph_lock:  # it closes the graph mappings no slot reads, as a registration does
            rc = self._lib.graphar_comm_exchange_alloc(self._handle, nbytes, int(keep_old), ctypes.byref(ptr), handle)
        self._ok(what, rc)
        return ptr.value, handle.raw

    def open_exchange(self, nbytes: int, handles: Sequence[bytes], what: str) -> list[int]:
        """Collective: map the peers' new exchange buffers; every rank's buffer as this process sees it."""
        ptrs = (ctypes.c_uint64 * self.world_size)()
        self._ok(what, self._lib.graphar_comm_exchange_open(self._handle, nbytes, b"".join(handles), ptrs))
        return list(ptrs)

    def pointer_info(self, ptr: int) -> tuple[int, bool]:
        """The start of the allocation holding `ptr`, and whether legacy IPC can share it."""
        base, size, capable = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
        self._ok(
            "all_reduce (capture)",
            self._lib.graphar_pointer_info(ptr, ctypes.byref(base), ctypes.byref(size), ctypes.byref(capable)),
        )
        return base.value, bool(capable.value)

    def ipc_handle(self, base: int) -> bytes:
        """The IPC handle of the allocation starting at `base`."""
        out = ctypes.create_string_buffer(_cuda.IPC_HANDLE_BYTES)
        self._ok("graph registration", self._lib.graphar_ipc_handle(base, out))
        return out.raw

    def fill_graph_slots(self, fill: GraphSlots) -> None:
        """After a capture: point `fill.slots` (one per call) at every rank's inputs."""
        n = len(fill.own_ptrs)
        with self._graph_lock:
            self._ok(
                "graph registration",
                self._lib.graphar_comm_register_graph(
                    self._handle,
                    (ctypes.c_int32 * n)(*fill.slots),
                    n,
                    fill.handles,
                    (ctypes.c_uint64 * len(fill.offsets))(*fill.offsets),
                    (ctypes.c_uint8 * len(fill.staged))(*fill.staged),
                    (ctypes.c_uint64 * n)(*fill.own_ptrs),
                ),
            )

    def forget_graph_slots(self, slots: Sequence[int]) -> None:
        """The graph reading through `slots` is gone: the peers' allocations only they read are
        closed at the next idle point (no CUDA call here: a finalizer may run during a capture)."""
        with self._graph_lock:
            if self._state.life is not Life.CLOSED:  # closed: the library kept or freed everything already
                self._ok(
                    "graph release",
                    self._lib.graphar_comm_forget_graph_slots(
                        self._handle, (ctypes.c_int32 * len(slots))(*slots), len(slots)
                    ),
                )

    def close_unused_mappings(self) -> None:
        """Close the peers' allocations no live graph reads (waits for the device when there is any)."""
        with self._graph_lock:
            self._ok("graph release", self._lib.graphar_comm_close_unused_mappings(self._handle))

    def _ok(self, op: str, rc: int) -> None:
        """A library call's return code: an error raises GrapharCudaError naming the op, the group and the rank."""
        if rc != 0:
            self._raise(op)

    def _raise(self, op: str) -> None:
        raise GrapharCudaError(f"graphar {op} on group {self.group_name!r} (rank {self.rank}): {_cuda.last_error()}")

    # ---- set-up steps, driven by graphar.allreduce.set_up ------------------------------------------------

    def ipc_handles(self) -> bytes:
        """This rank's IPC handles of its buffers, for its peers to open."""
        out = ctypes.create_string_buffer(2 * _cuda.IPC_HANDLE_BYTES)
        self._ok("IPC handle export", self._lib.graphar_comm_handles(self._handle, out))
        return out.raw

    def open_peers(self, handles: Sequence[bytes]) -> None:
        """Map every rank's buffers (`handles` in rank order)."""
        self._ok("IPC open", self._lib.graphar_comm_open(self._handle, b"".join(handles)))

    def probe(self, phase: int) -> str | None:
        """Phase 0 stores into every peer, phase 1 loads it back: why P2P failed, or None."""
        bad = ctypes.c_int(-1)
        self._ok("P2P probe", self._lib.graphar_comm_probe(self._handle, phase, ctypes.byref(bad)))
        return None if bad.value < 0 else f"P2P store/load with rank {bad.value} did not round-trip"
