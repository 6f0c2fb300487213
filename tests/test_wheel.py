"""The wheel: built where nvcc and torch are, it carries the CUDA library and the op library, and a
machine without nvcc or a host compiler loads them instead of building them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from graphar import _cuda

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(_cuda.find_nvcc() is None, reason="nvcc not found: the wheel would hold no library")


def test_a_wheel_holds_the_library_and_a_machine_without_compilers_loads_it(tmp_path: Path) -> None:
    env = {**os.environ, "GRAPHAR_CUDA_ARCHS": "90a"}  # one target: the test's build stays short
    env.pop("GRAPHAR_SKIP_CUDA_BUILD", None)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        env=env,
        timeout=900,
    )
    (wheel,) = tmp_path.glob("graphar-*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name  # machine code: not a pure wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith("graphar/libgraphar_cuda.so") for n in names), names
    assert any(n.endswith("graphar/libgraphar_torch.so") for n in names), names
    for source in ("graphar_cuda.cu", "torch_ops/ops.cpp"):  # what the build id is checked against
        assert any(n.endswith(f"graphar/csrc/{source}") for n in names), source

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300)
    # No nvcc, c++ or gcc on PATH and no CUDA_HOME: only the venv's own commands.
    bare = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "PYTHONPATH")}
    bare["PATH"] = str(venv / "bin")
    # The op library loads into this CPU build of torch and installs its kernels (for CUDA tensors,
    # which it never sees here).
    probe = (
        "import ctypes, shutil, graphar, graphar._cuda as c, graphar.allreduce.native_op as n\n"
        "assert shutil.which('nvcc') is None and shutil.which('c++') is None and shutil.which('gcc') is None\n"
        "lib = c.locate(); assert lib.parent == c.PACKAGE_DIR and 'site-packages' in str(lib), lib\n"
        "ops = n.locate(); assert ops.parent == c.PACKAGE_DIR, ops\n"
        "assert ctypes.CDLL(str(ops)).graphar_op_install() == 0\n"
        "t = ctypes.CDLL(str(lib)).graphar_targets; t.restype = ctypes.c_char_p; print(t().decode())\n"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=bare, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sm_90a"
