"""The op library (graphar.allreduce.native_op, csrc/torch_ops/) on the CPU: built by nvcc against the stable ABI
it links only what libtorch_cpu exports, loads into this CPU build of torch and installs its kernels;
a call it declines reaches the Python kernel; where it is off or missing the Python kernel serves;
a group torch destroys has its state withdrawn first."""

from __future__ import annotations

import collections
import ctypes
import datetime
import re
import resource
import subprocess
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graphar import _cuda, abi, ops, processes
from graphar.allreduce import native_op
from graphar.errors import GrapharCudaError

# ---- the library, built ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def op_library(tmp_path_factory) -> Path:
    """libgraphar_torch.so as build_library builds it, against this torch's headers."""
    if _cuda.find_nvcc() is None or _cuda.torch_root() is None:
        pytest.skip("nvcc or torch's headers not found")
    return _cuda.build_torch_library(tmp_path_factory.mktemp("graphar-torch"))


def _symbols(path: Path, which: str) -> set[str]:
    nm = subprocess.run(["nm", "-D", which, str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in nm.splitlines() if line.strip()}


def test_op_library_needs_of_torch_only_what_libtorch_cpu_exports(op_library: Path) -> None:
    """Built for the 2.11 stable ABI with this torch's headers: every torch function it links is
    libtorch_cpu's, and it names no CUDA or c10 library, so it loads into a CPU build of torch (the
    CUDA stream's function and 2.13's error message it looks up at run time). It exports its C ABI."""
    wanted = {s for s in _symbols(op_library, "--undefined-only") if s.startswith(("aoti_torch_", "torch_"))}
    assert {"torch_call_dispatcher", "torch_library_impl", "aoti_torch_empty_strided"} <= wanted, sorted(wanted)
    assert wanted <= _symbols(_cuda.torch_root() / "lib" / "libtorch_cpu.so", "--defined-only")
    dynamic = subprocess.run(["readelf", "-d", str(op_library)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)
    assert "libtorch_cpu.so" in needed, needed
    assert not [n for n in needed if n.startswith(("libtorch_cuda", "libc10", "libcudart"))], needed
    exported = {s for s in _symbols(op_library, "--defined-only") if re.fullmatch(r"graphar_op_\w+", s)}
    assert exported == set(native_op.PROTOTYPES)


def _declined_calls_reach_the_python_kernels(rank: int, world_size: int, library: str) -> None:
    """A process of its own, so that the CUDA kernels stay out of the test session's dispatcher."""
    lib = _cuda.bind(ctypes.CDLL(library), native_op.PROTOTYPES)
    assert lib.graphar_op_install() == 0 and lib.graphar_op_install() == 0  # the second: no-op
    for op in ("all_reduce", "all_reduce_add_rms_norm"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"graphar::{op}", "CUDA"), op
    group = dist.group.WORLD.group_name
    # The CUDA library's plans stand-ins: they decline every call (CPU tensors), or, once the group
    # timed out, fail with the library's message; the C++ kernels launch nothing of their own accord.
    timed_out, launched = [], []
    planned = collections.Counter()  # counted, not listed: the leak check below measures the op alone

    def decide(what: str) -> int:
        planned[what] += 1
        return abi.EINVAL if timed_out else abi.DECLINED

    plan = ctypes.CFUNCTYPE(
        ctypes.c_int, *(ctypes.c_void_p,) * 2, ctypes.c_uint64, *(ctypes.c_int,) * 2, *(ctypes.c_void_p,) * 2
    )(lambda comm, x, stream, how, algo, algo_out, path_out: decide("all_reduce"))
    plan_norm = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64
    )(lambda comm, x, residual, weight, row_bytes: decide("norm"))
    last_error = ctypes.CFUNCTYPE(ctypes.c_char_p)(lambda: b"the group timed out (a kernel of it gave up)")
    never = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda comm, args: launched.append(1) or 0)
    lib_ = types.SimpleNamespace(
        graphar_comm_plan=plan,
        graphar_comm_plan_norm=plan_norm,
        graphar_comm_all_reduce=never,
        graphar_comm_all_reduce_norm=never,
        graphar_last_error=last_error,
    )
    state = native_op.group_state(comm=1, lib=lib_, device=0, rank=0)
    assert lib.graphar_op_serve(group.encode(), ctypes.byref(state)) == 0
    # CPU tensors sent to the CUDA kernels: declined, the arguments go back on the stack to the private ops.
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    all_reduce, norm = torch.ops.graphar.all_reduce.default, torch.ops.graphar.all_reduce_add_rms_norm.default
    x = torch.arange(8.0).view(2, 4)
    assert torch.equal(all_reduce.redispatch(cuda, x, group), x)
    for residual, weight, weight_first in [(x, None, False), (None, torch.full((4,), 2.0), True)]:
        got = norm.redispatch(cuda, x, residual, weight, 1e-6, group, weight_first)
        want = ops.unfused_add_rms_norm(x, residual, weight, 1e-6, weight_first)
        assert all(torch.allclose(g, w) for g, w in zip(got, want))
    assert planned == {"all_reduce": 1, "norm": 2} and lib.graphar_op_calls(group.encode()) == 0
    # An error of the Python kernel: a RuntimeError with its message (torch >= 2.13 keeps it).
    with pytest.raises(RuntimeError, match="Could not resolve the process group registered under the name nope"):
        all_reduce.redispatch(cuda, x, "nope")
    # Declined calls leak nothing: the group name goes to the private op as bytes (a str would leak
    # torch's copy of it on every call, torch 2.11 to 2.13).
    for _ in range(5000):
        all_reduce.redispatch(cuda, x, group)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(50000):
        all_reduce.redispatch(cuda, x, group)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1024, "KiB more after 50000 calls"
    # A group that timed out raises in the C++ kernel itself, naming the group: behind the dispatcher
    # call to the Python kernel the error would lose its type (and on torch 2.11 its message).
    timed_out.append(True)
    for op, args in [(all_reduce, (x, group)), (norm, (x, None, None, 1e-6, group, False))]:
        with pytest.raises(RuntimeError, match=f"on group '{group}' \\(rank 0\\): the group timed out"):
            op.redispatch(cuda, *args)
    assert lib.graphar_op_serve(group.encode(), None) == 0  # withdrawn: the Python kernel serves, no plan asked
    planned.clear()
    assert torch.equal(all_reduce.redispatch(cuda, x, group), x) and not planned and launched == []


def test_op_library_loads_into_this_cpu_torch_and_hands_declined_calls_to_python(op_library: Path) -> None:
    processes.run(_declined_calls_reach_the_python_kernels, 1, str(op_library), collective_timeout_s=30)


# ---- where it comes from, or why not ------------------------------------------------------------


def test_op_library_is_the_one_beside_the_cuda_library_else_its_own_cached_build(monkeypatch, tmp_path) -> None:
    cuda_library = tmp_path / "package" / _cuda.LIB_NAME
    cuda_library.parent.mkdir()
    cuda_library.touch()
    cached = tmp_path / "cache" / native_op.LIB_NAME
    built: list[Path] = []
    monkeypatch.setattr(_cuda, "locate", lambda: cuda_library)
    monkeypatch.setattr(_cuda, "cached_torch_library", lambda src: built.append(src) or cached)
    assert native_op.locate() == cached and built == [_cuda.source_dir()]  # built where torch was not importable
    (cuda_library.parent / native_op.LIB_NAME).touch()
    assert native_op.locate() == cuda_library.parent / native_op.LIB_NAME and len(built) == 1


def test_op_library_off_or_unavailable_leaves_the_python_kernel(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setattr(native_op, "_tried", False)
    monkeypatch.setenv("GRAPHAR_NATIVE_OP", "0")
    with caplog.at_level("INFO", logger="graphar"):
        assert native_op.library() is None
    assert "GRAPHAR_NATIVE_OP=0" in caplog.text
    monkeypatch.setattr(native_op, "_tried", False)
    monkeypatch.delenv("GRAPHAR_NATIVE_OP")
    monkeypatch.setattr(_cuda, "locate", lambda: tmp_path / _cuda.LIB_NAME)  # none beside it
    monkeypatch.setattr(_cuda, "find_nvcc", lambda: None)
    with caplog.at_level("WARNING", logger="graphar"):
        assert native_op.library() is None
    assert "no nvcc to build one" in caplog.text and native_op.calls("g") == 0
    native_op.serve("g", None)  # nothing loaded: nothing to withdraw, no error


# ---- what Python hands it -----------------------------------------------------------------------


def test_a_group_torch_destroys_has_its_state_withdrawn_first(monkeypatch) -> None:
    """torch gives a destroyed group's name to the next group it makes, and the C++ kernels cannot ask
    c10d what a name names: the state of a group goes when torch unregisters its name, one group
    (destroy_process_group(group)) or all of them (destroy_process_group())."""
    served: list[tuple[str, bool]] = []

    class Library:  # what the C++ kernels would be handed
        def graphar_op_serve(self, name: bytes, state: object) -> int:
            served.append((name.decode(), state is not None))
            return 0

    monkeypatch.setattr(native_op, "_library", Library())
    monkeypatch.setattr(native_op, "_served", set())
    c10d = dist.distributed_c10d
    for name in ("_unregister_process_group", "_unregister_all_process_groups"):
        monkeypatch.setattr(c10d, name, getattr(c10d, name))  # torch's own again after the test
    native_op.withdraw_when_torch_unregisters()
    native_op.withdraw_when_torch_unregisters()  # idempotent: one withdrawal each below
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(30))
    try:
        world, sub = dist.group.WORLD, dist.new_group([0])
        for group in (world, sub):
            native_op.serve(group.group_name, abi.OpGroup())
        dist.destroy_process_group(sub)
        assert served[-1] == (sub.group_name, False)
        with pytest.raises(GrapharCudaError, match="Could not resolve"):  # torch no longer knows the name
            native_op.serve(sub.group_name, abi.OpGroup())
    finally:
        dist.destroy_process_group()
    assert served == [
        (world.group_name, True),
        (sub.group_name, True),
        (sub.group_name, False),
        (world.group_name, False),
    ]


def test_group_state_carries_the_library_s_entry_points() -> None:
    """The served state: the communicator's handle and the CUDA library's entry points by address; no
    kernel choice of its own (the library's plan holds it)."""
    proto = ctypes.CFUNCTYPE(ctypes.c_int)
    names = (
        "graphar_comm_plan",
        "graphar_comm_plan_norm",
        "graphar_comm_all_reduce",
        "graphar_comm_all_reduce_norm",
        "graphar_last_error",
    )
    functions = {name: proto(lambda: 0) for name in names}
    state = native_op.group_state(comm=7, lib=types.SimpleNamespace(**functions), device=1, rank=3)
    assert (state.comm, state.device, state.rank) == (7, 1, 3)
    for field, name in zip(("plan", "plan_norm", "all_reduce", "all_reduce_norm", "last_error"), names):
        assert getattr(state, field) == ctypes.cast(functions[name], ctypes.c_void_p).value, field
