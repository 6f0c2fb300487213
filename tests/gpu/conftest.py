"""Under MPS (ranks sharing one GPU, tools/gpu_session.sh stage `mps`) a fault in any client reaches every
client of the GPU, and the server then takes no new client until all of them have exited: the first
test whose processes faulted must fail by name, not only the tests after it. So after each test, the
lines the MPS server logged about a fault meanwhile fail it, beside its ranks' process ids. And a failure
is printed as it happens: the device tool's call limit cuts a run before pytest's summary."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from _dist import MPS, WORKERS

_FAULT = re.compile(r"fatal|exception|error|xid", re.IGNORECASE)


def _server_log() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"), "server.log")


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


@pytest.fixture(autouse=True)
def no_mps_fault() -> Iterator[None]:
    if not MPS:
        yield
        return
    log = _server_log()
    start = _size(log)
    WORKERS.clear()  # a test that starts no ranks names none, not the last test's
    yield
    if _size(log) <= start:
        return
    with log.open(errors="replace") as f:
        f.seek(start)
        faults = [line for line in f.read().splitlines() if _FAULT.search(line)]
    if faults:
        pytest.fail(
            f"the MPS server logged a fault during this test (its ranks' pids: {WORKERS}):\n" + "\n".join(faults),
            pytrace=False,
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n{report.nodeid} failed ({report.when}):\n{report.longreprtext[-4000:]}", flush=True)
