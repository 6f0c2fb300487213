"""`python -m graphar`: help lists the commands (demo, doctor, bench) and bench's benchmarks, bad or
missing commands exit 2, `demo --help` only helps, `doctor --help` documents the exit statuses.

In-process through `main(argv)` (argparse exits with SystemExit), and once as `python -m graphar` to
cover the module entry point.
"""

import subprocess
import sys

import pytest

from graphar.__main__ import main


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m graphar")
    for command in ("demo", "doctor", "bench"):
        assert f"\n    {command} " in out


def test_bench_help_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m graphar bench")
    for name in ("allreduce", "decode", "ulysses"):
        assert f"\n    {name}" in out


def test_bench_without_a_benchmark_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench"]) == 2
    assert "required: BENCHMARK" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("allreduce", ["--sizes", "--dtype", "--modes"]),
        ("decode", ["--batches", "--layers", "--steps", "--replays"]),
        ("ulysses", ["--shapes"]),
    ],
)
def test_each_benchmark_keeps_its_options(name: str, options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", name, "--help"]) == 0
    out = capsys.readouterr().out
    for option in options + ["--world-size", "--quick", "--dry-run", "--out"]:
        assert f" {option}" in out, option


def test_doctor_help_documents_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m graphar doctor")
    for status in ("0  the custom", "3  no GPU", "4  graphar's CUDA library", "5  graphar.init", "6  the check"):
        assert f"\n  {status}" in out, status


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_unknown_command_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["doctr"]) == 2
    assert "invalid choice: 'doctr'" in capsys.readouterr().err


def test_demo_help_helps_without_running_the_demo() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "graphar", "demo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m graphar demo")
    assert "--world-size" in out.stdout
    assert "graphar demo:" not in out.stdout + out.stderr  # the demo's first line
