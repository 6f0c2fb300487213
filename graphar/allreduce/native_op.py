"""The C++ kernels of graphar::all_reduce and graphar::all_reduce_add_rms_norm (csrc/torch_ops/): the
eager fast path.

An eager call through the dispatcher into a Python kernel spends more host time in boxing and
Python than in the CUDA library (tools/eager_breakdown.py measures each step). The C++ kernels
serve the common eager call and hand every other one to the Python kernel; their source says which.
Both ask the CUDA library's plan which kernel serves a call (csrc/plan.cu): the C++ kernels hold no
choice of their own, only each group's communicator (`serve`, once at its set-up).
They are libgraphar_torch.so, which nvcc builds with the CUDA library (graphar._cuda.build_library)
against torch's stable ABI as of 2.11: one build loads under every torch from 2.11 on, and a wheel
carries it. Off (GRAPHAR_NATIVE_OP=0), or where it cannot be had or loaded, the Python kernel serves
every call, as before, and one log line says why. Ranks need not agree on it: both kernels launch the
same CUDA kernel with the same arguments.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from ctypes import c_char_p, c_int, c_uint64, c_void_p
from pathlib import Path

import torch.distributed as dist

from graphar import _cuda, abi, settings
from graphar.errors import GrapharCudaError, GrapharUnavailable

logger = logging.getLogger("graphar")

LIB_NAME = _cuda.TORCH_LIB_NAME
PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "graphar_op_last_error": (c_char_p, []),
    "graphar_op_install": (c_int, []),
    "graphar_op_serve": (c_int, [c_char_p, c_void_p]),
    "graphar_op_calls": (c_uint64, [c_char_p]),
}


def locate() -> Path:
    """The op library beside the CUDA library graphar loads (one build made both), else its own
    cached build: a package built where torch was not importable (pip's build isolation) has none."""
    beside = _cuda.locate().parent / LIB_NAME
    if beside.is_file():
        return beside
    src = _cuda.source_dir()
    if src is None:
        raise GrapharUnavailable(f"{LIB_NAME} is missing from the package and there are no sources to build it")
    return _cuda.cached_torch_library(src)


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_served: set[str] = set()  # groups the C++ kernels serve


def library() -> ctypes.CDLL | None:
    """The op library, located (built if need be), loaded and installed on the first call; None when it
    is off or cannot be had (logged once). Only a CUDA communicator's set-up calls it
    (graphar.allreduce.communicator)."""
    global _library, _tried
    with _lock:
        if not _tried:
            _tried = True
            _library = _load()
    return _library


def _load() -> ctypes.CDLL | None:
    if not settings.NATIVE_OP.get():
        logger.info("graphar: GRAPHAR_NATIVE_OP=0: eager all-reduces run graphar::all_reduce's Python kernel")
        return None
    # The C++ kernels register for graphar::all_reduce, which `import graphar` (run before any of its
    # modules) defined: graphar.ops. torch is imported: the library's libtorch_cpu.so is loaded.
    try:
        lib = _cuda.bind(ctypes.CDLL(str(locate())), PROTOTYPES)
        if lib.graphar_op_install() != 0:
            raise GrapharUnavailable(f"installing it failed: {lib.graphar_op_last_error().decode()}")
    except (OSError, GrapharUnavailable) as e:
        logger.warning(
            "graphar: eager all-reduces run graphar::all_reduce's Python kernel (more host time per "
            "call): its C++ kernel cannot be had: %s",
            e,
        )
        return None
    withdraw_when_torch_unregisters()
    return lib


def withdraw_when_torch_unregisters() -> None:
    """From now on, torch unregistering a group's name (destroy_process_group, and the abort and
    clean-up beside it, call these module globals by name) first withdraws the group's state: torch
    gives the name to the next group it makes, whose ranks may differ, and the C++ kernels, on the
    stable ABI, cannot ask c10d what a name names. Idempotent."""
    c10d = dist.distributed_c10d
    unregister, unregister_all = c10d._unregister_process_group, c10d._unregister_all_process_groups
    if getattr(unregister, "graphar_withdraws", False):
        return

    def unregister_and_withdraw(group_name: str) -> None:
        if group_name in _served:
            serve(group_name, None)
        unregister(group_name)

    def unregister_all_and_withdraw() -> None:
        for group_name in list(_served):
            serve(group_name, None)
        unregister_all()

    unregister_and_withdraw.graphar_withdraws = True
    c10d._unregister_process_group = unregister_and_withdraw
    c10d._unregister_all_process_groups = unregister_all_and_withdraw


def group_state(*, comm: int, lib: ctypes.CDLL, device: int, rank: int) -> abi.OpGroup:
    """struct graphar_op_group for a communicator: its handle in the CUDA library `lib`, and the entry
    points the C++ kernels call."""

    def address(fn: object) -> int:
        return ctypes.cast(fn, c_void_p).value

    return abi.OpGroup(
        comm=comm,
        plan=address(lib.graphar_comm_plan),
        plan_norm=address(lib.graphar_comm_plan_norm),
        all_reduce=address(lib.graphar_comm_all_reduce),
        all_reduce_norm=address(lib.graphar_comm_all_reduce_norm),
        last_error=address(lib.graphar_last_error),
        device=device,
        rank=rank,
    )


def serve(group_name: str, state: abi.OpGroup | None) -> None:
    """The C++ kernels serve the group through `state` from now on (None: withdrawn); nothing when the
    library is not loaded. A state is for a group torch has registered now (its unregistering
    withdraws it)."""
    lib = _library
    if lib is None:
        return
    if state is not None:
        try:
            dist.distributed_c10d._resolve_process_group(group_name)
        except RuntimeError as e:  # no group of that name
            raise GrapharCudaError(f"graphar op library, group {group_name!r}: {e}") from e
    if lib.graphar_op_serve(group_name.encode(), None if state is None else ctypes.byref(state)) != 0:
        raise GrapharCudaError(f"graphar op library, group {group_name!r}: {lib.graphar_op_last_error().decode()}")
    if state is None:
        _served.discard(group_name)
    else:
        _served.add(group_name)


def calls(group_name: str) -> int:
    """Calls the C++ kernel served on the group in this process (0 when the library is not loaded)."""
    lib = _library
    return 0 if lib is None else lib.graphar_op_calls(group_name.encode())
