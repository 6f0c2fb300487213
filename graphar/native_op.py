"""The C++ kernels of graphar::all_reduce and graphar::all_reduce_add_rms_norm (csrc/torch_ops): the
eager fast path, built per torch version.

An eager call through the dispatcher into a Python kernel spends more host time in boxing and
Python than in the CUDA library (tools/eager_breakdown.py measures each step). The C++ kernels
serve the common eager call and hand every other one to the Python kernel; their source says which.
It includes torch's headers, so it is built for the torch at hand with the host compiler ($CXX,
else c++) into graphar's cache folder on first use (one process of a job builds, under a lock),
while the CUDA library stays free of torch. Off (GRAPHAR_NATIVE_OP=0), or where it cannot be built
or loaded, the Python kernel serves every call, as before, and one log line says why. Ranks need not
agree on it: both kernels launch the same CUDA kernel with the same arguments.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading
from ctypes import c_char_p, c_int, c_uint64, c_void_p
from pathlib import Path

import torch

from graphar import _cuda, settings
from graphar.comm import abi
from graphar.errors import GrapharCudaError, GrapharUnavailable

logger = logging.getLogger("graphar")

LIB_NAME = "libgraphar_op.so"
SOURCE = "all_reduce_op.cpp"
PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "graphar_op_last_error": (c_char_p, []),
    "graphar_op_install": (c_int, []),
    "graphar_op_publish": (c_int, [c_char_p, c_void_p]),
    "graphar_op_calls": (c_uint64, [c_char_p]),
}


def source_dir() -> Path | None:
    src = _cuda.source_dir()
    return None if src is None else src / "torch_ops"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cuda_include() -> Path | None:
    """The CUDA toolkit's headers (torch's CUDA stream header includes the runtime's): nvcc's (which
    CUDA_HOME picks), else /usr/local/cuda's."""
    nvcc = _cuda.find_nvcc()
    for root in filter(None, (nvcc and Path(nvcc).parent.parent, "/usr/local/cuda")):
        if (Path(root) / "include" / "cuda_runtime_api.h").is_file():
            return Path(root) / "include"
    return None


def build_command(cxx: str, src: Path, out: Path, cuda_headers: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    return [
        cxx,
        "-O2",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{torch_dir / 'include'}",
        f"-I{cuda_headers}",
        str(src / SOURCE),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-lc10_cuda",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-o",
        str(out),
    ]


def _build() -> Path:
    src, cxx, headers = source_dir(), compiler(), cuda_include()
    if src is None or not (src / SOURCE).is_file():
        raise GrapharUnavailable("its source (csrc/torch_ops) is not there")
    if cxx is None:
        raise GrapharUnavailable("no host compiler ($CXX, c++, g++)")
    if headers is None:
        raise GrapharUnavailable("the CUDA toolkit's headers were not found (CUDA_HOME, nvcc)")
    # Its own sources, and the CUDA library's header it includes (the argument structs).
    sources = f"{_cuda.source_hash(src, ('.cpp', '.h'))}|{_cuda.source_hash(src.parent, ('.h',))}"
    key = f"op|{sources}|{torch.__version__}|{torch.version.git_version}|{_cuda.compiler_version(cxx)}|{headers}"
    return _cuda.cached_build(
        key,
        LIB_NAME,
        lambda folder: _cuda.build_atomically(folder / LIB_NAME, lambda tmp: build_command(cxx, src, tmp, headers)),
    )


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The op library, built, loaded and installed on the first call; None when it is off or cannot be
    had (logged once). Only a CUDA communicator's set-up calls it (graphar.comm.communicator)."""
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
    # The C++ kernel registers for graphar::all_reduce, which `import graphar` (run before any of its
    # modules) defined: graphar.ops.
    try:
        lib = _cuda.bind(ctypes.CDLL(str(_build())), PROTOTYPES)
        if lib.graphar_op_install() != 0:
            raise GrapharUnavailable(f"installing it failed: {lib.graphar_op_last_error().decode()}")
    except (OSError, GrapharUnavailable) as e:
        logger.warning(
            "graphar: eager all-reduces run graphar::all_reduce's Python kernel (more host time per "
            "call): its C++ kernel cannot be had: %s",
            e,
        )
        return None
    return lib


def group_state(
    *,
    comm: int,
    lib: ctypes.CDLL,
    failed: int,
    max_bytes: int,
    device: int,
    rank: int,
    segments: abi.Segments,
    fused_norm_max: int,
    pdl: bool,
) -> abi.OpGroup:
    """struct graphar_op_group for a communicator: `lib` is the CUDA library, `failed` the host address of
    its error record, `segments` the eager kernel choice, `fused_norm_max` the fused norm's limit."""
    if len(segments) > abi.OP_MAX_ROWS:
        raise ValueError(f"{len(segments)} kernel rows: the op library takes at most {abi.OP_MAX_ROWS}")

    def address(fn: object) -> int:
        return ctypes.cast(fn, c_void_p).value

    state = abi.OpGroup(
        comm=comm,
        all_reduce=address(lib.graphar_comm_all_reduce),
        last_error=address(lib.graphar_last_error),
        failed=failed,
        max_bytes=max_bytes,
        all_reduce_norm=address(lib.graphar_comm_all_reduce_norm),
        fused_norm_max=fused_norm_max,
        norm_max_row_bytes=_cuda.NORM_MAX_ROW_BYTES,
        rows=len(segments),
        device=device,
        rank=rank,
        pdl=int(pdl),
    )
    for i, (bound, algo) in enumerate(segments):
        state.bounds[i] = bound
        state.algos[i] = 0 if algo is None else abi.ALGO_CODES[algo]
    return state


def publish(group_name: str, state: abi.OpGroup | None) -> None:
    """Hand a group's state to the C++ kernel (None withdraws it); nothing when the library is not loaded."""
    lib = _library
    if lib is None:
        return
    if lib.graphar_op_publish(group_name.encode(), None if state is None else ctypes.byref(state)) != 0:
        raise GrapharCudaError(f"graphar op library, group {group_name!r}: {lib.graphar_op_last_error().decode()}")


def calls(group_name: str) -> int:
    """Calls the C++ kernel served on the group in this process (0 when the library is not loaded)."""
    lib = _library
    return 0 if lib is None else lib.graphar_op_calls(group_name.encode())
