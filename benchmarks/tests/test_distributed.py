"""The distributed question: two processes time every method in lock-step and the suite writes
their rows; the collective methods run only inside it; ranks past the deadline are killed."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import benchmarks.__main__ as suite_main
from benchmarks import compare, distributed
from benchmarks.methods import METHODS, select
from benchmarks.suite import Context
from benchmarks.timing import QUICK_TIMING, TimingConfig
from benchmarks.workloads import Workload, uniform

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

CPU = torch.device("cpu")
TINY = (
    Workload("4 x 1K", tuple(uniform(4, 1024)), family="target"),
    Workload("50 x 16", tuple(uniform(50, 16)), family="count"),
)
ROUNDS = 3
# Exactly ROUNDS rounds: both ranks stop together because rank 0 decides for both.
FIXED = TimingConfig(warmup=1, min_rounds=ROUNDS, enough_rounds=ROUNDS, max_wall_s=5.0)
COLLECTIVE = ("ampfused-dist", "torch-dist", "ampfused-group", "ampfused-fsdp2", "torch-fsdp2")
COLLECTIVE += ("floor-allreduce",)


def test_suite_runs_the_question_in_two_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--only distributed --quick`` on tiny sets: every method has ROUNDS samples on rank 0,
    the collective methods run the all-reduce, and results.md and results.jsonl hold the rows."""
    monkeypatch.setattr(distributed, "WORKLOADS", TINY)
    monkeypatch.setattr(distributed, "QUICK_TIMING", FIXED)
    argv = ["--only", "distributed", "--quick", "--device", "cpu", "--no-progress", "--no-plots"]
    t0 = time.perf_counter()
    assert suite_main.main([*argv, "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - t0 < 30  # about 8 s on 2 busy cores
    recs = compare.load(tmp_path)["records"]
    assert {(r.workload, r.method) for r in recs} == {
        (w.name, m) for w in TINY for m in distributed.METHOD_NAMES
    }
    for r in recs:
        assert r.question == "distributed" and r.ok, (r.method, r.status, r.note)
        assert r.median_s > 0 and 0 < r.q1_s <= r.median_s <= r.q3_s
        assert r.samples == ROUNDS
        assert "rank 1 median" in r.note and "slowest rank per step median" in r.note
    for w in TINY:
        by = {r.method: r for r in recs if r.workload == w.name}
        assert by["floor-allreduce"].ops == 1
        assert by["ampfused-dist"].ops > by["ampfused"].ops
        assert by["ampfused-group"].ops > by["ampfused"].ops
        assert by["torch-dist"].ops > by["torch"].ops
        assert by["ampfused-fsdp2"].ops > by["ampfused"].ops  # the all-reduce over the mesh
        assert by["floor-allreduce"].gbps is None and by["ampfused-dist"].gbps > 0
    md = (tmp_path / "results.md").read_text()
    assert "## Distributed: a step with found_inf all-reduced" in md
    header = next(line for line in md.splitlines() if line.startswith("| gradients "))
    assert "| torch-dist / ampfused-dist " in header and "| collective adds" in header
    row = next(line for line in md.splitlines() if line.startswith("| 4 x 1K fp32 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    n = len(distributed.METHOD_NAMES)
    assert len(cells) == 3 + n + 5
    assert all(c.endswith(("us", "ms")) for c in cells[3 : 3 + n])  # every method's median
    assert all(c.endswith("x") for c in cells[3 + n : 3 + n + 4])  # the ratios
    assert "**torch-dist**" in md and "**floor-allreduce**" in md  # the method list


def test_collective_methods_only_in_the_question() -> None:
    """Not selected by default, and n/a (not a hang) where no process group is initialized."""
    assert not dist.is_initialized()
    assert not set(COLLECTIVE) & {m.name for m in select(None, CPU)}
    for name in COLLECTIVE:
        reason = METHODS[name].unavailable(TINY[0], CPU)
        assert reason and "process group" in reason, name


def test_ranks_that_miss_the_deadline_are_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that would time steps for a minute, a deadline before they start: every record an
    error that says so, within seconds, no rank left running."""
    minute = TimingConfig(warmup=1, min_rounds=10**6, max_wall_s=60.0)
    monkeypatch.setattr(distributed, "START_TIMEOUT_S", -60.0)
    monkeypatch.setattr(distributed, "WORKLOAD_SLACK_S", 0.0)
    ctx = Context(device=CPU, timing=QUICK_TIMING, methods=[], quick=True, profile=False)
    t0 = time.perf_counter()
    recs = distributed.run(ctx, sets=TINY, timing=minute)
    assert time.perf_counter() - t0 < 15
    assert len(recs) == len(TINY) * len(distributed.METHOD_NAMES)
    assert all(r.status == "error" and "timed out" in r.note for r in recs)
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]
