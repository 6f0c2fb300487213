"""`python -m graphar demo` on 2 gloo processes, run once for this module: both halves of graphar
rewritten, each rewrite reported with its transport, compiled outputs equal to eager."""

import os
import subprocess
import sys

import pytest

FALLBACK = "gloo fallback (no graphar communicator on this group)"


@pytest.fixture(scope="module")
def demo() -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the gloo path, also on a machine with GPUs
    out = subprocess.run(
        [sys.executable, "-m", "graphar", "demo"], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_says_what_runs_and_ends_ok(demo: str) -> None:
    assert "graphar demo: 2 processes, gloo on the CPU" in demo
    assert "graphar CUDA library: " in demo and "not usable here: no CUDA device is visible." in demo
    assert "graphar demo: OK" in demo
    assert "Failed to initialize NumPy" not in demo


def test_progress_before_each_compile(demo: str) -> None:
    for what in ("tensor-parallel MLP (fp32)", "tensor-parallel MLP (bf16)", "Ulysses attention block (fp32)"):
        assert f" s] compiling the {what}..." in demo


def test_tp_mlp_all_reduces_rewritten(demo: str) -> None:
    before, after = demo.split("graph after graphar:")
    before = before.split("graph before graphar:")[1]
    after = after.split("  all_reduce (")[0]  # the graph ends where the rewrite lines start
    assert before.count("_c10d_functional.all_reduce.default") == 2
    assert after.count("graphar.all_reduce.default") == 2
    assert "_c10d_functional" not in after
    for dtype in ("fp32", "bf16"):
        assert demo.count(f"  all_reduce (group '0', 8x64 {dtype}) -> graphar::all_reduce: {FALLBACK}\n") == 2


def test_ulysses_qkv_packed_into_one_exchange(demo: str) -> None:
    qkv = "3 x all_to_all_single (group '0', 1x16x8x8 fp32) -> graphar::qkv_all_to_all: one packed exchange over gloo"
    out = "all_to_all_single (group '0', 1x32x4x8 fp32) -> graphar::heads_to_seq_all_to_all: one exchange over gloo"
    assert demo.count(f"  {qkv}\n") == 1
    assert demo.count(f"  {out}\n") == 1


def test_every_compile_matches_eager(demo: str) -> None:
    assert demo.count("  compiled vs uncompiled: max |diff| = ") == 3
