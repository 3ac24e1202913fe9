"""The timing method checked without a GPU.

The batched method's code (``time_batch``, ``wall_sample``, ``device_pair_sample``,
``_measure_batched``) runs here against :class:`SimDevice`, a device with one in-order stream in
virtual time, whose per-step costs are known exactly: the method must recover them (host-bound,
device-bound, with a host sync inside the step, with a costly synchronization), and the spin in
front of a device-time batch must cover the host or be reported.  Then the same code runs on
the CPU (``HostClock``) against a step of known wall time, and on real gradient sets.

    python -m pytest benchmarks/tests -q
"""

from __future__ import annotations

import dataclasses
import gc
import time
import types
import weakref

import pytest
import torch

from benchmarks import e2e
from benchmarks.methods import METHODS, Runner
from benchmarks.suite import Context, run_workload
from benchmarks.timing import (
    HostClock,
    TimingConfig,
    batch_steps,
    batched,
    device_pair_sample,
    measure,
    time_batch,
    wall_sample,
)
from benchmarks.workloads import Workload, build, uniform

US = 1e-6


# --------------------------------------------------------------------------- the simulator
class SimDevice:
    """One in-order stream in virtual time.  ``launch(h, d)``: the host spends ``h`` queueing an
    op that then runs for ``d`` on the device, starting when it is queued and the previous op
    has finished.  ``sync()``: the host waits for the stream, plus ``sync_latency``."""

    def __init__(self, sync_latency: float = 0.0) -> None:
        self.host = 0.0
        self.free = 0.0  # when the last queued op finishes
        self.sync_latency = sync_latency

    def launch(self, host_s: float, device_s: float) -> float:
        self.host += host_s
        self.free = max(self.host, self.free) + device_s
        return self.free

    def sync(self) -> None:
        self.host = max(self.host, self.free) + self.sync_latency


class SimClock:
    """:class:`benchmarks.timing.DeviceClock` on a :class:`SimDevice`; a marker is the time the
    device reaches it."""

    has_events = True

    def __init__(self, dev: SimDevice) -> None:
        self.dev = dev

    def now(self) -> float:
        return self.dev.host

    def synchronize(self) -> None:
        self.dev.sync()

    def record(self) -> float:
        return self.dev.launch(0.0, 0.0)

    def elapsed(self, first: float, last: float) -> float:
        return last - first

    def reached(self, marker: float) -> bool:
        return marker <= self.dev.host

    def spin(self, seconds: float) -> bool:
        self.dev.launch(0.0, seconds)
        return True


def op(dev: SimDevice, host_us: float, device_us: float):  # noqa: ANN201
    return lambda: dev.launch(host_us * US, device_us * US)


def synced_step(dev: SimDevice, pre: tuple, post: tuple):  # noqa: ANN201
    """A scaler-like step: queue (pre), read a flag back (a host sync), queue (post)."""

    def run() -> None:
        dev.launch(pre[0] * US, pre[1] * US)
        dev.sync()
        dev.launch(post[0] * US, post[1] * US)

    return run


def us(x: float) -> float:
    return x / US


# --------------------------------------------------------------------------- batched method
def test_host_bound_step_costs_its_host_time() -> None:
    dev = SimDevice(sync_latency=50 * US)
    clock = SimClock(dev)
    restore, reset, run = op(dev, 10, 3), op(dev, 2, 1), op(dev, 20, 5)
    w = wall_sample(clock, restore, reset, run, n=200)
    # The loop is host-bound (32 us host vs 9 us device per iteration): the step adds its 20 us
    # of host time; the 50 us sync happens once per batch and cancels between A and B (what
    # remains is the device's tail after the host's last op: 5 us in A, 2 us in B where the
    # reset queues behind the restore's last microsecond, spread over 200 steps).
    assert us(w.wall) == pytest.approx(20 + (5 - 2) / 200, abs=1e-9)
    assert us(w.host) == pytest.approx(20, abs=1e-9)
    d = device_pair_sample(clock, restore, reset, run, 8, w.host, w.restore, 0.25)
    assert us(d.device) == pytest.approx(5, abs=1e-9)  # device work only: the spin hid the host
    assert us(d.restore_device) == pytest.approx(3 + 1, abs=1e-9)
    assert not d.overrun


def test_device_bound_step_costs_its_device_time() -> None:
    dev = SimDevice(sync_latency=40 * US)
    clock = SimClock(dev)
    restore, reset, run = op(dev, 5, 1000), op(dev, 2, 1), op(dev, 10, 800)
    w = wall_sample(clock, restore, reset, run, n=20, step_first=False)
    # Device-bound (1801 vs 17 us): the step adds its 800 us of device time; the host's 10 us
    # are hidden, and reported as the host cost.  The restore shows up as subtracted cost.
    assert us(w.wall) == pytest.approx(800, rel=1e-3)
    assert us(w.host) == pytest.approx(10, abs=1e-9)
    assert us(w.restore) == pytest.approx(1001, rel=0.01)
    d = device_pair_sample(clock, restore, reset, run, 8, w.host, w.restore, 0.25)
    assert us(d.device) == pytest.approx(800, abs=1e-9)
    assert not d.overrun


def test_step_with_a_host_sync_pays_the_turnaround() -> None:
    dev = SimDevice(sync_latency=40 * US)
    clock = SimClock(dev)
    restore, reset = op(dev, 5, 20), op(dev, 2, 1)
    run = synced_step(dev, pre=(30, 50), post=(10, 2))
    w = wall_sample(clock, restore, reset, run, n=100)
    # One iteration of A by hand: restore + reset queued (7 us host) and run on the device while
    # the host queues the step's first kernel (30 us); it runs 50 us, the host waits for it plus
    # the 40 us sync, then queues the rest (10 us): 7 + 30 + 50 + 40 + 10 = 137 us.  B is
    # device-bound at 21 us per iteration.  What the step adds to the loop: 137 - 21 = 116 us.
    assert us(w.wall) == pytest.approx(116, abs=0.2)
    # Host: the step's own 30 + 10 us plus its wait on the device and the sync.
    assert us(w.host) == pytest.approx(130, abs=1e-6)
    d = device_pair_sample(clock, restore, reset, run, 8, w.host, w.restore, 0.25)
    # The host cannot queue past the sync, so the spin cannot cover it: flagged, and the device
    # time includes the device's idle time while the host turns around.
    assert d.overrun
    assert us(d.device) > 50 + 2


def test_per_step_sync_no_longer_inside_the_sample() -> None:
    """The old per-step GPU sample (synchronize, run, synchronize) paid one sync latency per
    step; here it is paid once per batch.  Two methods whose steps cost 30 and 300 us of host
    time read 10x apart, whatever the sync costs."""
    for latency in (0.0, 36 * US, 73 * US):
        dev = SimDevice(sync_latency=latency)
        clock = SimClock(dev)
        restore, reset = op(dev, 4, 2), op(dev, 2, 1)
        fast = wall_sample(clock, restore, reset, op(dev, 30, 5), n=300)
        slow = wall_sample(clock, restore, reset, op(dev, 300, 10), n=300)
        assert slow.wall / fast.wall == pytest.approx(10, rel=1e-3)
        # The old sample: t0 after a sync, then run, then a sync, then t1.
        per_step = {}
        for name, h, d in (("fast", 30, 5), ("slow", 300, 10)):
            dev.sync()
            t0 = dev.host
            dev.launch(h * US, d * US)
            dev.sync()
            per_step[name] = dev.host - t0
        if latency:
            assert per_step["slow"] / per_step["fast"] < 0.8 * 10


def test_spin_too_short_is_reported() -> None:
    dev = SimDevice()
    clock = SimClock(dev)
    b = time_batch(clock, (op(dev, 20, 5),), n=10, spin_s=50 * US)  # host needs 200 us
    assert b.overrun
    b = time_batch(clock, (op(dev, 20, 5),), n=10, spin_s=500 * US)
    assert not b.overrun
    assert us(b.device_s) == pytest.approx(50, abs=1e-9)
    assert us(b.host_s) == pytest.approx(200, abs=1e-9)


def test_time_batch_runs_ops_in_order_n_times_and_restores_gc() -> None:
    calls: list[str] = []
    gc.enable()
    b = time_batch(HostClock(), (lambda: calls.append("a"), lambda: calls.append("b")), n=3)
    assert calls == ["a", "b"] * 3
    assert gc.isenabled()
    assert b.wall_s >= b.host_s >= 0
    gc.disable()
    time_batch(HostClock(), (lambda: None,), n=1)
    assert not gc.isenabled()
    gc.enable()


def test_batch_steps_are_clamped() -> None:
    cfg = TimingConfig(batch_s=0.01, batch_min=3, batch_max=50)
    assert batch_steps(1.0, cfg) == 3
    assert batch_steps(1e-3, cfg) == 10
    assert batch_steps(1e-9, cfg) == 50
    assert batch_steps(0.0, cfg) == 50


def test_modes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not batched(TimingConfig(), cpu) and batched(TimingConfig(), cuda)
    assert batched(TimingConfig(mode="batched"), cpu)
    assert not batched(TimingConfig(mode="per-step"), cuda)
    with pytest.raises(ValueError, match="timing mode"):
        batched(TimingConfig(mode="fast"), cpu)


class SimRunner(Runner):
    def __init__(self, run) -> None:  # noqa: ANN001
        self._run = run

    def run(self) -> None:
        self._run()


def test_measure_batched_on_the_simulator() -> None:
    dev = SimDevice(sync_latency=50 * US)
    gs = types.SimpleNamespace(device=torch.device("cpu"), restore=op(dev, 10, 3))
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] > 20:
            raise RuntimeError("out of memory\nsecond line")
        dev.launch(1 * US, 1 * US)

    runners = {
        "small": SimRunner(op(dev, 20, 5)),
        "big": SimRunner(op(dev, 10, 800)),
        "synced": SimRunner(synced_step(dev, (30, 50), (10, 2))),
        "flaky": SimRunner(flaky),
    }
    cfg = TimingConfig(
        mode="batched", warmup=2, min_rounds=4, enough_rounds=4, batch_s=0.005, batch_max=200
    )
    out = measure(gs, runners, cfg, clock=SimClock(dev))  # type: ignore[arg-type]
    small, big, synced = out["small"], out["big"], out["synced"]
    assert out["flaky"].error == "RuntimeError: out of memory"
    for t in (small, big, synced):
        assert t.error is None and t.mode == "batched"
        assert t.wall.n == t.host.n == t.device.n == 4  # type: ignore[union-attr]
    # Batches of 5 ms: 5 ms / (10 + 20 us of host time), 5 ms / (3 + 800 us of device time).
    assert small.steps == 167 and big.steps == 7
    assert small.device_steps == 8 and big.device_steps == 7
    assert us(small.wall.median) == pytest.approx(20, abs=0.1)
    assert us(small.host.median) == pytest.approx(20, abs=1e-6)  # type: ignore[union-attr]
    assert us(small.device.median) == pytest.approx(5, abs=1e-6)  # type: ignore[union-attr]
    assert us(big.wall.median) == pytest.approx(800, rel=0.01)
    assert us(big.device.median) == pytest.approx(800, abs=1e-6)  # type: ignore[union-attr]
    assert small.spin_overruns == big.spin_overruns == 0
    assert synced.spin_overruns == 4
    # 30 us queueing, 50 us waiting for the kernel, 50 us sync, 10 us queueing the rest.
    assert us(synced.host.median) == pytest.approx(140, abs=1e-6)  # type: ignore[union-attr]


# --------------------------------------------------------------------------- on the CPU
class ThreadTimeClock(HostClock):
    """HostClock on this thread's CPU time: what other processes do to the machine does not
    move it, so a step of known CPU cost must read exactly that."""

    def now(self) -> float:
        return time.thread_time()

    def record(self) -> float:
        return time.thread_time()


class BusyRunner(Runner):
    """A step of known cost: spins until this thread has used ``seconds`` of CPU time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self) -> None:
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass


def test_batched_method_on_a_real_clock() -> None:
    gs = types.SimpleNamespace(device=torch.device("cpu"), restore=lambda: sum(range(2000)))
    cfg = TimingConfig(
        mode="batched", warmup=1, min_rounds=5, enough_rounds=5, batch_s=0.01, max_wall_s=10
    )
    t = measure(gs, {"busy": BusyRunner(300 * US)}, cfg, clock=ThreadTimeClock())["busy"]  # type: ignore[arg-type]
    assert t.error is None and t.wall.n == 5 and t.device is None
    assert 20 <= t.steps <= 40  # type: ignore[operator]  # 10 ms / ~0.3 ms
    # Each sample subtracts the restores' real cost (a few microseconds) from A.
    assert us(t.restore.median) > 1  # type: ignore[union-attr]
    assert us(t.wall.median) == pytest.approx(300, rel=0.05)
    assert us(t.host.median) == pytest.approx(300, rel=0.05)  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["per-step", "batched"])
def test_run_workload_records(mode: str) -> None:
    ctx = Context(
        device=torch.device("cpu"),
        timing=TimingConfig(
            warmup=1, min_rounds=2, enough_rounds=2, batch_s=0.002, max_wall_s=1, mode=mode
        ),
        methods=[METHODS[n] for n in ("ampfused", "torch", "floor-mul")],
        profile=False,
    )
    for realloc in (False, True):
        w = Workload("64 x 256", tuple(uniform(64, 256)), realloc=realloc)
        recs = {r.method: r for r in run_workload(ctx, "step_cost", w)}
        for r in recs.values():
            assert r.realloc is realloc and r.timing == mode and r.samples == 2
            assert (r.pointer_change_rate is not None) is realloc
            if r.status != "ok":
                # Batched on a busy CPU, a restore that loses a time slice can outweigh a
                # cheap step: such a record says so instead of reporting a negative time.
                assert mode == "batched" and r.note.startswith("below resolution"), r.note
                continue
            assert (r.host_median_s is not None) is (mode == "batched")
            assert (r.steps_per_sample is not None) is (mode == "batched")
            assert r.device_median_s is None
        a, t = recs["ampfused"], recs["torch"]
        assert (a.speedup_vs_torch is not None) is (a.ok and t.ok)


# --------------------------------------------------------------------------- realloc
def _check_realloc(gs, same, groups) -> None:  # noqa: ANN001
    for p, g, s in zip(gs.params, gs.grads, same.grads, strict=True):
        assert p.grad is g
        assert g.dtype == s.dtype and g.shape == s.shape and g.is_contiguous()
        assert torch.equal(g.nan_to_num(), s.nan_to_num())  # the pristine values, inf included
    for dt, lst in gs.groups.items():
        assert lst is groups[dt]
        assert [id(g) for g in lst] == [id(g) for g in gs.grads if g.dtype == dt]


def test_realloc_restore_replaces_every_gradient() -> None:
    w = Workload("t", ((3, 5), (7,), (2, 2, 2)), "mixed", inject_inf=True, realloc=True)
    gs = build(w, torch.device("cpu"))
    same = build(Workload("t", w.shapes, "mixed", inject_inf=True), torch.device("cpu"))
    grads_list, groups = gs.grads, {dt: lst for dt, lst in gs.groups.items()}
    for _ in range(3):
        old = [weakref.ref(g) for g in gs.grads]
        torch._foreach_mul_(gs.grads, 0.5)  # what a step does to them
        gs.restore()
        assert all(ref() is None for ref in old)  # released, as zero_grad(set_to_none=True)
        assert gs.grads is grads_list  # the same lists, new contents (runners keep the lists)
        _check_realloc(gs, same, groups)  # (in a function: no loop variable keeps a grad)
    assert not gs.flats  # no flat buffer behind the gradients
    assert gs.reallocs == 4 and gs.pointer_change_rate is not None
    assert same.pointer_change_rate is None


def test_same_grads_restore_keeps_the_tensors() -> None:
    gs = build(Workload("t", ((4, 4), (9,))), torch.device("cpu"))
    before = [id(g) for g in gs.grads]
    gs.grads[0].mul_(0)
    gs.restore()
    assert [id(g) for g in gs.grads] == before
    assert torch.equal(gs.grads[0], gs.pristine[torch.float32][:16].view(4, 4))


# --------------------------------------------------------------------------- e2e chunks
def test_e2e_chunks() -> None:
    for cfg in (e2e.CPU_FULL, e2e.GPU_FULL, e2e.GPU_QUICK):
        chunks = e2e.chunks(cfg)
        assert [s for c in chunks for s in c] == list(range(cfg.steps))
        assert all(c[0] >= cfg.timed_from or c[-1] < cfg.timed_from for c in chunks)
        assert max(len(c) for c in chunks) == cfg.steps_per_sample
    assert e2e.chunks(e2e.CPU_FULL) == [[i] for i in range(e2e.CPU_FULL.steps)]
    odd = e2e.E2EConfig(steps=10, timed_from=2, steps_per_sample=3)
    assert e2e.chunks(odd) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]


@pytest.mark.parametrize("steps_per_sample", [1, 2])
def test_e2e_runs_in_chunks(steps_per_sample: int) -> None:
    """The GPU's chunked loop (several steps, then the losses and scales read back) run on the
    CPU: same losses, scales and weights as one step per sample, for both scalers."""
    cfg = e2e.E2EConfig(
        e2e.GPTConfig(block_size=16, n_layer=1, n_embd=32),
        batch_size=2,
        steps=5,
        timed_from=1,
        steps_per_sample=steps_per_sample,
    )
    ctx = Context(device=torch.device("cpu"), timing=TimingConfig(mode="batched"), methods=[])
    res = e2e.run(ctx, cfg)
    ref = e2e.run(ctx, dataclasses.replace(cfg, steps_per_sample=1))
    for key, r in res.runs.items():
        assert r["timed_steps"] == 4 and r["samples"] == 4 // steps_per_sample
        assert len(r["losses"]) == len(r["scales"]) == 5
        assert r["losses"] == ref.runs[key]["losses"] and r["scales"] == ref.runs[key]["scales"]
    for c in res.comparisons.values():
        assert c["max_abs_loss_diff"] == 0 and c["weights_bitwise_equal"]
