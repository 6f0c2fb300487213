"""CPU checks of the custom all-reduce: the nvcc build (no spills, the barrier's PTX, the C ABI)
and the communicator's pure-Python logic (algorithm choice, eligibility, agreement, store exchange)."""

from __future__ import annotations

import ctypes
import logging
import re
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from graphar import _cuda, graphs
from graphar.comm import allreduce as ar

KB, MB = 1 << 10, 1 << 20
needs_nvcc = pytest.mark.skipif(_cuda.find_nvcc() is None, reason="nvcc not found")


# ---- the build -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """One build for sm_90a and sm_80 with ptxas statistics and the intermediate PTX kept."""
    out = tmp_path_factory.mktemp("graphar-build")
    lib = out / _cuda.LIB_NAME
    command = _cuda.nvcc_command(_cuda.find_nvcc(), _cuda.source_dir(), lib, ["90a", "80"])
    command += ["-Xptxas", "-v", "--keep", "--keep-dir", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=out)
    assert result.returncode == 0, result.stderr[-4000:]
    return lib, out, result.stderr


def _kernel_stats(ptxas_log: str) -> dict[str, str]:
    """Kernel (mangled name, arch) -> its 'stack frame / spill' line."""
    stats = {}
    for m in re.finditer(r"Function properties for (\S+)\n\s*(.*spill loads)", ptxas_log):
        stats.setdefault(m.group(1), m.group(2))
    return stats


@needs_nvcc
def test_kernels_have_no_spills_or_local_memory(build) -> None:
    _, _, log = build
    stats = _kernel_stats(log)
    kernels = {name: line for name, line in stats.items() if "one_stage" in name or "two_stage" in name}
    assert len(kernels) == 24, sorted(kernels)  # ws 2, 4, 6, 8 x 3 dtypes x 2 algorithms
    for name, line in kernels.items():
        assert line.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"), (name, line)


def _ptx_function(ptx: str, fragment: str) -> str:
    start = ptx.index(".entry " + next(n for n in re.findall(r"\.entry (\S+)\(", ptx) if fragment in n))
    return ptx[start : ptx.index("\n}", start)]


@needs_nvcc
def test_barrier_ptx_has_the_intended_orderings(build) -> None:
    _, out, _ = build
    ptx = next(p for p in out.glob("*.ptx") if "compute_90a" in p.name or "sm_90a" in p.name).read_text()
    one = _ptx_function(ptx, "one_stageI13__nv_bfloat16Li2E")
    two = _ptx_function(ptx, "two_stageI13__nv_bfloat16Li8E")
    for body in (one, two):
        # fused copy-in entry and 2stage middle: release store / acquire spin; plain entry and 1stage
        # exit: volatile; every spin bounded by the global timer; never a trap
        for instruction in ("st.release.sys.global.u32", "ld.acquire.sys.global.u32", "st.volatile.global.u32",
                            "ld.volatile.global.u32", "%globaltimer", "bar.red.or.pred"):  # fmt: skip
            assert instruction in body
        assert "trap" not in body and ".local" not in body
        assert "ld.global.v4.u32" in body or "ld.v4.u32" in body  # 16-byte packs
    # block syncs: 1stage before the fenced entry and the exit; 2stage before the fenced entry and
    # the middle, none for an exit barrier
    assert one.count("bar.sync") == 2 and two.count("bar.sync") == 2


@needs_nvcc
def test_c_abi_exports_and_returns_errors(build) -> None:
    lib_path, _, _ = build
    lib = ctypes.CDLL(str(lib_path))  # no libcuda dependency: loads on a machine without a driver
    for name, (restype, argtypes) in _cuda.PROTOTYPES.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    assert lib.graphar_build_id().decode() == _cuda.source_hash(_cuda.source_dir())
    handle = ctypes.c_void_p()
    assert lib.graphar_comm_create(0, 3, MB, 36, 0, 16, ctypes.byref(handle)) == -1
    assert b"world size 3" in lib.graphar_last_error() and handle.value is None
    assert lib.graphar_comm_create(0, 2, MB, 65, 0, 16, ctypes.byref(handle)) == -1
    assert b"block limit 65" in lib.graphar_last_error()
    if not torch.cuda.is_available():  # a CUDA failure is an error code and a message, never an exit
        assert lib.graphar_comm_create(0, 2, MB, 36, 0, 16, ctypes.byref(handle)) > 0
        assert b"cuda" in lib.graphar_last_error().lower() and handle.value is None


def test_nvcc_command_targets(monkeypatch) -> None:
    monkeypatch.setenv("GRAPHAR_CUDA_ARCHS", "90a; 80")
    command = _cuda.nvcc_command("nvcc", _cuda.source_dir(), Path("out.so"), _cuda.cuda_archs())
    assert "-gencode=arch=compute_90a,code=sm_90a" in command
    assert "-gencode=arch=compute_80,code=sm_80" in command
    assert "-gencode=arch=compute_80,code=compute_80" in command  # PTX for newer GPUs
    assert {"-O3", "-shared", "-std=c++17", "-fPIC"} <= set(command)
    monkeypatch.setenv("GRAPHAR_CUDA_ARCHS", "sm_90")
    with pytest.raises(ValueError, match="GRAPHAR_CUDA_ARCHS"):
        _cuda.cuda_archs()


def test_build_without_nvcc_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(_cuda, "find_nvcc", lambda: None)
    with pytest.raises(_cuda.GrapharUnavailable, match="nvcc"):
        _cuda.build_library(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_library_without_gpu() -> None:
    assert _cuda.available() is False
    with pytest.raises(_cuda.GrapharUnavailable, match="CUDA device"):
        _cuda.library()


# ---- policy and eligibility ----------------------------------------------------------------


def test_algorithm_choice() -> None:
    assert all(ar.choose_algo(2, n) == "1stage" for n in (16, 256 * KB, 8 * MB))
    assert ar.choose_algo(4, 512 * KB - 16) == "1stage" and ar.choose_algo(4, 512 * KB) == "2stage"
    for ws in (6, 8):
        assert ar.choose_algo(ws, 256 * KB - 16) == "1stage" and ar.choose_algo(ws, 256 * KB) == "2stage"
    assert ar.choose_algo(2, 8 * MB, "2stage") == "2stage"
    assert ar.choose_algo(8, 8 * MB, "1stage") == "1stage"
    with pytest.raises(ValueError, match="1stage"):
        ar.choose_algo(2, 16, "oneshot")


def test_block_limit_by_architecture_unless_set(monkeypatch) -> None:
    monkeypatch.delenv("GRAPHAR_BLOCK_LIMIT", raising=False)
    assert ar.block_limit(9) == 64 and ar.block_limit(8) == 36
    monkeypatch.setenv("GRAPHAR_BLOCK_LIMIT", "48")
    assert ar.block_limit(9) == 48 and ar.block_limit(8) == 48


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: torch.ones(64, dtype=torch.int32), "dtype"),
        (lambda: torch.ones(8, 8).t(), "contiguous"),
        (lambda: torch.ones(12, dtype=torch.float16), "24 bytes"),
        (lambda: torch.ones(0), "0 bytes"),
        (lambda: torch.ones(MB // 4 + 4), "over the limit"),
        (lambda: torch.ones(65)[1:], "aligned"),
        (lambda: torch.ones(64, dtype=torch.bfloat16), "not on cuda:0"),
    ],
)
def test_ineligible_inputs_say_why(make, reason) -> None:
    x = make()
    got = ar.ineligible_reason(x, 0, MB)
    assert got is not None and reason in got, got


# ---- agreement between ranks ---------------------------------------------------------------


def _facts(host="h", bus="0000:01:00.0", settings=(MB, 36, None), error=None):
    return {"host": host, "bus": bus, "settings": settings, "error": error}


def test_shared_verdict() -> None:
    assert ar._shared_reason([_facts(), _facts(bus="0000:02:00.0")]) is None
    assert "several hosts" in ar._shared_reason([_facts(), _facts(host="other", bus="0000:02:00.0")])
    assert "share a GPU" in ar._shared_reason([_facts(), _facts()])
    differing = ar._shared_reason([_facts(), _facts(bus="0000:02:00.0", settings=(MB, 48, None))])
    assert "block limit" in differing
    assert ar._shared_reason([_facts(), _facts(error="no library")]) == "rank 1: no library"


def test_store_exchange_gathers_in_rank_order_and_times_out() -> None:
    store = dist.HashStore()
    results: dict[int, list] = {}

    def rank(r: int) -> None:
        exchange = ar._StoreExchange(store, "t", r, 2, timeout_s=30)
        results[r] = [exchange.all_gather(("step", s, r), "test") for s in range(3)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = [[("step", s, 0), ("step", s, 1)] for s in range(3)]
    assert results == {0: expected, 1: expected}

    alone = ar._StoreExchange(store, "alone", 0, 2, timeout_s=0.2)
    with pytest.raises(ar.GrapharCommError, match="not every rank arrived"):
        alone.all_gather(None, "lonely step")


def test_init_on_a_group_that_cannot_use_it(caplog) -> None:
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with caplog.at_level(logging.WARNING, logger="graphar"):
            assert ar.init() is None
            assert ar.init() is None
        warnings = [r for r in caplog.records if "custom all-reduce off" in r.getMessage()]
        assert len(warnings) == 1 and "not NCCL" in warnings[0].getMessage()
        assert ar.communicator(dist.group.WORLD.group_name) is None
        with pytest.raises(ValueError, match="max_bytes"):
            ar.init(max_bytes=24)
    finally:
        dist.destroy_process_group()


def test_no_capture_outside_graph_and_batch_graphs_validation() -> None:
    assert graphs.current_capture() is None
    with pytest.raises(ValueError, match="positive"):
        graphs.BatchGraphs(lambda x: x, lambda b: (torch.ones(b),), [])
    with pytest.raises(ValueError, match="positive"):
        graphs.BatchGraphs(lambda x: x, lambda b: (torch.ones(b),), [0, 2])


# ---- graph registration: what ranks exchange and what reaches the C ABI ----------------------


class _FakeLibrary:
    """The two library calls of graph registration, recorded."""

    def __init__(self) -> None:
        self.registered: tuple | None = None

    def graphar_ipc_handle(self, base: int, out) -> int:
        ctypes.memmove(out, base.to_bytes(8, "little") * 8, 64)  # a handle that names its allocation
        return 0

    def graphar_comm_register_graph(self, comm, first_slot, count, handles, offsets, staged, own) -> int:
        self.registered = (first_slot, count, handles, list(offsets), list(staged), list(own))
        return 0


def _fake_communicator(rank: int, store: dist.Store) -> ar.CustomAllreduce:
    comm = object.__new__(ar.CustomAllreduce)  # no GPU: only the Python side of registration
    comm.group_name, comm.rank, comm.world_size = "g", rank, 2
    comm._lib, comm._handle, comm._broken, comm._record = _FakeLibrary(), 1, None, ar._ErrorRecord()
    comm._exchange = ar._StoreExchange(store, "graphs", rank, 2, timeout_s=30)
    return comm


def _register_on_two_ranks(calls_per_rank) -> tuple[list[ar.CustomAllreduce], dict[int, BaseException]]:
    store = dist.HashStore()
    comms = [_fake_communicator(r, store) for r in (0, 1)]
    errors: dict[int, BaseException] = {}

    def run(r: int) -> None:
        try:
            comms[r].register_graph(calls_per_rank[r])
        except BaseException as e:  # noqa: BLE001  (collected for the assertions)
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return comms, errors


def test_graph_registration_is_call_major_with_staged_entries() -> None:
    segments = [torch.empty(256) for _ in range(2)]  # stand-ins for the ranks' allocations
    calls = [
        [ar.GraphCall(5, segments[0][16:80], segments[0].data_ptr(), False, (256, 2, 1)),
         ar.GraphCall(6, segments[0][80:144], segments[0].data_ptr(), False, (256, 2, 2))],
        [ar.GraphCall(9, segments[1][:64], segments[1].data_ptr(), True, (256, 2, 1)),
         ar.GraphCall(10, segments[1][64:128], segments[1].data_ptr(), False, (256, 2, 2))],
    ]  # fmt: skip
    comms, errors = _register_on_two_ranks(calls)
    assert not errors
    first, count, handles, offsets, staged, own = comms[0]._lib.registered
    assert (first, count) == (5, 2)
    # [call 0: rank 0, rank 1][call 1: rank 0, rank 1]
    assert offsets == [64, 0, 320, 256] and staged == [0, 1, 0, 0]
    assert own == [c.tensor.data_ptr() for c in calls[0]]
    handle = segments[0].data_ptr().to_bytes(8, "little") * 8
    assert handles == handle + bytes(64) + handle + segments[1].data_ptr().to_bytes(8, "little") * 8
    assert comms[1]._lib.registered[:2] == (9, 2)


def test_graph_registration_mismatch_is_an_error_on_every_rank() -> None:
    x = torch.empty(64)
    call, second = (ar.GraphCall(slot, x, x.data_ptr(), False, (256, 2, 1)) for slot in (1, 2))
    comms, errors = _register_on_two_ranks([[call, second], [call]])
    assert set(errors) == {0, 1}
    assert all("different numbers" in str(e) for e in errors.values())
    assert all(c._lib.registered is None for c in comms)
    with pytest.raises(ar.GrapharCommError, match="registration"):
        comms[0].check()  # the communicator is unusable from then on

    other = ar.GraphCall(1, x, x.data_ptr(), False, (512, 2, 1))
    _, errors = _register_on_two_ranks([[call], [other]])
    assert set(errors) == {0, 1} and all("disagree" in str(e) for e in errors.values())
