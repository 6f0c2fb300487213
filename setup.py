"""Build graphar; the CUDA library is built with nvcc when nvcc is on the PATH.

The library has a plain C ABI and no torch headers (DESIGN.md decision 1), so one build serves every
torch version. Without nvcc the package installs without it and `graphar._cuda` builds it on first
use where nvcc exists; set GRAPHAR_SKIP_CUDA_BUILD=1 to skip the build on purpose.
"""

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_cuda_module():
    """graphar/_cuda.py by path: the package itself is not importable during its own build."""
    spec = importlib.util.spec_from_file_location("_graphar_cuda_build", ROOT / "graphar" / "_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        package_dir = ROOT / "graphar" if self.editable_mode else Path(self.build_lib) / "graphar"
        if not self.editable_mode:
            shutil.copytree(ROOT / "csrc", package_dir / "csrc", dirs_exist_ok=True)
        if os.environ.get("GRAPHAR_SKIP_CUDA_BUILD"):
            print("graphar: GRAPHAR_SKIP_CUDA_BUILD is set; the CUDA library is not built")
        elif shutil.which("nvcc") is None:
            print("graphar: nvcc not found; the CUDA library is not built (built on first use where nvcc exists)")
        else:
            _load_cuda_module().build_library(package_dir)


setup(
    packages=["graphar", "graphar.comm", "graphar.kernels", "graphar.passes"],
    package_dir={"graphar.passes": "passes"},
    cmdclass={"build_py": BuildPyWithCuda},
)
