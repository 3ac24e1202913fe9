"""The pass of ``ampfused.GradScaler`` over the gradients, step for step against
``torch.amp.GradScaler``, bit for bit (the harness: _scaler_harness.py): sparse and float16
gradients, mixed and unsupported dtypes, no per-parameter Python work and none of torch's
unscale/update kernels, a subclass overriding _unscale_grads_, and the found_inf tensors.
"""

from __future__ import annotations

import functools
import glob
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from _scaler_harness import (
    D_HID,
    D_IN,
    D_OUT,
    SCALER_KW,
    SCALERS,
    FusedScaler,
    Net,
    Side,
    TorchScaler,
    assert_same,
    batch,
    build_three,
    device_key,
    forward_loss,
    found_from,
    lockstep,
    make_sides,
    mid_iteration,
    multi_step,
    scaler_state,
    scaler_step,
)
from torch import nn

import ampfused

# torch warns once per process that it does not check sparse invariants by default
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


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


# ------------------------------------------------------------------------------- dtypes
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


# ------------------------------------------------------------------------------- per-param work
def _count_scaler_lines(scaler_cls, n_params: int, fused: bool) -> int:
    """Python lines executed inside torch's grad_scaler module or ampfused's package during
    unscale_ (or the fused check) + step + update, for n_params tiny parameters."""
    params = [torch.ones(2, requires_grad=True) for _ in range(n_params)]
    for p in params:
        p.grad = torch.full((2,), 8.0)
    opt = torch.optim.SGD(params, lr=0.0, fused=fused)
    scaler = scaler_cls("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    package = os.path.dirname(ampfused.__file__)
    files = {*glob.glob(os.path.join(package, "*.py")), torch.amp.grad_scaler.__file__}
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


# ------------------------------------------------------------------------------- overrides
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


# ------------------------------------------------------------------------------- found_inf
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


def test_override_wrapped_by_a_decorator_is_honored():
    """An override made by wrapping the base method (functools.wraps copies its attributes) is
    still an override: the pass takes torch's methods, which call it."""
    calls = []

    def traced(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapper

    class Traced(FusedScaler):
        _unscale_grads_ = traced(FusedScaler._unscale_grads_)

    p = torch.ones(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = Traced("cpu", init_scale=4.0)
    p.grad = torch.full((3,), 8.0)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert calls == ["_unscale_grads_"] and torch.equal(p.detach(), torch.full((3,), 0.8))
