"""Step-for-step parity of ``ampfused.GradScaler`` with ``torch.amp.GradScaler``, bit for bit.

Every test builds the same models and optimizers twice (same seed), gives one copy torch's
scaler and the other ampfused's, feeds both the same data and runs them side by side.  After
every iteration it compares, bit for bit: every parameter, every gradient (after step, so
unscaled inf/NaN gradients of skipped steps included), every optimizer-state tensor, the scale
and growth tracker, the state_dict, and whatever the iteration observed between step() and
update() (get_scale(), _scale, found_inf_per_device, the grad_scale/found_inf handed to fused
optimizers, step()'s return value).  The oracle is torch's scaler itself, run in this process.

Overflows happen naturally (float16 autocast with an init_scale far too large, so the first
steps back off and a growth_interval of 2-3 lets the scale grow back into overflow) and are
also injected (inf and NaN written into chosen gradients in chosen iterations).

The harness is tests/_scaler_harness.py.
"""

from __future__ import annotations

import copy
import inspect
import math
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F
from _scaler_harness import (
    D_HID,
    D_IN,
    D_OUT,
    IMPLS,
    INF_ITER,
    OPTIMIZERS,
    SCALER_KW,
    SCALERS,
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
    device_key,
    forward_loss,
    found_from,
    inject_specials,
    lockstep,
    make_sides,
    make_train_step,
    mid_iteration,
    multi_step,
    scaler_state,
    scaler_step,
    torch_state_dict,
)
from torch import nn

import ampfused
import ampfused.grad_scaler

# torch warns once per process that it does not check sparse invariants by default
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


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


# ------------------------------------------------------------------------------- sparse
def test_sparse_embedding_sgd(device):
    def build(dev):
        model = Net(sparse=True).to(dev)
        return [model], [torch.optim.SGD(model.parameters(), lr=0.1)]

    def train_step(side: Side, i: int) -> dict:
        side.opt.zero_grad()
        loss = forward_loss(side.model, i, side.device)
        side.scaler.scale(loss).backward()
        g = side.model.emb.weight.grad
        assert g.is_sparse and not g.is_coalesced()
        with torch.no_grad():
            if i == 2:
                g._values()[1, 2] = float("inf")
            if i == 5:
                g._values()[-1, -1] = float("nan")
        ret, _ = scaler_step(side.scaler, side.opt)
        out = {"ret": ret, "mid": mid_iteration(side.scaler, [side.opt])}
        side.scaler.update()
        return out

    sides = make_sides(device, build, init_scale=2.0**12, growth_interval=2)
    history = lockstep(sides, train_step, 8)
    assert found_from(history[2]) and found_from(history[5])


def _fp16_sparse_case(device: str):
    """Params with float16 sparse grads whose duplicates overflow only once coalesced, clean
    float16 sparse grads, and dense float16/float32 grads."""
    i_dup = torch.tensor([[0, 1, 0], [2, 0, 2]], device=device)
    v_dup = torch.tensor([64000.0, 32.0, 64000.0], device=device)
    i_ok = torch.tensor([[0, 1, 1], [2, 0, 2]], device=device)
    v_ok = torch.tensor([16.0, 32.0, 64.0], device=device)
    params = [
        torch.zeros(2, 3, device=device, requires_grad=True),
        torch.zeros(2, 3, device=device, dtype=torch.float16, requires_grad=True),
        torch.zeros(2, 3, device=device, dtype=torch.float16, requires_grad=True),
        torch.zeros(5, device=device, dtype=torch.float16, requires_grad=True),
    ]
    params[0].grad = torch.full((2, 3), 8.0, device=device)
    params[1].grad = torch.sparse_coo_tensor(i_ok, v_ok, (2, 3)).to(torch.float16)
    params[2].grad = torch.sparse_coo_tensor(i_dup, v_dup, (2, 3)).to(torch.float16)
    params[3].grad = torch.full((5,), 4.0, device=device, dtype=torch.float16)
    return params, torch.optim.SGD(params, lr=1.0)


@pytest.mark.parametrize("duplicates_overflow", [True, False])
def test_fp16_sparse_unscale_grads(device, duplicates_overflow):
    results = []
    for cls in SCALERS:
        params, opt = _fp16_sparse_case(device)
        if not duplicates_overflow:
            params[2].grad = params[2].grad * 0.25  # 16000 + 16000 is finite in float16
        before = [p.grad for p in params]
        scaler = cls(device)
        inv_scale = torch.full((), 0.25, device=device)
        found_inf = torch.zeros((), device=device)
        found = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
        replaced = [p.grad is not b for p, b in zip(params, before, strict=True)]
        results.append(
            {
                "found": found,
                "found_inf_arg": found_inf,
                "replaced": replaced,
                "grads": [p.grad for p in params],
            }
        )
    assert_same(results[0], results[1])
    assert results[0]["replaced"] == [False, True, True, False]  # fp16 sparse grads coalesced
    assert results[0]["found"][device_key(device)].item() == float(duplicates_overflow)
    assert results[0]["found_inf_arg"].item() == 0.0  # torch works on a copy


def test_fp16_sparse_check_inf_per_device(device):
    # the fused-optimizer check path allows float16 and coalesces float16 sparse grads too
    results = []
    for cls in SCALERS:
        params, opt = _fp16_sparse_case(device)
        scaler = cls(device, init_scale=4.0)
        scaler.scale(torch.ones((), device=device))
        found = scaler._check_inf_per_device(opt)
        results.append({"found": dict(found), "grads": [p.grad for p in params]})
        scaler.update()
        results[-1]["after_update"] = scaler_state(scaler)
    assert_same(results[0], results[1])
    assert results[0]["found"][device_key(device)].item() == 1.0


def test_fp16_grads_rejected_without_allow_fp16(device):
    errors = []
    for cls in SCALERS:
        params, opt = _fp16_sparse_case(device)
        scaler = cls(device)
        with pytest.raises(ValueError) as exc:
            scaler._unscale_grads_(
                opt, torch.ones((), device=device), torch.zeros((), device=device), False
            )
        errors.append(str(exc.value))
        assert params[0].grad.eq(8.0).all()  # nothing was unscaled before the error
    assert errors[1].startswith(errors[0])


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


@pytest.mark.parametrize("impl", ["forloop", "foreach"])
def test_mixed_grad_dtypes(device, impl):
    # one optimizer over float32, bfloat16 and float64 parameters.  torch's CUDA unscale kernel
    # has no bfloat16 version, so on CUDA the low-precision layer is float32.
    low = torch.bfloat16 if device == "cpu" else torch.float32

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(D_IN, D_HID)
            self.fc2 = nn.Linear(D_HID, D_HID).to(low)
            self.head = nn.Linear(D_HID, D_OUT).double()

        def forward(self, x):
            h = F.relu(self.fc2(F.relu(self.fc1(x)).to(low)))
            with torch.autocast(device_type=x.device.type, enabled=False):
                return self.head(h.double())

    def build(dev):
        model = Mixed().to(dev)
        return [model], [
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=impl == "foreach")
        ]

    def train_step(side: Side, i: int) -> dict:
        side.opt.zero_grad()
        x, _, y = batch(i, side.device)
        with torch.autocast(device_type=side.device, dtype=torch.float16):
            out = side.model(x)
        side.scaler.scale(F.mse_loss(out.float(), y)).backward()
        assert {p.grad.dtype for p in side.model.parameters()} == {
            torch.float32,
            low,
            torch.float64,
        }
        with torch.no_grad():
            if i == 2:
                side.model.fc2.weight.grad[0, 1] = float("inf")
            if i == 5:
                side.model.head.bias.grad[2] = float("nan")
        ret, _ = scaler_step(side.scaler, side.opt)
        res = {"ret": ret, "mid": mid_iteration(side.scaler, [side.opt])}
        side.scaler.update()
        return res

    history = lockstep(make_sides(device, build, **SCALER_KW), train_step, 8)
    assert found_from(history[2]) and found_from(history[5])


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


# ------------------------------------------------------------------------------- per-param work
def _count_scaler_lines(scaler_cls, n_params: int, fused: bool) -> int:
    """Python lines executed inside the two grad_scaler modules during unscale_ (or the fused
    check) + step + update, for n_params tiny parameters."""
    params = [torch.ones(2, requires_grad=True) for _ in range(n_params)]
    for p in params:
        p.grad = torch.full((2,), 8.0)
    opt = torch.optim.SGD(params, lr=0.0, fused=fused)
    scaler = scaler_cls("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    files = {ampfused.grad_scaler.__file__, torch.amp.grad_scaler.__file__}
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in files else None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        if not fused:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    finally:
        sys.settrace(old)
    assert scaler.get_scale() == 4.0 and scaler._get_growth_tracker() == 1
    assert params[-1].grad[0].item() == 2.0  # unscaled (by the fused SGD kernel if fused)
    return count


@pytest.mark.parametrize("fused", [False, True], ids=["unscale_step_update", "fused_check"])
def test_no_per_parameter_python_loop(fused):
    few, many = 20, 2000
    _count_scaler_lines(FusedScaler, few, fused)  # warms per-function caches (step's signature)
    fused_few = _count_scaler_lines(FusedScaler, few, fused)
    fused_many = _count_scaler_lines(FusedScaler, many, fused)
    assert fused_few == fused_many, (fused_few, fused_many)
    # the probe sees torch's per-parameter loop, so it would see one in ampfused
    torch_few = _count_scaler_lines(TorchScaler, few, fused)
    torch_many = _count_scaler_lines(TorchScaler, many, fused)
    assert torch_many - torch_few >= many - few


def test_torch_unscale_and_update_kernels_not_called(device, monkeypatch):
    # built first: the constructors check their arguments with torch's update-argument parser
    sides = make_sides(device, build_three, init_scale=2.0**12, growth_interval=2)
    calls = {"_amp_foreach_non_finite_check_and_unscale_": 0, "_amp_update_scale_": 0}
    for name in calls:
        real = getattr(torch, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    lockstep(sides[1:], multi_step(), 3)
    assert calls == {"_amp_foreach_non_finite_check_and_unscale_": 0, "_amp_update_scale_": 0}
    lockstep(sides[:1], multi_step(), 1)  # the probe sees torch's own calls
    assert all(calls.values())


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


def _subclass_overriding_unscale_grads(base):
    class Sub(base):
        """A subclass that post-processes found_inf in _unscale_grads_, as sharded/distributed
        scalers do (all-reduce); here: ignore overflows."""

        calls = 0

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            type(self).calls += 1
            out = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            for f in out.values():
                f.zero_()
            return out

    return Sub


def test_subclass_override_of_unscale_grads_is_honored():
    results = []
    for base in SCALERS:
        sub = _subclass_overriding_unscale_grads(base)
        p = torch.ones(3, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = sub("cpu", init_scale=4.0, growth_interval=1)
        p.grad = torch.full((3,), float("inf"))
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        results.append({"calls": sub.calls, "scale": scaler.get_scale(), "p": p.detach()})
    assert_same(results[0], results[1])


def test_unsupported_grad_dtype_raises_like_torch():
    errors = []
    for cls in SCALERS:
        p = torch.randn(3, dtype=torch.complex64, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale((p.abs() ** 2).sum()).backward()
        with pytest.raises(Exception) as exc:
            scaler.step(opt)
        errors.append(type(exc.value))
    assert errors[0] is NotImplementedError
    assert errors[1] is errors[0]


# Deliberate difference (README): torch's update() sums the iteration's found_inf tensors in
# place into the first one (found_infs[0] += ...), a side effect costing a kernel per extra
# tensor; ampfused commits its pending update and leaves every found_inf as its pass wrote it.
def test_found_inf_tensors_kept_across_update():
    results = []
    for cls in SCALERS:
        p0, p1 = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
        opts = [torch.optim.SGD([p0], lr=0.1), torch.optim.SGD([p1], lr=0.1)]
        scaler = cls("cpu", init_scale=4.0)
        p0.grad = torch.ones(3)
        p1.grad = torch.full((3,), float("inf"))
        scaler.scale(torch.ones(()))
        for o in opts:
            scaler.step(o)
        kept = [scaler._found_inf_per_device(o)[torch.device("cpu")] for o in opts]
        scaler.update()
        results.append([f.item() for f in kept])
    assert results[0] == [1.0, 1.0]  # torch: the first optimizer's tensor now holds the sum
    assert results[1] == [0.0, 1.0]  # ampfused: each optimizer's own result
