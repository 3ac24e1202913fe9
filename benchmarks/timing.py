"""Interleaved timing of several methods on one gradient set (benchmarks/README.md, "Method").

Every round runs each method once, in an order shuffled each round (seeded), so that no method
always runs right after the same other one (a rotation keeps the circular order: in step_cost
ampfused then always ran right after the floor's 3000 per-tensor multiplies, which evict what a
step reads, while torch always followed ampfused's short step); before every step
the gradients are restored and the scale reset, untimed (``Timer.blocked_autorange`` would run
the statement many times per setup and the gradients would drift towards zero).

- **per-step** (CPU default): one sample = one step from a synchronized start to a synchronized
  end; on a GPU the synchronization would dominate, hence
- **batched** (GPU default): a sample times batches A = ``n x (restore; reset; run)`` and
  B = ``n x (restore; reset)``, one synchronization at the end of each.  wall = (A - B) / n;
  host = the same difference of host time until the last op was queued; device = the
  difference of CUDA-event spans of shorter batches A', B' queued behind a ``torch.cuda._sleep``
  spin long enough for the host to queue them first (a step with a host sync inside overruns
  the spin: counted in ``spin_overruns``); restore = B / n.

On CPU the same code runs with :class:`HostClock`, whose device is the host (no device time).
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.env import is_gpu
from benchmarks.methods import Runner
from benchmarks.workloads import GradSet

TIMING_MODES = ("auto", "per-step", "batched")


@dataclass(frozen=True)
class TimingConfig:
    """Rounds run until ``min_rounds`` are done and then either every method has been timed for
    ``min_time_s``, or ``enough_rounds`` are done, or ``max_wall_s`` has passed."""

    warmup: int = 1  # untimed runs per method first (also catches methods that fail)
    min_rounds: int = 5
    enough_rounds: int = 15
    min_time_s: float = 0.2
    max_wall_s: float = 6.0
    device_time: bool = True  # GPU only
    mode: str = "auto"  # auto: batched on GPU, per-step on CPU
    batch_s: float = 0.03  # target wall time of one batch A
    batch_min: int = 3  # steps per batch, at least ...
    batch_max: int = 400  # ... and at most
    device_batch_max: int = 8  # steps per device-time batch (keeps the launch queue short)
    max_spin_s: float = 0.1  # longest device spin in front of a device-time batch

    def done(self, rounds: int, timed: Sequence[float], elapsed_s: float) -> bool:
        """The stopping rule, after ``rounds`` rounds (``timed``: seconds timed per method)."""
        return rounds >= self.min_rounds and (
            rounds >= self.enough_rounds
            or all(t >= self.min_time_s for t in timed)
            or elapsed_s >= self.max_wall_s
        )


QUICK_TIMING = TimingConfig(
    warmup=1, min_rounds=3, enough_rounds=7, min_time_s=0.02, max_wall_s=1.5, batch_s=0.02
)
FULL_TIMING = TimingConfig()


def batched(cfg: TimingConfig, device: torch.device) -> bool:
    if cfg.mode not in TIMING_MODES:
        raise ValueError(f"timing mode must be one of {TIMING_MODES}, got {cfg.mode!r}")
    return cfg.mode == "batched" or (cfg.mode == "auto" and is_gpu(device))


@dataclass
class Stats:
    times: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.times)

    def _quartiles(self) -> list[float]:
        if len(self.times) == 1:
            return self.times * 3
        return statistics.quantiles(self.times, n=4, method="inclusive")

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def q1(self) -> float:
        return self._quartiles()[0]

    @property
    def q3(self) -> float:
        return self._quartiles()[2]


@dataclass
class MethodTiming:
    """One method's samples, seconds per step; the batched mode fills the optional fields."""

    wall: Stats = field(default_factory=Stats)  # what median_s reports
    device: Stats | None = None
    host: Stats | None = None
    restore: Stats | None = None
    restore_device: Stats | None = None
    steps: int | None = None  # steps per wall sample (n)
    device_steps: int | None = None  # steps per device sample (n')
    spin_overruns: int = 0
    mode: str = "per-step"
    error: str | None = None


def error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


# --------------------------------------------------------------------------- clocks
class HostClock:
    """The interface the timing needs from a device, for a device that is the host: every op
    has finished when it returns, markers are host timestamps, no device time."""

    has_events = False

    def now(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:  # wait until all queued device work has finished
        pass

    def record(self) -> Any:  # a marker queued on the stream
        return time.perf_counter()

    def elapsed(self, first: Any, last: Any) -> float:  # device seconds between two markers
        return last - first

    def reached(self, marker: Any) -> bool:  # has the device passed the marker yet?
        return True

    def spin(self, seconds: float) -> bool:  # queue a device busy-wait; False: cannot
        return False


_SLEEP_CYCLES_PER_S: dict[int, float] = {}


class CudaClock(HostClock):
    """Events and ``_sleep`` on the device's current stream (where the runners' ops launch).
    Use inside ``torch.cuda.device(device)``."""

    has_events = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def elapsed(self, first: torch.cuda.Event, last: torch.cuda.Event) -> float:
        return first.elapsed_time(last) / 1e3

    def reached(self, marker: torch.cuda.Event) -> bool:
        return marker.query()

    def spin(self, seconds: float) -> bool:
        if not hasattr(torch.cuda, "_sleep"):
            return False
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if index not in _SLEEP_CYCLES_PER_S:  # calibrate: _sleep spins a number of clock cycles
            cycles = 10_000_000
            torch.cuda._sleep(cycles // 10)
            start = self.record()
            torch.cuda._sleep(cycles)
            end = self.record()
            end.synchronize()
            _SLEEP_CYCLES_PER_S[index] = cycles / max(self.elapsed(start, end), 1e-6)
        torch.cuda._sleep(max(1, int(seconds * _SLEEP_CYCLES_PER_S[index])))
        return True


def device_clock(device: torch.device) -> HostClock:
    return CudaClock(device) if is_gpu(device) else HostClock()


# --------------------------------------------------------------------------- batches
@dataclass(frozen=True)
class BatchTime:
    wall_s: float  # synchronized start to synchronized end
    host_s: float  # synchronized start to the host having queued the last op
    device_s: float  # device time from the first marker to the last
    overrun: bool  # the device reached the first marker before the host had queued everything


def time_batch(
    clock: HostClock, ops: Sequence[Callable[[], None]], n: int, spin_s: float = 0.0
) -> BatchTime:
    """Runs ``ops`` in order, ``n`` times, with no synchronization inside, the garbage
    collector paused; with ``spin_s``, behind a device spin so the markers bracket device work."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        clock.synchronize()
        spun = spin_s > 0 and clock.spin(spin_s)
        t0 = clock.now()
        first = clock.record()
        for _ in range(n):
            for op in ops:
                op()
        last = clock.record()
        t1 = clock.now()
        overrun = spun and clock.reached(first)
        clock.synchronize()
        t2 = clock.now()
    finally:
        if gc_was_enabled:
            gc.enable()
    return BatchTime(t2 - t0, t1 - t0, clock.elapsed(first, last), overrun)


def batch_steps(step_s: float, cfg: TimingConfig) -> int:
    return max(cfg.batch_min, min(cfg.batch_max, math.ceil(cfg.batch_s / max(step_s, 1e-7))))


# --------------------------------------------------------------------------- rounds
def measure(
    gs: GradSet,
    runners: dict[str, Runner],
    cfg: TimingConfig,
    clock: HostClock | None = None,
) -> dict[str, MethodTiming]:
    """Times every runner on ``gs`` (``clock``: the device's own unless given, for tests); a
    runner that raises is reported with its error, not timed."""
    if clock is None and is_gpu(gs.device):
        with torch.cuda.device(gs.device):  # _sleep and the events use the current device
            return _measure(gs, runners, cfg, CudaClock(gs.device))
    return _measure(gs, runners, cfg, clock or HostClock())


def _measure(
    gs: GradSet, runners: dict[str, Runner], cfg: TimingConfig, clock: HostClock
) -> dict[str, MethodTiming]:
    per_step = not batched(cfg, gs.device)
    out = {name: MethodTiming(mode="per-step" if per_step else "batched") for name in runners}
    device_time = clock.has_events and cfg.device_time
    active: list[str] = []
    for name, r in runners.items():
        t, ops = out[name], (gs.restore, r.reset, r.run)
        try:
            for _ in range(max(cfg.warmup, 1)):  # caches, allocator, CUDA module loading
                for f in ops:
                    f()
            clock.synchronize()
            if not per_step:
                # The slope between batches of 1 and 3 iterations sizes the batches.
                one, three = time_batch(clock, ops, 1), time_batch(clock, ops, 3)
                t.steps = batch_steps((three.wall_s - one.wall_s) / 2, cfg)
                t.host, t.restore = Stats(), Stats()
                if device_time:
                    t.device_steps = min(t.steps, cfg.device_batch_max)
                    t.restore_device = Stats()
            t.device = Stats() if device_time else None
            active.append(name)
        except Exception as e:  # noqa: BLE001 - reported in the results table
            t.error = error_line(e)
    timed = dict.fromkeys(active, 0.0)

    def sample(name: str, rnd: int) -> None:
        r, t = runners[name], out[name]
        if per_step:
            gs.restore()
            r.reset()
            b = time_batch(clock, (r.run,), 1)
            t.wall.times.append(b.wall_s)
            timed[name] += b.wall_s
            if t.device is not None:
                gs.restore()
                r.reset()
                spin = min(max(2.0 * t.wall.median, 1e-4), cfg.max_spin_s)
                t.device.times.append(time_batch(clock, (r.run,), 1, spin).device_s)
            return
        n, order = t.steps, ((gs.restore, r.reset, r.run), (gs.restore, r.reset))
        a_first = rnd % 2 == 0  # A and B run first in turn
        x, y = (time_batch(clock, ops, n) for ops in (order if a_first else order[::-1]))
        a, b = (x, y) if a_first else (y, x)
        t.wall.times.append((a.wall_s - b.wall_s) / n)
        t.host.times.append((a.host_s - b.host_s) / n)
        t.restore.times.append(b.wall_s / n)
        timed[name] += a.wall_s + b.wall_s
        if t.device is not None:  # A' and B' behind spins of twice the host's time to queue them
            m, host, restore = t.device_steps, t.host.times[-1], t.restore.times[-1]

            def spin(per_iteration_s: float) -> float:
                return min(max(2.0 * per_iteration_s * m, 1e-4), cfg.max_spin_s)

            a = time_batch(clock, order[0], m, spin(host + restore))
            b = time_batch(clock, order[1], m, spin(restore))
            t.device.times.append((a.device_s - b.device_s) / m)
            t.restore_device.times.append(b.device_s / m)
            t.spin_overruns += a.overrun

    t_start = time.perf_counter()
    gc.collect()
    rnd, shuffle = 0, random.Random(0).shuffle
    while active:
        order = list(active)
        shuffle(order)
        for name in order:
            try:
                sample(name, rnd)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory half way
                out[name].error = error_line(e)
                active.remove(name)
        rnd += 1
        if cfg.done(rnd, [timed[n] for n in active], time.perf_counter() - t_start):
            break
    return out
