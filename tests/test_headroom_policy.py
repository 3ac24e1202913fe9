"""The headroom policy (``GradScaler(policy="headroom")``): the pass's measurement, the rule
(the ops against ``ampfused.reference.update_state``, bit for bit), the rule's properties and
the scaler around it.

Each property is checked on the reference rule and on the ops' rule, and each is shown to fail
on a rule broken the way that property guards against (``BROKEN``): a property test that
passes a broken rule tests nothing.

The properties run on a simulated training run (:func:`simulate`): at each iteration the
gradients the pass reads reach ``need * scale`` and, in float16 somewhere the pass does not
read (an activation gradient), ``unseen * scale``; the iteration overflows where either passes
float16's largest value.
"""

from __future__ import annotations

import io
import math
import pickle
import random
import warnings
from collections.abc import Callable

import pytest
import torch

import ampfused
from ampfused import ops, reference

INF = math.inf
HALF_MAX = 65504.0
HEADROOM = 4.0
F32_MAX = torch.finfo(torch.float32).max
TORCH = (2.0, 0.5, 2000, -INF, INF, 1)  # factors, interval, min_scale, max_scale, hysteresis

Rule = Callable[..., list]


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).float().item()


def bits(x: float) -> int:
    return torch.tensor(x, dtype=torch.float32).view(torch.int32).item()


def same(a: list, b: list) -> bool:
    """Equal states, the float fields compared as float32 bits."""
    return [bits(x) if isinstance(x, float) else x for x in a] == [
        bits(x) if isinstance(x, float) else x for x in b
    ]


# ----------------------------------------------------------------------------- the rules
def reference_rule(state: list, found: bool, *policy: float) -> list:
    return reference.update_state(state, found, *policy)


def kernel_rule(state: list, found: bool, *policy: float) -> list:
    """ops.scaler_update_ (the CPU kernel's update): the magnitude goes in through next_state,
    where the passes leave it."""
    *rule, headroom, magnitude = policy
    st = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    reference.state_from_list(state, st)
    nxt = torch.zeros_like(st)
    nxt[9:10].view(torch.float32).fill_(magnitude)
    ops.scaler_update_(torch.tensor(1.0 if found else 0.0), st, nxt, *rule, headroom)
    return reference.state_to_list(nxt)


def broken(name: str) -> Rule:
    """The reference rule broken as `name` says (each breaks one property)."""

    def rule(state: list, found: bool, *policy: float) -> list:
        *torch_rule, headroom, magnitude = policy
        if name == "torch interval":  # growth every growth_interval clean steps only
            return reference.update_state(state, found, *torch_rule, 0.0, magnitude)
        if name == "fixed margin":  # the most, never learned
            return reference.update_state(state, found, *torch_rule, abs(headroom), magnitude)
        if name in LEARNING_BREAKS:
            saved = reference.MARGIN_DECAY, reference._learned_margin
            reference.MARGIN_DECAY, reference._learned_margin = LEARNING_BREAKS[name]
            try:
                return reference.update_state(state, found, *policy)
            finally:
                reference.MARGIN_DECAY, reference._learned_margin = saved
        before = reference._full(state)
        slot = H0 + before[3] % reference.HISTORY
        if name == "no history":  # the cap of this iteration alone
            before = before[:H0] + [INF] * reference.HISTORY + before[reference.MARGIN :]
        out = reference.update_state(before, found, *policy)
        if name == "no history":
            out[H0 : reference.MARGIN] = reference._full(state)[H0 : reference.MARGIN]
            out[slot] = reference.update_state(before, found, *policy)[slot]
        if name == "one growth too many" and out[0] > before[0]:
            out[0] = f32(out[0] * 2.0)
        if name == "no overflow record" and found:
            out[slot] = INF
        if name == "no ceiling":
            out[10] = INF
        if name == "unmeasured overflow held" and found:  # (the first version's record)
            out[slot] = out[0]
        if name == "unmeasured ceiling kept" and not found and out[10] > before[10]:
            out[10:12] = before[10], before[11] + 1  # (the first measurement forgets nothing)
        if name == "every overflow a ceiling" and found and out[0] < before[0]:
            out[10] = min(out[10], before[0])
        if name == "overflow bound relaxed" and found:  # (recorded as a cap, not a bound)
            out[slot] = abs(out[slot])
        if name == "ceiling by the tracker" and found and out[0] < before[0]:
            # (the first version: any earlier skip, and the tracker, reset by every overflow)
            if before[4] != 0 and before[1] < reference.CEILING_WINDOW:
                out[10] = min(out[10], before[0])
        return out

    rule.__name__ = name
    return rule


def _rise_ignored(margin: float, lowest_cap: float, cap: float, most: float) -> float:
    m = (margin if 0 < margin < INF else most) * reference.MARGIN_DECAY
    return f32(min(max(m, reference.MARGIN_LEAST), most))


# (MARGIN_DECAY, _learned_margin) for the broken rules that learn the margin wrong
LEARNING_BREAKS = {
    "margin never forgets": (1.0, reference._learned_margin),
    "rise ignored": (reference.MARGIN_DECAY, _rise_ignored),
}
RULES = [reference_rule, kernel_rule]
H0 = reference.MARGIN - reference.HISTORY  # the history's first field


def simulate(
    rule: Rule,
    need: Callable[[int], float],
    steps: int,
    unseen: Callable[[int], float] = lambda t: 0.0,
    start: float = 1.0,
    policy: tuple = TORCH,
    headroom: float = HEADROOM,
) -> tuple[list[float], list[bool], list[list]]:
    """The scale in force at each iteration, whether it overflowed, and the states after."""
    state = reference.initial_state(start, policy[5])
    scales, skipped, states = [], [], []
    for t in range(steps):
        scale = state[0]
        seen, other = need(t) * scale, unseen(t) * scale
        found = max(seen, other) > HALF_MAX
        magnitude = 0.0 if found else f32(seen)
        state = rule(state, found, *policy, headroom, magnitude)
        scales.append(scale)
        skipped.append(found)
        states.append(state)
    return scales, skipped, states


def noisy(level: float, seed: int, spread: float = 2.0) -> Callable[[int], float]:
    """A gradient level that wanders by up to `spread` times either way, step to step."""
    rng = random.Random(seed)
    values = [level * spread ** rng.uniform(-1, 1) for _ in range(5000)]
    return lambda t: values[t]


# ----------------------------------------------------------------------------- properties
def check_never_grows_past_measured(rule: Rule) -> None:
    """After every update, each magnitude measured in the history, taken to the new scale,
    stays `headroom` times below float16's largest value: no growth into a predicted
    overflow."""
    need = noisy(1e-3, 1, spread=4.0)
    scales, skipped, states = simulate(rule, need, 400)
    assert sum(skipped) < 5  # (gradients wandering 16x step to step overflow now and then)
    for t in range(400):
        new = states[t][0]
        recent = range(max(0, t - reference.HISTORY + 1), t + 1)
        worst = max(need(j) for j in recent if not skipped[j])
        assert worst * new <= HALF_MAX / HEADROOM, (t, new, worst)


def check_grows_as_soon_as_room(rule: Rule) -> None:
    """From a low scale, with steady gradients, the scale reaches the level the magnitudes
    allow in one update, and again at once after the gradients shrink (no fixed count of
    steps)."""
    need = lambda t: 1e-2 if t < 100 else 1e-4  # noqa: E731
    scales, skipped, _ = simulate(rule, need, 140)
    assert not any(skipped)
    target = lambda n: 2.0 ** math.floor(math.log2(HALF_MAX / (HEADROOM * n)))  # noqa: E731
    assert scales[1] == target(1e-2), scales[:3]
    # gradients shrink at t=100; the history holds the larger ones for HISTORY iterations
    assert scales[100 + reference.HISTORY] == target(1e-4), scales[100:120]


def check_quiet_step_invites_no_growth(rule: Rule) -> None:
    """Every fifth iteration's gradients are 16 times the others': the quiet ones between
    must not raise the scale into the next loud one."""
    need = lambda t: 1.6e-2 if t % 5 == 0 else 1e-3  # noqa: E731
    _, skipped, _ = simulate(rule, need, 300)
    assert not any(skipped), f"skipped at {[t for t, s in enumerate(skipped) if s]}"


def check_spike_costs_one_step(rule: Rule) -> None:
    """A batch whose gradients are 10^3 times the others' (at iterations 300 and 700): that
    iteration is skipped, no other; the scale stays backed off while the overflow is in the
    history (a loud batch rarely comes alone), and is back at its level right after."""
    spikes = {300, 700}
    base = noisy(1e-3, 2)
    need = lambda t: base(t) * (1e3 if t in spikes else 1.0)  # noqa: E731
    scales, skipped, _ = simulate(rule, need, 1000)
    assert [t for t, s in enumerate(skipped) if s] == sorted(spikes)
    for t in spikes:
        held = scales[t + 1 : t + reference.HISTORY + 1]
        assert max(held) <= scales[t] / 2, (t, scales[t - 1 : t + 20])
        assert scales[t + reference.HISTORY + 2] >= min(scales[t - 20 : t]), (t, scales[t:])


def check_isolated_overflows_set_no_ceiling(rule: Rule) -> None:
    """Spikes 40 clean iterations apart set no ceiling, whatever the growth_interval (here
    shorter than the ceiling's window) or the hysteresis (here absorbing the first overflow of
    a pair): only a backoff soon after a backoff does."""
    for policy, spikes in (
        ((2.0, 0.5, 20, -INF, INF, 1), {100, 140, 180, 220}),
        ((2.0, 0.5, 2000, -INF, INF, 2), {100, 101, 300, 301}),
    ):
        base = noisy(1e-3, 5)

        def need(t: int, base: Callable = base, spikes: set = spikes) -> float:
            return base(t) * (1e3 if t in spikes else 1.0)

        _, _, states = simulate(rule, need, 400, policy=policy)
        assert all(s[10] == INF for s in states), (policy, [s[10] for s in states[95:230]])


def check_no_skip_at_startup(rule: Rule) -> None:
    """Started at the policy's start scale, a run whose first gradients are finite skips
    nothing (torch's rule from 65,536 skips its first iterations)."""
    for level in (1e-6, 1e-3, 1.0, 100.0):
        _, skipped, _ = simulate(rule, noisy(level, 3), 200)
        assert not any(skipped), (level, [t for t, s in enumerate(skipped) if s])


def check_unmeasured_overflow_is_learned(rule: Rule) -> None:
    """Gradients the pass does not read reach 64 times those it does (more than the margin):
    the policy skips a few iterations to find that level, then holds below it, probing one
    growth_factor higher every growth_interval clean iterations as torch's rule does: at most
    one skip per growth_interval after the first."""
    need = noisy(1e-3, 4, spread=1.2)
    unseen = lambda t: need(t) * 64  # noqa: E731
    policy = (2.0, 0.5, 500, -INF, INF, 1)
    _, skipped, _ = simulate(rule, need, 2000, unseen=unseen, policy=policy)
    later = [t for t, s in enumerate(skipped) if s and t >= 100]
    assert len(later) <= (2000 - 100) // 500 + 1, later


def check_unmeasured_overflow_holds_nothing(rule: Rule) -> None:
    """A NaN in the very first iteration (or the first two), before anything was measured: the
    scale backs off once and the step is skipped, but nothing holds it below where the first
    measurements put it (a backed-off entry would hold half a scale, less than no scaling, for
    HISTORY iterations), and no ceiling is set."""
    base = noisy(1e-3, 6, spread=1.2)
    _, _, clean_states = simulate(rule, base, 60)
    for nans in ({0}, {0, 1}):

        def need(t: int, nans: set = nans) -> float:
            return INF if t in nans else base(t)

        scales, skipped, states = simulate(rule, need, 60)
        assert [t for t, s in enumerate(skipped) if s] == sorted(nans)
        first_measured = max(nans) + 1
        level = clean_states[first_measured][0]  # where the measurements put the scale
        assert min(scales[first_measured + 1 : 40]) >= level, (nans, scales[:24], level)
        # (two overflows in a row set a ceiling; the first measurement forgets it)
        assert all(s[10] == INF for s in states[first_measured:]), [s[10] for s in states[:5]]


# The learned margin (headroom="learned", the ops' headroom -4): properties of its own, and the
# properties above that hold for any margin.
LEARNED = -HEADROOM


def check_learned_margin_shrinks_on_steady_gradients(rule: Rule) -> None:
    """Gradients that wander 1.1x step to step: the margin falls from its most (4) to its
    least (sqrt 2) within 800 iterations (a binade per 512), so the scale ends a binade above
    the fixed margin's, with no skip."""
    need = noisy(1e-3, 7, spread=1.1)
    learned, skipped, states = simulate(rule, need, 1000, headroom=LEARNED)
    fixed, _, _ = simulate(rule, need, 1000)
    assert not any(skipped), [t for t, s in enumerate(skipped) if s]
    assert states[-1][reference.MARGIN] < 1.5, states[-1][reference.MARGIN]  # (sqrt 2 and rises)
    assert min(learned[-100:]) >= 2 * max(fixed[-100:]), (learned[-100:], fixed[-100:])


def check_learned_margin_rises_at_once(rule: Rule) -> None:
    """Steady gradients (the margin at its least, sqrt 2), then one step 1.3x the usual: the
    margin after it is sqrt 2 times that rise over the history's largest (at least 1.6), at
    once, not a step later."""
    calm = noisy(1e-3, 13, spread=1.05)
    need = lambda t: calm(t) * (1.3 if t == 1000 else 1.0)  # noqa: E731
    _, skipped, states = simulate(rule, need, 1001, headroom=LEARNED)
    assert not any(skipped), [t for t, s in enumerate(skipped) if s]
    assert states[999][reference.MARGIN] < 1.5, states[999][reference.MARGIN]
    assert states[1000][reference.MARGIN] >= 1.6, states[1000][reference.MARGIN]


def check_learned_margin_forgets(rule: Rule) -> None:
    """300 iterations of gradients jumping 16x, then steady ones: the margin learned from the
    jumps fades (a binade in 512 clean iterations), so 1,000 iterations later the scale is
    where steady gradients alone put it."""
    noise, calm = noisy(1e-3, 10, spread=4.0), noisy(1e-3, 11, spread=1.05)
    need = lambda t: noise(t) if t < 300 else calm(t)  # noqa: E731
    scales, _, states = simulate(rule, need, 1300, headroom=LEARNED)
    steady, _, _ = simulate(rule, calm, 1300, headroom=LEARNED)
    assert states[-1][reference.MARGIN] < 1.5, states[-1][reference.MARGIN]
    assert scales[-1] == steady[-1], (scales[-1], steady[-1])


def check_learned_margin_takes_one_skip_for_a_lasting_rise(rule: Rule) -> None:
    """Steady gradients (the margin at its least), then a lasting 2.5x rise: at most one skip,
    then none (the rise, measured, lifts the margin)."""
    calm = noisy(1e-3, 12, spread=1.05)
    need = lambda t: calm(t) * (2.5 if t >= 1000 else 1.0)  # noqa: E731
    _, skipped, states = simulate(rule, need, 1300, headroom=LEARNED)
    assert states[999][reference.MARGIN] < 1.5
    assert sum(skipped) <= 1 and not any(skipped[1010:]), [t for t, s in enumerate(skipped) if s]


def check_learned_margin_holds_the_scale_after_a_spike(rule: Rule) -> None:
    """The spike property at the learned margin: an overflow's bound is not relaxed by the
    margin (only measured caps are)."""
    spikes = {900, 1100}
    base = noisy(1e-3, 2, spread=1.1)
    need = lambda t: base(t) * (1e3 if t in spikes else 1.0)  # noqa: E731
    scales, skipped, _ = simulate(rule, need, 1200, headroom=LEARNED)
    assert [t for t, s in enumerate(skipped) if s] == sorted(spikes)
    for t in spikes:
        assert max(scales[t + 1 : t + reference.HISTORY + 1]) <= scales[t] / 2, scales[t : t + 20]


# Each property and the broken rules it must catch.
PROPERTIES = {
    check_never_grows_past_measured: ["one growth too many"],
    check_grows_as_soon_as_room: ["torch interval"],
    check_quiet_step_invites_no_growth: ["no history"],
    check_spike_costs_one_step: ["every overflow a ceiling", "no overflow record"],
    check_unmeasured_overflow_is_learned: ["no ceiling"],
    check_isolated_overflows_set_no_ceiling: ["ceiling by the tracker", "every overflow a ceiling"],
    check_unmeasured_overflow_holds_nothing: [
        "unmeasured overflow held",
        "unmeasured ceiling kept",
    ],
    check_learned_margin_shrinks_on_steady_gradients: ["fixed margin"],
    check_learned_margin_rises_at_once: ["rise ignored"],
    check_learned_margin_forgets: ["margin never forgets"],
    check_learned_margin_holds_the_scale_after_a_spike: ["overflow bound relaxed"],
}
BROKEN_CASES = [(check, name) for check, names in PROPERTIES.items() for name in names]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
@pytest.mark.parametrize(
    "check",
    [*PROPERTIES, check_no_skip_at_startup, check_learned_margin_takes_one_skip_for_a_lasting_rise],
    ids=lambda c: c.__name__[6:],
)
def test_property_holds(check: Callable[[Rule], None], rule: Rule) -> None:
    check(rule)


@pytest.mark.parametrize(
    "check, name", BROKEN_CASES, ids=[f"{c.__name__[6:]}-{n}" for c, n in BROKEN_CASES]
)
def test_property_fails_on_a_broken_rule(check: Callable[[Rule], None], name: str) -> None:
    with pytest.raises(AssertionError):
        check(broken(name))


def test_a_lasting_rise_is_the_learned_margins_price() -> None:
    """What the learned margin gives up: the lasting 2.5x rise above costs the fixed margin (4)
    nothing and the learned one (at sqrt 2 then) its one skip."""
    calm = noisy(1e-3, 12, spread=1.05)
    need = lambda t: calm(t) * (2.5 if t >= 1000 else 1.0)  # noqa: E731
    _, learned, _ = simulate(reference_rule, need, 1300, headroom=LEARNED)
    _, fixed, _ = simulate(reference_rule, need, 1300)
    assert ([t for t, s in enumerate(learned) if s], any(fixed)) == ([1000], False)


def test_startup_fails_from_torchs_initial_scale() -> None:
    _, skipped, _ = simulate(reference_rule, noisy(10.0, 3), 50, start=2.0**16)
    assert skipped[0]


# ----------------------------------------------------------------------------- the ops' rule
def random_policy(rng: random.Random) -> tuple:
    return (
        rng.choice([2.0, 2.0, 1.5, 4.0, 1.0001]),
        rng.choice([0.5, 0.5, 0.25, 0.9]),
        rng.choice([2000, 3, 1, 50]),
        rng.choice([-INF, 1.0, 2.0**-10, 3.0]),
        rng.choice([INF, 2.0**20, 2.0**16 + 1.0, 1e30]),
        rng.choice([1, 1, 2, 3]),
    )


@pytest.mark.parametrize("seed", range(6))
def test_ops_rule_equals_reference(seed: int) -> None:
    """scaler_update_ over random verdicts, magnitudes (zero, tiny, huge) and policies, bit
    for bit against reference.update_state, every field every iteration."""
    rng = random.Random(seed)
    policy = random_policy(rng)
    headroom = rng.choice([HEADROOM, 1.0, 3.5, 65504.0, -HEADROOM, -1.0, -2.5, -65504.0])
    start = max(policy[3], min(policy[4], rng.choice([1.0, 2.0**16, 3.0, 2.0**-20])))
    state = reference.initial_state(start, policy[5])
    for i in range(300):
        found = rng.random() < 0.1
        magnitude = rng.choice([0.0, 1e-30, 1e-3 * state[0], 60000.0, 3e38, rng.random() * 1e4])
        want = reference.update_state(state, found, *policy, headroom, f32(magnitude))
        got = kernel_rule(state, found, *policy, headroom, f32(magnitude))
        assert same(got, want), (i, policy, headroom, state, got, want)
        state = want


def test_torch_rule_leaves_the_headroom_fields() -> None:
    """headroom 0 (torch's rule): the ceiling, the count since the last backoff and the history
    pass through; the scale and tracker are torch's _amp_update_scale_'s."""
    state = reference.initial_state(2.0**10)
    state[10], state[11], state[H0] = 5.0, 7, 9.0
    for found in (False, True, False):
        got = kernel_rule(state, found, *TORCH, 0.0, 123.0)
        assert got[10:13] == [5.0, 7, 9.0]
        scale, tracker = torch.tensor(state[0]), torch.tensor(state[1], dtype=torch.int32)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(found)), 2.0, 0.5, 2000)
        assert got[0] == scale.item() and got[1] == tracker.item()
        state = got


# ----------------------------------------------------------------------------- the measurement
def _grads(device: str, with_inf: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [
        (torch.randn(300_000, generator=g) * 1e3).to(device),  # over the parallel split
        (torch.randn(1000, generator=g) * 100).half().to(device),
        (torch.randn(77, generator=g) * 7).bfloat16().to(device),
        torch.tensor([3e300, -1e-300, 2.0], dtype=torch.float64, device=device),
        torch.tensor([-65504.0, 1.0, float("nan")], dtype=torch.float16, device=device)[:2],
        torch.randn(40, 3, generator=g).to(device).t(),  # not contiguous
    ]
    if with_inf:
        out[1][17] = float("inf")
    return out


@pytest.mark.parametrize("check_only", [False, True])
@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("with_inf", [False, True])
def test_pass_measures_and_updates_as_reference(
    device: str, check_only: bool, stats: bool, with_inf: bool
) -> None:
    """scaler_pass_ with headroom: the measured magnitude (the largest finite |v|; with
    statistics from the rows), the unscaled gradients and the whole next state, bit for bit
    against reference.scaler_pass_; then an accumulating second pass."""
    state_list = reference.initial_state(2.0**3)
    state = torch.zeros(ops.STATE_SIZE, dtype=torch.int32, device=device)
    reference.state_from_list(state_list, state)
    results = []
    for impl in (ops, reference):
        grads = _grads(device, with_inf)
        nxt = torch.full((ops.STATE_SIZE,), -5, dtype=torch.int32, device=device)
        found = torch.zeros((), device=device)
        table = None
        if stats:
            table = torch.empty(
                ops.grad_stats_rows(grads), len(ops.STAT_FIELDS), dtype=torch.float64, device=device
            )
        args = (grads, found, state, nxt, table, *TORCH, check_only)
        impl.scaler_pass_(*args, False, HEADROOM)
        first = reference.state_to_list(nxt)
        impl.scaler_pass_(grads[1:3], found, state, nxt, None, *TORCH, True, True, HEADROOM)
        results.append((first, reference.state_to_list(nxt), [g.cpu() for g in grads]))
    (got1, got2, got_grads), (want1, want2, want_grads) = results
    assert same(got1, want1), (got1[:12], want1[:12])
    assert same(got2, want2)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    # (a float64 gradient of 3e300: the magnitude is float32's largest, by either measurement)
    assert got1[9] == (INF if with_inf else F32_MAX)


def test_pass_without_headroom_measures_nothing(device: str) -> None:
    state = torch.zeros(ops.STATE_SIZE, dtype=torch.int32, device=device)
    reference.state_from_list(reference.initial_state(4.0), state)
    nxt = torch.zeros_like(state)
    ops.scaler_pass_(
        _grads(device, False), torch.zeros((), device=device), state, nxt, None, *TORCH
    )
    assert reference.state_to_list(nxt)[9] == 0.0


# ----------------------------------------------------------------------------- the scaler
class SimulatedRun:
    """ampfused.GradScaler over one parameter whose gradient is set to +-need * scale each
    iteration, with an element made inf where the simulated float16 gradients (need, or
    unseen: what the pass does not read) overflow at that scale."""

    def __init__(self, scaler: ampfused.GradScaler, device: str = "cpu") -> None:
        self.p = torch.nn.Parameter(torch.zeros(64, device=device))
        self.opt = torch.optim.SGD([self.p], lr=0.0)
        self.scaler = scaler

    def step(self, need: float, unseen: float = 0.0) -> float:
        s = self.scaler
        s.scale(torch.ones((), device=self.p.device))  # (the lazy init, the iteration begun)
        scale = s.get_scale()
        g = torch.full_like(self.p, need * scale)
        g[0] = -need * scale
        if max(need, unseen) * scale > HALF_MAX:
            g[1] = INF
        self.p.grad = g
        s.step(self.opt)
        s.update()
        return scale


@pytest.mark.parametrize("headroom", ["learned", 4.0, 2.5])
def test_scaler_follows_the_rule(device: str, headroom: float | str) -> None:
    """GradScaler(policy="headroom") over a simulated run, its margin learned or fixed: its
    whole state after every update is the reference rule's, from the policy's start scale
    (1.0) on."""
    need = lambda t: 1e-3 * (1e3 if t == 30 else 1.0) * (3.0 if t % 7 == 0 else 1.0)  # noqa: E731
    rule_headroom = LEARNED if headroom == "learned" else headroom
    _, _, want = simulate(reference_rule, need, 60, headroom=rule_headroom)
    scaler = ampfused.GradScaler(device, policy="headroom", headroom=headroom)
    run = SimulatedRun(scaler, device)
    for t in range(60):
        run.step(need(t))
        got = reference.state_to_list(run.scaler._scale_state.tensor)
        assert same(got, want[t]), (t, got[:12], want[t][:12])
    counts = run.scaler.counters()
    assert counts["skipped_steps"] == 1
    grown = sum(b[0] > a[0] for a, b in zip(want, want[1:], strict=False))
    assert counts["growths"] == grown + 1  # (+1: the first update, from the start scale)


def test_constructor_and_properties() -> None:
    s = ampfused.GradScaler("cpu", policy="headroom")
    assert (s.policy, s.headroom, s.get_scale()) == ("headroom", "learned", 1.0)
    assert ampfused.GradScaler("cpu", policy="headroom", headroom=4.0).headroom == 4.0
    assert ampfused.GradScaler("cpu", policy="headroom", init_scale=4.0).get_scale() == 4.0
    assert ampfused.GradScaler("cpu", policy="headroom", min_scale=2.0).get_scale() == 2.0
    assert ampfused.GradScaler("cpu", policy="headroom", headroom=2).headroom == 2.0
    t = ampfused.GradScaler("cpu")
    assert (t.policy, t.headroom, t.get_scale()) == ("torch", None, 2.0**16)
    # (4.0, the fixed default before the margin was learned, is still taken with torch's rule)
    assert ampfused.GradScaler("cpu", headroom=4.0).policy == "torch"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"policy": "auto"}, ValueError, "policy must be one of 'torch', 'headroom'"),
        ({"policy": None}, TypeError, "policy must be one of"),
        ({"policy": "headroom", "headroom": 0.5}, ValueError, "headroom must be from 1"),
        ({"policy": "headroom", "headroom": "8"}, TypeError, "headroom must be 'learned'"),
        ({"policy": "headroom", "headroom": -4.0}, ValueError, "headroom must be from 1"),
        ({"headroom": 2.0}, ValueError, "only with policy='headroom'"),
        ({"headroom": -4.0}, ValueError, "headroom must be from 1"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        ampfused.GradScaler("cpu", **kwargs)


def test_bounds_hysteresis_and_counters() -> None:
    """max_scale holds the growth, min_scale the lowering; hysteresis=2 keeps the scale
    through one overflow (the step still skipped); the counters count the policy's moves."""
    run = SimulatedRun(ampfused.GradScaler("cpu", policy="headroom", max_scale=2.0**6))
    for _ in range(5):
        run.step(1e-6)
    assert run.scaler.get_scale() == 2.0**6
    run = SimulatedRun(
        ampfused.GradScaler("cpu", policy="headroom", init_scale=2.0**10, min_scale=2.0**9)
    )
    run.step(20.0)  # the magnitudes ask for 2**8 (409.6): the lowering is held at min_scale
    assert run.scaler.get_scale() == 2.0**9
    counts = run.scaler.counters()
    assert (counts["backoffs"], counts["skipped_steps"], counts["floor_hits"]) == (1, 0, 0)
    run = SimulatedRun(ampfused.GradScaler("cpu", policy="headroom", hysteresis=2))
    run.step(1e-3)
    level = run.scaler.get_scale()
    run.step(1e3)  # one overflow: skipped, the scale kept
    assert run.scaler.get_scale() == level and run.scaler.counters()["skipped_steps"] == 1


def test_at_min_scale_raise_and_scaling_false() -> None:
    run = SimulatedRun(
        ampfused.GradScaler(
            "cpu", policy="headroom", init_scale=4.0, min_scale=4.0, at_min_scale="raise"
        )
    )
    with pytest.raises(RuntimeError, match="held at min_scale"):
        run.step(1e6)
    guard = SimulatedRun(ampfused.GradScaler("cpu", policy="headroom", scaling=False))
    for need in (1e-6, 1.0, 1e6):
        assert guard.step(need) == 1.0
    assert guard.scaler.get_scale() == 1.0


def test_resume_equals_uninterrupted() -> None:
    """state_dict() at iteration 25 loaded into a fresh scaler: the next 35 iterations' states
    equal the uninterrupted run's, bit for bit (history and ceiling included); torch's scaler
    loads the checkpoint, and a pickled scaler goes on the same way."""
    need = lambda t: 2e-3 * (1e3 if t in (20, 40) else 1.0) * (4.0 if t % 5 == 0 else 1.0)  # noqa: E731
    whole = SimulatedRun(ampfused.GradScaler("cpu", policy="headroom"))
    first = SimulatedRun(ampfused.GradScaler("cpu", policy="headroom"))
    states = []
    for t in range(60):
        whole.step(need(t))
        states.append(whole.scaler._scale_state.tensor.clone())
        if t < 25:
            first.step(need(t))
    checkpoint = first.scaler.state_dict()
    assert len(checkpoint["ampfused"]["history"]) == reference.HISTORY
    torch.amp.GradScaler("cpu").load_state_dict(checkpoint)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    resumed = SimulatedRun(ampfused.GradScaler("cpu"))  # the policy comes with the checkpoint
    resumed.scaler.load_state_dict(torch.load(buffer))
    pickled = SimulatedRun(pickle.loads(pickle.dumps(first.scaler)))
    for t in range(25, 60):
        for run in (resumed, pickled):
            run.step(need(t))
            assert torch.equal(run.scaler._scale_state.tensor, states[t]), t


def test_checkpoint_of_torchs_scaler_starts_the_history_afresh() -> None:
    ours = SimulatedRun(ampfused.GradScaler("cpu", policy="headroom"))
    for _ in range(3):
        ours.step(1e-3)
    ours.scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=4.0).state_dict())
    assert ours.scaler.policy == "headroom" and ours.scaler.get_scale() == 4.0
    fresh = [INF, 2**31 - 1] + [INF] * reference.HISTORY + [0.0]
    assert ours.scaler._scale_state.history() == fresh


def test_traced_activation_gradients_are_measured() -> None:
    """Under watch(model, activations=True) the magnitude the update reads is the largest of
    the parameter gradients' and the traced float16 activation gradients' (the scaled values
    backward produced), here the activations'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64, bias=False), torch.nn.ReLU(), torch.nn.Linear(64, 1, bias=False)
    )
    with torch.no_grad():
        model[2].weight.mul_(300.0)  # the first layer's output gradient: large
    scaler = ampfused.GradScaler("cpu", policy="headroom", init_scale=2.0**4)
    scaler.watch(model, activations=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[torch.Tensor] = []

    # (the ReLU's output gradient: the largest float16 one, the first Linear's is at most it)
    def keep_grad(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(seen.append)

    model[1].register_forward_hook(keep_grad)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 16) * 1e-2).float().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    params = max(p.grad.abs().max().item() for p in model.parameters()) * 2.0**4
    traced = seen[0].float().abs().max().item()
    assert seen[0].dtype == torch.float16 and traced > params
    assert scaler.magnitude() == traced


def _compiled_training(compiled: bool) -> list[torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = ampfused.GradScaler("cpu", policy="headroom")

    def scaler_step() -> None:
        scaler.step(opt)
        scaler.update()

    step = torch.compile(scaler_step, backend="eager") if compiled else scaler_step
    states = []
    for i in range(5):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
        if i == 2:
            model[0].weight.grad[1, 2] = INF
        step()
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        states.append((scaler._scale_state.tensor.clone(), params))
    torch._dynamo.reset()
    return states


def test_compiled_step_follows_the_rule() -> None:
    """scaler.step and update inside torch.compile, under the headroom policy: every update is
    the rule applied to the magnitude that step measured (the compiled optimizer rounds its
    parameters differently from the eager one, so the runs' magnitudes differ in the last bits:
    each run is held to the rule, and the compiled one to the eager one to float32 precision)."""
    eager, compiled = _compiled_training(False), _compiled_training(True)
    for run in (eager, compiled):
        before = reference.initial_state(1.0)
        for i, (state, _) in enumerate(run):
            after = reference.state_to_list(state)
            found = after[9] == INF
            want = reference.update_state(before, found, *TORCH, LEARNED, after[9])
            assert same(after, want), (i, after[:12], want[:12])
            before = after
    assert [s[0][0] for s in eager] == [s[0][0] for s in compiled]
    for (_, pa), (_, pb) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_nothing_measured_starts_fast_then_follows_torchs_rule() -> None:
    """Where the pass measures nothing (MasterWeights without traced activations, all-zero
    gradients), the policy doubles each clean step from its start up to 65,536, torch's initial
    scale, then grows by torch's rule; an overflow backs off as ever.  The ops' rule agrees."""
    policy = (2.0, 0.5, 50, -INF, INF, 1)
    state = reference.initial_state(1.0)
    scales = []
    for t in range(120):
        found = t == 30
        want = reference.update_state(state, found, *policy, HEADROOM, 0.0)
        assert same(kernel_rule(state, found, *policy, HEADROOM, 0.0), want), t
        state = want
        scales.append(state[0])
    assert scales[:17] == [2.0**k for k in range(1, 17)] + [2.0**16]
    # the overflow backed off; with no cap in the history it holds nothing (it says nothing
    # about a level that is not measured): the fast start again at once, then torch's rule, a
    # growth 50 clean steps after the overflow
    assert scales[30:32] == [2.0**15, 2.0**16]
    assert scales[79:81] == [2.0**16, 2.0**17]


def _bf16_steps(make: str, steps: int = 3, **watch: object) -> list[str]:
    """A few headroom-policy steps on bfloat16 gradients (a bfloat16 model, or float32 weights
    under bfloat16 autocast, traced) or on float16 autocast; the UserWarnings they gave."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    dtype = torch.float16 if make == "float16 autocast" else torch.bfloat16
    if make == "bfloat16 model":
        model = model.to(torch.bfloat16)
    scaler = ampfused.GradScaler("cpu", policy="headroom")
    if watch:
        scaler.watch(model, **watch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad()
            x = torch.randn(4, 8, dtype=torch.bfloat16 if make == "bfloat16 model" else None)
            with torch.autocast("cpu", dtype=dtype, enabled=make != "bfloat16 model"):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize(
    "make, watch",
    [
        ("bfloat16 model", {}),
        ("bfloat16 autocast", {"activations": True}),
    ],
)
def test_bfloat16_gradients_warn_once(make: str, watch: dict) -> None:
    """The headroom policy is a float16 rule (65,504): on bfloat16 gradients, or bfloat16 traced
    activations, the first pass says once that bfloat16 wants scaling=False."""
    got = _bf16_steps(make, **watch)
    assert len(got) == 1, got
    assert "bfloat16" in got[0] and "scaling=False" in got[0] and "65,504" in got[0]


def test_float16_gradients_do_not_warn() -> None:
    assert _bf16_steps("float16 autocast", activations=True) == []
    assert _bf16_steps("bfloat16 autocast") == []  # (float32 gradients, nothing traced: silent)


@pytest.mark.parametrize("activations", [False, True])
def test_master_weights_under_watch_measure_their_float16_gradients(activations: bool) -> None:
    """MasterWeights (a float16 model) under watch(): the headroom policy's magnitude is the
    largest float16 parameter gradient as backward made it (scaled), from the statistics pass
    (and, traced, at least the activation gradients'); without watch() nothing is measured."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = model.half()
    opt = ampfused.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.0))
    scaler = ampfused.GradScaler("cpu", policy="headroom", init_scale=2.0**6)
    scaler.watch(model, activations=activations)
    x = torch.randn(32, 8).half()
    scaler.scale(model(x).float().square().mean()).backward()
    largest = max(float(p.grad.float().abs().max()) for p in model.parameters())
    scaler.step(opt)
    scaler.update()
    traced = [a.abs_max for a in scaler.report().activations if a.direction == "backward"]
    want = max([largest, *[t for t in traced if activations]])
    assert scaler.magnitude() == want and largest > 0, (scaler.magnitude(), largest, traced)
    plain = ampfused.GradScaler("cpu", policy="headroom", init_scale=2.0**6)
    opt.zero_grad()
    plain.scale(model(x).float().square().mean()).backward()
    plain.step(opt)
    plain.update()
    assert plain.magnitude() == 0.0


def test_pickle_from_before_the_learned_margin_goes_on() -> None:
    """A scaler pickled before the state had a margin (its history list one shorter) unpickles
    with none learned and trains on by its fixed headroom, as it did."""
    scaler = ampfused.GradScaler("cpu", policy="headroom", headroom=4.0)
    run = SimulatedRun(scaler)
    for _ in range(3):
        run.step(1e-3)
    values = scaler.__getstate__()
    values["_init_history"] = values["_init_history"][:-1]  # (no margin)
    old = ampfused.GradScaler.__new__(ampfused.GradScaler)
    old.__setstate__(values)
    again = SimulatedRun(pickle.loads(pickle.dumps(old)))
    assert again.scaler.headroom == 4.0
    assert again.scaler.state_dict()["ampfused"]["margin"] == 0.0
    assert again.step(1e-3) == run.step(1e-3)
