"""Each parameter walk goes one way down the rooms (docs/design.md, "Rooms": calls go one way too): a
tensor into `graphar::all_reduce`, `max_bytes` into `graphar.init`, Q/K/V into the IPC exchange (and
over NCCL).

A walk is followed with `sys.setprofile`: a call into a graphar module is a visit of that module (its
room) when one of its arguments carries the parameter (the tensor's storage, the number, or a list,
dict, dataclass or partial holding either); the room's own functions and the calls they make without
the parameter belong to the visit they run in. A walk may visit a room several times only as the
helper of one visit of one room (the exchange asks the pack kernel whether it serves, then packs):
never from another room, and never while a visit of it is open (a call back up). So each room has
one place in the walk, and the walk draws as one tree, which each test states.

The exchange runs for real on host memory: its pack is the Triton kernel, interpreted, so those cases
run in a subprocess with TRITON_INTERPRET=1 (`test_exchange_walks_under_interpreter`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

import graphar
from graphar import _cuda, abi, ops
from graphar.allreduce import native_op, policy, registry, set_up
from graphar.allreduce.kernels import AllReduce
from graphar.ulysses import exchanges as bodies
from graphar.ulysses import shapes, transport
from tests._interpreted import INTERPRETED, run_interpreted
from tests.test_communicator_calls import _Library

MB = 1 << 20


@dataclasses.dataclass
class Visit:
    """A call that carried the parameter into `room` (graphar's module, less `graphar.`), from `parent`'s."""

    room: str
    function: str
    parent: Visit | None


@dataclasses.dataclass
class Walk:
    """A parameter's visits in the order they began, and what in them broke the rule."""

    visits: list[Visit]
    faults: list[str]

    def parents(self) -> dict[str, str | None]:
        """Each room the walk entered, in that order, and the room it entered it from."""
        return {v.room: v.parent.room if v.parent else None for v in self.visits}

    def drawing(self) -> str:
        """The visits as a tree, one `room.function` a line, indented under the visit that made it."""
        lines = []
        for v in self.visits:
            depth, up = 0, v.parent
            while up is not None:
                depth, up = depth + 1, up.parent
            lines.append(f"{'  ' * depth}{v.room}.{v.function}")
        return "\n".join(lines)


def _room(frame: types.FrameType) -> str | None:
    """The module of graphar a frame runs in, without the package's name (ulysses.transport); else None."""
    name = frame.f_globals.get("__name__") or ""
    return name.removeprefix("graphar.") if name.split(".")[0] in ("graphar", "passes") else None


def _carries(value: Any, storages: set[int], numbers: set[int], depth: int = 0) -> bool:
    """Whether `value` is or holds one of the tensors (by storage: views and slices too) or numbers."""
    if isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage().data_ptr() in storages
        except (RuntimeError, NotImplementedError):
            return False
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value in numbers
    if depth > 8:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_carries(v, storages, numbers, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_carries(v, storages, numbers, depth + 1) for v in value.values())
    if isinstance(value, functools.partial):
        return _carries((value.args, value.keywords), storages, numbers, depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(
            _carries(getattr(value, f.name, None), storages, numbers, depth + 1) for f in dataclasses.fields(value)
        )
    return False


def walk(fn: Callable[[], Any], tensors: Sequence[torch.Tensor] = (), numbers: Sequence[int] = ()) -> Walk:
    """The visits of `fn()`'s walk of `tensors` (by storage) and `numbers`, and the faults in it."""
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    wanted = set(numbers)
    visits: list[Visit] = []
    faults: list[str] = []
    stack: list[tuple[types.FrameType, str | None, Visit | None]] = []  # every Python frame: its room, its visit

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "return":
            while stack and stack.pop()[0] is not frame:
                pass
            return
        if event != "call":
            return
        room = _room(frame)
        caller = next((e for e in reversed(stack) if e[1] is not None), None)  # the nearest graphar frame
        visit = None
        if room is not None and caller is not None and caller[1] == room and caller[2] is not None:
            visit = caller[2]  # the room's own helper: the same visit
        elif room is not None and _carries(dict(frame.f_locals), storages, wanted):
            parent = next((e[2] for e in reversed(stack) if e[2] is not None), None)
            visit = Visit(room, frame.f_code.co_name, parent)
            where = f"{room}.{visit.function} from {parent.room if parent else 'outside'}"
            if any(e[2] is not None and e[2].room == room for e in stack):
                faults.append(f"{where}: called back while the walk is in it")
            elif any(v.room == room and v.parent is not parent for v in visits):
                faults.append(f"{where}: entered again after the walk left it")
            visits.append(visit)
        stack.append((frame, room, visit))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return Walk(visits, faults)


def _check(w: Walk, drawing: dict[str, str | None]) -> None:
    """No fault, and the walk's rooms, in order, each entered from the room `drawing` names."""
    assert w.faults == [], "\n".join(w.faults) + "\n" + w.drawing()
    assert list(w.parents().items()) == list(drawing.items()), w.drawing()


# ---- a tensor into graphar::all_reduce --------------------------------------------------------------


class _AllReduceCalls:
    """allreduce.CommCalls on the host: launches are recorded, not run."""

    group_name, device, max_bytes = "g", -1, MB
    usable = True

    def __init__(self) -> None:
        self.launched: list[bytes] = []

    def check(self) -> None:
        pass

    def native_calls(self) -> int:
        return 0

    def set_kernels(self, kernels: abi.Kernels) -> None:
        pass

    def plan(self, x: bytes, stream: int, how: int, algo: int) -> abi.Plan:
        """The library's verdict: float32 on the first kernel, anything else declined."""
        dtype = abi.TENSOR.unpack(x)[2]
        ok = dtype == abi.DTYPE_CODES[torch.float32]
        return abi.Plan(1, abi.PATH_UNCAPTURED) if ok else abi.Plan(0, 0, f"dtype code {dtype}")

    def launch_all_reduce(self, args: bytes) -> None:
        self.launched.append(args)


@pytest.fixture
def all_reduce_group(monkeypatch) -> _AllReduceCalls:
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.setattr(ops, "functional_all_reduce", lambda x, group_name: x.clone())  # the collective
    calls = _AllReduceCalls()
    allreduce = AllReduce(calls, policy.Policy(9, 2, policy.Limits(MB, MB)))
    monkeypatch.setitem(registry._communicators, "g", types.SimpleNamespace(group_name="g", kernels=allreduce))
    monkeypatch.setattr(set_up, "_live", lambda group: True)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=["served", "refused"])
def test_a_tensor_into_all_reduce(all_reduce_group: _AllReduceCalls, dtype: torch.dtype) -> None:
    x = torch.arange(256).to(dtype)
    w = walk(lambda: torch.ops.graphar.all_reduce(x, "g"), [x])
    _check(w, {"ops": None, "allreduce.kernels": "ops", "abi": "allreduce.kernels"})
    # One visit each: the tensor described once for the library's plan, which decides (a refused call's
    # reason comes from there, and the op's log line reads it without the tensor).
    assert [v.function for v in w.visits] == ["all_reduce", "try_all_reduce", "describe"], w.drawing()
    assert len(all_reduce_group.launched) == (dtype == torch.float32)


# ---- max_bytes into graphar.init ------------------------------------------------------------------


@contextlib.contextmanager
def _one_rank_world() -> Iterator[dist.ProcessGroup]:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_max_bytes_into_init(monkeypatch) -> None:
    """graphar.init(max_bytes=) on a group of one process posing as two H200s' rank 0, its library
    the stand-in: the number goes to settings' rule, to the ranks' agreement, into the communicator
    and its policy (the C++ kernels never hold it: the library's plan checks sizes)."""
    lib = _Library()
    lib.graphar_last_error = ctypes.CFUNCTYPE(ctypes.c_char_p)(lambda: b"")  # the C++ kernels' state takes its address
    for target, name, fake in [
        (_cuda, "library", lambda: lib),
        (_cuda, "build_id", lambda: "0123abcd"),
        (_cuda, "pci_bus_id", lambda device: "0000:01:00.0"),
        (native_op, "library", lambda: object()),
        (native_op, "serve", lambda name, state: None),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (set_up, "_uniform_reason", lambda group: None),
        (dist, "get_world_size", lambda group=None: 2),
        (set_up, "_settled", {}),
        (set_up, "_generations", {}),
        (registry, "_communicators", {}),
    ]:
        monkeypatch.setattr(target, name, fake)
    monkeypatch.setenv("GRAPHAR_TUNE", "0")  # it would time real kernels: none behind the stand-in library
    max_bytes = 3 * MB + 7 * 16  # a number nothing else in the walk holds
    with _one_rank_world() as group:
        w = walk(lambda: graphar.init(group, max_bytes=max_bytes), numbers=[max_bytes])
        comm = registry.communicator(group.group_name)
        assert comm is not None and comm.max_bytes == max_bytes
        comm.close()
    _check(
        w,
        {
            "allreduce.set_up": None,
            "settings": "allreduce.set_up",
            "allreduce.rendezvous": "allreduce.set_up",
            "allreduce.communicator": "allreduce.set_up",
            "allreduce.policy": "allreduce.communicator",
        },
    )


# ---- Q/K/V into the IPC exchange (the pack kernel interpreted) -------------------------------------


class _ExchangeCalls:
    """transport.TransportCalls of rank 0 of two on the host: the copies are recorded, not run."""

    group_name, rank, device = "g", 0, 0

    def __init__(self) -> None:
        self.copies: list[tuple[Any, ...]] = []

    def check(self) -> None:
        pass

    def take_exchange_lease(self, mode: int, stream: int) -> int:
        return 7

    def launch_all_to_all(self, *args: Any) -> None:
        self.copies.append(args)


def _ipc_group(monkeypatch, push: bool) -> tuple[transport.IpcTransport, _ExchangeCalls]:
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(transport.IpcTransport, "serves", lambda self, t: True)  # host tensors stand in for cuda:0
    monkeypatch.setattr(shapes, "world_size", lambda group_name: 2)
    monkeypatch.setattr(set_up, "_live", lambda group: True)
    calls = _ExchangeCalls()
    ex = transport.IpcTransport(calls)
    buffers = torch.zeros(2, 1 << 16, dtype=torch.uint8)  # grown already: both ranks' buffers, as mapped here
    ex.push, ex._buffer, ex._addresses = push, buffers[0], [b.data_ptr() for b in buffers]
    ex._guard = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setitem(registry._communicators, "g", calls)
    monkeypatch.setitem(transport._transports, calls, ex)  # the communicator's transport, made already
    return ex, calls


# The op body checks the shapes, makes the whole plan, then hands it to the exchange, which packs.
EXCHANGE = {
    "ops": None,
    "ulysses.exchanges": "ops",
    "ulysses.shapes": "ulysses.exchanges",
    "ulysses.stages": "ulysses.exchanges",
    "ulysses.transport": "ulysses.exchanges",
    "ulysses.pack": "ulysses.transport",
}


@pytest.mark.skipif(not INTERPRETED, reason="the pack kernel on host memory: test_exchange_walks_under_interpreter")
@pytest.mark.parametrize("push", [False, True], ids=["pulled", "pushed"])
@pytest.mark.parametrize("b", [1, 2])
def test_qkv_into_the_exchange(monkeypatch, push: bool, b: int) -> None:
    _, calls = _ipc_group(monkeypatch, push)
    q, k, v = (torch.randn(b, 4, h, 8) for h in (4, 2, 2))
    w = walk(lambda: torch.ops.graphar.qkv_all_to_all(q, k, v, "g"), [q, k, v])
    assert len(calls.copies) == 1, "the exchange went to NCCL"
    _check(w, EXCHANGE)


@pytest.mark.skipif(not INTERPRETED, reason="the pack kernel on host memory: test_exchange_walks_under_interpreter")
def test_the_output_into_the_exchange(monkeypatch) -> None:
    _, calls = _ipc_group(monkeypatch, push=False)
    o = torch.randn(1, 8, 2, 8)
    w = walk(lambda: torch.ops.graphar.heads_to_seq_all_to_all(o, "g"), [o])
    assert len(calls.copies) == 1, "the exchange went to NCCL"
    _check(w, EXCHANGE)


def test_qkv_over_nccl(monkeypatch) -> None:
    """A group without a communicator: the body packs into staging and runs the collective itself."""
    monkeypatch.setattr(shapes, "world_size", lambda group_name: 2)
    monkeypatch.setattr(set_up, "_live", lambda group: True)  # settled, with no communicator
    monkeypatch.setattr(bodies, "_all_to_all", lambda recv, send, group_name, op: recv.copy_(send))
    q, k, v = (torch.randn(2, 4, h, 8) for h in (4, 2, 2))
    w = walk(lambda: torch.ops.graphar.qkv_all_to_all(q, k, v, "g"), [q, k, v])
    _check(
        w,
        {
            "ops": None,
            "ulysses.exchanges": "ops",
            "ulysses.shapes": "ulysses.exchanges",
            "ulysses.pack": "ulysses.exchanges",
        },
    )


def test_exchange_walks_under_interpreter() -> None:
    """The exchange cases, in a subprocess where Triton interprets (it decides when a kernel is defined)."""
    run_interpreted(__file__, "into_the_exchange")
