"""`python -m graphar`: help lists the commands, bad or missing commands exit 2, `demo --help` only helps.

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
    assert "\n    demo " in out


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_unknown_command_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["doctr"]) == 2
    assert "invalid choice: 'doctr'" in capsys.readouterr().err


def test_demo_help_helps_without_running_the_demo() -> None:
    out = subprocess.run([sys.executable, "-m", "graphar", "demo", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m graphar demo")
    assert "--world-size" in out.stdout
    assert "graphar demo:" not in out.stdout + out.stderr  # the demo's first line
