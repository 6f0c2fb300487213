"""`python -m graphar doctor`: are graphar's custom all-reduce and IPC all-to-all on here, and if not, why.

It reports, in order:
- versions: Python, torch and its CUDA, Triton, the NVIDIA driver, NCCL, graphar;
- graphar's CUDA library: built or not, the architectures in it (cuobjdump), nvcc, how to build it;
- the GPUs and their peer matrix: the driver's peer access, NVLink (NVML), and graphar's own probe
  of each pair (graphar.init on a group of the two does a real IPC store and load);
- the allocator setting that matters: expandable segments (PYTORCH_CUDA_ALLOC_CONF);
- for the group of all visible GPUs (or --world-size of them): graphar.init's verdict and the reason
  it logs when it says no, the all-reduce kernel per size, and the Ulysses exchange's transport.

With two GPUs or more it spawns one process per GPU, as the benchmarks do; with fewer it says what
it can without spawning.

Exit status, the first that applies:
  0  the custom all-reduce and the IPC all-to-all are on for the group
  3  no GPU is visible, or only one
  4  graphar's CUDA library is unavailable (not built and no nvcc, or it does not load)
  5  graphar.init turned the custom paths off for the group (the report says why; NCCL serves it)
  6  the check itself failed: a process raised, or did not finish within --timeout seconds
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import itertools
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import graphar
from graphar import _cuda, settings
from graphar.allreduce import policy
from graphar.doctor_probe import PLAN_SIZES, probe
from graphar.errors import GrapharUnavailable

EXIT_ON, EXIT_NO_GPU, EXIT_NO_LIBRARY, EXIT_OFF, EXIT_FAILED = 0, 3, 4, 5, 6
KB, MB = 1 << 10, 1 << 20
_started = time.time()  # run() resets it: progress lines count from the command's start


def _say(text: str) -> None:
    print(text, flush=True)  # flushed: the spawned processes print to the same terminal


def _progress(text: str) -> None:
    _say(f"[{time.time() - _started:5.1f} s] {text}")


def _items(title: str, items: list[tuple[str, str]]) -> None:
    _say(f"\n{title}")
    for key, value in items:
        _say(f"  {key}: {value}")


# ---- versions --------------------------------------------------------------------------------------


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")  # read, not imported: importing Triton takes seconds
    except importlib.metadata.PackageNotFoundError:
        return "not installed (Ulysses packing runs through torch copies)"


def _driver_version() -> str:
    version = _cuda.driver_version()
    if version == "unknown":
        return "unknown (NVML did not say)"
    cuda = ctypes.c_int()
    if _cuda._nvml_library().nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) != 0:
        return version
    return f"{version} (supports CUDA {cuda.value // 1000}.{cuda.value % 1000 // 10})"


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001  (CPU builds of torch have no NCCL; they raise various errors)
        return "n/a (this torch has no NCCL)"


def versions() -> list[tuple[str, str]]:
    return [
        ("Python", platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})"),
        ("Triton", _triton_version()),
        ("NVIDIA driver", _driver_version()),
        ("NCCL", _nccl_version()),
        ("graphar", f"{graphar.__version__} ({Path(graphar.__file__).parent})"),
    ]


# ---- the CUDA library ------------------------------------------------------------------------------


def _nvcc_release(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release ([\d.]+)", out)
    return f"{nvcc} (release {found.group(1)})" if found else nvcc


def _archs(text: str, kind: str = "sm|compute") -> list[str]:
    """The architectures `text` names as <kind>_NN[a], ascending."""
    return sorted(set(re.findall(rf"(?:{kind})_(\d+a?)", text)), key=lambda a: int(a.rstrip("a")))


def split_targets(named: str) -> tuple[list[str], list[str]]:
    """'sm_80,sm_90a,compute_80' (graphar_targets) -> (['80', '90a'], ['80'])."""
    return _archs(named, "sm"), _archs(named, "compute")


def embedded_archs(lib: Path, loaded: bool) -> tuple[list[str], list[str]] | None:
    """The machine-code and PTX architectures in the library: as the loaded library names them itself
    (graphar_targets), else by cuobjdump; None when neither can tell."""
    named = _cuda.library().graphar_targets().decode() if loaded else ""
    if named:
        return split_targets(named)
    nvcc = _cuda.find_nvcc()
    tool = shutil.which("cuobjdump") or (nvcc and shutil.which("cuobjdump", path=str(Path(nvcc).parent)))
    if not tool:
        return None
    elf, ptx = (
        _archs(subprocess.run([tool, flag, str(lib)], capture_output=True, text=True).stdout)
        for flag in ("--list-elf", "--list-ptx")
    )
    return elf, ptx


def _archs_text(elf: list[str], ptx: list[str]) -> str:
    code, portable = ", ".join("sm_" + a for a in elf), ", ".join("compute_" + a for a in ptx)
    return f"machine code {code or 'none'}; PTX {portable or 'none'}"


def coverage(capability: str, elf: list[str], ptx: list[str]) -> str:
    """How a GPU of compute capability `capability` ('90') runs the library."""
    if any(a.rstrip("a") == capability for a in elf):
        return "machine code for it"
    if any(not a.endswith("a") and int(a) <= int(capability) for a in ptx):
        return "PTX only: the driver compiles it at first load"
    return f"NOT covered: rebuild with GRAPHAR_CUDA_ARCHS={capability}"


def _loaded_library() -> tuple[Path | None, str]:
    """The library as graphar loads it (built first when needed), or why it cannot."""
    if not torch.cuda.is_available():
        return None, "not tried: no CUDA device is visible"
    _progress("loading graphar's CUDA library (nvcc builds it on first use: a minute or two)...")
    try:
        return Path(_cuda.library()._name), "yes"
    except GrapharUnavailable as e:
        return None, f"no: {e}"


def library_report(capabilities: list[str]) -> bool:
    """Print the library's section; whether it loads here."""
    packaged = _cuda.PACKAGE_DIR / _cuda.LIB_NAME
    nvcc = _cuda.find_nvcc()
    loaded, loads = _loaded_library()
    items = [
        ("built at install", str(packaged) if packaged.is_file() else "no"),
        ("sources", str(_cuda.source_dir() or "none (a wheel without csrc/)")),
        ("nvcc", _nvcc_release(nvcc) if nvcc else "not found (PATH, CUDA_HOME)"),
        ("build targets (GRAPHAR_CUDA_ARCHS)", _archs_text(*_cuda.build_targets(_cuda.cuda_archs()))),
        ("loads here", loads if loaded is None else f"yes, {loaded}"),
    ]
    shown = loaded or (packaged if packaged.is_file() else None)
    archs = embedded_archs(shown, loaded is not None) if shown else _cuda.build_targets(_cuda.cuda_archs())
    if archs is None:
        items.append(("architectures in it", "unknown (cuobjdump, part of the CUDA toolkit, is not on PATH)"))
    else:
        items += [("architectures in it", _archs_text(*archs))] if shown else []
        items += [(f"GPUs of sm_{cc}", coverage(cc, *archs)) for cc in dict.fromkeys(capabilities)]
    if loaded is None:
        items.append(
            (
                "to build it",
                "`pip install -e .` in a checkout (or pip install from source) with nvcc on PATH "
                "or CUDA_HOME set; GRAPHAR_CUDA_ARCHS=<this GPU's, e.g. 90a> builds for it alone. Without a "
                "build at install, graphar builds it on first use where nvcc exists, into GRAPHAR_CACHE_DIR "
                "or ~/.cache/graphar",
            )
        )
    _items("graphar's CUDA library", items)
    return loaded is not None


# ---- GPUs, peers, allocator --------------------------------------------------------------------------


def gpus() -> list[dict[str, str]]:
    """The visible GPUs, bus ids from torch: the library's numbers, with no need to load it."""
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append(
            {
                "name": p.name,
                "cc": f"{p.major}{p.minor}",
                "memory": f"{p.total_memory / 2**30:.0f} GiB",
                "bus": f"{p.pci_domain_id:04X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0",
            }
        )
    return found


def link(a: int, b: int, found: list[dict[str, str]]) -> str:
    """The driver's word on a pair: peer access, and NVLink by NVML."""
    if not torch.cuda.can_device_access_peer(a, b):
        return "no P2P"
    try:
        return "NVLink" if _cuda.nvlink_between(found[a]["bus"], found[b]["bus"]) else "P2P/PCIe"
    except GrapharUnavailable:
        return "P2P"  # no NVML: the link is unknown


def matrix(n: int, links: dict[tuple[int, int], str], probes: dict[str, str]) -> list[str]:
    """The peer matrix: each cell the pair's link, then graphar's probe: ok, off[k] (reason k), or ?."""
    reasons: list[str] = []
    cells: dict[tuple[int, int], str] = {}
    for (a, b), what in links.items():
        probe = probes.get(f"{a}-{b}", "?")
        if probe not in ("ok", "?"):
            reasons += [] if probe in reasons else [probe]
            probe = f"off[{reasons.index(probe) + 1}]"
        cells[(a, b)] = cells[(b, a)] = f"{what} {probe}"
    width = max([len(c) for c in cells.values()] + [7])
    rows = [("        " + "".join(f"{f'cuda:{j}':<{width + 2}}" for j in range(n))).rstrip()]
    for i in range(n):
        rows.append((f"cuda:{i}  " + "".join(f"{cells.get((i, j), '-'):<{width + 2}}" for j in range(n))).rstrip())
    return rows + [f"[{k}] {reason}" for k, reason in enumerate(reasons, 1)]


def gpu_report(found: list[dict[str, str]], probes: dict[str, str]) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    _say(f"\nGPUs: {len(found) or 'none'} visible (CUDA_VISIBLE_DEVICES={visible})")
    for i, g in enumerate(found):
        _say(f"  cuda:{i}  {g['name']}  sm_{g['cc']}  {g['memory']}  bus {g['bus']}")
    if len(found) < 2:
        return
    links = {(a, b): link(a, b, found) for a, b in itertools.combinations(range(len(found)), 2)}
    _say("\nPeers: the driver's word (peer access; NVLink by NVML), then graphar's IPC store/load probe of the pair")
    for row in matrix(len(found), links, probes):
        _say(f"  {row}")


def allocator_report() -> None:
    # PYTORCH_ALLOC_CONF is the newer name of the same setting.
    names = [n for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if os.environ.get(n)]
    name = names[0] if names else "PYTORCH_CUDA_ALLOC_CONF"
    conf = os.environ.get(name, "")
    expandable = re.search(r"expandable_segments\s*:\s*(true|1)", conf, re.IGNORECASE) is not None
    _items(
        "Allocator",
        [
            (name, conf or "unset"),
            (
                "expandable segments",
                "on: graphar.init still sets up, but legacy CUDA IPC cannot share such memory, so "
                "all-reduces captured with graphar.graph copy their inputs in (staged) instead of zero copy"
                if expandable
                else "off (zero-copy all-reduces under graphar.graph can share torch's tensors)",
            ),
        ],
    )


# ---- what graphar does for the group -------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // KB} KB"


def _kernels(picks: list[str | None] | None) -> str:
    """The kernels of one size by capture mode, or why NCCL serves it."""
    if picks is None:
        return "NCCL (over the limit)"
    if len(set(picks)) == 1:
        return picks[0] or "NCCL (the tuner measured it faster, or the forced kernel cannot take it)"
    return ", ".join(f"{mode}: {pick or 'NCCL'}" for mode, pick in zip(policy.MODES, picks))


def group_report(world_size: int, facts: list[dict[str, Any]]) -> int:
    """Print what graphar does for the group of `world_size` ranks; the exit status."""
    first = facts[0]
    on = first["verdict"] == "ok"
    items = [("custom all-reduce", "ON" if on else f"OFF, NCCL serves it: {first['verdict']}")]
    items += [("graphar's warning", w) for w in first["warnings"]]
    if on:
        auto = settings.AUTO_INIT.get()
        items.append(
            (
                "set up",
                "at each group's first eager collective, or by graphar.init(group)"
                if auto
                else "only by graphar.init(group) (GRAPHAR_AUTO_INIT=0)",
            )
        )
        items.append(("size limit (GRAPHAR_MAX_ALLREDUCE_BYTES)", _size(first["max_bytes"])))
        push = first["push"]
        items.append(
            ("push kernels", f"one-shot up to {_size(push['one_shot'])}, fused norm up to {_size(push['fused_norm'])}")
        )
        pdl = "on" if first["pdl"] else "off (GRAPHAR_PDL=0, or a GPU before Hopper)"
        items.append(("programmatic dependent launch", pdl))
        tuned = first.get("tuned")
        table = "the shipped one (GRAPHAR_TUNE=0, or a kernel forced)"
        if tuned is not None:
            table = f"measured on this group ({'from the tuner cache' if tuned['source'] == 'cache' else 'now'})"
        items.append(("kernel table", table))
        items += [("  measured", line) for line in (tuned or {}).get("lines", [])]
        plan = {int(n): picks for n, picks in first["plan"].items()}  # JSON made the keys strings
        items += [(f"all-reduce of {_size(n)}", _kernels(plan.get(n))) for n in PLAN_SIZES]
        python = [r for r, f in enumerate(facts) if not f["native_op"]]
        items.append(
            (
                "eager calls of the op",
                f"the Python kernel on ranks {python} (more host time per call; "
                "GRAPHAR_NATIVE_OP, or graphar's warning says why)"
                if python
                else "its C++ kernel",
            )
        )
        staged = [r for r, f in enumerate(facts) if not f.get("shareable", True)]
        items.append(
            (
                "graphar.graph inputs",
                f"staged (copied in) on ranks {staged}: expandable segments" if staged else "zero copy",
            )
        )
    ulysses = f"CUDA IPC, {first['alltoall']} (GRAPHAR_ALLTOALL_ALGO)" if on else "NCCL (no communicator)"
    items.append(("Ulysses exchange", ulysses))
    _items(f"What graphar does for the group of {world_size} GPUs (the world group of the spawned processes)", items)
    return EXIT_ON if on else EXIT_OFF


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size", type=int, default=None, help="GPUs in the group to check (default: all visible)"
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds the spawned check may take (default: 180)"
    )


def _finish(code: int, why: str) -> int:
    _say(f"\ngraphar doctor: {why} (exit status {code})")
    return code


def run(args: argparse.Namespace) -> int:
    """The `doctor` command of `python -m graphar`."""
    global _started
    _started = time.time()
    _say("graphar doctor")
    _items("Versions", versions())
    found = gpus()
    library = library_report([g["cc"] for g in found])
    allocator_report()
    world_size = args.world_size or len(found)
    if len(found) < 2 or not 2 <= world_size <= len(found):
        gpu_report(found, {})
        return _finish(
            EXIT_NO_GPU,
            f"the custom paths need 2 GPUs or more in the group; {len(found)} visible"
            + (f", --world-size {world_size}" if args.world_size else ""),
        )
    if not library:
        gpu_report(found, {})
        return _finish(EXIT_NO_LIBRARY, "graphar's CUDA library is unavailable (see above); NCCL serves everything")
    _progress(f"starting {world_size} processes, one per GPU, to run graphar.init...")
    facts, failure = probe(world_size, args.timeout)
    gpu_report(found, {k: v for f in facts for k, v in f["pairs"].items()})
    if failure is not None:
        return _finish(EXIT_FAILED, failure)
    code = group_report(world_size, facts)
    return _finish(
        code,
        "custom all-reduce and IPC all-to-all ON"
        if code == EXIT_ON
        else "custom all-reduce and IPC all-to-all OFF for the group; NCCL serves them",
    )
