"""The communicator against a stand-in for the CUDA library, on the CPU: every call it makes is
converted by ctypes with the real library's prototypes (graphar._cuda.PROTOTYPES, which
tests/test_csrc_build.py holds to the built library's exports); its life (open, broken, failed,
closed); and the seams its collectives reach it through (`CommCalls`, `TransportCalls`), complete."""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
from pathlib import Path
from typing import Any

import pytest

from graphar import _cuda, abi
from graphar.allreduce import kernels, registry
from graphar.allreduce.communicator import Communicator, Life
from graphar.errors import GrapharCommError, GrapharCudaError, GrapharTimeoutError
from graphar.ulysses import transport

MB = 1 << 20
HANDLE, FLAG, BUFFER = 0x1000, 0x2000, 0x3000
COMM = Path(inspect.getfile(Communicator))


def _write(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


def _fill_exchange_open(lib: _Library, handle: int, nbytes: int, handles: int, ptrs: Any) -> None:
    ptrs[0], ptrs[1] = BUFFER, BUFFER + nbytes


# What each function writes for its caller to read (pointers arrive as ctypes pointers, buffers as addresses).
_OUTPUTS = {
    "graphar_comm_create": lambda lib, *args: args[-1].__setitem__(0, HANDLE),
    "graphar_comm_error_record": lambda lib, h, out: out.__setitem__(0, ctypes.addressof(lib.record)),
    "graphar_comm_push_limits": lambda lib, h, one, two: (one.__setitem__(0, 2 * MB), two.__setitem__(0, 64 * MB)),
    "graphar_comm_handles": lambda lib, h, out: _write(out, b"h" * 2 * _cuda.IPC_HANDLE_BYTES),
    "graphar_comm_probe": lambda lib, h, phase, bad: bad.__setitem__(0, lib.bad_peer),
    "graphar_comm_exchange_lease": lambda lib, h, mode, stream, lease: lease.__setitem__(0, 7),
    "graphar_comm_failed_flag": lambda lib, h, flag: flag.__setitem__(0, FLAG),
    "graphar_comm_exchange_alloc": lambda lib, h, n, keep, ptr, out: (
        ptr.__setitem__(0, BUFFER),
        _write(out, b"x" * _cuda.IPC_HANDLE_BYTES),
    ),
    "graphar_comm_exchange_open": _fill_exchange_open,
    "graphar_pointer_info": lambda lib, ptr, base, size, capable: (
        base.__setitem__(0, ptr - 16),
        capable.__setitem__(0, 1),
    ),
    "graphar_ipc_handle": lambda lib, base, out: _write(out, b"i" * _cuda.IPC_HANDLE_BYTES),
    "graphar_comm_plan": lambda lib, h, x, stream, how, algo, out, path: (
        out.__setitem__(0, abi.ALGO_CODES["2stage"]),
        path.__setitem__(0, abi.PATH_UNCAPTURED),
    ),
}


class _Library:
    """The CUDA library's functions that return a status, as ctypes callbacks with their real prototypes:
    a call of a wrong arity or type fails as it would on the real library; each is recorded and answered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.failing: set[str] = set()
        self.answers: dict[str, int] = {}  # a return code other than 0 or 1
        self.during: dict[str, Any] = {}  # what to look at while a function runs
        self.record = abi.ErrorRecord()
        self.bad_peer = -1
        for name, (restype, argtypes) in _cuda.PROTOTYPES.items():
            if restype is ctypes.c_int:
                setattr(self, name, ctypes.CFUNCTYPE(restype, *argtypes)(functools.partial(self._answer, name)))

    def _answer(self, name: str, *args: Any) -> int:
        self.calls.append((name, args))
        if name in self.during:
            self.during[name]()
        if name in _OUTPUTS:
            _OUTPUTS[name](self, *args)
        return self.answers.get(name, 1 if name in self.failing else 0)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def library(monkeypatch) -> _Library:
    lib = _Library()
    monkeypatch.setattr(_cuda, "library", lambda: lib)
    monkeypatch.setattr(_cuda, "last_error", lambda: "the stand-in says no")
    return lib


def _communicator() -> Communicator:
    return Communicator(
        group_name="g",
        rank=0,
        world_size=2,
        device=0,
        max_bytes=MB,
        timeout_s=1.5,
        blocks=36,
        forced_algo=None,
        capability_major=9,
        store=None,
    )


def test_made_open_with_the_library_s_limits(library: _Library) -> None:
    comm = _communicator()
    assert library.names() == [
        "graphar_comm_create",
        "graphar_comm_error_record",
        "graphar_comm_push_limits",
        "graphar_comm_set_kernels",  # the all-reduce's kernel table, before any call can be planned
    ]
    assert library.calls[0][1][:6] == (0, 2, MB, 36, 1_500_000_000, kernels.GRAPH_SLOTS)
    assert comm.handle == HANDLE and comm.life is Life.OPEN and comm.usable
    assert comm.kernels.policy.limits == (MB, 2 * MB)  # max_bytes within the two-shot's room


def test_every_call_reaches_its_function_with_the_handle(library: _Library) -> None:
    comm = _communicator()
    del library.calls[:]
    assert comm.ipc_handles() == b"h" * 2 * _cuda.IPC_HANDLE_BYTES
    comm.open_peers([b"a" * 128, b"b" * 128])
    assert comm.probe(0) is None
    assert comm.take_exchange_lease(abi.PATH_EAGER, 5) == 7
    copy = abi.AllToAllCopy(abi.PATH_CAPTURED_COPY, 2, 3, 4, 5, 6, abi.A2A_LAST, 64)
    comm.launch_all_to_all(copy, 1, 7, 8)
    # The copy's fields reach the library in its argument order.
    assert library.calls[-1][1] == (HANDLE, abi.PATH_CAPTURED_COPY, 1, 2, 3, 4, 5, 6, abi.A2A_LAST, 64, 7, 8)
    assert comm.failed_flag() == FLAG
    assert comm.alloc_exchange(4 * MB, True, "grow") == (BUFFER, b"x" * _cuda.IPC_HANDLE_BYTES)
    assert comm.open_exchange(4 * MB, [b"p" * 64, b"q" * 64], "grow") == [BUFFER, BUFFER + 4 * MB]
    assert comm.pointer_info(0x5010) == (0x5000, True)
    assert comm.ipc_handle(0x5000) == b"i" * _cuda.IPC_HANDLE_BYTES
    comm.fill_graph_slots(
        kernels.GraphSlots([1, 2], b"z" * 256, [0, 16, 32, 48], [False, True, False, False], [0x5000, 0x6000])
    )
    comm.forget_graph_slots([1, 2])
    comm.close_unused_mappings()
    without_handle = {"graphar_pointer_info", "graphar_ipc_handle"}
    assert all(args[0] == HANDLE for name, args in library.calls if name not in without_handle)
    assert library.names() == [
        "graphar_comm_handles",
        "graphar_comm_open",
        "graphar_comm_probe",
        "graphar_comm_exchange_lease",
        "graphar_comm_all_to_all",
        "graphar_comm_failed_flag",
        "graphar_comm_exchange_alloc",
        "graphar_comm_exchange_open",
        "graphar_pointer_info",
        "graphar_ipc_handle",
        "graphar_comm_register_graph",
        "graphar_comm_forget_graph_slots",
        "graphar_comm_close_unused_mappings",
    ]
    library.bad_peer = 1
    assert comm.probe(1) == "P2P store/load with rank 1 did not round-trip"


def test_a_plan_gives_the_kernel_or_why_none_takes_the_call(library: _Library) -> None:
    comm = _communicator()
    x = abi.TENSOR.pack(0x5000, 64, 0, 0, 1, 0)
    assert comm.plan(x, 5, abi.PLAN_STREAM, 0) == (abi.ALGO_CODES["2stage"], abi.PATH_UNCAPTURED, None)
    assert library.calls[-1][1][2:5] == (5, abi.PLAN_STREAM, 0)
    library.answers.update(graphar_comm_plan=abi.DECLINED, graphar_comm_plan_norm=abi.DECLINED)
    assert comm.plan(x, 5, abi.PLAN_STREAM, 0) == (0, 0, "the stand-in says no")  # a verdict, not an error
    assert comm.plan_norm(x, abi.NO_TENSOR, abi.NO_TENSOR, 64) == "the stand-in says no"
    library.answers.update(graphar_comm_plan=abi.EINVAL, graphar_comm_plan_norm=0)
    assert comm.plan_norm(x, abi.NO_TENSOR, abi.NO_TENSOR, 64) is None
    with pytest.raises(GrapharCudaError, match=r"graphar all_reduce on group 'g' \(rank 0\): the stand-in says no"):
        comm.plan(x, 5, abi.PLAN_STREAM, 0)  # an error (a group that timed out): raised


def test_what_touches_the_graph_mappings_holds_the_graph_lock(library: _Library) -> None:
    """A graph's finalizer may forget its slots from another thread while the library closes the
    mappings no slot reads: at a registration, and at an exchange buffer's growth too."""
    comm = _communicator()
    held: list[str] = []
    for name in ("graphar_comm_exchange_alloc", "graphar_comm_register_graph", "graphar_comm_close_unused_mappings"):
        library.during[name] = lambda name=name: comm._graph_lock._is_owned() and held.append(name)
    comm.alloc_exchange(4 * MB, False, "grow")
    comm.fill_graph_slots(_one_slot())
    comm.close_unused_mappings()
    assert held == list(library.during)


def _one_slot() -> kernels.GraphSlots:
    return kernels.GraphSlots([1], b"z" * 128, [0, 16], [False, False], [0x5000])


def test_the_communicator_calls_only_what_the_library_exports() -> None:
    """It names each function as an attribute of the loaded library, bound with its prototype at load."""
    nodes = [n for n in ast.walk(ast.parse(COMM.read_text())) if isinstance(n, ast.Attribute)]
    used = {n.attr for n in nodes if isinstance(n.value, ast.Attribute) and n.value.attr == "_lib"}
    assert used and used <= set(_cuda.PROTOTYPES)


def test_a_failed_call_names_the_op_the_group_and_the_rank(library: _Library) -> None:
    comm = _communicator()
    library.failing.add("graphar_comm_exchange_lease")
    with pytest.raises(GrapharCudaError, match=r"graphar all_to_all on group 'g' \(rank 0\): the stand-in says no"):
        comm.take_exchange_lease(abi.PATH_EAGER, 0)


def test_a_failed_step_of_making_it_frees_what_it_made(library: _Library) -> None:
    library.failing.add("graphar_comm_push_limits")
    with pytest.raises(GrapharCudaError, match="graphar create"):
        _communicator()
    assert library.names()[-1] == "graphar_comm_destroy" and library.calls[-1][1] == (HANDLE,)


def test_broken_then_closed(library: _Library) -> None:
    comm = _communicator()
    comm.mark_broken("the ranks went out of step")
    assert comm.life is Life.BROKEN and not comm.usable
    with pytest.raises(GrapharCommError, match="out of step") as refused:
        comm.check()
    assert type(refused.value) is GrapharCommError
    registry.register(comm)
    comm.close()
    assert comm.life is Life.CLOSED and comm.handle is None and registry.communicator("g") is None
    comm.close()  # idempotent: destroyed once
    comm.mark_broken("late")  # a closed one stays closed
    comm.forget_graph_slots([1])  # a dead graph's finalizer after close: no call
    with pytest.raises(GrapharCommError, match="is closed"):
        comm.check()
    assert library.names().count("graphar_comm_destroy") == 1 and library.names()[-1] == "graphar_comm_destroy"


def test_a_kernel_that_gave_up_fails_it_at_the_next_check(library: _Library) -> None:
    comm = _communicator()
    comm.check()
    library.record.failed, library.record.peer, library.record.where = 1, 1, 1  # cause 0: timed out
    assert not comm.usable and comm.life is Life.OPEN  # the host has not looked yet
    for _ in range(2):  # and every later call alike
        with pytest.raises(GrapharTimeoutError, match="rank 1 did not reach the all_reduce 1stage entry barrier"):
            comm.check()
    assert comm.life is Life.FAILED
    comm.close()
    assert comm.life is Life.CLOSED


@pytest.mark.parametrize(
    "cause, error, says",
    [
        (
            abi.PEER_GAVE_UP,
            GrapharTimeoutError,
            "rank 1 gave up at the all_reduce push-oneshot receive .block 3. first",
        ),
        (abi.CONCURRENT, GrapharCommError, "two of its kernels ran at once on this rank"),
        (abi.OUT_OF_STEP, GrapharCommError, "in another call .a graph replay where this rank made an eager call"),
        (
            abi.SWAPPED,
            GrapharCommError,
            "in another captured launch: the ranks replayed their graphs in different orders",
        ),
    ],
)
def test_each_failure_cause_reads_as_its_own_error(library: _Library, cause: int, error: type, says: str) -> None:
    comm = _communicator()
    record = library.record
    record.failed, record.peer, record.where, record.block, record.cause = 1, 1, 7, 3, cause
    with pytest.raises(error, match=says) as raised:
        comm.check()
    assert type(raised.value) is error
    comm.close()


# ---- the seams: what each collective asks of its communicator, declared whole ---------------------


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


def _asked(module: Any) -> set[str]:
    """What `module` reads of `self.comm` or of a local `comm`."""
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and (
            (isinstance(n.value, ast.Name) and n.value.id == "comm")
            or (
                isinstance(n.value, ast.Attribute)
                and n.value.attr == "comm"
                and isinstance(n.value.value, ast.Name)
                and n.value.value.id == "self"
            )
        )
    }


@pytest.mark.parametrize("module, protocol", [(kernels, kernels.CommCalls), (transport, transport.TransportCalls)])
def test_each_collective_s_protocol_is_what_it_asks(module: Any, protocol: type, library: _Library) -> None:
    assert _asked(module) == _members(protocol)
    comm = _communicator()
    assert all(hasattr(comm, name) for name in _members(protocol))
