"""Tests that need graphar's Triton kernels on host memory run them interpreted, in a subprocess: Triton
reads TRITON_INTERPRET when a kernel is defined, at import, so it must be set from the process's start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(path: str, selection: str) -> None:
    """Run the tests of `path` that `selection` picks (pytest's -k) where Triton interprets: each must
    pass, none may skip. In that subprocess the caller skips itself."""
    if INTERPRETED:
        pytest.skip("this is the interpreter subprocess")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection, path]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
