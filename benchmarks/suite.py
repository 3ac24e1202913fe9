"""One workload's methods timed into :class:`Record`s (the lines of results.jsonl), with
per-step op counts (``torch.profiler``) and Python bytecodes."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.env import is_gpu
from benchmarks.methods import Method, Runner
from benchmarks.timing import MethodTiming, TimingConfig, error_line, measure
from benchmarks.workloads import GradSet, Workload, build


@dataclass
class Context:
    """What every question needs: where, how long, which methods, where progress goes."""

    device: torch.device
    timing: TimingConfig
    methods: list[Method]
    quick: bool = False
    profile: bool = True
    progress: Any = None  # a tqdm bar, advanced once per workload
    notes: list[str] = field(default_factory=list)
    restore_on_one_thread: bool = False  # GradSet.restore_on_one_thread

    def tick(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress.update(n)

    def describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(text[:60], refresh=False)


@dataclass
class Record:
    """One (question, workload, method) result; seconds, GB/s (1e9 B/s).  ``median_s``: the
    step's cost as :mod:`benchmarks.timing` measures it."""

    question: str
    workload: str
    family: str
    dtype: str
    inject_inf: bool
    n_tensors: int
    numel: int
    grad_bytes: int
    method: str
    kind: str
    realloc: bool = False  # new gradient tensors every step (zero_grad(set_to_none=True))
    status: str = "ok"  # ok | n/a | skipped | error
    note: str = ""
    median_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    samples: int = 0
    bytes_moved: int = 0
    gbps: float | None = None
    x_floor: float | None = None  # median / median of the _foreach_mul_ floor
    x_copy: float | None = None  # copy-floor GB/s / this GB/s (GPU)
    speedup_vs_torch: float | None = None  # torch.amp.GradScaler median / this median
    device_median_s: float | None = None
    device_q1_s: float | None = None
    device_q3_s: float | None = None
    device_gbps: float | None = None
    device_x_copy: float | None = None
    device_speedup_vs_torch: float | None = None
    timing: str | None = None  # per-step | batched
    steps_per_sample: int | None = None  # batched: steps in one timed batch
    host_median_s: float | None = None  # batched: CPU-side cost of queueing one step
    host_q1_s: float | None = None
    host_q3_s: float | None = None
    host_speedup_vs_torch: float | None = None
    restore_median_s: float | None = None  # batched: untimed restore + reset per step (subtracted)
    restore_device_median_s: float | None = None
    device_steps_per_sample: int | None = None
    spin_overruns: int | None = None  # device samples whose spin ran out before the host queued
    pointer_change_rate: float | None = None  # realloc: share of steps with new grad addresses
    workload_wall_s: float | None = None  # the whole workload: build, warm-up, rounds, profile
    ops: int | None = None
    items: int | None = None
    launches: int | None = None
    syncs: int | None = None
    py_bytecodes: int | None = None  # Python bytecode instructions one step executes

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.median_s is not None

    @property
    def variant(self) -> str:
        return (" +inf" if self.inject_inf else "") + (" realloc" if self.realloc else "")

    @property
    def label(self) -> str:
        return f"{self.workload} {self.dtype}{self.variant}"

    @property
    def iqr_s(self) -> float | None:
        if self.q1_s is None or self.q3_s is None:
            return None
        return self.q3_s - self.q1_s


def too_big(w: Workload, device: torch.device, copies: int = 1) -> str | None:
    """Why ``copies`` builds of ``w`` do not fit in the free memory, or None."""
    need = copies * (2 * w.grad_bytes + (64 << 20))
    if is_gpu(device):
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return f"needs {need / 2**30:.1f} GiB of memory" if need > 0.8 * free else None


def _base(question: str, w: Workload, m: Method) -> Record:
    return Record(
        question, w.name, w.family, w.dtype, w.inject_inf, w.n_tensors, w.numel, w.grad_bytes,
        m.name, m.kind, realloc=w.realloc,
    )  # fmt: skip


def make_runners(
    gs: GradSet, methods: list[Method], quick: bool = False
) -> tuple[dict[str, Runner], dict[str, tuple[str, str]]]:
    """The runners of the methods that can run on ``gs``; (status, note) of the others."""
    runners: dict[str, Runner] = {}
    status: dict[str, tuple[str, str]] = {}
    w, gpu = gs.workload, is_gpu(gs.device)
    for m in methods:
        reason = m.unavailable(w, gs.device)
        limit = (m.max_cpu_bytes or 0) // (4 if quick else 1)
        if m.max_cpu_bytes is not None and not gpu and w.grad_bytes > limit:
            reason = f"skipped on CPU above {limit / 2**20:.0f} MiB of gradients (time budget)"
        if reason:
            status[m.name] = ("n/a", reason)
            continue
        try:
            runners[m.name] = m.factory(gs)
        except Exception as e:  # noqa: BLE001 - reported in the table
            status[m.name] = ("error", error_line(e))
    return runners, status


def run_workload(
    ctx: Context,
    question: str,
    w: Workload,
    methods: list[Method] | None = None,
    python_cost: bool = False,
) -> list[Record]:
    """Builds ``w``, times ``methods`` (default: the context's), counts their ops (and, with
    ``python_cost``, Python bytecodes), and derives GB/s and the ratios."""
    methods = methods if methods is not None else ctx.methods
    t0 = time.perf_counter()
    records = {m.name: _base(question, w, m) for m in methods}
    ctx.describe(w.label)
    big = too_big(w, ctx.device)
    if big:
        for r in records.values():
            r.status, r.note = "skipped", big
        return list(records.values())

    gs = build(w, ctx.device)
    gs.restore_on_one_thread = ctx.restore_on_one_thread
    runners, status = make_runners(gs, methods, ctx.quick)
    for name, (st, note) in status.items():
        records[name].status, records[name].note = st, note
    timings = measure(gs, runners, ctx.timing)
    for name, t in timings.items():
        _fill_timing(records[name], t, runners[name].bytes_moved(gs))
    if w.realloc:
        for r in records.values():
            r.pointer_change_rate = gs.pointer_change_rate
            if r.status == "ok" and r.pointer_change_rate is not None:
                note = f"new gradient addresses in {r.pointer_change_rate:.0%} of steps"
                r.note = f"{r.note}; {note}" if r.note else note
    ok = {n: r for n, r in runners.items() if records[n].status == "ok"}
    if ctx.profile:
        try:
            counts = count_ops(gs, ok)
        except Exception as e:  # noqa: BLE001 - counts are optional
            ctx.notes.append(f"profiler failed on {w.label}: {type(e).__name__}: {e}"[:200])
            counts = {}
        for name, c in counts.items():
            rec = records[name]
            rec.ops, rec.items, rec.launches, rec.syncs = c.ops, c.items, c.launches, c.syncs
    if python_cost:
        for name, n in python_bytecodes(gs, ok).items():
            records[name].py_bytecodes = n
    gs.release()
    del gs, runners
    gc.collect()
    if is_gpu(ctx.device):
        torch.cuda.empty_cache()
    derive(list(records.values()))
    for r in records.values():
        r.workload_wall_s = round(time.perf_counter() - t0, 2)
    return list(records.values())


def _fill_timing(rec: Record, t: MethodTiming, nbytes: int) -> None:
    if t.error is not None:
        rec.status, rec.note = "error", t.error
        return
    if t.wall.n == 0:
        rec.status, rec.note = "error", "no samples"
        return
    rec.timing, rec.steps_per_sample = t.mode, t.steps
    rec.median_s, rec.q1_s, rec.q3_s, rec.samples = t.wall.median, t.wall.q1, t.wall.q3, t.wall.n
    if rec.median_s <= 0:  # batched: lost in the noise of the restores subtracted
        rec.status = "n/a"
        rec.note = f"below resolution: median {rec.median_s * 1e6:.2f} us per step (<= 0)"
        rec.median_s = None
        return
    rec.bytes_moved = nbytes
    rec.gbps = nbytes / rec.median_s / 1e9
    if t.host is not None and t.host.n:
        rec.host_median_s, rec.host_q1_s, rec.host_q3_s = t.host.median, t.host.q1, t.host.q3
    if t.restore is not None and t.restore.n:
        rec.restore_median_s = t.restore.median
    if t.restore_device is not None and t.restore_device.n:
        rec.restore_device_median_s = t.restore_device.median
    if t.device is not None and t.device.n:
        rec.device_steps_per_sample = t.device_steps
        rec.spin_overruns = t.spin_overruns
        rec.device_median_s = t.device.median
        rec.device_q1_s, rec.device_q3_s = t.device.q1, t.device.q3
        if rec.device_median_s > 0:
            rec.device_gbps = nbytes / rec.device_median_s / 1e9


def derive(recs: list[Record]) -> None:
    """Ratios within one workload's records."""
    by = {r.method: r for r in recs if r.ok}
    floor, copy, ref = by.get("floor-mul"), by.get("floor-copy"), by.get("torch")
    for r in by.values():
        if floor is not None:
            r.x_floor = r.median_s / floor.median_s
        if copy is not None and r.gbps:
            r.x_copy = copy.gbps / r.gbps
            if copy.device_gbps and r.device_gbps:
                r.device_x_copy = copy.device_gbps / r.device_gbps
        if ref is not None and r.kind != "floor":
            r.speedup_vs_torch = ref.median_s / r.median_s
            if ref.device_median_s and r.device_median_s and r.device_median_s > 0:
                r.device_speedup_vs_torch = ref.device_median_s / r.device_median_s
            if ref.host_median_s and r.host_median_s and r.host_median_s > 0:
                r.host_speedup_vs_torch = ref.host_median_s / r.host_median_s


# --------------------------------------------------------------------------- counts
_LAUNCH = set("cudaLaunchKernel cudaLaunchKernelExC cuLaunchKernel cuLaunchKernelEx".split())
_LAUNCH.add("cudaLaunchCooperativeKernel")
_SYNC = set("cudaStreamSynchronize cudaDeviceSynchronize cudaEventSynchronize cudaMemcpy".split())
_ITEM = "aten::_local_scalar_dense"
_MARK = "ampfused_bench#"


@dataclass
class OpCounts:
    ops: int  # top-level dispatcher ops (aten::..., ampfused::...)
    items: int  # .item() / bool(tensor) calls: a blocking host sync each on a GPU
    launches: int | None = None  # GPU only
    syncs: int | None = None  # GPU only


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The profiler's own C++ logging to file descriptor 2 (kineto's USDT lines, "ERROR: ...
    gpuGetDeviceCount failed" without a GPU) would land in the progress bar."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def count_ops(gs: GradSet, runners: dict[str, Runner]) -> dict[str, OpCounts]:
    """Profiles one step of each runner (each after an unprofiled restore and reset)."""
    gpu = is_gpu(gs.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with _quiet_stderr(), profile(activities=activities) as prof:
        for name, runner in runners.items():
            gs.restore()
            runner.reset()
            if gpu:
                torch.cuda.synchronize(gs.device)
            with record_function(_MARK + name):
                runner.run()
            if gpu:
                torch.cuda.synchronize(gs.device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    marks = [e for e in events if e.name.startswith(_MARK)]
    out: dict[str, OpCounts] = {}
    for m in marks:
        name = m.name[len(_MARK) :]
        lo, hi = m.time_range.start, m.time_range.end
        inside = [
            e
            for e in events
            if e is not m
            and e.thread == m.thread
            and lo <= e.time_range.start
            and e.time_range.end <= hi
        ]
        c = OpCounts(
            ops=sum(1 for e in inside if "::" in e.name and e.cpu_parent is m),
            items=sum(1 for e in inside if e.name == _ITEM),
        )
        if gpu:
            c.launches = sum(1 for e in inside if e.name in _LAUNCH)
            c.syncs = sum(1 for e in inside if e.name in _SYNC)
        out[name] = c
    return out


def python_bytecodes(gs: GradSet, runners: dict[str, Runner]) -> dict[str, int]:
    """Python bytecode instructions one step of each runner executes, in every frame it enters:
    host work without timing noise (a count growing with the tensor count is a Python loop)."""
    out: dict[str, int] = {}
    for name, runner in runners.items():
        gs.restore()
        runner.reset()
        executed = 0

        def local(frame: FrameType, event: str, arg: object) -> Callable | None:
            nonlocal executed
            if event == "opcode":
                executed += 1
            return local

        def on_call(frame: FrameType, event: str, arg: object) -> Callable | None:
            frame.f_trace_opcodes = True
            return local

        previous = sys.gettrace()
        sys.settrace(on_call)
        try:
            runner.run()
        finally:
            sys.settrace(previous)
        out[name] = executed
    return out
