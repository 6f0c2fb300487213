"""SASS sizes of graphar's kernels: per kernel of a built CUDA library, its instruction count and the
memory, atomic, fence and block-barrier instructions among them.

Why: PTX line counts mix a kernel's cold paths (timeouts, poisoning, error records) with the code a
successful call runs, and ptxas still transforms PTX. The SASS is what the GPU runs, and its
memory, atomic and fence instructions are what a change to the kernels' synchronisation costs: one
system-scope round trip outweighs dozens of ALU instructions. Counts are static (every instruction
of the kernel once, NOP padding left out); what a successful call executes is a path through them,
which `cuobjdump -sass` (or `nvdisasm -cfg` on an extracted cubin) shows to follow by hand.

Columns: total instructions; ld / st: global and generic loads and stores (LDG, LD, STG, ST; shared
and local memory apart: lds/sts, ldl/stl); atom: ATOM*, RED* (global and shared); fence: MEMBAR and
FENCE; inval: CCTL.IVALL (the L1 invalidation an acquire load brings); sys / gpu: memory
instructions with .STRONG.SYS / .STRONG.GPU (volatile and system-scope accesses, gpu-scope
atomics); bar: BAR.* (block barriers: __syncthreads and its reductions).

Usage:
    python tools/kernel_sizes.py LIB.so                      # one library
    python tools/kernel_sizes.py BEFORE.so AFTER.so          # side by side, "before->after"
    python tools/kernel_sizes.py LIB.so --kernel 'bfloat16, 2>|all_to_all<2>|lease'

Comparing two commits (CPU only; nvcc on the PATH builds, cuobjdump reads). Each checkout builds with
its own graphar/_cuda.py, loaded by path as setup.py does, so that no installed graphar is imported:
    BUILD='import importlib.util as u, sys; s = u.spec_from_file_location("c", "graphar/_cuda.py")
    m = u.module_from_spec(s); sys.modules["c"] = m; s.loader.exec_module(m); print(m.build_library("out"))'
    git worktree add --detach /tmp/sizes-a COMMIT_A && git worktree add --detach /tmp/sizes-b COMMIT_B
    for x in a b; do (cd /tmp/sizes-$x && GRAPHAR_CUDA_ARCHS=90a python -c "$BUILD"); done
    python tools/kernel_sizes.py /tmp/sizes-{a,b}/out/libgraphar_cuda.so
    git worktree remove --force /tmp/sizes-a && git worktree remove --force /tmp/sizes-b
cuobjdump comes with the CUDA toolkit; without it, Triton's wheel carries one (triton/backends/nvidia/bin),
found here too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

# "        /*0070*/                   LDG.E.128 R8, desc[UR4][R8.64] ;   /* 0x... */"
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_ARCH = re.compile(r"^\s*code for (sm_\w+)")  # in a fatbin's listing and a cubin's
# Opcode (without modifiers) -> the column it counts in, besides total; ATOM*, RED* and CCTL.IVALL apart.
_KINDS = {"LDG": "ld", "LD": "ld", "STG": "st", "ST": "st", "LDS": "lds", "STS": "sts", "LDL": "ldl", "STL": "stl"}
_KINDS |= {"MEMBAR": "fence", "FENCE": "fence", "BAR": "bar"}


@dataclass
class Counts:
    """One kernel's instructions: all of them, and those of each kind (the table's columns)."""

    total: int = 0
    ld: int = 0
    st: int = 0
    lds: int = 0
    sts: int = 0
    ldl: int = 0
    stl: int = 0
    atom: int = 0
    fence: int = 0
    inval: int = 0
    sys: int = 0
    gpu: int = 0
    bar: int = 0

    def add(self, opcode: str) -> None:
        """Counts one instruction by its opcode with modifiers (e.g. LDG.E.128.STRONG.SYS)."""
        base, *modifiers = opcode.split(".")
        if base == "NOP":  # alignment padding after the last branch
            return
        self.total += 1
        kinds = [_KINDS.get(base)]
        if base.startswith(("ATOM", "RED")):
            kinds.append("atom")
        if base == "CCTL" and "IVALL" in modifiers:
            kinds.append("inval")
        kinds += [scope.lower() for scope in ("SYS", "GPU") if f"STRONG.{scope}" in opcode]
        for kind in filter(None, kinds):
            setattr(self, kind, getattr(self, kind) + 1)


def parse_sass(text: str) -> dict[tuple[str, str], Counts]:
    """(arch, mangled kernel name) -> its counts, from `cuobjdump -sass` output."""
    kernels: dict[tuple[str, str], Counts] = {}
    arch, current = "?", None
    for line in text.splitlines():
        if m := _ARCH.match(line):
            arch = m.group(1)
        elif m := _FUNCTION.match(line):
            current = kernels.setdefault((arch, m.group(1)), Counts())
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.add(m.group(1))
    return kernels


def find_cuobjdump() -> str | None:
    """The PATH's, CUDA_HOME's, or the one in Triton's wheel."""
    found = shutil.which("cuobjdump")
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(cuda_home) / "bin" / "cuobjdump"] if cuda_home else []
    triton = importlib.util.find_spec("triton")  # located, not imported
    if triton is not None and triton.origin is not None:
        candidates.append(Path(triton.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    return found or next((str(c) for c in candidates if os.access(c, os.X_OK)), None)


def kernel_counts(binary: Path, cuobjdump: str) -> dict[tuple[str, str], Counts]:
    """Counts of every kernel in a library, object or cubin."""
    result = subprocess.run([cuobjdump, "-sass", str(binary)], capture_output=True, text=True, check=True)
    return parse_sass(result.stdout)


def demangle(names: Iterable[str]) -> dict[str, str]:
    """Mangled -> readable (c++filt when there, else as they are)."""
    names = list(names)
    if shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def short_name(readable: str) -> str:
    """'void graphar::one_stage<__nv_bfloat16, 2>(graphar::Params)' -> 'one_stage<__nv_bfloat16, 2>'."""
    name = re.sub(r"^void ", "", readable)
    name = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", name)  # the parameter list
    return re.sub(r"^(graphar::|\(anonymous namespace\)::)", "", name)


def readable(kernels: dict[tuple[str, str], Counts]) -> dict[tuple[str, str], Counts]:
    """The same counts keyed by (arch, short readable name): mangled names of one kernel may differ
    between builds (an anonymous namespace's does)."""
    names = demangle(name for _, name in kernels)
    return {(arch, short_name(names[name])): counts for (arch, name), counts in kernels.items()}


def table(libraries: list[dict[tuple[str, str], Counts]], pattern: str | None) -> str:
    """One row per kernel found in any library; a cell reads 'a->b->...' where the libraries differ
    (n/a: not in that library)."""
    libraries = [readable(kernels) for kernels in libraries]
    keys = sorted({key for kernels in libraries for key in kernels if pattern is None or re.search(pattern, key[1])})
    columns = [f.name for f in fields(Counts)]
    rows = []
    for key in keys:
        cells = []
        for column in columns:
            values = [str(getattr(kernels[key], column)) if key in kernels else "n/a" for kernels in libraries]
            cells.append(values[0] if len(set(values)) == 1 else "->".join(values))
        rows.append([*key, *cells])
    header = ["arch", "kernel", *columns]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("libraries", nargs="+", type=Path, help="built libraries (.so), objects or cubins")
    parser.add_argument("--kernel", help="regular expression on the readable kernel name")
    parser.add_argument("--cuobjdump", default=find_cuobjdump(), help="default: PATH, CUDA_HOME, Triton's")
    args = parser.parse_args(argv)
    if args.cuobjdump is None:
        print("cuobjdump not found: put the CUDA toolkit's bin on the PATH or pass --cuobjdump", file=sys.stderr)
        return 2
    print(table([kernel_counts(lib, args.cuobjdump) for lib in args.libraries], args.kernel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
