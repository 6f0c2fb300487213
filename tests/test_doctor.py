"""`python -m graphar doctor`: the report and its exit status.

Once as `python -m graphar doctor` with no GPU visible (the report, exit 3), then in process with
the machine faked (GPUs, library, the spawned probe) for the other paths: one GPU (no spawn), no
library, a probe that fails, graphar.init on and off; and the peer matrix and per-size plan alone.
"""

import argparse
import os
import subprocess
import sys

import pytest

from graphar import doctor

TWO_H200 = [{"name": "NVIDIA H200", "cc": "90", "memory": "140 GiB", "bus": f"0000:{b}:00.0"} for b in ("19", "3B")]
OFF = "rank 1: P2P store/load with rank 0 did not round-trip"
WARNING = f"graphar: custom all-reduce off for group '0', its backend (nccl) serves it: {OFF}"


def test_without_gpus_it_reports_what_it_can_and_exits_3() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GRAPHAR_CUDA_ARCHS": "90a;80"}
    out = subprocess.run(
        [sys.executable, "-m", "graphar", "doctor"], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == doctor.EXIT_NO_GPU == 3, out.stdout + out.stderr
    for line in (
        "graphar doctor\n",
        "\nVersions\n  Python: ",
        "\n  torch: ",
        "\n  Triton: ",
        "\n  NCCL: ",
        "\ngraphar's CUDA library\n",
        "\n  build targets (GRAPHAR_CUDA_ARCHS): machine code sm_90a, sm_80; PTX compute_80\n",
        "\n  loads here: not tried: no CUDA device is visible\n",
        "\n  to build it: ",
        "\nAllocator\n  PYTORCH_CUDA_ALLOC_CONF: ",
        "\nGPUs: none visible",
        "\ngraphar doctor: the custom paths need 2 GPUs or more in the group; 0 visible (exit status 3)\n",
    ):
        assert line in out.stdout, line


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Two H200s on NVLink with a library that loads; tests change what they need."""
    monkeypatch.setattr(doctor, "gpus", lambda: list(TWO_H200))
    monkeypatch.setattr(doctor, "library_report", lambda capabilities: True)
    monkeypatch.setattr(doctor._cuda, "nvlink_between", lambda bus_a, bus_b: True)
    monkeypatch.setattr(doctor.torch.cuda, "can_device_access_peer", lambda a, b: True)
    return monkeypatch


def _facts(verdict: str, warnings: list[str], shareable: bool = True) -> list[dict]:
    one = {"pairs": {"0-1": verdict}, "verdict": verdict, "warnings": warnings}
    if verdict == "ok":
        # As the probe writes it, through JSON: sizes as strings, one kernel per capture mode.
        plan = {str(n): ["1stage"] * 3 for n in doctor.PLAN_SIZES if n <= 8 << 20}
        plan[str(256 << 10)] = ["push-oneshot", "push-oneshot", "1stage"]
        push = {"one_shot": 8 << 20, "fused_norm": 512 << 10}
        one.update(
            max_bytes=8 << 20, shareable=shareable, plan=plan, push=push, pdl=True, alltoall="pull", native_op=True
        )
        one["tuned"] = {"source": "cache", "lines": ["eager 1 KB: push-oneshot <- 1stage 3.1, push-oneshot 2.6"]}
    return [one, {**one, "native_op": False}]


def _run(world_size: int | None = None) -> int:
    return doctor.run(argparse.Namespace(world_size=world_size, timeout=5.0))


def test_on_exits_0_with_the_plan(machine: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    machine.setattr(doctor, "probe", lambda world_size, timeout_s: (_facts("ok", [], shareable=False), None))
    assert _run() == doctor.EXIT_ON
    out = capsys.readouterr().out
    matrix = out.split("graphar's IPC store/load probe of the pair\n")[1].splitlines()[:3]
    assert [row.split() for row in matrix] == [
        ["cuda:0", "cuda:1"],
        ["cuda:0", "-", "NVLink", "ok"],
        ["cuda:1", "NVLink", "ok", "-"],
    ]
    for line in (
        "custom all-reduce: ON",
        "set up: at each group's first eager collective, or by graphar.init(group)",
        "size limit (GRAPHAR_MAX_ALLREDUCE_BYTES): 8 MB",
        "all-reduce of 16 KB: 1stage",
        "all-reduce of 8 MB: 1stage",
        "all-reduce of 256 KB: eager: push-oneshot, graph: push-oneshot, graphar.graph: 1stage",
        "push kernels: one-shot up to 8 MB, fused norm up to 512 KB",
        "kernel table: measured on this group (from the tuner cache)",
        "measured: eager 1 KB: push-oneshot <- 1stage 3.1, push-oneshot 2.6",
        "programmatic dependent launch: on",
        "all-reduce of 16 MB: NCCL (over the limit)",
        "graphar.graph inputs: staged (copied in) on ranks [0, 1]: expandable segments",
        "Ulysses exchange: CUDA IPC, pull (GRAPHAR_ALLTOALL_ALGO)",
        "eager calls of the op: the Python kernel on ranks [1] (more host time per call;",
        "graphar doctor: custom all-reduce and IPC all-to-all ON (exit status 0)",
    ):
        assert line in out, line


def test_off_exits_5_with_graphar_s_reason(machine: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    machine.setattr(doctor, "probe", lambda world_size, timeout_s: (_facts(OFF, [WARNING]), None))
    assert _run() == doctor.EXIT_OFF
    out = capsys.readouterr().out
    assert f"custom all-reduce: OFF, NCCL serves it: {OFF}" in out
    assert f"graphar's warning: {WARNING}" in out
    assert "NVLink off[1]" in out and f"[1] {OFF}" in out
    assert "Ulysses exchange: NCCL (no communicator)" in out
    assert "all-reduce of 16 KB" not in out


def test_one_gpu_reports_without_spawning(machine: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    machine.setattr(doctor, "gpus", lambda: TWO_H200[:1])
    machine.setattr(doctor, "probe", lambda *a: pytest.fail("spawned with one GPU"))
    assert _run() == doctor.EXIT_NO_GPU
    assert "cuda:0  NVIDIA H200  sm_90  140 GiB  bus 0000:19:00.0" in capsys.readouterr().out


def test_a_world_size_above_the_gpus_is_exit_3(machine: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    machine.setattr(doctor, "probe", lambda *a: pytest.fail("spawned more ranks than GPUs"))
    assert _run(world_size=4) == doctor.EXIT_NO_GPU
    assert "2 visible, --world-size 4 (exit status 3)" in capsys.readouterr().out


def test_no_library_exits_4_without_spawning(machine: pytest.MonkeyPatch) -> None:
    machine.setattr(doctor, "library_report", lambda capabilities: False)
    machine.setattr(doctor, "probe", lambda *a: pytest.fail("spawned without the library"))
    assert _run() == doctor.EXIT_NO_LIBRARY


def test_a_failed_probe_exits_6(machine: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    machine.setattr(doctor, "probe", lambda *a: ([], "the probe did not finish within 5 s (--timeout)"))
    assert _run() == doctor.EXIT_FAILED
    out = capsys.readouterr().out
    assert "NVLink ?" in out  # the pairs were not probed
    assert "graphar doctor: the probe did not finish within 5 s (--timeout) (exit status 6)" in out


def test_matrix_numbers_each_distinct_reason_once() -> None:
    links = {(0, 1): "NVLink", (0, 2): "P2P/PCIe", (1, 2): "no P2P"}
    rows = doctor.matrix(3, links, {"0-1": "ok", "0-2": "no NVLink", "1-2": "no NVLink"})
    assert rows[1].split() == ["cuda:0", "-", "NVLink", "ok", "P2P/PCIe", "off[1]"]
    assert rows[3].split() == ["cuda:2", "P2P/PCIe", "off[1]", "no", "P2P", "off[1]", "-"]
    assert rows[4:] == ["[1] no NVLink"]


def test_coverage_of_a_gpu_by_the_library_s_architectures() -> None:
    assert doctor.coverage("90", ["80", "90a"], ["80"]) == "machine code for it"
    assert doctor.coverage("100", ["80", "90a"], ["80"]).startswith("PTX only")
    assert doctor.coverage("75", ["80", "90a"], ["80"]).startswith("NOT covered")


def test_the_library_s_own_list_of_targets_reads_as_cuobjdump_s() -> None:
    assert doctor.split_targets("sm_90a,sm_80,sm_100a,compute_80") == (["80", "90a", "100a"], ["80"])
    assert doctor.split_targets("") == ([], [])
