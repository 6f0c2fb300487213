"""`python -m graphar`: help lists the commands (demo, doctor; the benchmarks are bench/'s scripts, not a
command), bad or missing commands exit 2, `demo --help` only helps, `doctor --help` documents the exit statuses.

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
    for command in ("demo", "doctor"):
        assert f"\n    {command} " in out
    assert "\n    bench " not in out  # the benchmarks are bench/NAME.py, from a checkout


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
