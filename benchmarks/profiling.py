"""Per-step op counts from ``torch.profiler``: kernel launches and host syncs on a GPU; on CPU
the dispatcher ops and the ``.item()`` calls (each one a blocking host sync on a GPU).  And
(:func:`python_bytecodes`) the Python bytecode instructions a step executes.

All methods of a workload are profiled in one session (starting a profiler costs a fraction of
a second), one step each inside a ``record_function`` marker; events are attributed to the
marker whose time range holds them on the same thread.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.env import is_gpu
from benchmarks.methods import Runner
from benchmarks.workloads import GradSet

_LAUNCH = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
}
_SYNC = {
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous variant
}
_ITEM = "aten::_local_scalar_dense"
_MARK = "ampfused_bench#"


@dataclass
class OpCounts:
    ops: int  # top-level dispatcher ops (aten::..., ampfused::...)
    items: int  # .item() / bool(tensor) calls: a blocking host sync each on a GPU
    launches: int | None = None  # GPU only
    syncs: int | None = None  # GPU only


def count(gs: GradSet, runners: dict[str, Runner]) -> dict[str, OpCounts]:
    """Profiles one step of each runner (each after an unprofiled restore and reset)."""
    gpu = is_gpu(gs.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
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
    """Python bytecode instructions one step of each runner executes (each after an untraced
    restore and reset), in every Python frame the step enters: its Python cost in a unit that
    has no timing noise.  A count that grows with the number of gradients is per-parameter host
    work; C++ loops (the fused pass, foreach kernels) do not count."""
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
