"""The GPU tools (tools/one_gpu_check.py, tools/one_gpu_bench.py, tools/one_gpu_clients.py, tools/soak.py) run only
on GPU machines; here, on the CPU, they are kept from rotting: they import, their CLIs answer, they share one GPU
through graphar's documented switch (GRAPHAR_SHARE_GPU) and patch nothing of graphar's, the smoke run reads a report's graphar cells right, and the soak's plan, counts,
verdicts, report and launcher (with stand-in ranks) hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from graphar import _cuda, processes
from graphar.allreduce import set_up

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(autouse=True)
def _no_shared_gpu_after() -> None:
    """The tools turn GRAPHAR_SHARE_GPU on in their own process; run here, it ends with the test."""
    before = os.environ.pop("GRAPHAR_SHARE_GPU", None)
    yield
    os.environ.pop("GRAPHAR_SHARE_GPU", None)
    if before is not None:
        os.environ["GRAPHAR_SHARE_GPU"] = before


def test_the_harness_shares_a_gpu_through_the_documented_switch(monkeypatch) -> None:
    """The one-GPU tools overwrite nothing of graphar's: they turn on GRAPHAR_SHARE_GPU, under which the
    set-up takes a gloo group whose ranks share one GPU (and without which it refuses both)."""
    sources = [path.read_text() for path in TOOLS.glob("*.py")]
    assert not [m for text in sources for m in re.findall(r"^\s*set_up\._?\w+ = ", text, re.M)]
    gloo = types.SimpleNamespace()
    monkeypatch.setattr(set_up.dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(set_up.dist, "get_world_size", lambda group: 2)
    facts = [{"host": "h", "bus": "0000:01:00.0", "launch": {}, "error": None}] * 2
    monkeypatch.delenv("GRAPHAR_SHARE_GPU", raising=False)
    assert "not NCCL" in set_up._uniform_reason(gloo) and "share a GPU" in set_up._shared_reason(facts)
    sys.path.insert(0, str(TOOLS))
    try:
        import one_gpu_common

        one_gpu_common.relax_set_up()
    finally:
        sys.path.remove(str(TOOLS))
    assert set_up._uniform_reason(gloo) is None and set_up._shared_reason(facts) is None


def test_the_harness_imports_and_lists_its_world_sizes() -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "one_gpu_check.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--world {2,4,6,8}" in out.stdout


def test_the_smoke_run_imports_and_names_the_benchmarks() -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "one_gpu_bench.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "{allreduce,decode,norm,ulysses,attention,capture}" in out.stdout


def test_the_clients_run_imports_and_needs_a_gpu() -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "one_gpu_clients.py")], capture_output=True, text=True, timeout=120
    )
    assert (out.returncode, out.stdout.strip()) == (2, "no GPU"), out.stderr


def test_the_smoke_run_flags_graphar_cells_only() -> None:
    sys.path.insert(0, str(TOOLS))
    try:
        from one_gpu_bench import graphar_failures
    finally:
        sys.path.remove(str(TOOLS))
    report = """# t

## per op

| size | NCCL | graphar 1stage | graphar packed, NCCL | ranks equal |
|---|---|---|---|---|
| 16 KB | err | 5.0 | err | yes |
| 32 KB | err | fallback | 5.0 | yes |
| 64 KB | 5.0 | 5.0 | 5.0 | NO |
"""
    assert graphar_failures(report) == ["| 32 KB | err | fallback | 5.0 | yes |", "| 64 KB | 5.0 | 5.0 | 5.0 | NO |"]


# ---- tools/soak.py (issue 33): its plan, counts, verdicts, report and launcher; the GPU cases need two GPUs


def _soak():  # the tool's module
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))  # soak imports one_gpu_common, as when run from tools/
    import soak

    return soak


def test_the_soak_plans_the_issues_cases_and_counts() -> None:
    soak = _soak()
    full, quick = soak.plan(quick=False), soak.plan(quick=True)
    names = [
        "replay-push-oneshot",
        "replay-push-twoshot",
        "replay-1stage",
        "replay-2stage",
        "exchange-pull",
        "exchange-push",
        "two-streams-1stage",
        "two-streams-2stage",
        "two-streams-push-oneshot",
        "two-streams-push-twoshot",
        "two-streams-norm",
        "two-streams-exchange-pull",
        "two-streams-exchange-push",
    ]
    assert [c.name for c in full] == [c.name for c in quick] == names
    calls = {c.name: c.calls for c in full}
    assert all(calls[f"replay-{k}"] >= 10**6 for k in ("push-oneshot", "push-twoshot", "1stage", "2stage"))
    assert all(c.calls >= 10**5 for c in full if c.kind == soak.TWO_STREAMS)
    assert all(q.calls <= 10**3 for q in quick)
    # The smoke run on one shared GPU ends well under 3 minutes even where every case runs to its limit.
    assert sum(c.limit_s for c in quick) <= 150


def test_the_soak_selects_cases_by_the_start_of_their_names() -> None:
    soak = _soak()
    cases = soak.plan(quick=True)
    assert [c.name for c in soak.select(cases, "replay-push")] == ["replay-push-oneshot", "replay-push-twoshot"]
    assert len(soak.select(cases, "replay, exchange-push")) == 5
    assert soak.select(cases, None) == soak.select(cases, "") == cases
    with pytest.raises(ValueError, match="nothing"):
        soak.select(cases, "replay,nothing")


def test_the_soak_exchanges_run_in_eight_stages_of_a_megabyte_or_more_per_rank() -> None:
    from unittest import mock

    from graphar.ulysses import stages

    soak = _soak()
    nbytes = soak.exchange_bytes(soak.WORLD)
    assert nbytes >= 1 << 20 and all(h % soak.WORLD == 0 for h in soak.exchange_heads(soak.WORLD))
    with mock.patch.object(stages, "_STAGE_BYTES", soak.stage_bytes(soak.WORLD)):  # as the exchange case runs
        assert len(stages._slices(soak.EXCHANGE_S, nbytes)) == soak.STAGES == 8


def test_the_soak_patterns_stay_normal_numbers_and_differ_call_to_call() -> None:
    soak = _soak()
    masks = [soak.pattern(c) for c in range(256)]
    assert len(set(masks)) == 256 and soak.pattern(256) == masks[0]
    base = torch.arange(*soak.NORMAL_BITS, dtype=torch.int32).to(torch.int16)
    for mask in masks:
        x = (base ^ mask).view(torch.bfloat16).float()
        assert torch.isfinite(x).all() and (x.abs() >= torch.finfo(torch.bfloat16).tiny).all(), hex(mask)


def test_the_soak_spin_compiles_to_a_loop_on_the_global_timer() -> None:
    """The replays' spin kernel, compiled for an H100/H200 without one (Triton's own ptxas)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=_soak()._spin, signature={"ns_ptr": "*i64"}, constexprs={})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ptx.count("%globaltimer") == 2  # the start, and again in the loop


def test_the_soak_counts_wrong_rows_and_nan_rows_bitwise() -> None:
    soak = _soak()
    expected = torch.tensor([[1.0, 2.0]] * 5, dtype=torch.bfloat16)
    got = torch.tensor(
        [[1.0, 2.0], [1.0, 3.0], [float("nan"), 2.0], [float("nan"), 3.0], [1.0, 2.0]], dtype=torch.bfloat16
    )
    expected[4, 0], got[4, 0] = 0.0, -0.0  # equal as numbers, not as bits
    counts = torch.zeros(2, dtype=torch.int64)
    soak._count_bad(got, expected, counts)
    assert counts.tolist() == [3, 2]  # wrong: rows 1, 3 and 4; NaN: rows 2 and 3


def test_the_soak_classifies_each_two_streams_iteration() -> None:
    soak = _soak()
    assert soak.classify(wrong=False, nan=False, error=False) == soak.EXACT
    assert soak.classify(wrong=False, nan=True, error=True) == soak.DETECTED
    assert soak.classify(wrong=False, nan=False, error=True) == soak.DETECTED
    assert soak.classify(wrong=False, nan=True, error=False) == soak.UNDETECTED
    assert soak.classify(wrong=True, nan=True, error=True) == soak.WRONG


def test_the_soak_verdicts_by_mode() -> None:
    soak = _soak()
    first = {c.kind: c for c in reversed(soak.plan(quick=False))}
    replay, streams = first[soak.REPLAY], first[soak.TWO_STREAMS]
    Result = soak.Result
    clean, wrong = Result("x", calls=10), Result("x", calls=10, mismatches=1)
    nan, timed_out = Result("x", nans=3, timeouts=1), Result("x", timeouts=1, hung=True)
    detected, undetected = Result("x", nans=2, detected=2, timeouts=1), Result("x", nans=1, undetected=1)
    raised = Result("x", crashed=True, error="rank 1: RuntimeError: ...")
    assert soak.verdict(replay, clean, shared=False) == "ok"
    assert soak.verdict(replay, clean, shared=True) == "no verdict (shared GPU)"
    for case in (replay, streams):  # finite wrong values and errors fail in every mode
        for shared in (False, True):
            assert soak.verdict(case, wrong, shared).startswith("FAIL: 1 finite wrong")
            assert soak.failures(case, raised, shared) == ["an error"]
    assert soak.failures(replay, nan, shared=False) == ["3 NaN", "1 timed out"]
    assert soak.failures(replay, timed_out, shared=False) == ["hung"]
    assert soak.failures(replay, nan, shared=True) == soak.failures(replay, timed_out, shared=True) == []
    assert soak.failures(streams, detected, shared=False) == []  # NaN with an error: the contract's answer
    assert soak.failures(streams, undetected, shared=False) == ["1 NaN without an error"]
    assert soak.failures(streams, timed_out, shared=False) == ["hung"]


def test_the_soak_merges_the_ranks_results() -> None:
    soak = _soak()
    ranks = [
        soak.Result("c", calls=5, mismatches=1, nans=2, seconds=3.0, note="n"),
        soak.Result("c", calls=5, nans=1, detected=1, seconds=4.0, note="n", error="e"),
    ]
    assert soak.merged("c", ranks) == soak.Result(
        "c", calls=5, mismatches=1, nans=3, detected=1, seconds=4.0, note="n", error="e"
    )


def test_the_soak_report_has_a_row_per_case_and_a_verdict() -> None:
    soak = _soak()
    replay, streams = soak.plan(quick=True)[0], soak.plan(quick=True)[-1]
    rows = [
        (replay, soak.Result(replay.name, calls=1100, seconds=2.5)),
        (streams, soak.Result(streams.name, calls=7, mismatches=1, detected=2, note="a | b\nc")),
    ]
    text = soak.report(rows, shared=True, quick=True, gpu="NVIDIA H200", planned=13)
    table = [row for row in text.splitlines() if row.startswith("| ")]
    assert table[0] == "| " + " | ".join(soak.COLUMNS) + " |"
    assert table[1] == "| replay-push-oneshot | 1100 | 0 | 0 | 0 | - | - | 2.5 | no verdict (shared GPU) |  |"
    assert table[2] == ("| two-streams-exchange-push | 7 | 1 | 0 | 0 | 2 | 0 | 0.0 | FAIL: 1 finite wrong | a / b c |")
    assert "FAIL: two-streams-exchange-push (2 of 13 cases" in text and "2 ranks sharing one GPU" in text
    assert soak.line(streams, rows[1][1], shared=True) == (
        "two-streams-exchange-push: 7 iterations, 1 mismatches, 0 timeouts, 0 NaNs, 2 detected, 0 undetected, 0.0 s: "
        "FAIL: 1 finite wrong (a | b\nc)"
    )
    path = soak.report_path(None, gpu="NVIDIA H200", shared=True, quick=True, names="replay,exchange", dry_run=False)
    assert path.name == "soak-h200-ws2-shared-quick-replay-exchange.md" and path.parent.name == "results"


def test_the_soak_dry_run_writes_its_report(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "soak.py"), "--dry-run", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = re.findall(r"^[\w-]+: \d+ (?:calls|iterations), 0 mismatches, 0 timeouts, \d NaNs.*: ok$", out.stdout, re.M)
    assert len(lines) == 13, out.stdout
    report = tmp_path / "soak-cpu-ws2-quick.md"
    assert report.read_text().startswith("# graphar soak (issue 33)") and "every case passed" in report.read_text()


def test_the_soak_needs_a_gpu_or_two() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = subprocess.run(
        [sys.executable, str(TOOLS / "soak.py"), "--quick"], capture_output=True, text=True, timeout=120
    )
    assert (out.returncode, out.stdout.strip()) == (2, "no GPU"), out.stderr


def _stand_in_rank(rank: int, world_size: int, shared: bool, quick: bool, cases: list, folder: str) -> None:
    """A rank for the soak's launcher: a case named ...-crash kills rank 1, one named ...-hang hangs."""
    soak = _soak()
    for case in cases:
        if case.name.endswith("crash") and rank == 1:
            os._exit(3)
        if case.name.endswith("hang"):
            time.sleep(600)
        soak._put(folder, rank, soak.Result(case.name, calls=10 + rank, seconds=0.1))
    os._exit(0)


def test_the_soak_launcher_ends_a_hang_and_a_crash_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two launches (each costs the ranks' imports, seconds): the second starts after the hang."""
    soak = _soak()
    monkeypatch.setattr(soak, "GRACE_S", 1.0)
    cases = [soak.Case(name, soak.REPLAY, "1stage", 10, 1.0) for name in ("a-ok", "b-hang", "c-crash")]
    got: dict[str, soak.Result] = {}
    start = time.monotonic()
    soak.soak(
        cases,
        shared=True,
        quick=True,
        record=lambda case, result: got.setdefault(case.name, result),
        body=_stand_in_rank,
        group=processes.Group(),  # gloo on the CPU: the stand-in touches no GPU
    )
    assert list(got) == ["a-ok", "b-hang", "c-crash"], got
    assert got["a-ok"] == soak.Result("a-ok", calls=11, seconds=0.1)  # calls: the most of any rank
    assert got["b-hang"].hung and got["b-hang"].timeouts == 1 and got["b-hang"].calls == 0
    assert got["c-crash"].crashed and "rank 1 died (exit code 3)" in got["c-crash"].error
    assert time.monotonic() - start < 60


@pytest.mark.skipif(_cuda.find_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("tool", ["norm_floor.cu", "all_reduce_floor.cu"])
def test_the_floor_tools_compile_against_the_kernels_headers(tmp_path: Path, tool: str) -> None:
    # The floor tools build their kernels and ladders from csrc's own headers: a renamed primitive must
    # fail here.
    source, obj = str(TOOLS / tool), str(tmp_path / "floor.o")
    out = subprocess.run(
        [_cuda.find_nvcc(), "-c", "-std=c++17", "-arch=sm_90a", source, "-o", obj],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
