"""Interleaved, synchronized timing of several methods on one gradient set.

Every sample is one optimizer step, timed with :mod:`timeit` machinery (the engine under
``torch.utils.benchmark.Timer``) driven by a clock that synchronizes the device first, so a sample
is host wall time *including* device completion.  The untimed ``setup`` of each sample restores the
gradients and the method's scale state.  ``Timer.blocked_autorange`` itself cannot be used: it
runs the statement many times per setup, and unscaled gradients would drift towards zero.

Methods are interleaved: every round runs each method once, in an order rotated by one each round,
so machine drift (frequency, a busy neighbour) hits all methods alike.  On a GPU a second sample
per method measures device time alone with CUDA events, behind a ``torch.cuda._sleep`` that lets
the host queue the whole step first (so host launch overhead is hidden, except after a host sync
inside the step, which is then part of the cost).
"""

from __future__ import annotations

import gc
import statistics
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.env import is_gpu
from benchmarks.methods import Runner
from benchmarks.workloads import GradSet


@dataclass(frozen=True)
class TimingConfig:
    """Rounds run until ``min_rounds`` are done and then either every method has been timed for
    ``min_time_s`` in all, or ``enough_rounds`` are done, or the workload (restores included) has
    taken ``max_wall_s``."""

    warmup: int = 1  # untimed runs per method first (also catches methods that fail)
    min_rounds: int = 5
    enough_rounds: int = 15
    min_time_s: float = 0.2
    max_wall_s: float = 6.0
    device_time: bool = True  # GPU only


QUICK_TIMING = TimingConfig(
    warmup=1, min_rounds=3, enough_rounds=7, min_time_s=0.02, max_wall_s=1.5
)
FULL_TIMING = TimingConfig()


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
    host: Stats = field(default_factory=Stats)
    device: Stats | None = None
    error: str | None = None


def synced_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` after the device finished all queued work."""
    if is_gpu(device):

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


_SLEEP_CYCLES_PER_S: float | None = None


def _sleep_cycles_per_second() -> float:
    """Calibrates ``torch.cuda._sleep`` (it spins a number of GPU clock cycles)."""
    global _SLEEP_CYCLES_PER_S
    if _SLEEP_CYCLES_PER_S is None:
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S = cycles / max(start.elapsed_time(end) / 1e3, 1e-6)
    return _SLEEP_CYCLES_PER_S


def device_sample(gs: GradSet, runner: Runner, host_estimate_s: float) -> float:
    """Device time of one step in seconds (CUDA events), the host queued ahead behind a spin."""
    gs.restore()
    runner.reset()
    torch.cuda.synchronize(gs.device)
    spin_s = min(max(2.0 * host_estimate_s, 1e-4), 0.2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(spin_s * _sleep_cycles_per_second()))
    start.record()
    runner.run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(
    gs: GradSet,
    runners: dict[str, Runner],
    cfg: TimingConfig,
    on_round: Callable[[], None] | None = None,
) -> dict[str, MethodTiming]:
    """Time every runner on ``gs``; a runner that raises is reported with its error, not timed."""
    device = gs.device
    out = {name: MethodTiming() for name in runners}
    active: list[str] = []
    for name, r in runners.items():
        try:
            for _ in range(max(cfg.warmup, 1)):
                gs.restore()
                r.reset()
                r.run()
            if is_gpu(device):
                torch.cuda.synchronize(device)
            active.append(name)
        except Exception as e:  # noqa: BLE001 - reported in the results table
            out[name].error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
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
    t_start = time.perf_counter()
    gc.collect()
    rnd = 0
    while active:
        k = rnd % len(active)
        for name in active[k:] + active[:k]:
            try:
                out[name].host.times.append(timers[name].timeit(1))
                if gpu_device_time:
                    est = out[name].host.median
                    out[name].device.times.append(device_sample(gs, runners[name], est))  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - e.g. out of memory half way
                out[name].error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                active.remove(name)
        if on_round is not None:
            on_round()
        rnd += 1
        if rnd >= cfg.min_rounds and (
            rnd >= cfg.enough_rounds
            or all(sum(out[n].host.times) >= cfg.min_time_s for n in active)
            or time.perf_counter() - t_start >= cfg.max_wall_s
        ):
            break
    return out
