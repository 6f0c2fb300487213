"""Build graphar; the CUDA library is built with nvcc when there is one (PATH, CUDA_HOME).

The library has a plain C ABI and no torch headers, so one build serves every
torch version. Without nvcc the package installs without it and `graphar._cuda` builds it on first
use where nvcc exists; set GRAPHAR_SKIP_CUDA_BUILD=1 to skip the build on purpose.

pip shows what this build says only with `pip install -v` (or when it fails); after any install,
`python -m graphar demo` says whether the library is built and loads.
"""

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

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
        cuda = _load_cuda_module()
        if cuda.settings.SKIP_CUDA_BUILD.get():
            print("graphar: GRAPHAR_SKIP_CUDA_BUILD is set; the CUDA library is not built")
        elif cuda.find_nvcc() is None:
            print(
                "graphar: nvcc not found (PATH, CUDA_HOME); the CUDA library is not built "
                "(built on first use where nvcc exists)"
            )
        else:
            print(f"graphar: built {_build(cuda, package_dir)}")


class PlatformWheel(bdist_wheel):
    """A wheel for this platform, not a pure one: it carries the CUDA library (machine code for Linux
    x86-64 or aarch64), which graphar loads with ctypes, so any Python 3 takes the one wheel."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


def _build(cuda: ModuleType, package_dir: Path) -> Path:
    try:
        return cuda.build_library(package_dir)
    except cuda.GrapharUnavailable as e:
        # SystemExit, not an exception: an editable install ignores exceptions from build_py. pip
        # shows the message, as the output of a failed build.
        raise SystemExit(
            f"graphar: {e}\nSet GRAPHAR_CUDA_ARCHS to targets this nvcc supports, or "
            "GRAPHAR_SKIP_CUDA_BUILD=1 to install without the CUDA library."
        ) from e


setup(
    packages=["graphar", "graphar.benchmarks", "graphar.comm", "graphar.kernels", "graphar.passes"],
    package_dir={"graphar.passes": "passes"},
    cmdclass={"build_py": BuildPyWithCuda, "bdist_wheel": PlatformWheel},
)
