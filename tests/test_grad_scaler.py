"""``ampfused.GradScaler`` as a drop-in ``torch.amp.GradScaler``: the constructor, unscale_,
step (with the fused-optimizer protocol), update, a disabled scaler and misuse, each step for step
against torch's scaler, bit for bit (the harness: _scaler_harness.py).

The scale state and its checkpoints are tested in test_scale_state.py, the pass over the gradients
in test_grad_pass.py.
"""

from __future__ import annotations

import copy
import inspect
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from _scaler_harness import (
    D_HID,
    D_OUT,
    IMPLS,
    INF_ITER,
    OPTIMIZERS,
    SCALER_KW,
    FusedScaler,
    Net,
    Side,
    TorchScaler,
    _prepared,
    assert_exercised_skip_and_growth,
    assert_same,
    batch,
    build_net,
    build_three,
    compare_sides,
    forward_loss,
    found_from,
    inject_specials,
    lockstep,
    make_sides,
    make_train_step,
    mid_iteration,
    multi_step,
    scaler_step,
    torch_state_dict,
)
from torch import nn

import ampfused
import ampfused.grad_scaler


# ------------------------------------------------------------------------------- identity
def test_is_a_torch_grad_scaler():
    s = FusedScaler("cpu")
    assert isinstance(s, torch.amp.GradScaler)
    assert issubclass(FusedScaler, torch.amp.GradScaler)
    sig_t = list(inspect.signature(TorchScaler.__init__).parameters.values())
    sig_a = list(inspect.signature(FusedScaler.__init__).parameters.values())
    # torch's arguments, then ours (the scale policy), keyword-only with defaults
    assert [(p.name, p.default, p.kind) for p in sig_t] == [
        (p.name, p.default, p.kind) for p in sig_a[: len(sig_t)]
    ]
    extra = sig_a[len(sig_t) :]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), extra
    assert ampfused.grad_scaler.OptState is torch.amp.grad_scaler.OptState


# ------------------------------------------------------------------------------- optimizers
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_optimizer_parity(device, opt_name, impl, dtype):
    sides = make_sides(device, build_net(opt_name, impl), **SCALER_KW)
    if impl == "fused":
        assert sides[0].opt._step_supports_amp_scaling
    history = lockstep(sides, make_train_step(dtype))
    assert_exercised_skip_and_growth(history, natural_overflow=dtype == torch.float16)
    for h in history:
        seen = h["seen_by_step"]
        assert h["mid"]["fused_attrs_left"] == [False]  # deleted after step, as torch does
        if impl == "fused":
            # the read-only check path: the optimizer got the scale and found_inf, and ran
            assert len(seen) == 1 and isinstance(seen[0]["grad_scale"], torch.Tensor)
            assert seen[0]["found_inf"].item() == h["found"]
        else:
            assert len(seen) == (0 if h["found"] else 1)


@pytest.mark.parametrize("impl", ["forloop", "fused"])
def test_unscale_then_step_parity(device, impl):
    # unscale_ explicitly before step: ordinary optimizers skip their own unscale; fused ones get
    # grad_scale=None and the found_inf of unscale_.
    sides = make_sides(device, build_net("adam", impl), **SCALER_KW)
    history = lockstep(sides, make_train_step(unscale_first=True))
    assert_exercised_skip_and_growth(history, natural_overflow=True)
    if impl == "fused":
        assert all(h["seen_by_step"][0]["grad_scale"] is None for h in history)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_fill"])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_zero_grad_modes(device, impl, set_to_none):
    sides = make_sides(device, build_net("adamw", impl), **SCALER_KW)
    lockstep(sides, make_train_step(set_to_none=set_to_none))


def test_gradient_accumulation(device):
    micro = 3

    def train_step(side: Side, i: int) -> dict:
        side.opt.zero_grad()
        losses = []
        for k in range(micro):
            loss = forward_loss(side.model, micro * i + k, side.device) / micro
            side.scaler.scale(loss).backward()
            losses.append(loss.detach())
            if i == 2 and k == 0:  # an overflow in an early micro-batch survives accumulation
                with torch.no_grad():
                    side.model.fc1.weight.grad[0, 0] = float("inf")
        ret, seen = scaler_step(side.scaler, side.opt)
        out = {"losses": losses, "ret": ret, "mid": mid_iteration(side.scaler, side.opts)}
        side.scaler.update()
        return out

    sides = make_sides(device, build_net("sgd", "foreach"), init_scale=2.0**18, growth_interval=2)
    history = lockstep(sides, train_step, 8)
    assert sum(found_from(h) for h in history) >= 1


@pytest.mark.parametrize("impl", ["forloop", "foreach", "fused"])
def test_unscale_clip_step(device, impl):
    def train_step(side: Side, i: int) -> dict:
        side.opt.zero_grad()
        loss = forward_loss(side.model, i, side.device)
        side.scaler.scale(loss).backward()
        inject_specials(side.model, i)
        side.scaler.unscale_(side.opt)
        norm = nn.utils.clip_grad_norm_(side.model.parameters(), max_norm=0.5, foreach=True)
        ret, seen = scaler_step(side.scaler, side.opt)
        out = {
            "norm": norm,
            "ret": ret,
            "seen": seen,
            "mid": mid_iteration(side.scaler, [side.opt]),
        }
        side.scaler.update()
        return out

    sides = make_sides(device, build_net("sgd", impl), **SCALER_KW)
    history = lockstep(sides, train_step)
    assert any(not math.isfinite(h["norm"].item()) for h in history)
    assert any(math.isfinite(h["norm"].item()) for h in history)


def test_multiple_models_optimizers_losses(device):
    sides = make_sides(device, build_three, init_scale=2.0**12, growth_interval=2)
    history = lockstep(sides, multi_step(), 7)
    # exactly one optimizer overflowed (the others stepped), in the middle and the first pass
    assert history[1]["found"] == [0.0, 1.0, 0.0]
    assert history[4]["found"] == [0.0, 0.0, 1.0]


def test_gradient_penalty(device):
    # torch's AMP example: autograd.grad on the scaled loss with create_graph, unscale by hand,
    # add the gradient norm to the loss, then the usual scaled backward.
    def train_step(side: Side, i: int) -> dict:
        model, opt, scaler = side.model, side.opt, side.scaler
        opt.zero_grad()
        x, idx, y = batch(i, side.device)
        with torch.autocast(device_type=side.device, dtype=torch.float16):
            out = model(x, idx)
            loss = F.mse_loss(out.float(), y)
        params = list(model.parameters())
        scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        with torch.autocast(device_type=side.device, dtype=torch.float16):
            penalty = sum(((g * inv_scale) ** 2).sum() for g in scaled).sqrt()
            loss = loss + penalty
        scaler.scale(loss).backward()
        inject_specials(model, i)
        ret, seen = scaler_step(scaler, opt)
        res = {"loss": loss.detach(), "penalty": penalty.detach(), "ret": ret}
        res["mid"] = mid_iteration(scaler, [opt])
        scaler.update()
        return res

    sides = make_sides(device, build_net("adam", "foreach"), init_scale=2.0**12, growth_interval=2)
    lockstep(sides, train_step, 8)


# ------------------------------------------------------------------------------- disabled
def test_disabled_scaler(device):
    sides = make_sides(device, build_net("sgd", "foreach"), enabled=False)
    for side in sides:
        x = torch.ones(3, device=device)
        assert side.scaler.scale(x) is x
        lst = [x, (x,)]
        assert side.scaler.scale(lst) is lst

    def train_step(side: Side, i: int) -> dict:
        side.opt.zero_grad()
        loss = forward_loss(side.model, i, side.device)
        scaled = side.scaler.scale(loss)
        scaled.backward()
        side.scaler.unscale_(side.opt)
        ret = side.scaler.step(side.opt)
        side.scaler.update()
        side.scaler.update(4.0)
        side.scaler.load_state_dict({})
        return {
            "same_loss_object": scaled is loss,
            "ret": ret,
            "get_scale": side.scaler.get_scale(),
            "tracker": side.scaler._get_growth_tracker(),
            "state_dict": torch_state_dict(side.scaler),
            "enabled": side.scaler.is_enabled(),
        }

    history = lockstep(sides, train_step, 4)
    assert history[0]["same_loss_object"] and history[0]["get_scale"] == 1.0
    for side in sides:
        clone = pickle.loads(pickle.dumps(side.scaler))
        assert type(clone) is type(side.scaler) and not clone.is_enabled()
        copy.deepcopy(side.scaler)


# ------------------------------------------------------------------------------- odd params
def test_frozen_and_unused_parameters(device):
    class Partial(Net):
        def __init__(self):
            super().__init__()
            self.fc1.requires_grad_(False)  # frozen but handed to the optimizer: grad None
            self.side = nn.Linear(D_HID, D_OUT)  # used in odd iterations only

        def forward(self, x, idx, use_side=False):
            h = F.relu(self.fc2(F.relu(self.fc1(x + self.emb(idx)))))
            return self.head(h) + (self.side(h) if use_side else 0)

    def build(dev):
        model = Partial().to(dev)
        return [model], [torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)]

    def train_step(side: Side, i: int) -> dict:
        side.opt.zero_grad(set_to_none=True)
        x, idx, y = batch(i, side.device)
        with torch.autocast(device_type=side.device, dtype=torch.float16):
            out = side.model(x, idx, use_side=bool(i % 2))
        side.scaler.scale(F.mse_loss(out.float(), y)).backward()
        assert side.model.fc1.weight.grad is None
        inject_specials(side.model, i)
        ret, _ = scaler_step(side.scaler, side.opt)
        res = {"ret": ret, "mid": mid_iteration(side.scaler, [side.opt])}
        side.scaler.update()
        return res

    lockstep(make_sides(device, build, **SCALER_KW), train_step)


def test_optimizer_without_grads_raises(device):
    def build(dev):
        used, unused = Net().to(dev), Net().to(dev)
        return [used, unused], [
            torch.optim.SGD(used.parameters(), lr=0.1),
            torch.optim.SGD(unused.parameters(), lr=0.1),
        ]

    def train_step(side: Side, i: int) -> dict:
        for o in side.opts:
            o.zero_grad()
        side.scaler.scale(forward_loss(side.model, i, side.device)).backward()
        with pytest.raises(AssertionError) as exc:
            side.scaler.step(side.opts[1])
        ret = side.scaler.step(side.opts[0])  # the other optimizer and the update still work
        res = {"ret": ret, "mid": mid_iteration(side.scaler, side.opts)}
        side.scaler.update()
        side.log.append(str(exc.value))
        return res

    sides = make_sides(device, build, **SCALER_KW)
    lockstep(sides, train_step, 4)
    msg_t, msg_a = sides[0].log[0], sides[1].log[0]
    assert msg_t == "No inf checks were recorded for this optimizer."
    assert msg_a.startswith(msg_t) and len(msg_a) > len(msg_t)


class _TaggedSGD(torch.optim.SGD):
    """step() takes extra arguments and returns something, to check what scaler.step forwards
    and returns."""

    def step(self, closure=None, tag=None, *, scale_lr=1.0):  # type: ignore[override]
        for g in self.param_groups:
            g["lr"] = 0.05 * scale_lr
        super().step(closure)
        return (tag, scale_lr)


def test_step_forwards_arguments_and_return_value(device):
    def build(dev):
        model = Net().to(dev)
        return [model], [_TaggedSGD(model.parameters(), lr=0.05, foreach=False)]

    def train_step(side: Side, i: int) -> dict:
        _prepared(side, i)
        inject_specials(side.model, i)
        ret = side.scaler.step(side.opt, None, f"it{i}", scale_lr=1.0 + i)
        res = {"ret": ret, "mid": mid_iteration(side.scaler, [side.opt])}
        side.scaler.update()
        return res

    history = lockstep(make_sides(device, build, **SCALER_KW), train_step)
    rets = [h["ret"] for h in history]
    assert rets[INF_ITER] is None and ("it9", 10.0) in rets


# ------------------------------------------------------------------------------- misuse
def _noop(side: Side) -> None:
    pass


def _step_update(side: Side) -> None:
    side.scaler.step(side.opt)
    side.scaler.update()


def _update(side: Side) -> None:
    side.scaler.update()


def _unscale(side: Side) -> None:
    side.scaler.unscale_(side.opt)


def _step(side: Side) -> None:
    side.scaler.step(side.opt)


def _prepared_unscaled(side: Side) -> None:
    _prepared(side)
    side.scaler.unscale_(side.opt)


def _prepared_stepped(side: Side) -> None:
    _prepared(side)
    side.scaler.step(side.opt)


def _half_grads(side: Side) -> None:
    side.model.head.half()  # float16 params after float32 ones: nothing may be unscaled
    _prepared(side)


def _not_a_tensor(side: Side) -> None:
    _prepared(side)
    side.opt.param_groups[0]["params"].append(1.5)


# name: (prepare, misuse, finish, exception type, ampfused adds guidance, torch's message)
MISUSE: dict[str, tuple] = {
    "unscale_twice": (
        _prepared_unscaled,
        _unscale,
        _step_update,
        RuntimeError,
        True,
        "unscale_() has already been called on this optimizer since the last update().",
    ),
    "unscale_after_step": (
        _prepared_stepped,
        _unscale,
        _update,
        RuntimeError,
        True,
        "unscale_() is being called after step().",
    ),
    "step_twice": (
        _prepared_stepped,
        _step,
        _update,
        RuntimeError,
        True,
        "step() has already been called since the last update().",
    ),
    "closure": (
        _prepared,
        lambda s: s.scaler.step(s.opt, closure=lambda: None),
        _step_update,
        RuntimeError,
        True,
        "Closure use is not currently supported if GradScaler is enabled.",
    ),
    "fp16_grads_step": (
        _half_grads,
        _step,
        _noop,
        ValueError,
        True,
        "Attempting to unscale FP16 gradients.",
    ),
    "fp16_grads_unscale": (
        _half_grads,
        _unscale,
        _noop,
        ValueError,
        True,
        "Attempting to unscale FP16 gradients.",
    ),
    "update_without_step": (
        _prepared,
        _update,
        _step_update,
        AssertionError,
        True,
        "No inf checks were recorded prior to update.",
    ),
    "update_before_scale": (
        _noop,
        _update,
        _noop,
        AssertionError,
        False,
        "Attempted update but _scale is None.  This may indicate your "
        "script did not use scaler.scale(loss or outputs) earlier in the "
        "iteration.",
    ),
    "step_before_scale": (
        _noop,
        _step,
        _noop,
        AssertionError,
        False,
        "Attempted step but _scale is None.",
    ),
    "param_not_a_tensor": (
        _not_a_tensor,
        _step,
        _noop,
        AssertionError,
        None,
        "expected param to be torch.Tensor, got float",
    ),
}


@pytest.mark.parametrize("impl", ["forloop", "fused"])
@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_like_torch(device, case, impl):
    prepare, misuse, finish, exc_type, guidance, torch_msg = MISUSE[case]
    sides = make_sides(device, build_net("adam", impl), **SCALER_KW)
    if case == "fp16_grads_step" and impl == "fused":
        # not a misuse there: the fused-optimizer check path allows float16 grads, in both
        for side in sides:
            prepare(side)
            side.scaler.step(side.opt)
            side.scaler.update()
        compare_sides(sides, "float16 grads, fused optimizer")
        return
    messages = []
    for side in sides:
        prepare(side)
        with pytest.raises(Exception) as exc:
            misuse(side)
        assert type(exc.value) is exc_type, f"{type(side.scaler)}: {exc.value!r}"
        messages.append(str(exc.value))
    msg_t, msg_a = messages
    assert msg_t.startswith(torch_msg)  # guards the expectation against torch changing
    assert msg_a.startswith(msg_t), f"ampfused: {msg_a!r}\ntorch: {msg_t!r}"
    if guidance:
        assert len(msg_a) > len(msg_t), "ampfused's message should add guidance"
    # the failed call left both scalers in the same state: finish the iteration and train on
    compare_sides(sides, "after the error")
    for side in sides:
        finish(side)
    if case != "param_not_a_tensor" and not case.startswith("fp16"):
        lockstep(sides, make_train_step(), range(1, 4))
    else:
        compare_sides(sides, "after finishing")


# ------------------------------------------------------------------------------- protocol bugs
class _AmpAwareOptimizer(torch.optim.SGD):
    """A minimal optimizer using the fused-optimizer protocol: it reads grad_scale and found_inf
    and, like some custom optimizers, keeps them (for a deferred update) or consumes found_inf."""

    def __init__(self, params, consume_found_inf: bool = False):
        super().__init__(params, lr=0.1)
        self._step_supports_amp_scaling = True
        self.consume_found_inf = consume_found_inf
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.kept.append((self.grad_scale, self.found_inf))
        if self.consume_found_inf:
            self.found_inf.zero_()
        return "stepped"


def _run_amp_aware(cls, consume: bool) -> dict:
    p = torch.ones(3, requires_grad=True)
    opt = _AmpAwareOptimizer([p], consume_found_inf=consume)
    scaler = cls("cpu", init_scale=4.0, growth_interval=1)
    rets = []
    for i in range(3):
        p.grad = torch.full((3,), float("inf") if i == 1 else 1.0)
        scaler.scale(torch.ones(()))
        rets.append(scaler.step(opt))
        scaler.update()
    return {
        "rets": rets,
        "kept": [(g.item(), f.item()) for g, f in opt.kept],
        "scale": scaler.get_scale(),
    }


def test_fused_protocol_found_inf_is_a_private_tensor():
    assert_same(_run_amp_aware(TorchScaler, True), _run_amp_aware(FusedScaler, True))


def test_fused_protocol_grad_scale_is_a_snapshot():
    assert_same(_run_amp_aware(TorchScaler, False), _run_amp_aware(FusedScaler, False))
