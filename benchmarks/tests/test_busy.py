"""The busy question: its busy processes come and go with it, its plan pairs each pass with
torch's way, and its target fails where a pass is slower beyond noise."""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks import env
from benchmarks import questions as qs
from benchmarks import targets as tg
from benchmarks.methods import METHODS
from benchmarks.suite import Context
from benchmarks.tests import rec
from benchmarks.timing import QUICK_TIMING
from benchmarks.workloads import build


def _children() -> set[int]:
    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    with open(path) as f:
        return {int(p) for p in f.read().split()}


def test_busy_cores_start_one_process_per_core_and_end_them() -> None:
    before = _children()
    with env.busy_cores() as n:
        assert n == len(os.sched_getaffinity(0))
        started = _children() - before
        assert len(started) == n
        time.sleep(0.3)
        for pid in started:  # each one is running, not waiting
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split(") ", 1)[1][0] == "R", pid
    assert _children() & started == set()


def test_plan_pairs_every_pass_with_torchs_way() -> None:
    for quick in (False, True):
        ctx = Context(device=torch.device("cpu"), timing=QUICK_TIMING, methods=[], quick=quick)
        plan = qs.QUESTIONS["busy"].plan(ctx, argparse.Namespace())
        names = {n for _, ms in plan for n in ms}
        for _, ours, theirs in qs.BUSY_PAIRS[:-1]:  # (tracing: its own module's records)
            assert {ours, theirs} <= names
        assert all(m in METHODS for m in names)
    ctx = Context(device=torch.device("meta"), timing=QUICK_TIMING, methods=[])
    assert qs.QUESTIONS["busy"].plan(ctx, argparse.Namespace()) == []


def test_fork_join_method_splits_every_pass_and_restores_auto() -> None:
    gs = build(qs.X1000_1K, torch.device("cpu"))
    config, stats = torch.ops.ampfused._cpu_split_config, torch.ops.ampfused._cpu_split_stats
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config("never", 0, True)
        runner = METHODS["ampfused-forkjoin"].factory(gs)
        runner.run()
        assert stats()[0] == 1  # split although the mode was "never"
        assert config("auto", 0, True) == "auto"  # ... and the run left "auto"
    finally:
        torch.set_num_threads(threads)
        config("auto", 0, True)


def test_target_fails_where_a_pass_is_slower_beyond_noise() -> None:
    def pair(ours_us: float, theirs_us: float, what: int = 0) -> list:
        _, ours, theirs = qs.BUSY_PAIRS[what]
        return [rec(ours, ours_us, question="busy"), rec(theirs, theirs_us, question="busy")]

    assert tg.busy_target(pair(100.0, 300.0) + pair(50.0, 60.0, 2)).passed is True
    assert tg.busy_target(pair(100.0, 101.0)).passed is True  # within noise
    res = tg.busy_target(pair(100.0, 300.0) + pair(80.0, 60.0, 3))
    assert res.passed is False and "masters 10 x 16 fp32" in res.detail
    assert tg.busy_target([]).passed is None
    table = qs.QUESTIONS["busy"].table(pair(100.0, 300.0) + pair(80.0, 60.0, 3), "simple")
    assert "3.00x" in table and "0.75x" in table
