"""Every GRAPHAR_* variable is validated where it enters, with an error naming it, and documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphar import settings
from graphar.errors import SettingError

# variable: (good values and what they read as, bad values)
CASES = {
    "GRAPHAR_MAX_ALLREDUCE_BYTES": ({"4096": 4096, " 16 ": 16}, ["8MB", "-1", "8.5", "0", "24"]),
    "GRAPHAR_ALLREDUCE_ALGO": ({"1stage": "1stage", "push-twoshot": "push-twoshot"}, ["3stage", "oneshot"]),
    "GRAPHAR_AUTO_INIT": ({"0": False, "yes": True}, ["auto"]),
    "GRAPHAR_PDL": ({"0": False, "on": True}, ["2"]),
    "GRAPHAR_NATIVE_OP": ({"off": False, "1": True}, ["maybe"]),
    "GRAPHAR_BLOCK_LIMIT": ({"1": 1, "64": 64}, ["0", "65", "8.5"]),
    "GRAPHAR_ALLTOALL_ALGO": ({"pull": "pull", "push": "push"}, ["both", "PUSH"]),
    "GRAPHAR_PULL_BLOCKS": ({"32": 32}, ["0", "65", "x"]),
    "GRAPHAR_TUNE": ({"0": False, "yes": True}, ["later"]),
    "GRAPHAR_TUNE_BUDGET_S": ({"0.5": 0.5, "10": 10.0}, ["0", "-1", "inf", "quick"]),
    "GRAPHAR_DETERMINISTIC": ({"off": False, "1": True}, ["mostly"]),
    "GRAPHAR_TIMEOUT_S": ({"0": 0.0, "2.5": 2.5}, ["-1", "inf", "nan", "soon"]),
    "GRAPHAR_EXCHANGE_TIMEOUT_S": ({"10": 10.0}, ["0", "-3", "inf"]),
    "GRAPHAR_CACHE_DIR": ({"/tmp/g": "/tmp/g"}, []),
    "GRAPHAR_CUDA_ARCHS": ({"90a;80": ("90a", "80"), "90a, 100a": ("90a", "100a")}, ["sm_90", "9", ";"]),
    "GRAPHAR_SKIP_CUDA_BUILD": ({"1": True, "off": False}, ["maybe"]),
    "GRAPHAR_SHARE_GPU": ({"1": True, "no": False}, ["shared"]),
}


def test_cases_cover_every_variable() -> None:
    assert sorted(CASES) == sorted(s.name for s in settings.ALL)


@pytest.mark.parametrize("setting", settings.ALL, ids=lambda s: s.name)
def test_values_parse_or_fail_naming_the_variable(setting: settings.Setting, monkeypatch) -> None:
    good, bad = CASES[setting.name]
    monkeypatch.delenv(setting.name, raising=False)
    assert setting.get() == setting.default
    monkeypatch.setenv(setting.name, "")
    assert setting.get() == setting.default
    for raw, value in good.items():
        monkeypatch.setenv(setting.name, raw)
        assert setting.get() == value
    for raw in bad:
        monkeypatch.setenv(setting.name, raw)
        with pytest.raises(SettingError, match=re.escape(f"{setting.name}={raw!r}") + ".*expected"):
            setting.get()


def test_import_rejects_a_bad_variable_even_where_it_is_never_read() -> None:
    # On gloo no communicator ever reads GRAPHAR_ALLREDUCE_ALGO: the import is where it is checked.
    env = {"GRAPHAR_ALLREDUCE_ALGO": "3stage", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", "import graphar"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert (
        "SettingError: GRAPHAR_ALLREDUCE_ALGO='3stage' is not valid: expected '1stage', '2stage', 'push-oneshot'"
        in out.stderr
    )


def test_readme_documents_every_variable() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert settings.describe() in readme, "README's table of variables is stale: paste settings.describe()"


@pytest.mark.parametrize("value", [16, 8 << 20, 24, 0, -16, 8.5, 4096.0, True])
def test_one_rule_for_the_byte_limit_wherever_it_is_given(value, monkeypatch) -> None:
    """GRAPHAR_MAX_ALLREDUCE_BYTES (its text), the option max_all_reduce_bytes and graphar.init(max_bytes=)
    (the values given in code) are held to one rule: the same values pass."""
    from graphar.config import Config

    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % 16 == 0
    if ok:
        assert settings.byte_limit(value, "max_bytes") == Config(max_all_reduce_bytes=value).max_all_reduce_bytes
        monkeypatch.setenv("GRAPHAR_MAX_ALLREDUCE_BYTES", str(value))
        assert settings.MAX_ALLREDUCE_BYTES.get() == value
        return
    with pytest.raises(SettingError, match="max_bytes"):
        settings.byte_limit(value, "max_bytes")
    with pytest.raises(SettingError, match="max_all_reduce_bytes"):
        Config(max_all_reduce_bytes=value)
    monkeypatch.setenv("GRAPHAR_MAX_ALLREDUCE_BYTES", str(value))
    with pytest.raises(SettingError, match="GRAPHAR_MAX_ALLREDUCE_BYTES"):
        settings.MAX_ALLREDUCE_BYTES.get()
