"""tools/kernel_sizes.py: its counts of a fixed SASS excerpt (everywhere), and of a tiny kernel nvcc
compiles here, read back with cuobjdump (skipped without them: CI has no CUDA toolkit)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from graphar import _cuda

TOOLS = Path(__file__).resolve().parent.parent / "tools"

# cuobjdump -sass of a kernel, cut down: a predicated acquire-style atomic, its L1 invalidation, a
# system-scope flag store, a fence, a block barrier and the NOP padding that is not counted.
SASS = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

	code for sm_90a

        Function : _ZN7graphar4tinyEPy
        /*0000*/                   LDC R1, c[0x0][0x28] ;                    /* 0x00000a00ff017b82 */
        /*0010*/               @P0 ATOMG.E.ADD.64.STRONG.GPU PT, R2, desc[UR4][R4.64], R2 ;  /* 0x... */
        /*0020*/               @P0 CCTL.IVALL ;                              /* 0x... */
        /*0030*/                   MEMBAR.ALL.SYS ;                          /* 0x... */
        /*0040*/                   ERRBAR;                                   /* 0x... */
        /*0050*/                   STG.E.STRONG.SYS desc[UR4][R2.64], R5 ;   /* 0x... */
        /*0060*/                   LDG.E.128 R8, desc[UR4][R6.64] ;          /* 0x... */
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;             /* 0x... */
        /*0080*/                   EXIT ;                                    /* 0x... */
        /*0090*/                   BRA 0x90;                                 /* 0x... */
        /*00a0*/                   NOP;                                      /* 0x... */
"""


@pytest.fixture(scope="module")
def kernel_sizes() -> Iterator[ModuleType]:
    sys.path.insert(0, str(TOOLS))
    try:
        import kernel_sizes

        yield kernel_sizes
    finally:
        sys.path.remove(str(TOOLS))


def test_counts_a_sass_listing(kernel_sizes: ModuleType) -> None:
    counts = kernel_sizes.parse_sass(SASS)
    assert list(counts) == [("sm_90a", "_ZN7graphar4tinyEPy")]
    c = counts[("sm_90a", "_ZN7graphar4tinyEPy")]
    assert (c.total, c.ld, c.st, c.atom, c.fence, c.inval, c.sys, c.gpu, c.bar) == (10, 1, 1, 1, 1, 1, 1, 1, 1)


def test_names_kernels_without_parameters_or_namespace(kernel_sizes: ModuleType) -> None:
    name = "void graphar::one_stage<__nv_bfloat16, 2>(graphar::Params)"
    assert kernel_sizes.short_name(name) == "one_stage<__nv_bfloat16, 2>"


def test_compares_two_libraries_cell_by_cell(kernel_sizes: ModuleType) -> None:
    key = ("sm_90a", "_ZN7graphar4tinyEPy")
    before = {key: kernel_sizes.Counts(total=10, ld=1, st=1)}
    after = {key: kernel_sizes.Counts(total=11, ld=2, st=1)}
    header, row = (line.split()[2:5] for line in kernel_sizes.table([before, after], None).splitlines())
    assert (header, row) == (["total", "ld", "st"], ["10->11", "1->2", "1"])


@pytest.mark.skipif(_cuda.find_nvcc() is None, reason="nvcc not found")
def test_reads_a_compiled_kernel(kernel_sizes: ModuleType, tmp_path: Path) -> None:
    cuobjdump = kernel_sizes.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not found")
    source = tmp_path / "tiny.cu"
    source.write_text("""
extern "C" __global__ void tiny(unsigned long long* counter, unsigned* flag) {
  atomicAdd(counter, 1ull);
  __threadfence_system();
  *reinterpret_cast<volatile unsigned*>(flag) = 1;
}
""")
    cubin = tmp_path / "tiny.cubin"
    subprocess.run([_cuda.find_nvcc(), "-cubin", "-arch=sm_90a", str(source), "-o", str(cubin)], check=True)
    c = kernel_sizes.kernel_counts(cubin, cuobjdump)[("sm_90a", "tiny")]
    assert (c.atom, c.st, c.sys) == (1, 1, 1)
    assert c.fence >= 1 and c.total > c.atom + c.fence + c.st
    assert (
        "tiny"
        in subprocess.run(
            [sys.executable, str(TOOLS / "kernel_sizes.py"), str(cubin), "--cuobjdump", cuobjdump],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
