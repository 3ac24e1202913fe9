"""Interleaved timing of several methods on one gradient set: per step on CPU, batched on GPU.

Both methods interleave: every round runs each method once, in an order rotated by one each
round, so machine drift (frequency, a busy neighbour) hits all methods alike.  Before every step
the gradients are restored from a pristine copy and the method's scale state reset (``restore``
and ``reset``, not part of the step's cost).  ``Timer.blocked_autorange`` cannot be used: it runs
the statement many times per setup, and unscaled gradients would drift towards zero.

**per-step** (the CPU default): one sample = one step, timed with :mod:`timeit` machinery (the
engine under ``torch.utils.benchmark.Timer``) driven by :func:`synced_clock`.  On a CPU every op
has finished when it returns, so this is exactly the step's cost.  On a GPU the clock
synchronizes the device before each reading, and a synchronization costs tens of microseconds:
there a per-step sample mostly measures the synchronization, so the GPU default is batched.

**batched** (the GPU default): steps run as a training loop runs them, many in a row with one
device synchronization at the end.  One sample times two batches of ``n`` iterations from a
synchronized start to a synchronized end: A = ``restore; reset; run`` and B = ``restore; reset``
(the same untimed work, queued on the same stream, without the step).  Per step:

- wall   = (wall(A) - wall(B)) / n: what the step adds to a loop (``median_s``)
- host   = (queued(A) - queued(B)) / n, where queued = host time until the last op of the batch
  was queued: the CPU-side cost of the step (launches, Python, and any host sync in the step)
- device = (events(A') - events(B')) / n' from a second pair of shorter batches A', B' queued
  behind a device spin (``torch.cuda._sleep``) long enough for the host to queue the whole
  batch first, so the CUDA events span device work only.  A step with a host sync inside it
  (``.item()``) makes the host wait, and its device time then includes the device's idle time
  while the host turns around after the sync; such samples are counted (``spin_overruns``).
- restore = wall(B) / n and restore_device = events(B') / n', the subtracted restore cost.

The same batched code runs on CPU (``--timing batched``) with :class:`HostClock`, a stand-in
device whose events are host timestamps: wall and host are measured, device time is not.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from benchmarks.env import is_gpu
from benchmarks.methods import Runner
from benchmarks.workloads import GradSet

TIMING_MODES = ("auto", "per-step", "batched")


@dataclass(frozen=True)
class TimingConfig:
    """Rounds run until ``min_rounds`` are done and then either every method has been timed for
    ``min_time_s`` in all, or ``enough_rounds`` are done, or the workload (restores included) has
    taken ``max_wall_s``.  ``mode``: ``auto`` (batched on GPU, per-step on CPU), ``per-step`` or
    ``batched``; the ``batch_*`` fields size the batches of the batched mode."""

    warmup: int = 1  # untimed runs per method first (also catches methods that fail)
    min_rounds: int = 5
    enough_rounds: int = 15
    min_time_s: float = 0.2
    max_wall_s: float = 6.0
    device_time: bool = True  # GPU only
    mode: str = "auto"
    batch_s: float = 0.03  # target wall time of one batch A (steps and restores)
    batch_min: int = 3  # steps per batch, at least ...
    batch_max: int = 400  # ... and at most
    device_batch_max: int = 8  # steps per device-time batch (keeps the launch queue short)
    max_spin_s: float = 0.1  # longest device spin in front of a device-time batch


QUICK_TIMING = TimingConfig(
    warmup=1, min_rounds=3, enough_rounds=7, min_time_s=0.02, max_wall_s=1.5, batch_s=0.02
)
FULL_TIMING = TimingConfig()


def batched(cfg: TimingConfig, device: torch.device) -> bool:
    """Whether ``cfg`` times ``device`` with the batched method."""
    if cfg.mode not in TIMING_MODES:
        raise ValueError(f"timing mode must be one of {TIMING_MODES}, got {cfg.mode!r}")
    return cfg.mode == "batched" or (cfg.mode == "auto" and is_gpu(device))


@dataclass
class Stats:
    times: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.times)

    def _quartiles(self) -> tuple[float, float, float]:
        if len(self.times) == 1:
            t = self.times[0]
            return t, t, t
        q1, q2, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return q1, q2, q3

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def q1(self) -> float:
        return self._quartiles()[0]

    @property
    def q3(self) -> float:
        return self._quartiles()[2]

    @property
    def iqr(self) -> float:
        q1, _, q3 = self._quartiles()
        return q3 - q1


@dataclass
class MethodTiming:
    """One method's samples, seconds per step.  ``wall`` is what ``median_s`` reports: per-step
    host wall time including device completion, or (batched) what the step adds to a loop."""

    wall: Stats = field(default_factory=Stats)
    device: Stats | None = None
    host: Stats | None = None  # batched: CPU-side cost of queueing one step
    restore: Stats | None = None  # batched: the untimed restore's wall time per step
    restore_device: Stats | None = None  # batched: its device time per step
    steps: int | None = None  # batched: steps per wall sample (n)
    device_steps: int | None = None  # batched: steps per device sample (n')
    spin_overruns: int = 0  # device samples the host had not finished queueing in time
    mode: str = "per-step"
    error: str | None = None


def synced_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` after the device finished all queued work."""
    if is_gpu(device):

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


_SLEEP_CYCLES_PER_S: dict[int, float] = {}


def _sleep_cycles_per_second(device: torch.device) -> float:
    """Calibrates ``torch.cuda._sleep`` on ``device`` (it spins a number of GPU clock cycles).
    Call with ``device`` current: ``_sleep`` runs on the current device's current stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SLEEP_CYCLES_PER_S:
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S[index] = cycles / max(start.elapsed_time(end) / 1e3, 1e-6)
    return _SLEEP_CYCLES_PER_S[index]


# --------------------------------------------------------------------------- per step
def device_sample(gs: GradSet, runner: Runner, host_estimate_s: float) -> float:
    """Device time of one step in seconds (CUDA events), the host queued ahead behind a spin."""
    gs.restore()
    runner.reset()
    torch.cuda.synchronize(gs.device)
    spin_s = min(max(2.0 * host_estimate_s, 1e-4), 0.2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(spin_s * _sleep_cycles_per_second(gs.device)))
    start.record()
    runner.run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _warm_up(gs: GradSet, r: Runner, cfg: TimingConfig) -> None:
    """Untimed steps before a method is timed (caches, allocator, CUDA module loading)."""
    for _ in range(max(cfg.warmup, 1)):
        gs.restore()
        r.reset()
        r.run()


def error_line(e: BaseException) -> str:
    """A method's failure as one short line for the results table."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _measure_per_step(
    gs: GradSet,
    runners: dict[str, Runner],
    cfg: TimingConfig,
    on_round: Callable[[], None] | None = None,
) -> dict[str, MethodTiming]:
    """The per-step method: one sample = one step between two device synchronizations."""
    device = gs.device
    out = {name: MethodTiming() for name in runners}
    active: list[str] = []
    for name, r in runners.items():
        try:
            _warm_up(gs, r, cfg)
            if is_gpu(device):
                torch.cuda.synchronize(device)
            active.append(name)
        except Exception as e:  # noqa: BLE001 - reported in the results table
            out[name].error = error_line(e)
    clock = synced_clock(device)
    timers = {
        name: timeit.Timer(
            stmt="run()",
            setup="restore(); reset()",
            timer=clock,
            globals={"run": runners[name].run, "restore": gs.restore, "reset": runners[name].reset},
        )
        for name in active
    }
    gpu_device_time = is_gpu(device) and cfg.device_time
    if gpu_device_time:
        for name in active:
            out[name].device = Stats()

    def sample(name: str, rnd: int) -> None:
        out[name].wall.times.append(timers[name].timeit(1))
        if gpu_device_time:
            est = out[name].wall.median
            out[name].device.times.append(device_sample(gs, runners[name], est))  # type: ignore[union-attr]

    return _rounds(out, active, cfg, sample, lambda n: sum(out[n].wall.times), on_round)


def _rounds(
    out: dict[str, MethodTiming],
    active: list[str],
    cfg: TimingConfig,
    sample: Callable[[str, int], None],
    timed: Callable[[str], float],
    on_round: Callable[[], None] | None,
) -> dict[str, MethodTiming]:
    """Rounds of one ``sample(name, round)`` per active method, in an order rotated by one each
    round, until the config's rule stops them (``timed(name)``: seconds timed so far); a method
    that raises is reported with its error and leaves the rounds."""
    t_start = time.perf_counter()
    gc.collect()
    rnd = 0
    while active:
        k = rnd % len(active)
        for name in active[k:] + active[:k]:
            try:
                sample(name, rnd)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory half way
                out[name].error = error_line(e)
                active.remove(name)
        if on_round is not None:
            on_round()
        rnd += 1
        if rnd >= cfg.min_rounds and (
            rnd >= cfg.enough_rounds
            or all(timed(n) >= cfg.min_time_s for n in active)
            or time.perf_counter() - t_start >= cfg.max_wall_s
        ):
            break
    return out


# --------------------------------------------------------------------------- batched
class DeviceClock(Protocol):
    """What the batched method needs from a device."""

    has_events: bool  # False: the device is the host, so device time is not measured

    def now(self) -> float: ...  # host time, seconds

    def synchronize(self) -> None: ...  # wait until all queued device work has finished

    def record(self) -> Any: ...  # a marker queued on the stream

    def elapsed(self, first: Any, last: Any) -> float: ...  # device seconds between two markers

    def reached(self, marker: Any) -> bool: ...  # has the device passed the marker yet?

    def spin(self, seconds: float) -> bool: ...  # queue a device busy-wait; False: cannot


class CudaClock:
    """CUDA: ``perf_counter`` on the host, events and ``_sleep`` on the device's current stream
    (the stream the runners' ops launch on).  Use inside ``torch.cuda.device(device)``."""

    has_events = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device)

    def now(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def elapsed(self, first: torch.cuda.Event, last: torch.cuda.Event) -> float:
        return first.elapsed_time(last) / 1e3  # milliseconds; both have completed

    def reached(self, marker: torch.cuda.Event) -> bool:
        return marker.query()

    def spin(self, seconds: float) -> bool:
        if not hasattr(torch.cuda, "_sleep"):
            return False
        torch.cuda._sleep(max(1, int(seconds * _sleep_cycles_per_second(self.device))))
        return True


class HostClock:
    """A stand-in device that runs every op on the host before returning (the CPU): markers are
    host timestamps, nothing is ever queued, and there is no device time to measure."""

    has_events = False

    def now(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        pass

    def record(self) -> float:
        return time.perf_counter()

    def elapsed(self, first: float, last: float) -> float:
        return last - first

    def reached(self, marker: float) -> bool:
        return True

    def spin(self, seconds: float) -> bool:
        return False


@dataclass(frozen=True)
class BatchTime:
    wall_s: float  # synchronized start to synchronized end
    host_s: float  # synchronized start to the host having queued the last op
    device_s: float  # device time from the first marker to the last
    overrun: bool  # the device reached the first marker before the host had queued everything


def time_batch(
    clock: DeviceClock, ops: Sequence[Callable[[], None]], n: int, spin_s: float = 0.0
) -> BatchTime:
    """Runs ``ops`` in order, ``n`` times, as a loop does: no synchronization inside.  With
    ``spin_s``, a device spin is queued first so that the host can queue the batch before the
    device reaches it (the markers then bracket device work only)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: no collection pause inside a timed region
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
    """Steps per batch for an iteration (step + restore) of ``step_s`` seconds."""
    n = math.ceil(cfg.batch_s / max(step_s, 1e-7))
    return max(cfg.batch_min, min(cfg.batch_max, n))


@dataclass(frozen=True)
class PairSample:
    """One sample of the batched method, seconds per step."""

    wall: float
    host: float
    restore: float
    timed_s: float  # wall time of the batches run


def wall_sample(
    clock: DeviceClock,
    restore: Callable[[], None],
    reset: Callable[[], None],
    run: Callable[[], None],
    n: int,
    step_first: bool = True,
) -> PairSample:
    """Batches A (restore, reset, run) and B (restore, reset) of ``n`` iterations, back to back
    in either order; the step's cost is their difference."""
    with_step, without = (restore, reset, run), (restore, reset)
    if step_first:
        a = time_batch(clock, with_step, n)
        b = time_batch(clock, without, n)
    else:
        b = time_batch(clock, without, n)
        a = time_batch(clock, with_step, n)
    return PairSample(
        wall=(a.wall_s - b.wall_s) / n,
        host=(a.host_s - b.host_s) / n,
        restore=b.wall_s / n,
        timed_s=a.wall_s + b.wall_s,
    )


@dataclass(frozen=True)
class DeviceSample:
    device: float
    restore_device: float
    overrun: bool
    timed_s: float


def device_pair_sample(
    clock: DeviceClock,
    restore: Callable[[], None],
    reset: Callable[[], None],
    run: Callable[[], None],
    n: int,
    host_step_s: float,
    host_restore_s: float,
    max_spin_s: float,
) -> DeviceSample:
    """Batches A' and B' of ``n`` iterations, each behind a spin of twice the host's estimated
    time to queue it (``host_step_s`` + ``host_restore_s`` per iteration for A', the latter for
    B'); the step's device time is the difference of their event spans."""

    def spin(per_iteration_s: float) -> float:
        return min(max(2.0 * per_iteration_s * n, 1e-4), max_spin_s)

    a = time_batch(clock, (restore, reset, run), n, spin(host_step_s + host_restore_s))
    b = time_batch(clock, (restore, reset), n, spin(host_restore_s))
    return DeviceSample(
        device=(a.device_s - b.device_s) / n,
        restore_device=b.device_s / n,
        overrun=a.overrun,
        timed_s=a.wall_s + b.wall_s,
    )


def _measure_batched(
    gs: GradSet,
    runners: dict[str, Runner],
    cfg: TimingConfig,
    clock: DeviceClock,
    on_round: Callable[[], None] | None = None,
) -> dict[str, MethodTiming]:
    """The batched method (module docstring) with ``clock`` as the device."""
    out = {name: MethodTiming(mode="batched") for name in runners}
    active: list[str] = []
    for name, r in runners.items():
        try:
            _warm_up(gs, r, cfg)
            clock.synchronize()
            # Calibration: the slope between batches of 1 and 3 iterations (the synchronization
            # each batch ends with cancels) sizes the batches; it also warms the loop's path.
            ops = (gs.restore, r.reset, r.run)
            one, three = time_batch(clock, ops, 1), time_batch(clock, ops, 3)
            t = out[name]
            t.steps = batch_steps((three.wall_s - one.wall_s) / 2, cfg)
            t.host, t.restore = Stats(), Stats()
            if clock.has_events and cfg.device_time:
                t.device_steps = min(t.steps, cfg.device_batch_max)
                t.device, t.restore_device = Stats(), Stats()
            active.append(name)
        except Exception as e:  # noqa: BLE001 - reported in the results table
            out[name].error = error_line(e)
    timed = dict.fromkeys(active, 0.0)

    def sample(name: str, rnd: int) -> None:
        r, t = runners[name], out[name]
        w = wall_sample(clock, gs.restore, r.reset, r.run, t.steps, rnd % 2 == 0)  # type: ignore[arg-type]
        t.wall.times.append(w.wall)
        t.host.times.append(w.host)  # type: ignore[union-attr]
        t.restore.times.append(w.restore)  # type: ignore[union-attr]
        timed[name] += w.timed_s
        if t.device is not None:
            d = device_pair_sample(
                clock,
                gs.restore,
                r.reset,
                r.run,
                t.device_steps,  # type: ignore[arg-type]
                w.host,
                w.restore,
                cfg.max_spin_s,
            )
            t.device.times.append(d.device)
            t.restore_device.times.append(d.restore_device)  # type: ignore[union-attr]
            t.spin_overruns += d.overrun

    return _rounds(out, active, cfg, sample, timed.__getitem__, on_round)


def measure(
    gs: GradSet,
    runners: dict[str, Runner],
    cfg: TimingConfig,
    on_round: Callable[[], None] | None = None,
    clock: DeviceClock | None = None,
) -> dict[str, MethodTiming]:
    """Time every runner on ``gs``; a runner that raises is reported with its error, not timed.
    Per step or batched as ``cfg`` says (:func:`batched`); ``clock`` overrides the device's own
    (tests)."""
    if not batched(cfg, gs.device):
        if is_gpu(gs.device):
            with torch.cuda.device(gs.device):  # device_sample's _sleep and events
                return _measure_per_step(gs, runners, cfg, on_round)
        return _measure_per_step(gs, runners, cfg, on_round)
    if clock is not None:
        return _measure_batched(gs, runners, cfg, clock, on_round)
    if is_gpu(gs.device):
        # _sleep and the events go to the current device's current stream: make it gs.device.
        with torch.cuda.device(gs.device):
            return _measure_batched(gs, runners, cfg, CudaClock(gs.device), on_round)
    return _measure_batched(gs, runners, cfg, HostClock(), on_round)
