"""Scale policies (min_scale, max_scale, hysteresis) and the counters, in the ops and GradScaler.

The ops' update rule (``scaler_update_`` and ``scaler_pass_``, one C++ function) is run over
random found/clean sequences and policies and held, iteration by iteration, against
``ampfused.reference.update_state``: the scale's bits, the growth tracker, hysteresis left and
every counter.  With the default policy it must equal ``torch._amp_update_scale_`` bit for bit.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

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
