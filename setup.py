"""Build graphar; the CUDA library is built with nvcc when there is one (PATH, CUDA_HOME).

The library has a plain C ABI and no torch headers, so one build serves every
torch version. Beside it the same build makes the op library (graphar.allreduce.native_op) against torch's
stable ABI as of 2.11, which serves every torch from 2.11 on, where torch is importable here
(`pip install --no-build-isolation`). Without nvcc the package installs without them and graphar
builds them on first use where nvcc exists; set GRAPHAR_SKIP_CUDA_BUILD=1 to skip the build on purpose.

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
            # Anew: a file left in build/ by an earlier build would change the sources' hash, which the
            # libraries' build id is checked against.
            shutil.rmtree(package_dir / "csrc", ignore_errors=True)
            shutil.copytree(ROOT / "csrc", package_dir / "csrc")
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
            if cuda.torch_root() is None:
                print(
                    f"graphar: torch is not importable here (pip's build isolation: pass --no-build-isolation); "
                    f"{cuda.TORCH_LIB_NAME}, the ops' C++ kernels, is not built (built on first use where nvcc exists)"
                )
            else:
                print(f"graphar: built {package_dir / cuda.TORCH_LIB_NAME}")


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
    packages=["graphar", "graphar.allreduce", "graphar.ulysses", "graphar.passes"],
    package_dir={"graphar.passes": "passes"},
    cmdclass={"build_py": BuildPyWithCuda, "bdist_wheel": PlatformWheel},
)
