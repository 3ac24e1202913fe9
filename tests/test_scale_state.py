"""The scale state of ``ampfused.GradScaler``, step for step against ``torch.amp.GradScaler``,
bit for bit (the harness: _scaler_harness.py): state_dict and checkpoints loaded across the two
classes and mid-iteration, pickling and deepcopy, changes to the scale, the growth tracker, the
factors and found_inf between step() and update(), replaced _scale/_growth_tracker tensors, and
update(new_scale); and the state alone (``ampfused._scale_state.ScaleState``), with no
optimizer, against ``ampfused.reference.update_state``.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import _scaler_harness as harness
import pytest
import torch
from _scaler_harness import (
    INF_ITER,
    SCALER_KW,
    SCALERS,
    FusedScaler,
    Side,
    TorchScaler,
    _prepared,
    assert_same,
    build_net,
    build_three,
    compare_sides,
    inject_specials,
    lockstep,
    make_sides,
    make_train_step,
    torch_state_dict,
)

from ampfused import reference
from ampfused._scale_state import ScaleState


# ------------------------------------------------------------------------------- state_dict
def test_state_dict_matches_torch(device):
    kw = {
        "init_scale": 3.0 * 2**18,
        "growth_factor": 3.0,
        "backoff_factor": 0.25,
        "growth_interval": 3,
    }
    sides = make_sides(device, build_net("sgd", "forloop"), **kw)
    sds = [torch_state_dict(s.scaler) for s in sides]  # before the scale exists
    assert_same(sds[0], sds[1])
    assert list(sds[0]) == [
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    ]
    assert list(sides[1].scaler.state_dict()) == [*sds[0], "ampfused"]
    history = lockstep(sides, make_train_step(), 6)  # compares state_dict() every iteration
    assert any(h["mid"]["_growth_tracker"].item() for h in history)


def _crossload(src: torch.amp.GradScaler, dst: torch.amp.GradScaler) -> None:
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst.load_state_dict(torch.load(buf))


def test_checkpoint_crossload_mid_training(device):
    # sides: torch uninterrupted, ampfused uninterrupted, then torch and ampfused scalers that
    # are replaced mid-training by ones loaded from the other class's checkpoint.
    classes = (TorchScaler, FusedScaler, TorchScaler, FusedScaler)
    kw = {"init_scale": 2.0**20, "growth_interval": 3}
    sides = make_sides(device, build_net("adam", "foreach"), classes=classes, **kw)
    step = make_train_step()
    i = 0
    while i < 3 or sides[0].scaler._get_growth_tracker() == 0:  # load a non-trivial tracker
        lockstep(sides, step, range(i, i + 1))
        i += 1
        assert i < 12
    old = [s.scaler for s in sides]
    # a fresh scaler (lazy: no _scale yet) and a used one (its _scale is overwritten in place)
    fresh_fused = FusedScaler(device, init_scale=1.0, growth_factor=9.0, growth_interval=7)
    used_torch = TorchScaler(device, init_scale=5.0, backoff_factor=0.1)
    used_torch.scale(torch.ones((), device=device))
    _crossload(old[0], fresh_fused)  # torch -> ampfused
    _crossload(old[1], used_torch)  # ampfused -> torch
    sides[3].scaler, sides[2].scaler = fresh_fused, used_torch
    # and the other way round on a used ampfused scaler
    used_fused = FusedScaler(device, init_scale=7.0)
    used_fused.scale(torch.ones((), device=device))
    _crossload(old[2], used_fused)
    assert_same(torch_state_dict(used_fused), old[2].state_dict())
    lockstep(sides, step, range(i, i + 6))


@pytest.mark.parametrize("where", ["after_unscale", "after_step"])
def test_load_state_dict_mid_iteration(device, where):
    # Loading a checkpoint between unscale_/step and update: update() must start from the loaded
    # scale and tracker, as torch's does, never commit an update computed before the load.
    loaded = {
        "scale": 512.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 2,
        "_growth_tracker": 1,
    }

    def train_step(side: Side, i: int) -> dict:
        _prepared(side, i)
        inject_specials(side.model, i)
        if where == "after_unscale":
            side.scaler.unscale_(side.opt)
            side.scaler.load_state_dict(dict(loaded, scale=loaded["scale"] * (i + 1)))
            ret = side.scaler.step(side.opt)
        else:
            ret = side.scaler.step(side.opt)
            side.scaler.load_state_dict(dict(loaded, scale=loaded["scale"] * (i + 1)))
        res = {"ret": ret, "mid": harness.mid_iteration(side.scaler, [side.opt])}
        side.scaler.update()
        return res

    sides = make_sides(device, build_net("sgd", "forloop"), **SCALER_KW)
    history = lockstep(sides, train_step, 5)
    assert harness.found_from(history[INF_ITER])
    # the loaded tracker (1) with interval 2 means: a clean step grows, an overflow backs off
    assert sides[0].scaler.get_scale() == 512.0 * 5 * 4.0


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_pickle_and_deepcopy(device, how):
    def clone(scaler):
        return pickle.loads(pickle.dumps(scaler)) if how == "pickle" else copy.deepcopy(scaler)

    base = make_train_step()

    def train_step(side: Side, i: int) -> dict:
        side.scaler = clone(side.scaler)  # at the iteration boundary
        out = base(side, i)
        return out

    sides = make_sides(device, build_net("adamw", "fused"), **SCALER_KW)
    for side in sides:
        side.scaler = clone(side.scaler)  # before the scale exists
    lockstep(sides, train_step, 6)
    assert type(sides[1].scaler) is FusedScaler
    # mid-iteration both refuse, with the same error
    messages = []
    for side in sides:
        _prepared(side)
        side.scaler.unscale_(side.opt)
        with pytest.raises(AssertionError) as exc:
            clone(side.scaler)
        messages.append(str(exc.value))
        side.scaler.step(side.opt)
        side.scaler.update()
    assert messages[0] == messages[1]
    compare_sides(sides, "after the refused copy")
    lockstep(sides, train_step, range(6, 8))


# ------------------------------------------------------------------------------- fallbacks
def _between_fill_scale(side: Side, i: int) -> None:
    if i in (2, 5):
        side.scaler._scale.fill_(3.0 * 2**10)


def _between_mul_scale(side: Side, i: int) -> None:
    if i % 3 == 1:
        side.scaler._scale.mul_(0.25)


def _between_tracker(side: Side, i: int) -> None:
    if i == 4:
        side.scaler._growth_tracker.fill_(1)


def _setter(name: str, values: dict[int, float]) -> Callable[[Side, int], None]:
    def between(side: Side, i: int) -> None:
        if i in values:
            getattr(side.scaler, name)(values[i])

    return between


def _found_inf_edit(op: str) -> Callable[[Side, int], Any]:
    def between(side: Side, i: int) -> Any:
        for f in side.scaler._found_inf_per_device(side.opt).values():
            if op == "zero":  # hide every overflow: the scale keeps growing
                f.zero_()
            elif op == "one" and i % 2 == 0:  # report an overflow on every other step
                f.fill_(1.0)
            elif op == "add" and i % 3 == 0:  # found_inf values summing to 2
                f.add_(1.0)

    return between


def _replace_scale(side: Side, i: int) -> None:
    if i == 3:
        side.scaler._scale = torch.full((), 2.0**11, device=side.device)
    if i == 5:
        side.scaler._growth_tracker = torch.full((), 1, dtype=torch.int32, device=side.device)


FALLBACKS: dict[str, Callable[[Side, int], Any]] = {
    "scale_fill_": _between_fill_scale,
    "scale_mul_": _between_mul_scale,
    "growth_tracker_fill_": _between_tracker,
    "set_growth_factor": _setter("set_growth_factor", {1: 3.0, 4: 1.5}),
    "set_backoff_factor": _setter("set_backoff_factor", {0: 0.125, 3: 0.75}),
    "set_growth_interval": _setter("set_growth_interval", {1: 1, 5: 3}),
    "found_inf_zero_": _found_inf_edit("zero"),
    "found_inf_fill_one": _found_inf_edit("one"),
    "found_inf_add_": _found_inf_edit("add"),
    "replace_scale_tensors": _replace_scale,
}


@pytest.mark.parametrize("impl", ["forloop", "fused"])
@pytest.mark.parametrize("case", list(FALLBACKS))
def test_changes_between_step_and_update(device, case, impl):
    sides = make_sides(device, build_net("sgd", impl), **SCALER_KW)
    lockstep(sides, make_train_step(between=FALLBACKS[case]))


@pytest.mark.parametrize("case", ["scale_mul_", "set_growth_factor", "set_backoff_factor"])
def test_changes_between_two_optimizers(device, case):
    # the change lands after the first optimizer's pass and before the others' passes
    sides = make_sides(device, build_three, init_scale=2.0**12, growth_interval=2)
    lockstep(sides, harness.multi_step(FALLBACKS[case]), 6)


def test_replaced_scale_tensors_between_iterations(device):
    def train_step(side: Side, i: int) -> dict:
        if i == 2:
            side.scaler._scale = torch.full((), 2.0**13, device=side.device)
            side.scaler._growth_tracker = torch.full((), 1, dtype=torch.int32, device=side.device)
        return make_train_step()(side, i)

    lockstep(make_sides(device, build_net("sgd", "foreach"), **SCALER_KW), train_step)


@pytest.mark.parametrize("kind", ["float", "tensor"])
def test_update_new_scale(device, kind):
    def train_step(side: Side, i: int) -> dict:
        _prepared(side, i)
        inject_specials(side.model, i)
        ret = side.scaler.step(side.opt)
        res = {"ret": ret, "mid": harness.mid_iteration(side.scaler, [side.opt])}
        if i in (1, 3, 4):
            value = 2.0 ** (10 + i)
            new_scale = value if kind == "float" else torch.tensor(value, device=side.device)
            side.scaler.update(new_scale)
            if kind == "tensor":
                new_scale.fill_(7.0)  # later changes to the argument do not leak in
        else:
            side.scaler.update()
        return res

    sides = make_sides(device, build_net("sgd", "forloop"), **SCALER_KW)
    lockstep(sides, train_step, 7)


@pytest.mark.parametrize(
    "bad",
    ["two_elements", "requires_grad"],
)
def test_update_new_scale_invalid(device, bad):
    messages = []
    for cls in SCALERS:
        scaler = cls(device, init_scale=8.0)
        scaler.scale(torch.ones((), device=device))
        if bad == "two_elements":
            new_scale = torch.ones(2, device=device)
        else:
            new_scale = torch.ones((), device=device, requires_grad=True)
        with pytest.raises(AssertionError) as exc:
            scaler.update(new_scale)
        messages.append((str(exc.value), scaler.get_scale()))
    (msg_t, scale_t), (msg_a, scale_a) = messages
    assert scale_a == scale_t == 8.0
    # torch's wording first, then what was given
    assert msg_a.startswith(msg_t) and len(msg_a) > len(msg_t), (msg_t, msg_a)


# ------------------------------------------------------------------------------- the state alone
# ScaleState (ampfused/_scale_state.py) driven directly, with no optimizer and no scaler: found_inf
# tensors in, the rule's state out, against ampfused.reference.update_state.
_RULE = (2.0, 0.5, 2)  # growth_factor, backoff_factor, growth_interval
_FOUND_SEQUENCE = [0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]


def _state_on(device: str, policy=(2.0**2, 2.0**5, 2, "clamp")) -> tuple[ScaleState, Any, Any]:
    state = ScaleState(policy)
    scale, tracker = state.make(2.0**4, 0, torch.device(device))
    return state, scale, tracker


def test_scale_state_follows_the_reference_rule(device):
    state, scale, tracker = _state_on(device)
    want = reference.state_to_list(state.tensor)
    assert want == reference.initial_state(2.0**4, 2)
    for i, found in enumerate(_FOUND_SEQUENCE):
        flag = torch.full((), float(found), device=device)
        assert state.prepare_next(state.take_pending(), scale, tracker, _RULE, [flag], False)
        state.commit(scale, tracker)
        want = reference.update_state(want, bool(found), *_RULE, 2.0**2, 2.0**5, 2)
        assert reference.state_to_list(state.tensor) == want, i
        assert state.owns(scale, tracker) and float(scale) == want[0]
    # every branch of the policy was met: growth held at max_scale, backoffs held at min_scale
    assert state.counters()["floor_hits"] > 0 and float(scale) <= 2.0**5


def test_scale_state_pending_update_holds_only_while_its_inputs_do(device):
    state, scale, tracker = _state_on(device)
    flag = torch.zeros((), device=device)
    pending = state.start_pending(scale, tracker, _RULE)
    pending.note(flag)
    assert state.pending_holds(pending, scale, tracker, _RULE, [flag])
    assert not state.pending_holds(pending, scale, tracker, (2.0, 0.5, 3), [flag])
    assert not state.pending_holds(pending, scale, tracker, _RULE, [flag, flag.clone()])
    assert not state.pending_holds(pending, scale, tracker, _RULE, [flag.clone()])
    flag.add_(0.0)  # written since the pass: its version moved
    assert not state.pending_holds(pending, scale, tracker, _RULE, [flag])
    pending = state.start_pending(scale, tracker, _RULE)
    pending.note(flag)
    scale.mul_(1.0)
    assert not state.pending_holds(pending, scale, tracker, _RULE, [flag])
    assert state.take_pending() is pending and state.pending is None


def test_scale_state_commits_into_replaced_tensors(device):
    state, _, _ = _state_on(device)
    scale = torch.full((), 2.0**3, device=device)
    tracker = torch.full((), 1, dtype=torch.int32, device=device)
    assert not state.owns(scale, tracker)
    found = torch.zeros((), device=device)
    assert state.prepare_next(None, scale, tracker, _RULE, [found], in_place=False)
    state.commit(scale, tracker)
    # The rule ran on the replaced values; the counters are the state's own.
    assert float(scale) == 2.0**4 and int(tracker) == 0
    assert state.counters() == {
        "steps": 1,
        "skipped_steps": 0,
        "consecutive_skips": 0,
        "growths": 1,
        "backoffs": 0,
        "floor_hits": 0,
        "hysteresis_left": 2,
    }
    # A replacement of another dtype only torch's update can handle.
    assert not state.prepare_next(None, scale.double(), tracker, _RULE, [found], in_place=False)


def test_scale_state_snapshot_keeps_its_policy_and_counters(device):
    state, scale, tracker = _state_on(device, (None, 2.0**8, 3, "clamp"))
    for found in (1, 0, 1):
        flag = torch.full((), float(found), device=device)
        state.prepare_next(state.take_pending(), scale, tracker, _RULE, [flag], False)
        state.commit(scale, tracker)
    counters = state.counter_values()
    snapshot = state.snapshot()
    # plain values only: a pickle of the scaler names no ampfused class for them
    assert all(v is None or type(v) in (int, float, str, list) for v in snapshot.values())
    copy = ScaleState.from_snapshot(snapshot)
    assert copy.tensor is None and copy.pending is None  # made again lazily
    assert (copy.min_scale, copy.max_scale, copy.hysteresis, copy.at_min_scale) == (
        None,
        2.0**8,
        3,
        "clamp",
    )
    copy.make(float(scale), int(tracker), torch.device(device))
    got, want = reference.state_to_list(copy.tensor), reference.state_to_list(state.tensor)
    # (all but the last iteration's measured magnitude: a measurement, not the policy's state)
    assert got[:9] + got[10:] == want[:9] + want[10:]
    assert copy.counter_values() == counters


# ------------------------------------------------------------------------------- copies, pickles
def _iteration(scaler, model, opt, inf: bool) -> None:
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    if inf:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_shallow_copy_has_a_state_of_its_own():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = FusedScaler("cpu", hysteresis=2)
    _iteration(scaler, model, opt, False)
    before = scaler.counters()
    twin = copy.copy(scaler)
    for _ in range(3):
        _iteration(twin, model, opt, True)
    assert scaler.counters() == before  # untouched by the copy's iterations
    assert twin.counters()["steps"] == 4 and twin.counters()["skipped_steps"] == 3
    assert scaler.state_dict()["ampfused"]["steps"] == 1


# Pickled by ampfused at c0bf0b3 (before the scaler's state moved into ScaleState): init_scale 64,
# min_scale 4, hysteresis 3, at_min_scale "warn", after a clean and a skipped iteration.
OLD_PICKLE = (
    "gASVqQIAAAAAAACMFGFtcGZ1c2VkLmdyYWRfc2NhbGVylIwKR3JhZFNjYWxlcpSTlCmBlH2UKIwHX2RldmljZZSMA2Nw"
    "dZSMCF9lbmFibGVklIiMC19pbml0X3NjYWxllEdAUAAAAAAAAIwGX3NjYWxllE6MDl9ncm93dGhfZmFjdG9ylEdAAAAA"
    "AAAAAIwPX2JhY2tvZmZfZmFjdG9ylEc/4AAAAAAAAIwQX2dyb3d0aF9pbnRlcnZhbJRN0AeMFF9pbml0X2dyb3d0aF90"
    "cmFja2VylEsAjA9fZ3Jvd3RoX3RyYWNrZXKUTowVX3Blcl9vcHRpbWl6ZXJfc3RhdGVzlIwLY29sbGVjdGlvbnOUjAtk"
    "ZWZhdWx0ZGljdJSTlGgAjBZfZnJlc2hfb3B0aW1pemVyX3N0YXRllJOUhZRSlIwGX3N0YXRllE6MDF9zdGF0ZV92aWV3"
    "c5ROjAVfbmV4dJROjAtfbmV4dF9zY2FsZZROjBRfbmV4dF9ncm93dGhfdHJhY2tlcpROjAhfcGVuZGluZ5ROjAhfc2Nh"
    "bGluZ5SIjAZfd2F0Y2iUTowKX3N0YXRzX25vd5RdlIwLX3N0YXRzX2xhc3SUXZSMCl9taW5fc2NhbGWUR0AQAAAAAAAA"
    "jApfbWF4X3NjYWxllE6MC19oeXN0ZXJlc2lzlEsDjA1fYXRfbWluX3NjYWxllIwEd2FybpSMDl9rZXJuZWxfcG9saWN5"
    "lEdAEAAAAAAAAEd/8AAAAAAAAEsDh5SMDl9pbml0X2NvdW50ZXJzlF2UKEsCSwJLAUsBSwBLAEsAZYwLX2FsbG93X2Zw"
    "MTaUiYwPX2ZvdW5kX2luZl9wbGFulF2UjAxfbmV4dF9kZXZpY2WUjAV0b3JjaJSMBmRldmljZZSTlIwDY3B1lIWUUpR1"
    "Yi4="
)


def test_scaler_pickled_before_the_split_keeps_policy_and_counters():
    import base64

    scaler = pickle.loads(base64.b64decode(OLD_PICKLE))
    assert (scaler.min_scale, scaler.max_scale, scaler.hysteresis, scaler.at_min_scale) == (
        4.0,
        None,
        3,
        "warn",
    )
    assert scaler.counters() == {
        "steps": 2,
        "skipped_steps": 1,
        "consecutive_skips": 1,
        "growths": 0,
        "backoffs": 0,
        "floor_hits": 0,
        "hysteresis_left": 2,
    }
    assert not {"_state", "_pending", "_stats_now", "_min_scale"} & set(vars(scaler))
    model = torch.nn.Linear(2, 2)
    _iteration(scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), False)
    assert scaler.get_scale() == 64.0 and scaler.counters()["steps"] == 3


def test_weights_only_load_needs_no_ampfused_private_class(tmp_path):
    import collections

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    import ampfused.grad_scaler as gs

    model = torch.nn.Linear(2, 2)
    scaler = FusedScaler("cpu", init_scale=2.0, min_scale=1.0)
    fresh = tmp_path / "fresh.pt"
    torch.save(scaler, fresh)  # (torch's defaultdict factory before the first update())
    _iteration(scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), False)
    used = tmp_path / "used.pt"
    torch.save(scaler, used)
    safe = [
        FusedScaler,
        collections.defaultdict,
        _refresh_per_optimizer_state,
        gs._fresh_optimizer_state,
    ]
    with torch.serialization.safe_globals(safe):
        for path, steps in ((fresh, 0), (used, 1)):
            loaded = torch.load(path, weights_only=True)
            assert loaded.get_scale() == 2.0 and loaded.min_scale == 1.0
            assert loaded.counters()["steps"] == steps


def test_init_scale_of_a_type_torch_takes_needs_no_float_without_bounds():
    # torch.full accepts it; float() would not: only bounds compare init_scale as a float.
    FusedScaler("cpu", init_scale=2 + 0j)
