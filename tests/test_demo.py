"""`python -m graphar demo` with 2 gloo processes: the compiled TP model equals eager for fp32 and bf16."""

import subprocess
import sys


def test_demo_rewrites_and_matches_eager() -> None:
    out = subprocess.run([sys.executable, "-m", "graphar", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    before, after = out.stdout.split("graph after graphar:")[:2]
    assert before.count("_c10d_functional.all_reduce.default") == 2
    assert after.count("graphar.all_reduce.default") == 2
    assert "_c10d_functional" not in after
    assert "torch.float32: compiled vs uncompiled" in out.stdout
    assert "torch.bfloat16: compiled vs uncompiled" in out.stdout
    assert "graphar demo: OK" in out.stdout
