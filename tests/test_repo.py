"""The repo stands alone and installs lean: no text points outside it, and the dependencies bring
only what graphar needs (torch's CUDA wheels bring Triton themselves)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_nothing_points_outside_the_repo() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout (an sdist): read what is there
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]
    texts = [
        f for f in files if f.endswith((".py", ".md", ".cu", ".cuh", ".h", ".sh", ".toml")) and (ROOT / f).is_file()
    ]
    offenders = [f for f in texts if re.search(r"\.\./shared|DESIGN\.md", (ROOT / f).read_text(errors="replace"))]
    assert offenders == [] or offenders == ["tests/test_repo.py"], offenders


def test_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[\s;<>=!\[]", d)[0] for d in project["dependencies"]]
    assert "triton" not in names and {"torch", "numpy"} <= set(names)
    test_extra = [re.split(r"[\s;<>=!\[]", d)[0] for d in project["optional-dependencies"]["test"]]
    assert {"pytest", "expecttest", "triton"} <= set(test_extra)
