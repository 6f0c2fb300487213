"""graphar's CUDA library (csrc/, a plain C ABI): build with nvcc, locate, load with ctypes.

The library is looked up next to this file (put there by setup.py) and used when it was built from
the sources at hand; otherwise it is built once into ~/.cache/graphar/<hash of sources, nvcc and
archs>/ under a file lock, so that the ranks of a job do not race. `available()` never raises. The
same build makes the op library beside it (csrc/torch_ops/, torch's stable ABI: graphar.allreduce.native_op
loads it) where torch's headers are installed.

setup.py loads this module by path, without the package (torch may not be installed yet), so it
imports nothing from graphar but `graphar.settings` and `graphar.errors`, which import nothing else.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from ctypes import POINTER, c_char_p, c_int, c_int32, c_uint8, c_uint64, c_void_p
from pathlib import Path

LIB_NAME = "libgraphar_cuda.so"
TORCH_LIB_NAME = "libgraphar_torch.so"
PACKAGE_DIR = Path(__file__).resolve().parent


def _settings_module():
    if __package__ == "graphar":
        from graphar import settings

        return settings
    spec = importlib.util.spec_from_file_location("_graphar_settings", PACKAGE_DIR / "settings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


settings = _settings_module()
# graphar.errors as graphar.settings has it (loaded by path too where this module was).
GrapharCudaError, GrapharUnavailable = settings.errors.GrapharCudaError, settings.errors.GrapharUnavailable
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
_TORCH_SOURCE = Path("torch_ops") / "ops.cpp"
# torch 2.11's stable ABI (major and minor in the top two bytes), the oldest torch graphar supports:
# one build of the op library loads under every torch from 2.11 on.
TORCH_TARGET_VERSION = "0x020b000000000000"
# The translation units that instantiate the most kernels: compiled first, so that the others fill in beside them.
_LONGEST_UNITS = ("launch_norm.cu", "launch.cu", "exchange.cu")

# name -> (restype, argtypes); the exports of csrc/graphar_cuda.h
PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "graphar_last_error": (c_char_p, []),
    "graphar_build_id": (c_char_p, []),
    "graphar_targets": (c_char_p, []),
    "graphar_device_pci_bus_id": (c_int, [c_int, c_char_p, c_int]),
    "graphar_pointer_info": (c_int, [c_uint64, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_int)]),
    "graphar_ipc_handle": (c_int, [c_uint64, c_void_p]),
    "graphar_comm_create": (c_int, [c_int, c_int, c_uint64, c_int, c_uint64, c_int, POINTER(c_void_p)]),
    "graphar_comm_handles": (c_int, [c_void_p, c_void_p]),
    "graphar_comm_open": (c_int, [c_void_p, c_void_p]),
    "graphar_comm_probe": (c_int, [c_void_p, c_int, POINTER(c_int)]),
    "graphar_comm_error_record": (c_int, [c_void_p, POINTER(c_void_p)]),
    "graphar_comm_failed_flag": (c_int, [c_void_p, POINTER(c_void_p)]),
    "graphar_comm_set_kernels": (c_int, [c_void_p, c_void_p]),
    "graphar_comm_plan": (c_int, [c_void_p, c_void_p, c_uint64, c_int, c_int, POINTER(c_int32), POINTER(c_int32)]),
    "graphar_comm_plan_norm": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_uint64]),
    "graphar_comm_all_reduce": (c_int, [c_void_p, c_void_p]),
    "graphar_comm_push_limits": (c_int, [c_void_p, POINTER(c_uint64), POINTER(c_uint64)]),
    "graphar_comm_all_reduce_norm": (c_int, [c_void_p, c_void_p]),
    "graphar_comm_exchange_lease": (c_int, [c_void_p, c_int, c_uint64, POINTER(c_uint64)]),
    "graphar_comm_exchange_alloc": (c_int, [c_void_p, c_uint64, c_int, POINTER(c_uint64), c_void_p]),
    "graphar_comm_exchange_open": (c_int, [c_void_p, c_uint64, c_void_p, POINTER(c_uint64)]),
    "graphar_comm_all_to_all": (
        c_int,
        [c_void_p, c_int, c_uint64, c_uint64, c_uint64, c_uint64, c_uint64, c_uint64, c_int, c_int, c_uint64, c_uint64],
    ),
    "graphar_comm_register_graph": (
        c_int,
        [c_void_p, POINTER(c_int32), c_int, c_void_p, POINTER(c_uint64), POINTER(c_uint8), POINTER(c_uint64)],
    ),
    "graphar_comm_forget_graph_slots": (c_int, [c_void_p, POINTER(c_int32), c_int]),
    "graphar_comm_close_unused_mappings": (c_int, [c_void_p]),
    "graphar_comm_destroy": (c_int, [c_void_p]),
}
IPC_HANDLE_BYTES = 64
# kNormThreads * kNormPacksPerThread * 16 of csrc/push_norm.cuh: the fused norm kernel's longest row.
NORM_MAX_ROW_BYTES = 512 * 8 * 16


def source_dir() -> Path | None:
    """csrc/ of a wheel (copied into the package) or of a source tree; None when absent."""
    for candidate in (PACKAGE_DIR / "csrc", PACKAGE_DIR.parent / "csrc"):
        if (candidate / "graphar_cuda.cu").is_file():
            return candidate
    return None


def source_hash(src: Path) -> str:
    """A hash of the sources in `src` and its folders (both libraries'): what a build from them depends on."""
    digest = hashlib.sha256()
    for path in sorted(p for p in src.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.access(Path(cuda_home) / "bin" / "nvcc", os.X_OK):
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cuda_archs() -> list[str]:
    """Build targets (GRAPHAR_CUDA_ARCHS, default "80;90a;100a"): compute capabilities, 'a' for arch-specific."""
    return list(settings.CUDA_ARCHS.get())


def build_targets(archs: list[str]) -> tuple[list[str], list[str]]:
    """What a build makes of these archs: machine code for each, and PTX of the newest portable one
    ('a' targets are not forward compatible), which GPUs newer than every target compile at load."""
    portable = [a for a in archs if not a.endswith("a")]
    return archs, [max(portable, key=int)] if portable else []


# Hidden: the library exports the C ABI of graphar_cuda.h alone, not the helpers its files share.
HOST_FLAGS = ["-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-std=c++17"]


def nvcc_flags(archs: list[str]) -> list[str]:
    """What every translation unit of the library is compiled with, the targets included (and named
    in the library: graphar_targets)."""
    elf, ptx = build_targets(archs)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in elf]
    gencode += [f"-gencode=arch=compute_{a},code=compute_{a}" for a in ptx]
    named = ",".join([f"sm_{a}" for a in elf] + [f"compute_{a}" for a in ptx])
    # nvcc splits a -D value at its commas (defining sm_80 and the like, which breaks CUDA's own headers)
    # unless they are escaped.
    escaped = named.replace(",", "\\,")
    return [*HOST_FLAGS, *gencode, f"-DGRAPHAR_TARGETS={escaped}"]


def compile_commands(nvcc: str, src: Path, objects: Path, archs: list[str]) -> dict[Path, list[str]]:
    """object -> the nvcc command that compiles it: one per .cu file of src (its own translation unit,
    each kernel instantiated in the one that launches it), into the folder `objects`."""
    flags = [nvcc, "-c", *nvcc_flags(archs), f"-DGRAPHAR_BUILD_ID={source_hash(src)}"]
    units = sorted(src.glob("*.cu"), key=lambda cu: (_LONGEST_UNITS + (cu.name,)).index(cu.name))
    return {objects / f"{cu.stem}.o": [*flags, str(cu), "-o", str(objects / f"{cu.stem}.o")] for cu in units}


def link_command(nvcc: str, objects: list[Path], out: Path) -> list[str]:
    return [nvcc, "-shared", *map(str, objects), "-o", str(out)]


def torch_root() -> Path | None:
    """The installed torch's folder where it has the stable ABI's headers; found without importing
    torch (setup.py runs where it may not be importable: pip's build isolation)."""
    spec = importlib.util.find_spec("torch")
    for root in map(Path, spec.submodule_search_locations if spec else []):
        if (root / "include" / "torch" / "csrc" / "stable" / "library.h").is_file():
            return root
    return None


def torch_library_command(nvcc: str, src: Path, out: Path, torch: Path) -> list[str]:
    """The nvcc command that builds the op library (host code: no CUDA runtime) against torch's stable
    ABI as of TORCH_TARGET_VERSION. It links libtorch_cpu alone: the one libtorch_cuda function it
    calls it looks up at run time (csrc/torch_ops/ops.cpp), so it loads into a CPU build of torch too."""
    return [
        nvcc,
        "-O3",
        "-std=c++17",
        "-shared",
        "-Xcompiler",
        "-fPIC",
        "-Xcompiler",
        "-fvisibility=hidden",
        "-cudart",
        "none",
        "-DUSE_CUDA",  # declares the shim's CUDA functions (their types), links none
        f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
        "-I",
        str(torch / "include"),
        str(src / _TORCH_SOURCE),
        "-L",
        str(torch / "lib"),
        "-ltorch_cpu",
        "-ldl",
        "-o",
        str(out),
    ]


def run_parallel(commands: list[list[str]], cwd: Path | None = None) -> str:
    """Runs the commands, as many at once as this process has CPUs, in their order; returns what they
    wrote to stderr, one after the other; GrapharUnavailable with the words of the first that failed."""
    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max(1, min(jobs, len(commands)))) as pool:
        results = list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, cwd=cwd), commands))
    for command, result in zip(commands, results):
        if result.returncode != 0:
            what = next((Path(a).name for a in command if a.endswith((".cu", ".cpp"))), Path(command[0]).name)
            raise GrapharUnavailable(f"compiling {what} failed:\n{result.stderr[-4000:]}")
    return "".join(result.stderr for result in results)


def _sources_and_nvcc() -> tuple[Path, str]:
    src = source_dir()
    if src is None:
        raise GrapharUnavailable("graphar's CUDA sources (csrc/) are not there to build from")
    nvcc = find_nvcc()
    if nvcc is None:
        raise GrapharUnavailable("nvcc not found (PATH, CUDA_HOME); it is needed to build graphar's CUDA library")
    return src, nvcc


def build_library(out_dir: str | os.PathLike[str]) -> Path:
    """Compile csrc/ into out_dir/libgraphar_cuda.so, and out_dir/libgraphar_torch.so where torch's
    headers are installed (`torch_root`); returns the CUDA library's path. Each is replaced atomically,
    the op library first and removed where it is not built: one beside a CUDA library is of its build."""
    src, nvcc = _sources_and_nvcc()
    target = Path(out_dir) / LIB_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    torch = torch_root()
    with tempfile.TemporaryDirectory(prefix=".build-objects-", dir=target.parent) as objects:
        commands = compile_commands(nvcc, src, Path(objects), cuda_archs())
        torch_lib = Path(objects) / TORCH_LIB_NAME
        torch_build = [] if torch is None else [torch_library_command(nvcc, src, torch_lib, torch)]
        run_parallel([*torch_build, *commands.values()])
        if torch is None:
            (target.parent / TORCH_LIB_NAME).unlink(missing_ok=True)
        else:
            os.replace(torch_lib, target.parent / TORCH_LIB_NAME)
        return build_atomically(target, lambda tmp: link_command(nvcc, list(commands), tmp))


def build_torch_library(out_dir: str | os.PathLike[str]) -> Path:
    """Build out_dir/libgraphar_torch.so alone (replaced atomically); returns its path."""
    src, nvcc = _sources_and_nvcc()
    torch = torch_root()
    if torch is None:
        raise GrapharUnavailable("torch's headers (include/torch/csrc/stable) are not installed")
    return build_atomically(Path(out_dir) / TORCH_LIB_NAME, lambda tmp: torch_library_command(nvcc, src, tmp, torch))


def build_atomically(target: Path, command: Callable[[Path], list[str]]) -> Path:
    """Run command(tmp), which writes a library to tmp, then move it to `target` in one step (a
    process loading `target` never sees half a file); GrapharUnavailable with the compiler's words."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        result = subprocess.run(command(tmp), capture_output=True, text=True)
        if result.returncode != 0:
            raise GrapharUnavailable(f"building {target.name} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _cache_root() -> Path:
    if settings.CACHE_DIR.get():
        return Path(settings.CACHE_DIR.get())
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "graphar"


def cached_build(key: str, lib_name: str, build: Callable[[Path], object]) -> Path:
    """<cache>/<key>/<lib_name>, made by build(folder) the first time: one process of a job builds
    (under a file lock), the others wait and reuse it. `key` names everything the build depends on."""
    folder = _cache_root() / hashlib.sha256(key.encode()).hexdigest()[:16]
    lib = folder / lib_name
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.is_file():
            build(folder)
    return lib


def compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _cached_build(src: Path) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise GrapharUnavailable(f"no up-to-date {LIB_NAME} next to the package and no nvcc to build one")
    return cached_build(f"{source_hash(src)}|{compiler_version(nvcc)}|{cuda_archs()}", LIB_NAME, build_library)


def cached_torch_library(src: Path) -> Path:
    """The op library alone, built once into graphar's cache (for a CUDA library built where torch
    was not importable)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise GrapharUnavailable(f"no {TORCH_LIB_NAME} beside the CUDA library and no nvcc to build one")
    return cached_build(f"torch|{source_hash(src)}|{compiler_version(nvcc)}", TORCH_LIB_NAME, build_torch_library)


def _built_from(path: Path, src: Path) -> bool:
    lib = ctypes.CDLL(str(path))
    lib.graphar_build_id.restype = c_char_p
    return lib.graphar_build_id().decode() == source_hash(src)


def locate() -> Path:
    """The CUDA library to load: the package's when built from the sources at hand, else the cached
    build (made now if need be)."""
    packaged = PACKAGE_DIR / LIB_NAME
    src = source_dir()
    if packaged.is_file() and (src is None or _built_from(packaged, src)):
        return packaged
    if src is None:
        raise GrapharUnavailable(f"{LIB_NAME} is missing from the package and there are no sources to build it")
    return _cached_build(src)


_library: ctypes.CDLL | None = None
_load_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """The loaded library (built first if needed); GrapharUnavailable when it cannot be had."""
    global _library
    if _library is not None:
        return _library
    with _load_lock:
        if _library is None:
            import torch

            if not torch.cuda.is_available():
                raise GrapharUnavailable("no CUDA device is visible")
            try:
                lib = ctypes.CDLL(str(locate()))
            except OSError as e:
                raise GrapharUnavailable(f"cannot load {LIB_NAME}: {e}") from e
            _library = bind(lib, PROTOTYPES)
    return _library


def bind(lib: ctypes.CDLL, prototypes: Mapping[str, tuple[object, list[object]]]) -> ctypes.CDLL:
    """`lib`, each function of `prototypes` given its C types: callers then call them as attributes of
    it (`lib.graphar_comm_open(...)`), each converted and checked by ctypes as its C declaration says."""
    for name, (restype, argtypes) in prototypes.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def available() -> bool:
    """Whether the library loads here; never raises."""
    try:
        library()
    except Exception:  # noqa: BLE001  (any failure means "not available")
        return False
    return True


def last_error() -> str:
    return library().graphar_last_error().decode(errors="replace")


def check(rc: int, what: str) -> None:
    """Raise GrapharCudaError naming `what` when a library call returned an error code."""
    if rc != 0:
        raise GrapharCudaError(f"{what}: {last_error()}")


def build_id() -> str:
    """The loaded library's build id: the hash of the sources it was built from (`source_hash`)."""
    return library().graphar_build_id().decode()


def pci_bus_id(device: int) -> str:
    buf = ctypes.create_string_buffer(64)
    check(library().graphar_device_pci_bus_id(device, buf, len(buf)), f"PCI bus id of cuda:{device}")
    return buf.value.decode()


# ---- NVML, for the NVLink check of world sizes above 2 ------------------------------------------

_NVML_P2P_CAPS_INDEX_NVLINK = 2
_NVML_P2P_STATUS_OK = 0
_nvml: ctypes.CDLL | None = None


def _nvml_library() -> ctypes.CDLL:
    global _nvml
    if _nvml is None:
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise GrapharUnavailable(f"NVML is not available: {e}") from e
        if nvml.nvmlInit_v2() != 0:
            raise GrapharUnavailable("nvmlInit failed")
        _nvml = nvml
    return _nvml


def driver_version() -> str:
    """The driver's version as NVML gives it ('580.95.05'), or 'unknown' where NVML cannot say."""
    try:
        nvml = _nvml_library()
    except GrapharUnavailable:
        return "unknown"
    buf = ctypes.create_string_buffer(96)
    return buf.value.decode() if nvml.nvmlSystemGetDriverVersion(buf, len(buf)) == 0 else "unknown"


def nvlink_between(bus_a: str, bus_b: str) -> bool:
    """Whether NVML reports NVLink P2P between the GPUs at these PCI bus ids."""
    nvml = _nvml_library()
    handles = [c_void_p(), c_void_p()]
    for bus, handle in zip((bus_a, bus_b), handles):
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) != 0:
            raise GrapharUnavailable(f"NVML does not know the GPU at {bus}")
    status = c_int(-1)
    rc = nvml.nvmlDeviceGetP2PStatus(handles[0], handles[1], _NVML_P2P_CAPS_INDEX_NVLINK, ctypes.byref(status))
    return rc == 0 and status.value == _NVML_P2P_STATUS_OK
