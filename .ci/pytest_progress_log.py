"""pytest plugin for .ci/gpu: each failure and each slow test, written as it happens.

Loaded with ``-p pytest_progress_log`` (``.ci`` on PYTHONPATH) and ``AMPFUSED_PROGRESS_LOG=path``.
pytest prints its failures only at the end of a session, so a run stopped by a time limit would
say nothing about them; this log is flushed after every report (under xdist, the controller
receives every worker's reports).
"""

from __future__ import annotations

import os

import pytest

_SLOW_S = 5.0


def _write(line: str) -> None:
    path = os.environ.get("AMPFUSED_PROGRESS_LOG")
    # Under xdist the workers' reports reach the controller, which writes them once.
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(line.rstrip("\n") + "\n")


@pytest.hookimpl
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        text = str(report.longrepr)
        lines = text.splitlines()
        # The assertion or exception lines ("E   ...") say the most in the least space.
        errors = [ln for ln in lines if ln.startswith("E ")][:12] or lines[-12:]
        _write(f"FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)")
        for ln in errors:
            _write("    " + ln[:400])
    elif report.when == "call" and report.duration >= _SLOW_S:
        _write(f"SLOW {report.nodeid} {report.duration:.1f} s")


@pytest.hookimpl
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write(f"SESSION FINISHED exit {exitstatus}")
