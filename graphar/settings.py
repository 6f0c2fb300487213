"""Every `GRAPHAR_*` environment variable: read, validated and documented here, nowhere else.

A variable is checked where it enters: `import graphar` validates every one that is set, so a bad
value fails at once with an error naming the variable, the value and what is allowed, not deep in
a kernel launch or in Inductor. `describe()` renders the table the README carries.

This module imports nothing from graphar but `graphar.errors` (nor torch): setup.py and
`graphar._cuda` load it by path while the package itself cannot be imported yet, and it loads the
errors by path then.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

T = TypeVar("T")
MB = 1 << 20
MAX_BLOCKS = 64  # kMaxBlocks of csrc/signal.cuh: one barrier slot per block


def _errors_module() -> ModuleType:
    """graphar.errors: imported, or loaded by path where this module was (setup.py, through graphar._cuda)."""
    if __package__ == "graphar":
        from graphar import errors

        return errors
    spec = importlib.util.spec_from_file_location("_graphar_errors", Path(__file__).with_name("errors.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


errors = _errors_module()


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: its parser (raises ValueError), what it allows, what it means."""

    name: str
    default: T
    parse: Callable[[str], T]
    allowed: str
    meaning: str

    def get(self) -> T:
        """The variable's value; the default when it is unset or empty."""
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise errors.SettingError(f"{self.name}={raw!r} is not valid: expected {self.allowed}") from None


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if not low <= value <= high:
            raise ValueError(raw)
        return value

    return parse


# The two settings a caller can also give in code (an option, an argument of graphar.init): each has
# one rule, which the variable's parser applies to its text and the code to what it is given.


def byte_limit(value: Any, what: str) -> int:
    """The all-reduce's largest message in bytes as `what` gives it (GRAPHAR_MAX_ALLREDUCE_BYTES, the
    option max_all_reduce_bytes, graphar.init(max_bytes=)): an integer, a positive multiple of 16 (the
    kernels move 16-byte packs); SettingError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0 or value % 16:
        raise errors.SettingError(f"{what}={value!r}: expected a positive multiple of 16 (bytes, an int)")
    return int(value)


def seconds(value: Any, what: str, zero_unbounded: bool = True) -> float:
    """A bound on a wait in seconds as `what` gives it (GRAPHAR_TIMEOUT_S, graphar.init(timeout_s=),
    GRAPHAR_EXCHANGE_TIMEOUT_S): a finite number >= 0, 0 meaning unbounded, or > 0 where zero is not
    allowed (`zero_unbounded` False); SettingError naming `what` otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero_unbounded)
    ):
        least = ">= 0" if zero_unbounded else "> 0"
        raise errors.SettingError(f"{what}={value!r}: expected a number of seconds {least}")
    return float(value)


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(raw)
        return raw

    return parse


def _archs(raw: str) -> tuple[str, ...]:
    archs = tuple(a for a in re.split(r"[;,\s]+", raw) if a)
    if not archs or not all(re.fullmatch(r"\d{2,3}a?", a) for a in archs):
        raise ValueError(raw)
    return archs


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


MAX_ALLREDUCE_BYTES = Setting(
    "GRAPHAR_MAX_ALLREDUCE_BYTES",
    8 * MB,
    lambda raw: byte_limit(int(raw), "GRAPHAR_MAX_ALLREDUCE_BYTES"),
    "a positive multiple of 16 (bytes)",
    "default of the `max_all_reduce_bytes` option and of `graphar.init(max_bytes=)`: the largest "
    "all-reduce the custom kernels serve, and the size of their IPC buffers",
)
ALGOS = ("1stage", "2stage", "push-oneshot", "push-twoshot")  # the all-reduce kernels (graphar.abi)
ALLREDUCE_ALGO = Setting(
    "GRAPHAR_ALLREDUCE_ALGO",
    None,
    _choice(*ALGOS),
    ", ".join(f"'{a}'" for a in ALGOS),
    "force one all-reduce kernel (a call it cannot take runs on NCCL); unset, graphar picks from its measured "
    "table by GPU, world size, size and capture mode",
)


def _switch(name: str, default: bool, meaning: str) -> Setting[bool]:
    return Setting(name, default, _flag, "1/0, true/false, yes/no or on/off", meaning)


AUTO_INIT = _switch(
    "GRAPHAR_AUTO_INIT",
    True,
    "set up a group's IPC communicator at its first eager collective on CUDA tensors when `graphar.init` was not "
    'called for it, so `backend="graphar"` alone turns the custom paths on; off, groups without `graphar.init` '
    "keep NCCL",
)
PDL = _switch(
    "GRAPHAR_PDL",
    True,
    "launch the all-reduce kernels with programmatic dependent launch (Hopper and later, where the CUDA "
    "library holds code for the GPU's architecture: `GRAPHAR_CUDA_ARCHS`), so that a kernel's start overlaps the "
    "end of the kernel before it",
)


def _seconds(name: str, default: float, meaning: str, zero_unbounded: bool) -> Setting[float]:
    """A bound in seconds (`seconds`): >= 0 with 0 unbounded, or > 0 where zero is not allowed."""
    allowed = f"a number of seconds {'>= 0' if zero_unbounded else '> 0'}"
    return Setting(name, default, lambda raw: seconds(float(raw), name, zero_unbounded), allowed, meaning)


def _blocks(name: str, default: int | None, meaning: str) -> Setting[int | None]:
    """A count of blocks per launch: one barrier slot each, so at most MAX_BLOCKS."""
    return Setting(name, default, _int_in(1, MAX_BLOCKS), f"an integer in [1, {MAX_BLOCKS}]", meaning)


SHARE_GPU = _switch(
    "GRAPHAR_SHARE_GPU",
    False,
    "testing only: let a group whose ranks share one GPU, over gloo, set up (graphar's one-GPU tests and tools; "
    "run them under CUDA's Multi-Process Service, else the GPU time-slices the ranks and every call waits for a "
    "context switch); never for a real job",
)
NATIVE_OP = _switch(
    "GRAPHAR_NATIVE_OP",
    True,
    "serve eager calls of graphar::all_reduce and graphar::all_reduce_add_rms_norm from their C++ kernels "
    "(libgraphar_torch.so, built with the CUDA library); off, or where they cannot be had, their Python kernels "
    "serve every call (more host time per call)",
)
BLOCK_LIMIT = _blocks(
    "GRAPHAR_BLOCK_LIMIT",
    None,
    "blocks per all-reduce launch; unset, a table by GPU architecture (64 on Hopper, 36 before)",
)
ALLTOALL_ALGOS = ("pull", "push")  # how the IPC all-to-all crosses the link (graphar.ulysses.transport)
ALLTOALL_ALGO = Setting(
    "GRAPHAR_ALLTOALL_ALGO",
    "pull",
    _choice(*ALLTOALL_ALGOS),
    ", ".join(f"'{a}'" for a in ALLTOALL_ALGOS),
    "how the Ulysses exchanges over CUDA IPC cross the link: each rank reads its chunks from its peers' "
    "buffers (pull), or the pack stores each chunk straight into its rank's buffer (push); every rank "
    "must set the same",
)
PULL_BLOCKS = _blocks(
    "GRAPHAR_PULL_BLOCKS", MAX_BLOCKS, "blocks of the IPC all-to-all's copy into its output (Ulysses exchanges)"
)
TUNE = _switch(
    "GRAPHAR_TUNE",
    False,
    "measure the all-reduce kernel for each size and capture mode on the group at its set-up (cached on disk "
    "per GPU, driver, world size, GPUs and build: a job pays once); off, the shipped table serves (the default "
    "until the tuner has run on GPUs); every rank must set the same",
)
TUNE_BUDGET_S = _seconds(
    "GRAPHAR_TUNE_BUDGET_S",
    2.0,
    "bound on the tuner's time at a set-up: sizes it did not reach keep the shipped table's kernels; every rank "
    "must set the same",
    zero_unbounded=False,
)
DETERMINISTIC = _switch(
    "GRAPHAR_DETERMINISTIC",
    True,
    "every all-reduce sums in rank order in fp32, so a result's bits do not depend on the kernel, size or "
    "batch; off, the tuner may also pick NCCL where it measured faster (its ring order varies); every rank "
    "must set the same",
)
# 60 s: long enough for the ranks' skew at a compiled graph's first call (each rank runs it right
# after its own compile, which can finish tens of seconds apart), short enough to end a hang.
TIMEOUT_S = _seconds(
    "GRAPHAR_TIMEOUT_S",
    60.0,
    "bound on every spin-wait for a peer in graphar's kernels; 0 = unbounded. A peer that never "
    "arrives raises GrapharTimeoutError naming the group, the barrier and the peer",
    zero_unbounded=True,
)
EXCHANGE_TIMEOUT_S = _seconds(
    "GRAPHAR_EXCHANGE_TIMEOUT_S",
    300.0,
    "bound on each set-up exchange over the group's store (`graphar.init`, graph registration, exchange-buffer growth)",
    zero_unbounded=False,
)
CACHE_DIR = Setting(
    "GRAPHAR_CACHE_DIR",
    None,
    str,
    "a folder path",
    "where graphar builds its CUDA library and its op library on first use; unset, $XDG_CACHE_HOME/graphar or "
    "~/.cache/graphar",
)
CUDA_ARCHS = Setting(
    "GRAPHAR_CUDA_ARCHS",
    ("80", "90a", "100a"),
    _archs,
    "compute capabilities like '80;90a;100a'",
    "targets of the CUDA library's build (setup.py and the build on first use)",
)
SKIP_CUDA_BUILD = _switch(
    "GRAPHAR_SKIP_CUDA_BUILD",
    False,
    "install without building the CUDA library (it is then built on first use where nvcc exists)",
)

ALL: tuple[Setting[Any], ...] = (
    MAX_ALLREDUCE_BYTES,
    ALLREDUCE_ALGO,
    AUTO_INIT,
    PDL,
    NATIVE_OP,
    BLOCK_LIMIT,
    ALLTOALL_ALGO,
    PULL_BLOCKS,
    TUNE,
    TUNE_BUDGET_S,
    DETERMINISTIC,
    TIMEOUT_S,
    EXCHANGE_TIMEOUT_S,
    CACHE_DIR,
    CUDA_ARCHS,
    SKIP_CUDA_BUILD,
    SHARE_GPU,
)


def check_all() -> None:
    """Validate every variable that is set; raise graphar.errors.SettingError for the first bad one."""
    for setting in ALL:
        setting.get()


def describe() -> str:
    """The README's table of variables."""
    rows = ["| variable | allowed | default | meaning |", "|---|---|---|---|"]
    for s in ALL:
        default = ";".join(s.default) if isinstance(s.default, tuple) else s.default
        shown = "unset" if default is None else f"`{default}`"
        rows.append(f"| `{s.name}` | {s.allowed} | {shown} | {s.meaning} |")
    return "\n".join(rows)
