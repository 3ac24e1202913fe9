"""Question: what does a step cost when found_inf is agreed across ranks?  Data-parallel
(DDP, FSDP) training needs every rank to make the same skip decision, so the scaler all-reduces
its found_inf flag in each step.  torch's FSDP1 ``ShardedGradScaler`` does it (SUM over the
world group); so do ``ampfused.ShardedGradScaler`` (the same, on the fused pass) and
``ampfused.GradScaler(found_inf_group=WORLD)`` (MAX).

Two processes (``torch.multiprocessing``, spawn), one thread each, gloo on 127.0.0.1, each with
its own gradient set (the DDP layout without a model: parameters with ``.grad``, a no-op
optimizer).  Both ranks run the same steps in lock-step: each timed step is
``restore; reset`` (untimed), a barrier (untimed), then the step, timed with
``time.perf_counter`` on each rank; the records are rank 0's times, rank 1's median is in the
note.  Beside the three collective methods, in the same processes and rounds: both scalers
without a collective, the collective alone (``floor-allreduce``: one all-reduce of one flag)
and the memory floor (``floor-mul``).

Every wait is bounded: the process group has a timeout, the parent waits for each workload's
results with a deadline, and kills both processes when one passes.
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
    available_bytes,
    count_ops,
    derive,
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

# Lock-step rounds: rank 0 decides when to stop (the same rule as timing.TimingConfig) and
# broadcasts the decision after each round, so both ranks run the same steps.
TIMING = TimingConfig(warmup=2, min_rounds=10, enough_rounds=60, min_time_s=0.3, max_wall_s=10.0)
QUICK_TIMING = TimingConfig(
    warmup=1, min_rounds=4, enough_rounds=12, min_time_s=0.03, max_wall_s=1.5
)
# Seconds the parent gives the processes to start and join the group, and each workload on top
# of its timing budget (building gradients, warm-up, the profiler).
START_TIMEOUT_S = 60.0
WORKLOAD_SLACK_S = 30.0
# The process group's own timeout: a collective one rank never joins raises after it.
GROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankResult:
    """One rank's results for one workload: per method its step times (seconds), or why it did
    not run; its bytes moved per step; rank 0's op counts."""

    times: dict[str, list[float]]
    status: dict[str, tuple[str, str]]  # method -> (status, note) for methods that did not run
    nbytes: dict[str, int]
    counts: dict[str, tuple[int, int]]  # method -> (ops, items)


def workloads(ctx: Context) -> list[Workload]:
    return list(WORKLOADS)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- in each rank
def _agree(ok: list[bool]) -> list[bool]:
    """Which entries are True on every rank (one all-reduce, MIN)."""
    import torch.distributed as dist

    flags = torch.tensor([int(x) for x in ok], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return [bool(x) for x in flags.tolist()]


def _agreed(
    names: Sequence[str], runners: dict[str, Any], status: dict[str, tuple[str, str]]
) -> list[str]:
    """The methods that are ready on every rank; the others, ready here, get the status
    "failed on another rank"."""
    ready = [n in runners and n not in status for n in names]
    agreed = _agree(ready)
    for n, here, everywhere in zip(names, ready, agreed, strict=True):
        if here and not everywhere:
            status[n] = ("error", "failed on another rank")
    return [n for n, ok in zip(names, agreed, strict=True) if ok]


def _continue(go: bool) -> bool:
    """Rank 0's decision, on every rank."""
    import torch.distributed as dist

    flag = torch.tensor([int(go)], dtype=torch.int32)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _measure_rank(
    rank: int, w: Workload, names: Sequence[str], cfg: TimingConfig, profile: bool
) -> RankResult:
    """Builds ``w`` on this rank, makes the runners, and times them in lock-step with the other
    ranks: every step after a barrier, rounds rotated, rank 0 deciding when to stop."""
    import torch.distributed as dist

    device = torch.device("cpu")
    gs = build(w, device, seed=rank)
    status: dict[str, tuple[str, str]] = {}
    runners = {}
    for name in names:
        m = METHODS[name]
        reason = m.unavailable(w, device)
        if reason:
            status[name] = ("n/a", reason)
            continue
        try:
            runners[name] = m.factory(gs)
        except Exception as e:  # noqa: BLE001 - reported in the table
            status[name] = ("error", error_line(e))
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
            stop = rnd >= cfg.min_rounds and (
                rnd >= cfg.enough_rounds
                or all(sum(times[n]) >= cfg.min_time_s for n in active)
                or time.perf_counter() - t_start >= cfg.max_wall_s
            )
            if not _continue(not stop):
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
    rank: int,
    world: int,
    port: int,
    sets: Sequence[Workload],
    names: Sequence[str],
    cfg: TimingConfig,
    profile: bool,
    out: Any,
) -> None:
    """One process: joins the gloo group on 127.0.0.1, measures each workload, puts
    ``("result", rank, index, RankResult)`` per workload, then ``("done", rank)``, or
    ``("error", rank, traceback)`` and returns."""
    try:
        torch.set_num_threads(1)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
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
    """Waits up to ``grace_s`` for the processes to exit, kills those still running and reaps
    them (bounded)."""
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
    steps of the slowest rank's time (what a lock-step job waits for); ratios within the
    workload."""
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
        # The same steps on every rank, in the same order: step i is done when the slowest
        # rank has finished it.
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
    """Runs the question in ``WORLD_SIZE`` processes: records for each workload (``sets``,
    default :func:`workloads`) and method; a workload the processes did not finish in time, or
    that they failed on, gets records with status "error" and the reason."""
    import torch.distributed as dist

    sets = list(workloads(ctx) if sets is None else sets)
    cfg = timing or (QUICK_TIMING if ctx.quick else TIMING)
    if not (dist.is_available() and dist.is_gloo_available()):
        note = "torch.distributed with the gloo backend is not available in this torch"
        return [r for w in sets for r in _failed(w, names, "n/a", note)]
    records: list[Record] = []
    todo: list[Workload] = []
    for w in sets:
        need = WORLD_SIZE * (2 * w.grad_bytes + (64 << 20))
        if need > 0.8 * available_bytes(torch.device("cpu")):
            note = f"needs {need / 2**30:.1f} GiB of memory ({WORLD_SIZE} processes)"
            records += _failed(w, names, "skipped", note)
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
            args=(rank, WORLD_SIZE, port, todo, tuple(names), cfg, ctx.profile, out),
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
    """One row per workload: each method's median step on rank 0, torch's way over ampfused's,
    ampfused's sharded scaler over the memory floor, and what the collective adds to each
    scaler's step (the median with it minus the median without)."""

    def added(ok: dict[str, Record]) -> str:
        cells = []
        for with_it, without in (("ampfused-dist", "ampfused"), ("torch-dist", "torch")):
            if with_it not in ok or without not in ok:
                cells.append("-")
                continue
            d = ok[with_it].median_s - ok[without].median_s  # type: ignore[operator]
            cells.append(("-" if d < 0 else "") + fmt_time(abs(d)))
        return " / ".join(cells)

    pairs = (("torch-dist", "ampfused-dist"), ("torch-fsdp2", "ampfused-fsdp2"))
    pairs += (("torch", "ampfused"), ("ampfused-dist", "floor-mul"))
    ratios = [(f"{x} / {y}", x, y) for x, y in pairs]
    extra = [("collective adds: ampfused / torch", added)]
    return _table(records, METHOD_NAMES, ratios, extra, tablefmt)
