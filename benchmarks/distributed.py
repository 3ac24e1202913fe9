"""What does a step cost when found_inf is agreed across ranks, as data-parallel training
needs?  Two processes (spawn, one thread each, gloo on 127.0.0.1) time every method in
lock-step on gradient sets of their own (benchmarks/README.md, "Distributed"); every wait is
bounded: the group's timeout, the parent's deadline per workload, then both processes killed.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.methods import METHODS
from benchmarks.report import fmt_time
from benchmarks.report import table as _table
from benchmarks.suite import (
    Context,
    Record,
    _base,
    _fill_timing,
    count_ops,
    derive,
    make_runners,
    too_big,
)
from benchmarks.timing import MethodTiming, Stats, TimingConfig, error_line
from benchmarks.workloads import Workload, build, uniform

QUESTION = "distributed"
WORLD_SIZE = 2

# In the order of the table's columns (the run order is rotated every round).
METHOD_NAMES = (
    "ampfused-dist",
    "torch-dist",
    "ampfused-group",
    "ampfused-fsdp2",
    "torch-fsdp2",
    "ampfused",
    "torch",
    "floor-allreduce",
    "floor-mul",
)
WORKLOADS = (
    Workload("4 x 4M", tuple(uniform(4, 1 << 22)), family="target"),
    Workload("300 x 16K", tuple(uniform(300, 1 << 14)), family="count"),
    Workload("1000 x 16", tuple(uniform(1000, 16)), family="count"),
)

# Rank 0 decides when to stop (TimingConfig.done) and broadcasts it after each round.
TIMING = TimingConfig(warmup=2, min_rounds=10, enough_rounds=60, min_time_s=0.3, max_wall_s=10.0)
QUICK_TIMING = TimingConfig(
    warmup=1, min_rounds=4, enough_rounds=12, min_time_s=0.03, max_wall_s=1.5
)
# The parent's deadline: start-up, then each workload's max_wall_s plus slack (build, warm-up,
# profiler); a collective one rank never joins raises after the group's timeout.
START_TIMEOUT_S, WORKLOAD_SLACK_S, GROUP_TIMEOUT_S = 60.0, 30.0, 60.0


@dataclass(frozen=True)
class RankResult:
    """One rank's results for one workload."""

    times: dict[str, list[float]]
    status: dict[str, tuple[str, str]]  # method -> (status, note) for methods that did not run
    nbytes: dict[str, int]
    counts: dict[str, tuple[int, int]]  # method -> (ops, items)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- in each rank
def _agreed(
    names: Sequence[str], runners: dict[str, Any], status: dict[str, tuple[str, str]]
) -> list[str]:
    """The methods ready on every rank (one MIN all-reduce); the others ready here get the
    status "failed on another rank"."""
    import torch.distributed as dist

    ready = [n in runners and n not in status for n in names]
    flags = torch.tensor(ready, dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    for n, here, everywhere in zip(names, ready, flags.tolist(), strict=True):
        if here and not everywhere:
            status[n] = ("error", "failed on another rank")
    return [n for n, ok in zip(names, flags.tolist(), strict=True) if ok]


def _measure_rank(
    rank: int, w: Workload, names: Sequence[str], cfg: TimingConfig, profile: bool
) -> RankResult:
    """Builds ``w`` on this rank and times the methods in lock-step with the other ranks."""
    import torch.distributed as dist

    gs = build(w, torch.device("cpu"), seed=rank)
    runners, status = make_runners(gs, [METHODS[n] for n in names])
    # A method that failed on any rank is dropped on all (its collectives would wait for it),
    # after the factories and again after the warm-up.
    active = _agreed(names, runners, status)
    for name in active:
        try:
            for _ in range(max(cfg.warmup, 1)):
                gs.restore()
                runners[name].reset()
                dist.barrier()
                runners[name].run()
        except Exception as e:  # noqa: BLE001
            status[name] = ("error", error_line(e))
    active = _agreed(names, runners, status)
    times: dict[str, list[float]] = {n: [] for n in active}
    gc.collect()
    gc.disable()
    try:
        t_start = time.perf_counter()
        rnd = 0
        while active:
            k = rnd % len(active)
            for name in active[k:] + active[:k]:
                r = runners[name]
                gs.restore()
                r.reset()
                dist.barrier()
                t0 = time.perf_counter()
                r.run()
                times[name].append(time.perf_counter() - t0)
            rnd += 1
            timed = [sum(times[n]) for n in active]
            done = cfg.done(rnd, timed, time.perf_counter() - t_start)
            stop = torch.tensor([int(done)], dtype=torch.int32)
            dist.broadcast(stop, src=0)  # rank 0's decision, on every rank
            if stop.item():
                break
    finally:
        gc.enable()
    counts: dict[str, tuple[int, int]] = {}
    if profile and active:
        # Both ranks profile the same steps in the same order (lock-step collectives).
        for name, c in count_ops(gs, {n: runners[n] for n in active}).items():
            counts[name] = (c.ops, c.items)
    nbytes = {n: runners[n].bytes_moved(gs) for n in active}
    gs.release()
    del gs, runners
    gc.collect()
    return RankResult(times, status, nbytes, counts)


def _rank_main(
    rank: int, port: int, sets: list, names: tuple, cfg: TimingConfig, profile: bool, out: Any
) -> None:
    """One process: puts ``("result", rank, index, RankResult)`` per workload, then ``("done",
    rank)``, or ``("error", rank, traceback)``."""
    try:
        torch.set_num_threads(1)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
        try:
            for i, w in enumerate(sets):
                out.put(("result", rank, i, _measure_rank(rank, w, names, cfg, profile)))
                dist.barrier()
        finally:
            dist.destroy_process_group()
        out.put(("done", rank))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put(("error", rank, traceback.format_exc()[-2000:]))


# --------------------------------------------------------------------------- in the parent
def _stop(procs: list[Any], grace_s: float) -> None:
    """Waits up to ``grace_s`` for the processes, kills those still running, reaps them."""
    end = time.perf_counter() + grace_s
    for p in procs:
        p.join(timeout=max(end - time.perf_counter(), 0.0))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def _records(
    w: Workload, names: Sequence[str], by_rank: dict[int, RankResult], wall_s: float
) -> list[Record]:
    """Rank 0's times as records; in the note, the other ranks' medians and the median over
    steps of the slowest rank's time (what a lock-step job waits for)."""
    recs = {n: _base(QUESTION, w, METHODS[n]) for n in names}
    r0 = by_rank[0]
    for n, rec in recs.items():
        if n in r0.status:
            rec.status, rec.note = r0.status[n]
            continue
        if n not in r0.times:
            rec.status, rec.note = "error", "no samples"
            continue
        _fill_timing(rec, MethodTiming(wall=Stats(list(r0.times[n]))), r0.nbytes.get(n, 0))
        if rec.ok and not rec.bytes_moved:
            rec.gbps = None
        others = [
            f"rank {k} median {fmt_time(Stats(res.times[n]).median)}"
            for k, res in sorted(by_rank.items())
            if k != 0 and res.times.get(n)
        ]
        per_rank = [res.times.get(n, []) for _, res in sorted(by_rank.items())]
        if len(per_rank) > 1 and all(len(t) == len(per_rank[0]) > 0 for t in per_rank):
            slowest = [max(step) for step in zip(*per_rank, strict=True)]
            others.append(f"slowest rank per step median {fmt_time(Stats(slowest).median)}")
        rec.note = "; ".join(x for x in (rec.note, *others) if x)
        if n in r0.counts:
            rec.ops, rec.items = r0.counts[n]
    for rec in recs.values():
        rec.workload_wall_s = round(wall_s, 2)
    derive(list(recs.values()))
    return list(recs.values())


def _failed(w: Workload, names: Sequence[str], status: str, note: str) -> list[Record]:
    recs = [_base(QUESTION, w, METHODS[n]) for n in names]
    for r in recs:
        r.status, r.note = status, note
    return recs


def run(
    ctx: Context,
    sets: Sequence[Workload] | None = None,
    timing: TimingConfig | None = None,
    names: Sequence[str] = METHOD_NAMES,
) -> list[Record]:
    """Records for each workload (default ``WORKLOADS``) and method, timed in ``WORLD_SIZE``
    processes; a workload they did not finish in time, or failed on, gets status "error"."""
    import torch.distributed as dist

    sets = list(WORKLOADS if sets is None else sets)
    cfg = timing or (QUICK_TIMING if ctx.quick else TIMING)
    if not (dist.is_available() and dist.is_gloo_available()):
        note = "torch.distributed with the gloo backend is not available in this torch"
        return [r for w in sets for r in _failed(w, names, "n/a", note)]
    records: list[Record] = []
    todo: list[Workload] = []
    for w in sets:
        big = too_big(w, torch.device("cpu"), WORLD_SIZE)
        if big:
            records += _failed(w, names, "skipped", f"{big} ({WORLD_SIZE} processes)")
            ctx.tick()
        else:
            todo.append(w)
    if not todo:
        return records
    mp = torch.multiprocessing.get_context("spawn")
    out = mp.Queue()
    port = _free_port()
    procs = [
        mp.Process(
            target=_rank_main,
            args=(rank, port, todo, tuple(names), cfg, ctx.profile, out),
            daemon=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[int, RankResult]] = {}
    done: set[int] = set()
    error: str | None = None
    i = 0  # the workload being waited for
    t_workload = time.perf_counter()
    deadline = t_workload + START_TIMEOUT_S + cfg.max_wall_s + WORKLOAD_SLACK_S
    ctx.describe(f"{QUESTION}: {todo[0].label}")
    try:
        while len(done) < WORLD_SIZE and error is None:
            try:
                msg = out.get(timeout=min(1.0, max(deadline - time.perf_counter(), 0.01)))
            except queue.Empty:
                if time.perf_counter() > deadline:
                    error = f"timed out after {time.perf_counter() - t_workload:.0f} s"
                elif any(p.exitcode not in (None, 0) for p in procs):
                    codes = [p.exitcode for p in procs]
                    error = f"a process exited with code {codes} without reporting"
                continue
            if msg[0] == "error":
                error = f"rank {msg[1]}: " + msg[2].strip().splitlines()[-1]
                ctx.notes.append(f"{QUESTION}: rank {msg[1]} failed:\n{msg[2]}"[:1500])
            elif msg[0] == "done":
                done.add(msg[1])
            else:
                _, rank, index, res = msg
                results.setdefault(index, {})[rank] = res
                while i < len(todo) and len(results.get(i, {})) == WORLD_SIZE:
                    wall = time.perf_counter() - t_workload
                    records += _records(todo[i], names, results[i], wall)
                    ctx.tick()
                    i += 1
                    t_workload = time.perf_counter()
                    deadline = t_workload + cfg.max_wall_s + WORKLOAD_SLACK_S
                    if i < len(todo):
                        ctx.describe(f"{QUESTION}: {todo[i].label}")
    finally:
        _stop(procs, 0.0 if error else 10.0)
        with contextlib.suppress(Exception):
            out.close()
    for w in todo[i:]:
        records += _failed(w, names, "error", error or "no results")
        ctx.tick()
    return records


# --------------------------------------------------------------------------- table
def table(records: list[Record], tablefmt: str = "simple") -> str:
    """Rank 0's medians, the ratios, and what the collective adds to each scaler's step."""

    def added(ok: dict[str, Record]) -> str:
        cells = []
        for with_it, without in (("ampfused-dist", "ampfused"), ("torch-dist", "torch")):
            if with_it not in ok or without not in ok:
                cells.append("-")
                continue
            d = ok[with_it].median_s - ok[without].median_s
            cells.append(("-" if d < 0 else "") + fmt_time(abs(d)))
        return " / ".join(cells)

    pairs = (("torch-dist", "ampfused-dist"), ("torch-fsdp2", "ampfused-fsdp2"))
    pairs += (("torch", "ampfused"), ("ampfused-dist", "floor-mul"))
    ratios = [(f"{x} / {y}", x, y) for x, y in pairs]
    extra = [("collective adds: ampfused / torch", added)]
    return _table(records, METHOD_NAMES, ratios, extra, tablefmt)
