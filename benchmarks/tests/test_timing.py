"""The timing method without a GPU: the batched code against a simulated device whose costs
are known exactly, then on the CPU against a step of known cost and on real gradient sets."""

from __future__ import annotations

import dataclasses
import time
import types
import weakref

import pytest
import torch

from benchmarks import e2e
from benchmarks.methods import METHODS, Runner
from benchmarks.suite import Context, run_workload
from benchmarks.timing import HostClock, TimingConfig, batched, measure, time_batch
from benchmarks.workloads import Workload, build, uniform

US = 1e-6


class SimClock:
    """One in-order stream in virtual time: ``launch(h, d)`` costs the host ``h`` and then runs
    ``d`` on the device once the previous op has finished; a sync waits, plus ``latency``."""

    has_events = True

    def __init__(self, latency_us: float = 0.0) -> None:
        self.host = self.free = 0.0
        self.latency = latency_us * US

    def launch(self, host_s: float, device_s: float) -> float:
        self.host += host_s
        self.free = max(self.host, self.free) + device_s
        return self.free

    def op(self, host_us: float, device_us: float):  # noqa: ANN201
        return lambda: self.launch(host_us * US, device_us * US)

    def synced_op(self, pre: tuple, post: tuple):  # noqa: ANN201
        """A scaler-like step: queue, read a flag back (a host sync), queue the rest."""
        return lambda: (self.op(*pre)(), self.synchronize(), self.op(*post)())

    def now(self) -> float:
        return self.host

    def synchronize(self) -> None:
        self.host = max(self.host, self.free) + self.latency

    def record(self) -> float:  # a marker: the time the device reaches it
        return self.launch(0.0, 0.0)

    def elapsed(self, first: float, last: float) -> float:
        return last - first

    def reached(self, marker: float) -> bool:
        return marker <= self.host

    def spin(self, seconds: float) -> bool:
        self.launch(0.0, seconds)
        return True


class FnRunner(Runner):
    def __init__(self, run) -> None:  # noqa: ANN001
        self.run = run


def sim_measure(clock: SimClock, restore, runs: dict, n: int = 200, **cfg) -> dict:  # noqa: ANN001, ANN003
    gs = types.SimpleNamespace(device=torch.device("cpu"), restore=restore)
    cfg = TimingConfig(**{"mode": "batched", "warmup": 2, "min_rounds": 2, "enough_rounds": 2,
                          "batch_min": n, "batch_max": n, **cfg})  # fmt: skip
    return measure(gs, {k: FnRunner(f) for k, f in runs.items()}, cfg, clock)


@pytest.mark.parametrize(
    ("latency", "restore", "step", "wall", "host", "device", "overruns"),
    [
        # Host-bound (host 10 + 20 us a step, device 3 + 5): the step adds its 20 us of host
        # time (and the device's 5 us tail over 3 us of B's, spread over 200 steps); the spin
        # hides the host from the device time.
        (50, (10, 3), (20, 5), 20 + 2 / 200, 20, 5, 0),
        # Device-bound: the step adds its 800 us of device time; its host time is hidden.
        (40, (5, 1000), (10, 800), 800, 10, 800, 0),
        # A host sync inside: 30 us queued, the host waits for the 50 us kernel and the 40 us
        # sync, then queues 10 us: 7 + 130 us against B's 21 us device-bound iteration.  The
        # spin cannot cover a host that waits: every device sample overruns.
        (40, (5, 20), ((30, 50), (10, 2)), 116, 130, None, 2),
    ],
)
def test_batched_method_recovers_known_costs(latency, restore, step, wall, host, device, overruns):  # noqa: ANN001
    clock = SimClock(latency)
    run = clock.synced_op(*step) if isinstance(step[0], tuple) else clock.op(*step)
    gs_restore, reset = clock.op(*restore), clock.op(2, 1)
    t = sim_measure(clock, lambda: (gs_restore(), reset()), {"r": run})["r"]
    assert t.error is None and t.steps == 200 and t.device_steps == 8
    assert t.wall.median / US == pytest.approx(wall, abs=0.2)
    assert t.host.median / US == pytest.approx(host, abs=1e-6)
    if device is not None:
        assert t.device.median / US == pytest.approx(device, abs=1e-6)
    else:
        assert t.device.median / US > 50 + 2  # includes the device's idle time
    assert t.spin_overruns == overruns


def test_each_method_follows_each_other() -> None:
    """The rounds do not keep one circular order: each method runs right after each of the
    others about as often (a rotation by one gave a method the same predecessor in two rounds
    of three)."""
    clock, ran = SimClock(), []
    runs = {k: (lambda k=k: (ran.append(k), clock.op(10, 1)())) for k in "abc"}
    sim_measure(clock, clock.op(1, 1), runs, n=1, mode="per-step", min_rounds=300,
                enough_rounds=300, warmup=1)  # fmt: skip
    timed = ran[3:]  # after the warm-up steps
    assert len(timed) >= 900
    for x in "abc":
        before = [p for p, y in zip(timed, timed[1:], strict=False) if y == x and p != x]
        for p in set("abc") - {x}:
            assert 0.4 < before.count(p) / len(before) < 0.6, (x, p, before.count(p))


def test_sync_latency_is_paid_once_per_batch() -> None:
    """Two steps of 30 and 300 us of host time read 10x apart whatever a sync costs (the old
    per-step GPU sample paid one sync each, compressing the ratio)."""
    for latency in (0.0, 36, 73):
        clock = SimClock(latency)
        runs = {"fast": clock.op(30, 5), "slow": clock.op(300, 10)}
        t = sim_measure(clock, clock.op(4, 2), runs, n=300)
        assert t["slow"].wall.median / t["fast"].wall.median == pytest.approx(10, rel=1e-3)


def test_batches_spin_failures_and_sizes() -> None:
    clock = SimClock()
    b = time_batch(clock, (clock.op(20, 5),), n=10, spin_s=50 * US)  # the host needs 200 us
    assert b.overrun
    b = time_batch(clock, (clock.op(20, 5),), n=10, spin_s=500 * US)
    assert not b.overrun and b.device_s / US == pytest.approx(50) and b.host_s / US == 200
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] > 20:
            raise RuntimeError("out of memory\nsecond line")
        clock.launch(US, US)

    runs = {"small": clock.op(20, 5), "big": clock.op(10, 800), "flaky": flaky}
    out = measure(
        types.SimpleNamespace(device=torch.device("cpu"), restore=clock.op(10, 3)),
        {k: FnRunner(f) for k, f in runs.items()},
        TimingConfig(mode="batched", min_rounds=4, enough_rounds=4, batch_s=0.005),
        clock,
    )
    assert out["flaky"].error == "RuntimeError: out of memory"
    # Batches of 5 ms: 5 ms / (10 + 20 us of host time), 5 ms / (3 + 800 us of device time).
    assert (out["small"].steps, out["big"].steps) == (167, 7)
    assert out["small"].wall.n == out["big"].device.n == 4


def test_modes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not batched(TimingConfig(), cpu) and batched(TimingConfig(), cuda)
    assert batched(TimingConfig(mode="batched"), cpu)
    assert not batched(TimingConfig(mode="per-step"), cuda)
    with pytest.raises(ValueError, match="timing mode"):
        batched(TimingConfig(mode="fast"), cpu)


class ThreadTimeClock(HostClock):
    """This thread's CPU time: what other processes do does not move it."""

    def now(self) -> float:
        return time.thread_time()

    record = now


@pytest.mark.parametrize("mode", ["per-step", "batched"])
def test_a_step_of_known_cpu_cost(mode: str) -> None:
    def busy() -> None:
        end = time.thread_time() + 300 * US
        while time.thread_time() < end:
            pass

    gs = types.SimpleNamespace(device=torch.device("cpu"), restore=lambda: sum(range(2000)))
    cfg = TimingConfig(mode=mode, min_rounds=5, enough_rounds=5, batch_s=0.01, max_wall_s=10)
    t = measure(gs, {"busy": FnRunner(busy)}, cfg, ThreadTimeClock())["busy"]
    assert t.error is None and t.wall.n == 5 and t.device is None
    assert t.wall.median / US == pytest.approx(300, rel=0.05)
    if mode == "batched":
        assert 20 <= t.steps <= 40 and t.restore.median / US > 1
        assert t.host.median / US == pytest.approx(300, rel=0.05)


@pytest.mark.parametrize("mode", ["per-step", "batched"])
def test_run_workload_records(mode: str) -> None:
    timing = TimingConfig(min_rounds=2, enough_rounds=2, batch_s=0.002, max_wall_s=1, mode=mode)
    methods = [METHODS[n] for n in ("ampfused", "torch", "floor-mul")]
    ctx = Context(device=torch.device("cpu"), timing=timing, methods=methods, profile=False)
    for realloc in (False, True):
        w = Workload("64 x 256", tuple(uniform(64, 256)), realloc=realloc)
        recs = {r.method: r for r in run_workload(ctx, "step_cost", w)}
        for r in recs.values():
            assert r.realloc is realloc and r.timing == mode and r.samples == 2
            assert (r.pointer_change_rate is not None) is realloc
            if r.status != "ok":  # batched on a busy CPU: a restore's stall can outweigh a step
                assert mode == "batched" and r.note.startswith("below resolution"), r.note
                continue
            assert (r.host_median_s is not None) is (
                mode == "batched"
            ) and r.device_median_s is None
        a, t = recs["ampfused"], recs["torch"]
        assert (a.speedup_vs_torch is not None) is (a.ok and t.ok)


def test_restores() -> None:
    w = Workload("t", ((3, 5), (7,), (2, 2, 2)), "mixed", inject_inf=True, realloc=True)
    gs, same = build(w, torch.device("cpu")), build(dataclasses.replace(w, realloc=False), "cpu")
    lists = (gs.grads, dict(gs.groups))
    before = [id(g) for g in same.grads]
    for _ in range(3):
        old = [weakref.ref(g) for g in gs.grads]
        torch._foreach_mul_(gs.grads + same.grads, 0.5)  # what a step does to them
        gs.restore()
        same.restore()
        assert all(ref() is None for ref in old)  # released, as zero_grad(set_to_none=True)
        assert gs.grads is lists[0] and all(gs.groups[d] is g for d, g in lists[1].items())
        for p, g, s in zip(gs.params, gs.grads, same.grads, strict=True):
            assert p.grad is g and g.dtype == s.dtype and g.shape == s.shape
            assert torch.equal(g.nan_to_num(), s.nan_to_num())  # pristine values, inf included
        del p, g, s
    assert [id(g) for g in same.grads] == before and same.pointer_change_rate is None
    assert not gs.flats and gs.reallocs == 4 and gs.pointer_change_rate is not None


def test_e2e_chunks() -> None:
    for cfg in (e2e.CPU_FULL, e2e.GPU_FULL, e2e.GPU_QUICK):
        chunks = e2e.chunks(cfg)
        assert [s for c in chunks for s in c] == list(range(cfg.steps))
        assert all(c[0] >= cfg.timed_from or c[-1] < cfg.timed_from for c in chunks)
        assert max(len(c) for c in chunks) == cfg.steps_per_sample
    odd = e2e.E2EConfig(steps=10, timed_from=2, steps_per_sample=3)
    assert e2e.chunks(odd) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]


@pytest.mark.parametrize("steps_per_sample", [1, 2])
def test_e2e_runs_in_chunks(steps_per_sample: int) -> None:
    """The GPU's chunked loop run on the CPU: the same losses, scales and weights as one step
    per sample, for both scalers."""
    gpt = e2e.GPTConfig(block_size=16, n_layer=1, n_embd=32)
    cfg = e2e.E2EConfig(gpt, batch_size=2, steps=5, timed_from=1, steps_per_sample=steps_per_sample)
    ctx = Context(device=torch.device("cpu"), timing=TimingConfig(mode="batched"), methods=[])
    res = e2e.run(ctx, cfg)
    ref = e2e.run(ctx, dataclasses.replace(cfg, steps_per_sample=1))
    for key, r in res["runs"].items():
        assert r["timed_steps"] == 4 and r["samples"] == 4 // steps_per_sample
        assert len(r["losses"]) == len(r["scales"]) == 5
        assert (
            r["losses"] == ref["runs"][key]["losses"] and r["scales"] == ref["runs"][key]["scales"]
        )
    for c in res["comparisons"].values():
        assert c["max_abs_loss_diff"] == 0 and c["weights_bitwise_equal"]
