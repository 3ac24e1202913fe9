"""A step's host cost in instructions: a number that does not move with the machine's load.

Counts the user-space instructions of ``unscale_``, ``step`` and ``update`` apart (no-op
optimizer, torch on one thread, gc paused, after 20 warm-up steps) for both scalers on the
host-bound gradient sets, with the CPU's hardware counter (``perf_event_open``; a figure is the
smallest mean over three windows) or else under callgrind, re-running itself with
instrumentation off until the workloads are built, one dump per call, which also splits each
count by layer (Python, torch, ampfused's extension, the C library).  An empty window's count
(the floor, printed beside) is in every figure.

    python -m benchmarks.instructions [--counter callgrind] [--out DIR]  # + instructions.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.env import REPO, run_folder, shown

PHASES = ("unscale_", "step", "update")
# (name, tensors, elements each): the fixed cost of a step, and two host-bound sets.
WORKLOADS = (("1 x 16", 1, 16), ("3000 x 16", 3000, 16), ("1000 x 1K", 1000, 1024))
# "optimizer": the no-op optimizer's step() alone, no scaler: the part of `step` neither scaler
# can cut (torch.optim's wrapper, the hooks, @torch.no_grad)
METHOD_NAMES = ("ampfused", "torch", "optimizer")
_UNDER_CALLGRIND = "AMPFUSED_BENCH_CALLGRIND_OUT"


# --------------------------------------------------------------------------- counters
# begin() ... end(label) -> (instructions, {object file: instructions} under callgrind)
class HardwareCounter:
    name = "hardware counter (perf_event_open: instructions, user space, one thread)"
    _SYSCALL = {"x86_64": 298, "aarch64": 241}

    def __init__(self) -> None:
        self.fd = -1
        number = self._SYSCALL.get(platform.machine())
        if not sys.platform.startswith("linux") or number is None:
            self.reason = f"no perf_event_open on {sys.platform}/{platform.machine()}"
            return
        # perf_event_attr: type PERF_TYPE_HARDWARE (0), its size, config INSTRUCTIONS (1), and
        # the flags word at byte 40: disabled | exclude_kernel | exclude_hv
        attr = bytearray(128)
        struct.pack_into("IIQ", attr, 0, 0, len(attr), 1)
        struct.pack_into("Q", attr, 40, (1 << 0) | (1 << 5) | (1 << 6))
        libc = ctypes.CDLL(None, use_errno=True)
        buf = (ctypes.c_char * len(attr)).from_buffer(attr)
        fd = libc.syscall(number, buf, 0, -1, -1, 0)  # this thread, any CPU
        if fd < 0:
            self.reason = (
                f"perf_event_open: {os.strerror(ctypes.get_errno())} (no instructions counter "
                "on this CPU or VM, or /proc/sys/kernel/perf_event_paranoid forbids it)"
            )
            return
        self.fd, self.reason, self._ioctl = fd, None, libc.ioctl

    def begin(self) -> None:
        self._ioctl(self.fd, 0x2403, 0)  # PERF_EVENT_IOC_RESET
        self._ioctl(self.fd, 0x2400, 0)  # PERF_EVENT_IOC_ENABLE

    def end(self, label: str) -> tuple[int, dict[str, int]]:
        self._ioctl(self.fd, 0x2401, 0)  # PERF_EVENT_IOC_DISABLE
        return struct.unpack("q", os.read(self.fd, 8))[0], {}


_CLIENT_SOURCE = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_begin(void) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
void cg_end(const char* label) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(label); }
"""


class CallgrindCounter:
    """Inside ``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no``."""

    name = "callgrind (valgrind: instructions executed, user space, one thread)"
    reason = None

    def __init__(self, out_file: str) -> None:
        lib = os.path.join(os.path.dirname(out_file), "cg_client.so")
        src = lib[:-3] + ".c"
        with open(src, "w") as f:
            f.write(_CLIENT_SOURCE)
        subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
        self.lib = ctypes.CDLL(lib)
        self.out_file = out_file
        self.dumps = 0
        self.lib.cg_start()

    def begin(self) -> None:
        self.lib.cg_begin()

    def end(self, label: str) -> tuple[int, dict[str, int]]:
        self.lib.cg_end(label.encode())
        self.dumps += 1
        (path,) = glob.glob(f"{self.out_file}.{self.dumps}*")
        by_object = _self_cost_by_object(path)
        os.remove(path)
        return sum(by_object.values()), by_object


def _self_cost_by_object(path: str) -> dict[str, int]:
    """Instructions in a callgrind dump, by the object file whose code executed them (self
    cost: a call line's cost is the callee's, counted where the callee's own lines are)."""
    names: dict[str, str] = {}
    costs: dict[str, int] = defaultdict(int)
    current, skip_next = "?", False
    with open(path) as f:
        for line in f:
            if line.startswith(("ob=", "cob=")):
                # ob= and cob= share one table of compressed names: "(id) name" defines one
                ref = line.partition("=")[2].strip()
                if ref.startswith("(") and ")" in ref:
                    key, _, name = ref.partition(")")
                    if name.strip():
                        names[key] = name.strip()
                    ref = names.get(key, "?")
                if line.startswith("ob="):
                    current = ref
            elif line.startswith("calls="):
                skip_next = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if skip_next:
                    skip_next = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    costs[current] += int(parts[1])
    return dict(costs)


def _layer(obj: str) -> str:
    base = os.path.basename(obj)
    if base.startswith("libpython") or base.startswith("python"):
        return "Python"
    if base.startswith(("libtorch", "libc10", "_C.cpython")) and "ampfused" not in obj:
        return "torch"
    if "ampfused" in obj:
        return "ampfused _C"
    if base.startswith(("libc.so", "libc-", "libm.", "ld-linux", "libstdc++", "libgomp")):
        return "C/C++ runtime"
    return "other"


# --------------------------------------------------------------------------- measurement
@dataclass
class Row:
    workload: str
    tensors: int
    method: str
    phases: dict[str, float] = field(default_factory=dict)  # instructions per call
    layers: dict[str, float] = field(default_factory=dict)  # callgrind: per step, by layer

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def _runner(method: str, tensors: int, numel: int):  # noqa: ANN202
    from benchmarks.methods import METHODS
    from benchmarks.workloads import Workload, build, uniform

    gs = build(
        Workload(f"{tensors} x {numel}", tuple(uniform(tensors, numel))), torch.device("cpu")
    )
    return gs, METHODS[method].factory(gs)


def measure(counter, steps: int, windows: int, warmup: int = 20) -> tuple[list[Row], float]:  # noqa: ANN001
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.disable()
    try:
        empty = min(_window(counter, "empty", lambda: None)[0] for _ in range(steps * windows))
        rows = []
        for name, tensors, numel in WORKLOADS:
            for method in METHOD_NAMES:
                gs, runner = _runner("torch" if method == "optimizer" else method, tensors, numel)
                s, opt = runner.scaler, runner.optimizer
                calls: dict[str, Callable[[], None]] = {
                    "unscale_": lambda s=s, opt=opt: s.unscale_(opt),
                    "step": lambda s=s, opt=opt: s.step(opt),
                    "update": s.update,
                }
                if method == "optimizer":
                    calls = {"step": opt.step}
                for _ in range(warmup):
                    gs.restore()
                    runner.reset()
                    runner.run()
                row = Row(name, tensors, method)
                best: dict[str, float] = {}
                layers: dict[str, float] = defaultdict(float)
                for _ in range(windows):
                    sums: dict[str, int] = defaultdict(int)
                    for _ in range(steps):
                        gs.restore()
                        runner.reset()
                        for phase, call in calls.items():
                            n, by_object = _window(counter, f"{name}/{method}/{phase}", call)
                            sums[phase] += n
                            for obj, c in by_object.items():
                                layers[_layer(obj)] += c / (steps * windows)
                    for phase, total in sums.items():
                        best[phase] = min(best.get(phase, float("inf")), total / steps)
                row.phases = {p: best.get(p, 0.0) for p in PHASES}
                row.layers = dict(sorted(layers.items(), key=lambda kv: -kv[1]))
                rows.append(row)
                gs.release()
        return rows, empty
    finally:
        gc.enable()
        torch.set_num_threads(threads)


def _window(counter, label: str, call: Callable[[], None]) -> tuple[int, dict[str, int]]:  # noqa: ANN001
    counter.begin()
    call()
    return counter.end(label)


# --------------------------------------------------------------------------- report
def _grid(rows: list[list[str]], headers: list[str]) -> str:
    from benchmarks.report import tabulate

    return tabulate(rows, headers=headers, tablefmt="github")


def table(rows: list[Row], empty: float) -> str:
    ref = {r.workload: r for r in rows if r.method == "torch"}
    out = [
        [r.workload, r.method, *(f"{r.phases[p]:,.0f}" for p in PHASES), f"{r.total:,.0f}"]
        + [f"{r.total / r.tensors:,.0f}"]
        + [
            f"{r.total / ref[r.workload].total:.3f}"
            if r.method == "ampfused" and r.workload in ref
            else ""
        ]
        for r in rows
    ]
    headers = ["gradients (fp32)", "scaler", *PHASES, "per step", "per tensor", "ampfused / torch"]
    return (
        _grid(out, headers)
        + f"\n\nfloor (an empty window, in every figure above): {empty:,.0f} instructions"
    )


def layer_table(rows: list[Row]) -> str:
    names = sorted(
        {k for r in rows for k in r.layers}, key=lambda k: -max(r.layers.get(k, 0) for r in rows)
    )
    out = [[r.workload, r.method, *(f"{r.layers.get(k, 0):,.0f}" for k in names)] for r in rows]
    return _grid(out, ["gradients", "scaler", *names])


def targets(rows: list[Row]) -> list[tuple[str, str, bool]]:
    """Issue 22's: a one-tensor step at most a third of torch's; at 3000 x 16, per tensor at
    most a twentieth of torch's."""
    by = {(r.workload, r.method): r for r in rows}
    out = []
    for workload, n, what in (
        ("1 x 16", 3, "fixed cost of a step"),
        ("3000 x 16", 20, "per tensor"),
    ):
        a, t = by.get((workload, "ampfused")), by.get((workload, "torch"))
        if a and t:
            x = a.total / t.total
            out.append((f"{workload}: {what} <= 1/{n} of torch's", f"{x:.3f}", x <= 1 / n))
    return out


def targets_text(results: list[tuple[str, str, bool]]) -> str:
    lines = [f"  {'met' if ok else 'not met'}: {name}: {value}" for name, value, ok in results]
    return "\n".join(["our targets (development goals, not tests):", *lines])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.instructions", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--counter", choices=("auto", "hardware", "callgrind"), default="auto")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="folder for instructions.json (default: a new benchmarks/runs/<date>-<time>-"
        "instructions/; the committed one: --out benchmarks/results/cpu)",
    )
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    out_dir = args.out or str(run_folder("instructions"))
    inside = os.environ.get(_UNDER_CALLGRIND)
    if inside:
        counter, steps, windows = CallgrindCounter(inside), 2, 1
    else:
        hw = HardwareCounter() if args.counter in ("auto", "hardware") else None
        if hw is not None and hw.reason is None:
            counter, steps, windows = hw, 10, 3
        elif args.counter == "hardware":
            sys.exit(f"benchmarks.instructions: {hw.reason}")
        else:  # the run under callgrind writes to the folder chosen here
            out_args = [] if args.out else ["--out", out_dir]
            sys.exit(_run_under_callgrind([*argv, *out_args], hw.reason if hw else None))
    rows, empty = measure(counter, steps, windows)
    result = {
        "counter": counter.name,
        "torch": torch.__version__,
        "threads": 1,
        "floor": empty,
        "rows": [asdict(r) | {"total": r.total} for r in rows],
        "targets": targets(rows),
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "instructions.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"host cost in instructions per call ({counter.name}; torch {torch.__version__}, 1 thread)"
    )
    print(table(rows, empty))
    if any(r.layers for r in rows):
        print("\nby layer, per step (self cost of each object file's code):")
        print(layer_table(rows))
    print("\n" + targets_text(result["targets"]))
    # stderr: the suite's instructions question prints stdout under its own heading
    print(f"wrote {shown(Path(path))}", file=sys.stderr)


def _run_under_callgrind(argv: list[str], why: str | None) -> int:
    if shutil.which("valgrind") is None:
        return f"benchmarks.instructions: no counter: {why}, and valgrind is not installed"
    print(
        f"benchmarks.instructions: {why or 'callgrind asked for'}; running under callgrind",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        env = dict(os.environ, **{_UNDER_CALLGRIND: out})
        cmd = "valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no --quiet".split()
        cmd += [f"--callgrind-out-file={out}", sys.executable, "-m", "benchmarks.instructions"]
        return subprocess.run([*cmd, *argv], env=env, cwd=REPO).returncode


if __name__ == "__main__":
    main()
