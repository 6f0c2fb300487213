"""The testing library (tools/graphar_testing.cu): what tests, benchmarks and the floor tools do to a
communicator that the shipped library offers no user (set its counters, read its registered buffer and
its mappings, make it its own peer), and a graph's edges (through the driver: no build). Built on first use from this checkout, beside nothing graphar installs; it
reads struct Comm by its handle, so it refuses a loaded library built from other sources."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Any

from graphar import _cuda
from graphar.errors import GrapharUnavailable

SOURCE = Path(__file__).with_name("graphar_testing.cu")
LIB_NAME = "libgraphar_testing.so"
PROTOTYPES = {
    "graphar_testing_last_error": (c_char_p, []),
    "graphar_testing_set_barrier_counters": (c_int, [c_void_p, c_uint32]),
    "graphar_testing_registered_buffer": (c_int, [c_void_p, POINTER(c_uint64)]),
    "graphar_testing_loopback": (c_int, [c_void_p, c_uint64]),
    "graphar_testing_graph_mappings": (c_int, [c_void_p, POINTER(c_int), POINTER(c_int)]),
    "graphar_testing_norm_split": (c_int, [c_void_p, c_int]),
    "graphar_testing_norm_grid": (
        c_int,
        [c_void_p, c_uint64, c_uint64, c_int, c_uint64, c_int, POINTER(c_int), POINTER(c_int), POINTER(c_int)],
    ),
}
_loaded: ctypes.CDLL | None = None


def compile_command(nvcc: str, src: Path, out: Path) -> list[str]:
    """The command that builds the library from the sources `src` (a csrc/ folder) into `out`."""
    # The shipped library's flags, and no target: no kernel is built here.
    return [nvcc, "-shared", *_cuda.HOST_FLAGS, f"-I{src}", f"-I{SOURCE.parent}", str(SOURCE), "-o", str(out)]


def build(out_dir: Path, src: Path) -> ctypes.CDLL:
    """Build into out_dir from the csrc/ folder src and load it, its prototypes bound."""
    nvcc = _cuda.find_nvcc()
    if nvcc is None:
        raise GrapharUnavailable("the testing library needs nvcc (CUDA_HOME or PATH)")
    lib = _cuda.build_atomically(out_dir / LIB_NAME, lambda tmp: compile_command(nvcc, src, tmp))
    return _cuda.bind(ctypes.CDLL(str(lib)), PROTOTYPES)


def library() -> ctypes.CDLL:
    """The library for the loaded graphar library, built once per source (cached as graphar's builds are)."""
    global _loaded
    if _loaded is None:
        src = _cuda.source_dir()
        if src is None or _cuda.build_id() != _cuda.source_hash(src):
            raise GrapharUnavailable(
                f"the loaded graphar library ({_cuda.library()._name}) was not built from {src}: "
                "the testing library reads its communicator's layout and needs its sources"
            )
        sources = (SOURCE, SOURCE.with_suffix(".h"))
        key = f"testing {_cuda.build_id()} " + " ".join(p.read_bytes().hex() for p in sources)
        path = _cuda.cached_build(key, LIB_NAME, lambda folder: build(folder, src))
        _loaded = _cuda.bind(ctypes.CDLL(str(path)), PROTOTYPES)
    return _loaded


def check(rc: int, what: str, lib: ctypes.CDLL | None = None) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {(lib or library()).graphar_testing_last_error().decode()}")


def handle(comm: Any) -> int:
    """The library handle of a graphar communicator (or a handle itself)."""
    return comm if isinstance(comm, int) else comm.handle


def set_barrier_counters(comm: Any, value: int) -> None:
    """Every barrier counter as if `value` barriers had passed (every rank, the same value, no kernel running)."""
    check(library().graphar_testing_set_barrier_counters(handle(comm), value), "set barrier counters")


def registered_buffer(comm: Any) -> int:
    """The address of this rank's registered input buffer."""
    ptr = c_uint64()
    check(library().graphar_testing_registered_buffer(handle(comm), ctypes.byref(ptr)), "registered buffer")
    return ptr.value


def loopback(comm: Any, nbytes: int) -> None:
    """Make a never-opened world-size-2 communicator of rank 0 its own peer for calls of nbytes."""
    check(library().graphar_testing_loopback(handle(comm), nbytes), "loopback")


def graph_mappings(comm: Any) -> tuple[int, int]:
    """Peers' allocations mapped for graph slots: (read by a live graph, unused and not closed yet)."""
    open_, unused = c_int(), c_int()
    check(library().graphar_testing_graph_mappings(handle(comm), ctypes.byref(open_), ctypes.byref(unused)), "mappings")
    return open_.value, unused.value


def norm_split(comm: Any, max_split: int) -> None:
    check(library().graphar_testing_norm_split(handle(comm), max_split), "norm split")


def norm_grid(
    comm: Any | None,
    nbytes: int,
    row_bytes: int,
    block_limit: int = 0,
    scratch_words: int = 0,
    max_split: int = 0,
    lib: ctypes.CDLL | None = None,
) -> tuple[int, int, int]:
    """(blocks, threads per block, blocks per row) of the fused norm: a communicator's launch, or (comm
    None) of block_limit blocks, scratch_words scratch words and max_split."""
    lib = lib or library()
    out = [c_int() for _ in range(3)]
    comm = None if comm is None else handle(comm)
    rc = lib.graphar_testing_norm_grid(
        comm, nbytes, row_bytes, block_limit, scratch_words, max_split, *map(ctypes.byref, out)
    )
    check(rc, "norm grid", lib)
    return out[0].value, out[1].value, out[2].value


class _EdgeData(ctypes.Structure):
    """CUgraphEdgeData (cuda.h)."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte)]
    _fields_ += [("reserved", ctypes.c_ubyte * 5)]


_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


def graph_edges(graph: Any) -> tuple[int, int]:
    """(all edges, programmatic edges: those PDL launches keep when captured) of a torch.cuda.CUDAGraph
    captured with keep_graph=True, through the driver (no compiler: it serves a wheel's check too)."""
    get_edges = ctypes.CDLL("libcuda.so.1").cuGraphGetEdges_v2
    get_edges.argtypes = [c_void_p, c_void_p, c_void_p, c_void_p, POINTER(ctypes.c_size_t)]
    handle, n = graph.raw_cuda_graph(), ctypes.c_size_t()
    if get_edges(handle, None, None, None, ctypes.byref(n)) != 0:
        raise RuntimeError("cuGraphGetEdges_v2 failed to count the edges")
    nodes = c_void_p * max(n.value, 1)
    data = (_EdgeData * max(n.value, 1))()
    if n.value and get_edges(handle, nodes(), nodes(), data, ctypes.byref(n)) != 0:
        raise RuntimeError("cuGraphGetEdges_v2 failed to list the edges")
    return n.value, sum(d.type == _PROGRAMMATIC for d in data[: n.value])
