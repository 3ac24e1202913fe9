"""Scale policies (min_scale, max_scale, hysteresis) and the counters, in the ops and GradScaler.

The ops' update rule (``scaler_update_`` and ``scaler_pass_``, one C++ function) is run over
random found/clean sequences and policies and held, iteration by iteration, against
``ampfused.reference.update_state``: the scale's bits, the growth tracker, hysteresis left and
every counter.  With the default policy it must equal ``torch._amp_update_scale_`` bit for bit.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import random
import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import ampfused
from ampfused import ops, reference

INF = float("inf")
F32_MAX = torch.finfo(torch.float32).max
INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------- helpers
def make_state(device: str, scale: float, tracker: int = 0, rest: list[int] | None = None):
    """An int32 state tensor: scale, tracker, then hysteresis left and the six counters."""
    state = torch.zeros(ops.STATE_SIZE, dtype=torch.int32, device=device)
    reference.state_from_list([scale, tracker, *(rest or [1, 0, 0, 0, 0, 0, 0])], state)
    return state


def same_state(got: list[Any], want: list[Any]) -> bool:
    """Equal lists of state values; scales compared as float32 bits, except that any NaN
    matches any NaN (the payload of a NaN scale is the arithmetic's, not part of the rule)."""
    a, b = got[0], want[0]
    if math.isnan(a) or math.isnan(b):
        scales_equal = math.isnan(a) and math.isnan(b)
    else:
        bits = [torch.tensor(x, dtype=torch.float32).view(torch.int32).item() for x in (a, b)]
        scales_equal = bits[0] == bits[1]
    return scales_equal and got[1:] == want[1:]


def found_sequence(rng: random.Random, n: int, p_start: float = 0.2) -> list[float]:
    """found_inf values: bursts of overflowing iterations (1.0, sometimes 2.0 or 3.0, the sums
    several optimizers give) between runs of clean ones."""
    out, burst = [], 0
    for _ in range(n):
        if burst == 0 and rng.random() < p_start:
            burst = rng.randint(1, 6)
        if burst:
            burst -= 1
            out.append(rng.choice([1.0, 1.0, 1.0, 2.0, 3.0]))
        else:
            out.append(0.0)
    return out


def op_trajectory(state: torch.Tensor, founds: list[float], policy: tuple) -> list[list[Any]]:
    """The state after each iteration, scaler_update_ committing into state each time."""
    nxt = torch.empty_like(state)
    found_inf = torch.zeros((), dtype=torch.float32, device=state.device)
    out = []
    for f in founds:
        found_inf.fill_(f)
        ops.scaler_update_(found_inf, state, nxt, *policy)
        state.copy_(nxt)
        out.append(reference.state_to_list(state))
    return out


def reference_trajectory(start: list[Any], founds: list[float], policy: tuple) -> list[list]:
    out, state = [], start
    for f in founds:
        state = reference.update_state(state, f != 0, *policy)
        out.append(state)
    return out


def assert_trajectories_match(got: list, want: list, founds: list, policy: tuple) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert same_state(g, w), (
            f"iteration {i} (found={founds[i]}, policy {policy}):\n op:        {g}\n "
            f"reference: {w}\n founds so far {founds[: i + 1]}"
        )


def random_policy(rng: random.Random) -> tuple:
    """(growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis)."""
    low = rng.choice([-INF, 1.0, 2.0**-10, 3.0, 0.1])
    high = rng.choice([INF, 2.0**20, 2.0**16 + 1.0, 1e30])
    return (
        rng.choice([2.0, 3.0, 1.5, 1.0001]),
        rng.choice([0.5, 0.25, 0.7, 0.1]),
        rng.randint(1, 5),
        low,
        high,
        rng.randint(1, 4),
    )


# Starting states: ordinary, growth overflowing float32, near zero, special, counters near the
# int32 wrap, hysteresis left at 0 or beyond the policy's (as a hand-made checkpoint may hold).
STARTS: dict[str, list[Any]] = {
    "ordinary": [2.0**16, 0, 1, 0, 0, 0, 0, 0, 0],
    "near_f32_max": [F32_MAX / 2, 0, 1, 0, 0, 0, 0, 0, 0],
    "f32_max": [F32_MAX, 3, 2, 0, 0, 0, 0, 0, 0],
    "subnormal": [1e-44, 0, 1, 0, 0, 0, 0, 0, 0],
    "zero": [0.0, 0, 1, 0, 0, 0, 0, 0, 0],
    "inf": [INF, 0, 1, 0, 0, 0, 0, 0, 0],
    "nan": [math.nan, 0, 1, 0, 0, 0, 0, 0, 0],
    "counters_near_wrap": [
        2.0**10,
        0,
        1,
        INT32_MAX - 2,
        INT32_MAX - 1,
        INT32_MAX,
        INT32_MAX - 3,
        INT32_MAX - 1,
        INT32_MAX,
    ],
    "negative_counters": [2.0**10, 0, 0, -5, -(2**31), -1, -2, 7, -3],
    "hysteresis_left_high": [2.0**10, 1, 9, 0, 0, 0, 0, 0, 0],
    "below_min": [2.0**-12, 0, 1, 0, 0, 0, 0, 0, 0],
    "above_max": [2.0**40, 0, 1, 0, 0, 0, 0, 0, 0],
}


# ------------------------------------------------------------------------------- the op's rule
@pytest.mark.parametrize("start", list(STARTS))
@pytest.mark.parametrize("seed", range(6))
def test_update_op_matches_reference(device, start, seed):
    rng = random.Random(seed * 1000 + len(start))
    for _ in range(4):
        policy = random_policy(rng)
        founds = found_sequence(rng, 120, p_start=rng.choice([0.05, 0.2, 0.5]))
        state = make_state(device, STARTS[start][0], STARTS[start][1], STARTS[start][2:])
        got = op_trajectory(state, founds, policy)
        want = reference_trajectory(STARTS[start], founds, policy)
        assert_trajectories_match(got, want, founds, policy)


def test_reference_exercises_every_rule():
    """The random trajectories above reach every branch of the rule (guards the generator)."""
    seen = set()
    for start in STARTS:
        for seed in range(6):
            rng = random.Random(seed * 1000 + len(start))
            for _ in range(4):
                policy = random_policy(rng)
                founds = found_sequence(rng, 120, p_start=rng.choice([0.05, 0.2, 0.5]))
                prev = STARTS[start]
                for s in reference_trajectory(prev, founds, policy):
                    if s[8] != prev[8]:
                        seen.add("floor_hit")
                    if s[6] != prev[6] and s[0] == policy[4]:
                        seen.add("growth_held_at_max")
                    if s[5] > 0 and s[0] == prev[0] and prev[2] > 1:
                        seen.add("overflow_absorbed_by_hysteresis")
                    if s[7] != prev[7]:
                        seen.add("backoff")
                    if s[3] < prev[3]:
                        seen.add("counter_wrap")
                    prev = s
    want = {
        "floor_hit",
        "growth_held_at_max",
        "overflow_absorbed_by_hysteresis",
        "backoff",
        "counter_wrap",
    }
    assert seen == want


@pytest.mark.parametrize("check_only", [False, True])
def test_pass_op_matches_reference(device, check_only):
    """scaler_pass_: several passes per iteration (accumulate after the first), each with or
    without an inf/NaN, against reference.scaler_pass_ on copies of the same inputs."""
    rng = random.Random(7)
    specials = [INF, -INF, math.nan]
    for _ in range(6):
        policy = random_policy(rng)
        state = make_state(device, 2.0**12)
        ref_state = state.clone()
        nxt, ref_nxt = torch.empty_like(state), torch.empty_like(state)
        for _ in range(40):
            for k in range(rng.randint(1, 3)):
                grads = [
                    torch.randn(n, device=device).to(dt)
                    for n, dt in ((5, torch.float16), (70_000, torch.float32), (3, torch.bfloat16))
                ]
                if rng.random() < 0.3:
                    g = rng.choice(grads)
                    g.view(-1)[rng.randrange(g.numel())] = rng.choice(specials)
                ref_grads = [g.clone() for g in grads]
                f, ref_f = (torch.full((), 5.0, device=device) for _ in range(2))
                args = (*policy, check_only, k > 0)
                ops.scaler_pass_(grads, f, state, nxt, None, *args)
                reference.scaler_pass_(ref_grads, ref_f, ref_state, ref_nxt, None, *args)
                assert torch.equal(f, ref_f)
                # (NaN payloads of 16-bit gradients are the converter's: test_ops.py's matter)
                for g, r in zip(grads, ref_grads, strict=True):
                    torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
                assert same_state(reference.state_to_list(nxt), reference.state_to_list(ref_nxt))
            state.copy_(nxt)
            ref_state.copy_(ref_nxt)


# ------------------------------------------------------------------------------- torch's rule
@pytest.mark.parametrize("start", ["ordinary", "near_f32_max", "subnormal", "inf", "nan", "zero"])
@pytest.mark.parametrize("growth_interval", [1, 2, 5, 2000])
def test_default_policy_is_torch(device, start, growth_interval):
    """Long random runs: the op with the default policy against torch._amp_update_scale_, scale
    bits and tracker after every iteration (NaN payloads included: same arithmetic)."""
    rng = random.Random(growth_interval)
    scale0 = STARTS[start][0]
    for factors in ((2.0, 0.5), (3.0, 0.25), (1.0001, 0.9999)):
        founds = found_sequence(rng, 2500, p_start=0.01 if growth_interval == 2000 else 0.1)
        state = make_state(device, scale0)
        nxt = torch.empty_like(state)
        t_scale = torch.full((), scale0, dtype=torch.float32, device=device)
        t_tracker = torch.zeros((), dtype=torch.int32, device=device)
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        got, want = [], []
        for f in founds:
            found_inf.fill_(f)
            ops.scaler_update_(found_inf, state, nxt, *factors, growth_interval)
            state.copy_(nxt)
            torch._amp_update_scale_(t_scale, t_tracker, found_inf, *factors, growth_interval)
            got.append(state[:2].clone())
            want.append(torch.stack((t_scale.view(torch.int32), t_tracker)))
        got_t, want_t = torch.stack(got), torch.stack(want)
        if not torch.equal(got_t, want_t):
            i = int((got_t != want_t).any(1).nonzero()[0])
            raise AssertionError(f"iteration {i}: op {got_t[i]} vs torch {want_t[i]}")


# ------------------------------------------------------------------------------- GradScaler
def state_list(scaler: ampfused.GradScaler) -> list[Any]:
    return reference.state_to_list(scaler._scale_state.tensor)


class Loop:
    """A two-layer float32 model with its optimizers and a scaler: step(found) runs one
    iteration, with an inf, -inf or NaN written into a scaled gradient when found."""

    def __init__(self, device: str, scaler: Any, path: str = "step", n_opts: int = 1) -> None:
        torch.manual_seed(0)
        self.device, self.scaler, self.path = device, scaler, path
        self.models = [torch.nn.Linear(4, 4).to(device) for _ in range(n_opts)]
        fused = {"fused": True} if path == "fused_optimizer" else {}
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.1, **fused) for m in self.models]
        self.special = iter([INF, -INF, math.nan] * 10_000)

    def step(self, found: bool, new_scale: float | None = None) -> None:
        self.run(found)
        self.scaler.update(new_scale)

    def run(self, found: bool) -> None:
        """The iteration up to update()."""
        x = torch.ones(2, 4, device=self.device)
        for opt in self.opts:
            opt.zero_grad()
        loss = sum(m(x).sum() for m in self.models)
        self.scaler.scale(loss).backward()
        if found:
            grad = self.models[-1].weight.grad
            grad.view(-1)[1] = next(self.special)
        for opt in self.opts:
            if self.path == "unscale_first":
                self.scaler.unscale_(opt)
            self.scaler.step(opt)
        if self.path == "found_inf_touched":
            # a found_inf modified in place after the pass: update() computes the update again
            for f in self.scaler._per_optimizer_states[id(self.opts[0])][
                "found_inf_per_device"
            ].values():
                f.add_(0.0)


class UnscaleHooked(ampfused.GradScaler):
    """Hooks _unscale_grads_ (as sharded scalers do): the fused pass steps aside, so update()
    computes the update from the found_inf tensors."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


PATHS = ["step", "unscale_first", "fused_optimizer", "found_inf_touched", "hooked", "two_opts"]
POLICIES: dict[str, dict[str, Any]] = {
    "torch": {},
    "floor": {"min_scale": 2.0**6},
    "ceiling": {"max_scale": 2.0**9 + 3.0},
    "hysteresis3": {"hysteresis": 3},
    "all": {"min_scale": 3.0, "max_scale": 2.0**10, "hysteresis": 2},
}


def reference_policy(scaler: ampfused.GradScaler) -> tuple:
    low, high = scaler.min_scale, scaler.max_scale
    return (
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
        -INF if low is None else low,
        INF if high is None else high,
        scaler.hysteresis,
    )


def make_loop(device: str, path: str, policy: dict[str, Any], **kw: Any) -> Loop:
    cls = UnscaleHooked if path == "hooked" else ampfused.GradScaler
    scaler = cls(device, init_scale=2.0**8, growth_interval=2, **{**policy, **kw})
    return Loop(device, scaler, path, n_opts=2 if path == "two_opts" else 1)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("path", PATHS)
def test_scaler_follows_reference(device, path, policy):
    """Every update path applies the same rule: the scaler's whole state after each iteration
    equals reference.update_state's."""
    loop = make_loop(device, path, POLICIES[policy])
    founds = found_sequence(random.Random(path + policy), 60, p_start=0.25)
    want = [2.0**8, 0, loop.scaler.hysteresis, 0, 0, 0, 0, 0, 0]
    for i, f in enumerate(founds):
        loop.step(bool(f))
        want = reference.update_state(want, bool(f), *reference_policy(loop.scaler))
        assert same_state(state_list(loop.scaler), want), f"iteration {i}: {founds[: i + 1]}"
    counters = loop.scaler.counters()
    assert counters["steps"] == 60 and counters["skipped_steps"] == sum(map(bool, founds))
    assert counters["growths"] and counters["backoffs"]


def test_default_policy_counters_beside_torch(device):
    """With the default policy, a run beside torch's scaler: same scale and tracker at every
    step (the parity suites check much more), and counters that count what torch did."""
    loops = [
        Loop(device, cls(device, init_scale=2.0**8, growth_interval=2))
        for cls in (torch.amp.GradScaler, ampfused.GradScaler)
    ]
    founds = found_sequence(random.Random(3), 50, p_start=0.3)
    steps = skipped = growths = backoffs = consecutive = 0
    for f in founds:
        before = loops[0].scaler.get_scale()
        for loop in loops:
            loop.step(bool(f))
        after = loops[0].scaler.get_scale()
        assert (after, loops[0].scaler._get_growth_tracker()) == (
            loops[1].scaler.get_scale(),
            loops[1].scaler._get_growth_tracker(),
        )
        steps, skipped = steps + 1, skipped + bool(f)
        consecutive = consecutive + 1 if f else 0
        growths, backoffs = growths + (after > before), backoffs + (after < before)
        assert loops[1].scaler.counters() == {
            "steps": steps,
            "skipped_steps": skipped,
            "consecutive_skips": consecutive,
            "growths": growths,
            "backoffs": backoffs,
            "floor_hits": 0,
            "hysteresis_left": 0 if f else 1,
        }
    assert growths and backoffs and max(map(bool, founds))


def test_update_new_scale(device):
    """update(new_scale) sets the scale, leaves tracker and hysteresis left, counts the step
    (skipped when it found inf/NaN) and no growth or backoff; without an iteration it counts
    nothing."""
    loop = make_loop(device, "step", {"hysteresis": 2})
    loop.step(False)  # tracker 1
    loop.step(True)  # hysteresis left 1, no backoff
    before = state_list(loop.scaler)
    loop.step(True, new_scale=5.0)
    assert state_list(loop.scaler) == [5.0, before[1], before[2], 3, 2, 2, *before[6:]]
    loop.step(False, new_scale=7.0)
    assert state_list(loop.scaler) == [7.0, before[1], before[2], 4, 2, 0, *before[6:]]
    loop.scaler.update(9.0)  # no iteration ran: nothing counted
    assert state_list(loop.scaler) == [9.0, before[1], before[2], 4, 2, 0, *before[6:]]
    # a new_scale torch refuses is refused before anything is counted; the iteration stays
    # open and update() ends it
    loop.run(True)
    with pytest.raises(AssertionError, match="2 elements"):
        loop.scaler.update(torch.ones(2, device=device))
    assert state_list(loop.scaler) == [9.0, before[1], before[2], 4, 2, 0, *before[6:]]
    loop.scaler.update()
    assert state_list(loop.scaler)[3:6] == [5, 3, 1]


@pytest.mark.parametrize("at_min_scale", ["clamp", "warn", "raise"])
def test_at_min_scale(device, at_min_scale):
    """Floor hits hold the scale at min_scale; "warn" warns and "raise" raises from update() at
    each of them (after committing it), "clamp" neither."""
    loop = make_loop(device, "step", {"min_scale": 2.0**6, "at_min_scale": at_min_scale})
    policy = reference_policy(loop.scaler)
    want = [2.0**8, 0, 1, 0, 0, 0, 0, 0, 0]
    hits = 0
    # 256 -> 128 -> 64 (at the floor, not below it) -> held twice -> grows -> 64
    for f in [True, True, False, True, True, False, False, True]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loop.step(f)
                raised = None
            except RuntimeError as e:
                raised = e
        hit = reference.update_state(want, f, *policy)[8] != want[8]
        want = reference.update_state(want, f, *policy)
        hits += hit
        # committed either way, the iteration closed: the next one can start
        assert same_state(state_list(loop.scaler), want)
        assert not loop.scaler._per_optimizer_states
        warned = [w for w in caught if "min_scale" in str(w.message)]
        assert len(warned) == (hit if at_min_scale == "warn" else 0)
        assert (raised is not None) == (hit and at_min_scale == "raise")
        if raised is not None:
            message = str(raised)
            assert "min_scale=64.0" in message and "the scale is 64.0" in message
            assert "at_min_scale='clamp'" in message
    assert hits == 2


BAD_POLICIES = [
    ({"min_scale": "1"}, TypeError, "min_scale"),
    ({"min_scale": True}, TypeError, "min_scale"),
    ({"max_scale": torch.tensor(2.0)}, TypeError, "max_scale"),
    ({"min_scale": 0.0}, ValueError, "min_scale"),
    ({"min_scale": -1.0}, ValueError, "min_scale"),
    ({"max_scale": 1e39}, ValueError, "max_scale"),
    ({"max_scale": INF}, ValueError, "max_scale"),
    ({"min_scale": math.nan}, ValueError, "min_scale"),
    ({"min_scale": 1e-50}, ValueError, "min_scale"),  # 0 in float32
    ({"max_scale": 10**400}, ValueError, "max_scale"),
    ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "min_scale=4.0 is above max_scale"),
    ({"hysteresis": 0}, ValueError, "hysteresis"),
    ({"hysteresis": 2**31}, ValueError, "hysteresis"),
    ({"hysteresis": 2.0}, TypeError, "hysteresis"),
    ({"hysteresis": True}, TypeError, "hysteresis"),
    ({"at_min_scale": "stop"}, ValueError, "at_min_scale"),
    ({"at_min_scale": None}, TypeError, "at_min_scale"),
    ({"at_min_scale": "raise"}, ValueError, "pass min_scale too"),
    ({"min_scale": 2.0**17}, ValueError, "init_scale=65536.0 is outside"),
    ({"max_scale": 2.0**15}, ValueError, "init_scale=65536.0 is outside"),
]


@pytest.mark.parametrize(("kw", "error", "match"), BAD_POLICIES, ids=lambda v: repr(v)[:40])
def test_bad_policy_arguments(device, kw, error, match):
    with pytest.raises(error, match=re.escape(match)):
        ampfused.GradScaler(device, **kw)


def test_policy_arguments():
    s = ampfused.GradScaler("cpu", min_scale=1, max_scale=2**20, hysteresis=np.int64(3))
    assert (s.min_scale, s.max_scale, s.hysteresis, s.at_min_scale) == (1.0, 2.0**20, 3, "clamp")
    assert type(s.min_scale) is float and type(s.hysteresis) is int
    with pytest.raises(TypeError):  # keyword-only: torch's positional arguments stay as they are
        ampfused.GradScaler("cpu", 2.0**16, 2.0, 0.5, 2000, True, 1.0)
    # a disabled scaler checks the new arguments too (they are ours), and stays a no-op
    with pytest.raises(ValueError, match="hysteresis"):
        ampfused.GradScaler("cpu", enabled=False, hysteresis=0)
    off = ampfused.GradScaler("cpu", enabled=False, min_scale=2.0**20)
    assert off.state_dict() == {} and set(off.counters().values()) == {0}


# ------------------------------------------------------------------------------- checkpoints
# With hysteresis 2: the checkpoint is taken after an overflow that did not back off (one
# more is tolerated), so a resumed run that lost hysteresis_left would diverge at once.
FOUNDS = [False, True, True, False, False, False, True, True, False, True, True, True, False]
CUT = 7
CHECKPOINT_POLICY = {"min_scale": 2.0**5, "max_scale": 2.0**10, "hysteresis": 2}


def through_torch_save(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def resumed(device: str, how: str, scaler: ampfused.GradScaler) -> ampfused.GradScaler:
    if how == "pickle":
        return pickle.loads(pickle.dumps(scaler))
    # into a scaler made with other arguments: the checkpoint's policy and factors win, as
    # torch's factors do
    fresh = ampfused.GradScaler(device, init_scale=1.0, growth_interval=7, hysteresis=4)
    if how == "state_dict_after_scale":
        fresh.scale(torch.ones((), device=device))
    fresh.load_state_dict(through_torch_save(scaler.state_dict()))
    return fresh


@pytest.mark.parametrize("how", ["state_dict", "state_dict_after_scale", "pickle"])
def test_checkpoint_round_trip_mid_run(device, how):
    """Resumed from a checkpoint mid-run, the scaler goes on exactly as an uninterrupted one:
    every state element, and the parameters, after every iteration."""
    whole = make_loop(device, "step", CHECKPOINT_POLICY)
    part = make_loop(device, "step", CHECKPOINT_POLICY)
    for f in FOUNDS[:CUT]:
        whole.step(f)
        part.step(f)
    at_cut = state_list(part.scaler)
    assert at_cut[2] == 1 and at_cut[4] == 3  # one overflow tolerated, three skipped so far
    part.scaler = resumed(device, how, part.scaler)
    if how != "state_dict_after_scale":
        assert part.scaler._scale_state.tensor is None  # made lazily, from the checkpoint's values
    assert part.scaler.counters() == whole.scaler.counters()
    for i, f in enumerate(FOUNDS[CUT:], CUT):
        whole.step(f)
        part.step(f)
        assert state_list(part.scaler) == state_list(whole.scaler), f"iteration {i}"
        for a, b in zip(whole.models[0].parameters(), part.models[0].parameters(), strict=True):
            assert torch.equal(a, b)
    assert whole.scaler.counters()["backoffs"] >= 2


def test_state_dict_entry(device):
    loop = make_loop(device, "step", {**CHECKPOINT_POLICY, "at_min_scale": "warn"})
    fresh = loop.scaler.state_dict()["ampfused"]  # before the state exists
    assert fresh == {
        "min_scale": 32.0,
        "max_scale": 1024.0,
        "hysteresis": 2,
        "at_min_scale": "warn",
        "hysteresis_left": 2,
        "steps": 0,
        "skipped_steps": 0,
        "consecutive_skips": 0,
        "growths": 0,
        "backoffs": 0,
        "floor_hits": 0,
        "headroom": 0.0,  # torch's rule
        # the headroom policy's state: no ceiling, no backoff yet, no cap, no margin learned
        "ceiling": INF,
        "since_backoff": 2**31 - 1,
        "history": [INF] * ops.HISTORY,
        "margin": 0.0,
    }
    for f in FOUNDS[:CUT]:
        loop.step(f)
    entry = loop.scaler.state_dict()["ampfused"]
    left, *counts = state_list(loop.scaler)[2:9]
    assert list(entry.values())[:11] == [32.0, 1024.0, 2, "warn", left, *counts]
    assert all(type(v) is int for v in list(entry.values())[4:11])


def test_checkpoint_ours_into_torch(device):
    """torch's load_state_dict takes our checkpoint (it ignores the extra entry) and goes on as
    ours does under the default policy."""
    ours = make_loop(device, "step", {})
    theirs = make_loop(device, "step", {})
    for f in FOUNDS[:CUT]:
        ours.step(f)
        theirs.step(f)
    saved = through_torch_save(ours.scaler.state_dict())
    assert "ampfused" in saved
    theirs.scaler = torch.amp.GradScaler(device)
    theirs.scaler.load_state_dict(saved)
    assert not hasattr(theirs.scaler, "ampfused") and theirs.scaler._scale is None
    for f in FOUNDS[CUT:]:
        ours.step(f)
        theirs.step(f)
        assert theirs.scaler.get_scale() == ours.scaler.get_scale()
        assert theirs.scaler._get_growth_tracker() == ours.scaler._get_growth_tracker()


@pytest.mark.parametrize("after_scale", [False, True])
def test_checkpoint_torch_into_ours(device, after_scale):
    """Ours from torch's checkpoint: torch's values, the constructor's policy, counters from
    zero and hysteresis left full."""
    theirs = Loop(device, torch.amp.GradScaler(device, init_scale=2.0**8, growth_interval=2))
    for f in FOUNDS[:CUT]:
        theirs.step(f)
    ours = make_loop(device, "step", {**CHECKPOINT_POLICY, "hysteresis": 3})
    for f in FOUNDS[:2]:  # counters and hysteresis left that the load must overwrite
        ours.step(f)
    if not after_scale:
        ours.scaler = ampfused.GradScaler(
            device, init_scale=64.0, **{**CHECKPOINT_POLICY, "hysteresis": 3}
        )
    ours.scaler.load_state_dict(through_torch_save(theirs.scaler.state_dict()))
    assert ours.scaler.counters() == {
        **dict.fromkeys(ops.STATE_FIELDS[3:9], 0),
        "hysteresis_left": 3,
    }
    assert (ours.scaler.min_scale, ours.scaler.max_scale, ours.scaler.hysteresis) == (
        32.0,
        1024.0,
        3,
    )
    want = [theirs.scaler.get_scale(), theirs.scaler._get_growth_tracker(), 3, 0, 0, 0, 0, 0, 0]
    for f in FOUNDS[CUT:]:
        ours.step(f)
        want = reference.update_state(want, f, *reference_policy(ours.scaler))
        assert state_list(ours.scaler) == want


GOOD_ENTRY = {
    "min_scale": 2.0,
    "max_scale": None,
    "hysteresis": 2,
    "at_min_scale": "raise",
    "hysteresis_left": 1,
    "steps": 10,
    "skipped_steps": 4,
    "consecutive_skips": 1,
    "growths": 3,
    "backoffs": 2,
    "floor_hits": 1,
    "headroom": 4.0,
    "ceiling": 2.0**12,
    "since_backoff": 40,
    "history": [2.0**10] + [INF] * 13 + [-(2.0**9), 2.0**8],  # (negative: an overflow's bound)
    "margin": 0.0,
}
BAD_ENTRIES = [
    ("entry", [1, 2], TypeError, "must be the dict"),
    ("steps", None, KeyError, "no 'steps' entry"),
    ("steps", 1.5, TypeError, "['steps'] must be an int"),
    ("growths", True, TypeError, "['growths'] must be an int"),
    ("floor_hits", 2**31, RuntimeError, "['floor_hits']"),
    ("hysteresis", 0, ValueError, "hysteresis must be an int from 1"),
    ("hysteresis_left", 3, ValueError, "hysteresis_left'] must be from 0 to hysteresis=2"),
    ("hysteresis_left", -1, ValueError, "hysteresis_left'] must be from 0"),
    ("min_scale", "2", TypeError, "min_scale must be None"),
    ("max_scale", 1.0, ValueError, "min_scale=2.0 is above max_scale=1.0"),
    ("at_min_scale", "ignore", ValueError, "at_min_scale must be one of"),
    ("headroom", 0.5, ValueError, "['headroom']: headroom must be from 1 to 65504"),
    ("headroom", "4", TypeError, "['headroom']: headroom must be 'learned' (a margin"),
    ("headroom", -4.0, ValueError, "['headroom']: headroom must be from 1 to 65504"),
    ("history", [1.0] * 3, TypeError, "['history'] must be a list of 16 floats"),
    ("history", [0.0] * 16, ValueError, "['history'] must hold nonzero floats"),
    ("margin", -1.0, ValueError, "['margin'] must be 0 (none learned) or a float from sqrt(2)"),
    ("margin", 0.5, ValueError, "['margin'] must be 0 (none learned) or a float from sqrt(2)"),
    ("margin", "2", TypeError, "['margin'] must hold floats"),
    ("ceiling", "big", TypeError, "['ceiling'] must hold floats"),
    ("since_backoff", -1, TypeError, "['since_backoff'] must be an int from 0"),
    ("since_backoff", None, KeyError, "no 'since_backoff' entry"),
]


@pytest.mark.parametrize("lazy", [True, False], ids=["before_scale", "after_scale"])
@pytest.mark.parametrize(("key", "value", "error", "match"), BAD_ENTRIES, ids=lambda v: str(v))
def test_bad_checkpoint_entry_changes_nothing(device, lazy, key, value, error, match):
    scaler = ampfused.GradScaler(device, init_scale=8.0, min_scale=1.0, hysteresis=3)
    if not lazy:
        scaler.scale(torch.ones((), device=device))
    before = (scaler.state_dict(), None if lazy else scaler._scale_state.tensor.clone())
    good = {**scaler.state_dict(), "scale": 4.0, "_growth_tracker": 1, "ampfused": GOOD_ENTRY}
    if key == "entry":
        bad = {**good, "ampfused": value}
    elif value is None:
        bad = {**good, "ampfused": {k: v for k, v in GOOD_ENTRY.items() if k != key}}
    else:
        bad = {**good, "ampfused": {**GOOD_ENTRY, key: value}}
    with pytest.raises(error, match=re.escape(match)):
        scaler.load_state_dict(copy.deepcopy(bad))
    assert scaler.state_dict() == before[0]
    if not lazy:
        assert torch.equal(scaler._scale_state.tensor, before[1])
    scaler.load_state_dict(copy.deepcopy(good))  # and the good one loads
    assert scaler.state_dict() == good
    assert scaler.counters()["steps"] == 10


def test_checkpoint_from_before_the_learned_margin(device):
    """A checkpoint written before the margin was learned (no 'margin' entry, a fixed
    headroom) loads with no margin learned and the fixed headroom; one of the learned margin
    says so and carries it."""
    old = {k: v for k, v in GOOD_ENTRY.items() if k != "margin"}
    scaler = ampfused.GradScaler(device)
    scaler.load_state_dict({**scaler.state_dict(), "ampfused": old})
    assert (scaler.policy, scaler.headroom) == ("headroom", 4.0)
    assert scaler.state_dict()["ampfused"]["margin"] == 0.0
    learned = {**GOOD_ENTRY, "headroom": "learned", "margin": 2.5}
    scaler.load_state_dict({**scaler.state_dict(), "ampfused": learned})
    assert scaler.headroom == "learned"
    scaler.scale(torch.ones((), device=device))  # (the lazy init holds the loaded margin)
    assert scaler.state_dict()["ampfused"]["margin"] == 2.5


def test_torchs_rule_checkpoint_with_a_numpy_zero_headroom(device):
    """'headroom': 0 written as a NumPy float (a checkpoint passed through NumPy) is torch's
    rule, as an int or float 0 is."""
    np = pytest.importorskip("numpy")
    scaler = ampfused.GradScaler(device)
    entry = {**GOOD_ENTRY, "headroom": np.float64(0.0)}
    scaler.load_state_dict({**scaler.state_dict(), "ampfused": entry})
    assert scaler.policy == "torch"


def test_disabled_scalers_checkpoints(device):
    off = ampfused.GradScaler(device, enabled=False)
    assert off.state_dict() == {}
    off.load_state_dict({"anything": 1})  # a no-op, as torch's
    on = ampfused.GradScaler(device)
    with pytest.raises(RuntimeError, match="empty"):
        on.load_state_dict(off.state_dict())
    assert pickle.loads(pickle.dumps(off)).state_dict() == {}


@pytest.mark.parametrize("touch", [False, True], ids=["pending", "recomputed"])
def test_state_replaced_from_outside(device, touch):
    """_scale and _growth_tracker replaced by other tensors (as code written against torch's
    private attributes may do): the update reads and writes those, the counters go on."""
    loop = make_loop(device, "found_inf_touched" if touch else "step", {"hysteresis": 2})
    policy = reference_policy(loop.scaler)
    want = [2.0**8, 0, 2, 0, 0, 0, 0, 0, 0]
    for i, f in enumerate(FOUNDS):
        if i == 3:
            loop.scaler._scale = torch.full((), 2.0**7, device=device)
            loop.scaler._growth_tracker = torch.ones((), dtype=torch.int32, device=device)
            want = [2.0**7, 1, *want[2:]]
        loop.step(f)
        want = reference.update_state(want, f, *policy)
        got = [loop.scaler.get_scale(), loop.scaler._get_growth_tracker()]
        assert same_state([*got, *state_list(loop.scaler)[2:]], want), f"iteration {i}"
    assert not loop.scaler._scale_state.owns(loop.scaler._scale, loop.scaler._growth_tracker)
