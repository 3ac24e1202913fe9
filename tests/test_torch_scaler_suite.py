"""PyTorch's own GradScaler tests, ported to pytest with the scaler class as a parameter.

Ported from pytorch/pytorch ``test/test_torch.py`` (TestTorchDeviceType.test_grad_scaling_*:
unscale, update_scale, unscale_sparse, state_dict, scale, autocast (for-loop, foreach, fused),
clipping, clipping_separate_unscale, penalty, accumulation, multiple,
autocast_fused_optimizers) and ``test/test_cuda.py`` (test_grad_scaler_pass_itself,
test_grad_scale_will_not_overflow,
test_params_invalidated_with_grads_invalidated_between_unscale_and_step).  Their facts (models,
data, scales, skip iteration, expected growth/backoff counts, tolerances) are kept; the code is
rewritten for pytest and CPU.  ``_create_scaling_models_optimizers`` / ``_create_scaling_case``
exist in ``torch.testing._internal.common_cuda``, but importing that module imports
``common_utils``, which calls ``torch.backends.disable_global_flags()`` and patches TorchScript
for the whole pytest session, so they are re-implemented here, unchanged in substance.

Every test runs once with ``torch.amp.GradScaler`` and once with ``ampfused.GradScaler``: torch's
assertions (mostly tolerances against an unscaled float32 control run) must hold for both.
``test_cases_agree_bitwise`` then runs each case for both classes and requires bit-identical
results.  Skipped from the originals: the raw-op halves (``torch._amp_foreach_non_finite_check_
and_unscale_`` on hand-made lists, which do not involve the scaler) and the multi-GPU parts.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import warnings
from collections.abc import Callable
from itertools import chain
from typing import Any

import pytest
import torch

import ampfused

SCALERS = (torch.amp.GradScaler, ampfused.GradScaler)
SCALER_IDS = ("torch", "ampfused")
# torch warns once per process that it does not check sparse invariants by default
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


@pytest.fixture(params=SCALERS, ids=SCALER_IDS)
def scaler_cls(request: pytest.FixtureRequest) -> type[torch.amp.GradScaler]:
    return request.param


def assert_close(actual, expected, atol=None, rtol=None, msg=""):
    """TestCase.assertEqual for tensors: float32 defaults rtol=1.3e-6, atol=1e-5."""
    if atol is None and rtol is None:
        torch.testing.assert_close(actual, expected, msg=msg or None)
    else:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg or None)


# ------------------------------------------------------------------------- torch's helpers
def _create_scaling_models_optimizers(
    device, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
    # a module+optimizer that will use scaling, and a control module+optimizer that will not
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)
    kwargs = {"lr": 1.0}
    if optimizer_kwargs is not None:
        kwargs.update(optimizer_kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    opt_scaling = optimizer_ctor(mod_scaling.parameters(), **kwargs)
    return mod_control, mod_scaling, opt_control, opt_scaling


def _create_scaling_case(
    device, dtype=torch.float, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
    data = [
        (
            torch.randn((8, 8), dtype=dtype, device=device),
            torch.randn((8, 8), dtype=dtype, device=device),
        )
        for _ in range(4)
    ]
    loss_fn = torch.nn.MSELoss().to(device)
    skip_iter = 2
    return _create_scaling_models_optimizers(device, optimizer_ctor, optimizer_kwargs) + (
        data,
        loss_fn,
        skip_iter,
    )


def _final_state(models, opts, scaler) -> dict[str, Any]:
    params = [p for m in models for p in m.parameters()]
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "state": [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in o.state[p].items()}
            for o in opts
            for g in o.param_groups
            for p in g["params"]
        ],
        "scale": scaler.get_scale(),
        "growth_tracker": scaler._get_growth_tracker(),
    }


RunFn = Callable[..., Any]


def _run_scaling_case(
    device,
    scaler_cls,
    run: RunFn,
    unskipped,
    skipped,
    atol=1e-7,
    optimizer_ctor=torch.optim.SGD,
    optimizer_kwargs=None,
):
    """torch's _run_scaling_case: run() once without the scaling API on the control model and
    once with it on the scaling model, for enabled in (True, False); the scale must have grown
    `unskipped` times and backed off `skipped` times, and both models must agree to atol."""
    results = []
    for enabled in (True, False):
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = (
            _create_scaling_case(
                device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
            )
        )
        # a modest initial scale, and an unrealistically large growth factor so any potential
        # errors with the growth factor handling are magnified
        scaler = scaler_cls(
            device, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
        )
        _ = run(device, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler  # run() may return a different (unpickled) scaler
        assert type(scaler) is scaler_cls
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * net_growth * net_backoff
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            assert_close(s.grad, c.grad, atol=atol, rtol=1e-05)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                assert_close(s_state[k], c_state[k], atol=atol, rtol=1e-05, msg=k)
            assert_close(s, c, atol=atol, rtol=1e-05)
        results.append(_final_state([mod_scaling], [opt_scaling], scaler))
    return results


# ------------------------------------------------------------------------- cases
# Each _case_* runs torch's assertions for one scaler class and returns what it ended with, so
# test_cases_agree_bitwise can compare the two classes.


def _case_unscale(device, scaler_cls):
    """test_grad_scaling_unscale, the scaler half: _unscale_grads_ sorts a 'perfect storm' of
    grads (contiguous, non-dense slices, float32 and float16) by device and dtype, unscales them
    and finds an inf injected into any of them."""
    inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=device)
    size = 20
    g = torch.full((size, size), 4.0, dtype=torch.float, device=device)

    def perfect_storm_grads(inject_inf):
        grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf")
        return grads

    scaler = scaler_cls(device)
    dummy_params = [torch.empty_like(t) for t in perfect_storm_grads(-1)]
    dummy_opt = torch.optim.SGD(dummy_params, lr=1.0)
    out = []
    # the inf/nan checking finds an inf injected onto any grad in the perfect storm
    for inject_inf in range(-1, len(dummy_params)):
        found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device)
        grads = perfect_storm_grads(inject_inf)
        for i, p in enumerate(dummy_params):
            p.grad = grads[i]
        found_inf_per_device = scaler._unscale_grads_(dummy_opt, inv_scale, found_inf, True)
        if inject_inf < 0:
            # no inf was injected: unscaling worked normally
            assert sum(v.item() for v in found_inf_per_device.values()) == 0
            for grad in grads:
                assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            # inf was injected: it was found
            assert sum(v.item() for v in found_inf_per_device.values()) == 1
        out.append({"found": dict(found_inf_per_device), "grads": grads})
    return out


def _case_update_scale(device, scaler_cls):
    """test_grad_scaling_update_scale, through the scaler: growth 2.0, backoff 0.25, growth
    interval 2, scale 4.0.  Two unskipped iterations grow the scale to 8.0; a skipped one backs
    it off to 2.0 and resets the tracker."""
    scaler = scaler_cls(
        device, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2
    )
    p = torch.zeros(3, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    seen = []

    def iteration(grad_value):
        scaler.scale(torch.ones((), device=device))
        p.grad = torch.full((3,), grad_value, device=device)
        scaler.step(opt)
        scaler.update()
        seen.append((scaler._growth_tracker.item(), scaler._scale.item()))

    # simulates 2 consecutive unskipped iterations
    iteration(1.0)
    assert seen[-1] == (1, 4.0)
    iteration(1.0)
    assert seen[-1] == (0, 8.0)
    # simulates a skipped iteration
    iteration(float("inf"))
    assert seen[-1] == (0, 2.0)
    return seen


def _case_unscale_sparse(device, scaler_cls):
    """test_grad_scaling_unscale_sparse: sparse grads are unscaled through their values; inf and
    nan values are found; float16 sparse grads whose duplicates overflow only once coalesced
    (64000 + 64000 > float16 max) report an overflow."""
    dtype = torch.float
    scaler = scaler_cls(device)
    inv_scale = torch.full((1,), 0.25, dtype=dtype, device=device)
    found_inf = torch.empty((1,), dtype=dtype, device=device)
    cur = found_inf.device
    out = []

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=device, dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], device=device, dtype=torch.float)
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)

    p = s.clone()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)

    p.grad = s.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    assert found_inf.item() == 0.0
    assert_close(p.grad.to_dense(), (s / 4).to_dense())
    out.append((found_inf, p.grad))

    v = torch.tensor([16.0, 32.0, float("inf")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    assert found_inf.item() == 1.0
    out.append((found_inf, p.grad))

    v = torch.tensor([16.0, 32.0, float("nan")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
    assert found_inf.item() == 1.0
    out.append((found_inf, p.grad))

    p = s.clone().half()
    assert p.is_sparse
    opt = torch.optim.SGD([p], lr=1.0)

    p.grad = s.clone().half()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    assert found_inf.item() == 0.0
    assert_close(p.grad.to_dense(), (s.half() / 4).to_dense())
    out.append((found_inf, p.grad))

    # an uncoalesced float16 sparse tensor with duplicated indices: the uncoalesced form does
    # not overflow, the coalesced one would (64000 + 64000 > fp16 max)
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    v = torch.tensor([64000.0, 32.0, 64000.0])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=torch.float16)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
    assert found_inf.item() == 1.0
    out.append((found_inf, p.grad))
    return out


def _case_state_dict(device, scaler_cls, source_cls=None):
    """test_grad_scaling_state_dict (lazy_init_scale True/False); source_cls lets the state
    come from the other class."""
    out = []
    for lazy_init_scale in (True, False):
        s0 = (source_cls or scaler_cls)(
            device, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2
        )
        s1 = scaler_cls(
            device, init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1
        )
        # a random value for load_state_dict to overwrite
        s1._init_growth_tracker = 7
        if lazy_init_scale:
            # dummy scale() call to ensure the scale tensor is lazily initialized
            s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=device))
            assert s1._scale.dtype == torch.float32 and s1._scale.device.type == device
        s1.load_state_dict(s0.state_dict())
        assert s1.get_scale() == 3.0
        assert s1.get_growth_factor() == 4.0
        assert s1.get_backoff_factor() == 0.5
        assert s1.get_growth_interval() == 2
        assert s1._init_growth_tracker == 0
        out.append(s1.state_dict())
    return out


def _case_scale(device, scaler_cls):
    """test_grad_scaling_scale: nested iterables of outputs are scaled; the scale lives on the
    device of the first output (single device here)."""
    scaler = scaler_cls(device, init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device=device)
    t1 = torch.full((1,), 4.0, dtype=torch.float32, device=device)
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)
    assert (
        outputs[0] == 8.0
        and outputs[1][0] == 8.0
        and outputs[1][1] == 8.0
        and outputs[2][0] == 8.0
        and outputs[2][1][0] == 8.0
        and outputs[2][1][1] == 8.0
    )
    assert isinstance(outputs, tuple) and isinstance(outputs[2], list)
    assert scaler._scale.device == t1.device
    return outputs


def _autocast_run(try_pickle: bool):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.half, enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    return run


AUTOCAST_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {}),
    "SGD-momentum": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    "SGD-nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "Adam": (torch.optim.Adam, {}),
    "Adam-amsgrad": (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1}),
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW-amsgrad-maximize": (torch.optim.AdamW, {"amsgrad": True, "maximize": True}),
}
IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _case_autocast(device, scaler_cls, optim="SGD", impl="forloop"):
    """test_grad_scaling_autocast / _foreach / _fused: no scaling + no autocast (control) against
    scaling + float16 autocast, atol=1e-3, then again with the scaler pickled every iteration.
    As in torch, Adam and AdamW do not meet that tolerance (the comparison must fail)."""
    optimizer_ctor, kwargs = AUTOCAST_OPTIMS[optim]
    kwargs = dict(kwargs, **IMPLS[impl])
    results = []
    context: Any = contextlib.nullcontext()
    if optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW):
        # only the tolerance check may fail, not the scale bookkeeping
        context = pytest.raises(AssertionError, match="not close")
    with context:
        for try_pickle in (False, True):
            results += _run_scaling_case(
                device,
                scaler_cls,
                _autocast_run(try_pickle),
                3,
                1,
                atol=1e-3,
                optimizer_ctor=optimizer_ctor,
                optimizer_kwargs=kwargs,
            )
    return results


def _case_clipping(device, scaler_cls):
    """test_grad_scaling_clipping: clip the scaled grads to max_norm * scale."""

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # a reasonable value that actually has an effect
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    return _run_scaling_case(device, scaler_cls, run, unskipped=3, skipped=1, atol=1e-5)


def _case_clipping_separate_unscale(device, scaler_cls):
    """test_grad_scaling_clipping_separate_unscale: unscale_, clip the unscaled grads, step."""

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), max_norm, error_if_nonfinite=False
                )
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    return _run_scaling_case(device, scaler_cls, run, unskipped=3, skipped=1)


def _case_penalty(device, scaler_cls):
    """test_grad_scaling_penalty: a gradient penalty from autograd.grad on the scaled loss."""

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(
                    scaler.scale(loss), model.parameters(), create_graph=True
                )
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    return _run_scaling_case(device, scaler_cls, run, unskipped=3, skipped=1)


def _case_accumulation(device, scaler_cls):
    """test_grad_scaling_accumulation: two backward passes per step."""

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    return _run_scaling_case(device, scaler_cls, run, unskipped=2, skipped=0)


def _run_multiple(data, loss_fn, scaler, skip_iter, models, optimizers, try_scaling_api):
    model0, model1 = models
    optimizer0, optimizer1 = optimizers
    for i, (input, target) in enumerate(data):
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        output0 = model0(input)
        output1 = model1(input)
        loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
        loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
        if try_scaling_api:
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if i == skip_iter and scaler.is_enabled():
                model1[1].weight.grad.data.fill_(float("inf"))
            # as an additional stress test, separately unscale for one of the optimizers
            scaler.unscale_(optimizer0)
            scaler.step(optimizer0)
            scaler.step(optimizer1)
            scaler.update()
        else:
            loss0.backward(retain_graph=True)
            loss1.backward()
            optimizer0.step()
            if (not scaler.is_enabled()) or (i != skip_iter):
                optimizer1.step()


def _case_multiple(device, scaler_cls):
    """test_grad_scaling_multiple: 2 models and 2 optimizers that both receive gradients from 2
    losses; model 1 overflows in skip_iter, so optimizer 0 steps and optimizer 1 is skipped."""
    results = []
    for enabled in (True, False):
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = (
            _create_scaling_case(device)
        )
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers(
            device
        )
        scaler = scaler_cls(
            device, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
        )
        common = (data, loss_fn, scaler, skip_iter)
        _run_multiple(*common, (mod_control0, mod_control1), (opt_control0, opt_control1), False)
        _run_multiple(*common, (mod_scaling0, mod_scaling1), (opt_scaling0, opt_scaling1), True)
        # the scale was multiplied by the growth factor 3 times and the backoff factor once
        if enabled:
            growth, backoff = scaler.get_growth_factor(), scaler.get_backoff_factor()
            assert scaler.get_scale() == 128.0 * growth**3 * backoff**1
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(
            chain(mod_control0.parameters(), mod_control1.parameters()),
            chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
            strict=True,
        ):
            assert_close(s, c, rtol=1e-5, atol=1e-7)
        results.append(
            _final_state([mod_scaling0, mod_scaling1], [opt_scaling0, opt_scaling1], scaler)
        )
    return results


FUSED_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "Adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"amsgrad": True}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


def _case_autocast_fused_optimizers(device, scaler_cls, optim="Adam", separate_unscale=False):
    """test_grad_scaling_autocast_fused_optimizers: a fused optimizer (which unscales inside its
    kernel) against the for-loop one, both under float16 autocast with their own scaler
    (init_scale=128).  As torch's TensorTracker does, each compared tensor of the fused side is
    reset to the control's value after the check, so errors do not accumulate.  The tolerance is
    widened to 2e-5 for params and (max_)exp_avg_sq when betas are Python floats."""
    optimizer_ctor, kwargs = FUSED_OPTIMS[optim]
    kwargs = dict(kwargs, fused=True)
    mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, _ = _create_scaling_case(
        device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=kwargs
    )
    control_kwargs = copy.deepcopy(kwargs)
    control_kwargs["fused"] = False
    control_kwargs.setdefault("lr", 1.0)
    opt_control = optimizer_ctor(mod_control.parameters(), **control_kwargs)
    scaler_scaling = scaler_cls(device, init_scale=128.0)
    scaler_control = scaler_cls(device, init_scale=128.0)
    loose: dict[str, float] = {}
    if "betas" in opt_control.param_groups[0] and not torch.is_tensor(
        opt_control.param_groups[0]["betas"][0]
    ):
        loose = {"atol": 2e-5, "rtol": 2e-5}

    def check_set(actual, expected, tol):
        assert_close(actual, expected, **tol)
        with torch.no_grad():
            actual.copy_(expected)

    for input, target in data:
        opt_control.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.half):
            output_control = mod_control(input)
            loss_control = loss_fn(output_control, target)
        scaler_control.scale(loss_control).backward()
        scaler_control.step(opt_control)
        scaler_control.update()

        opt_scaling.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.half):
            output_scaling = mod_scaling(input)
            loss_scaling = loss_fn(output_scaling, target)
        scaler_scaling.scale(loss_scaling).backward()
        if separate_unscale:
            scaler_scaling.unscale_(opt_scaling)
        scaler_scaling.step(opt_scaling)
        scaler_scaling.update()

        check_set(loss_scaling.detach(), loss_control.detach(), {})
        for param_control, param_scaling in zip(
            mod_control.parameters(), mod_scaling.parameters(), strict=True
        ):
            check_set(param_scaling.grad, param_control.grad, {})
            check_set(param_scaling, param_control, loose)
            state_control = opt_control.state[param_control]
            state_scaling = opt_scaling.state[param_scaling]
            for k in state_control:
                actual = state_scaling[k]
                if k == "step":
                    actual = actual.squeeze()
                tol = loose if k in ("exp_avg_sq", "max_exp_avg_sq") else {}
                check_set(actual, state_control[k], tol)
    return _final_state([mod_scaling], [opt_scaling], scaler_scaling)


def _case_pass_itself(device, scaler_cls):
    """test_grad_scaler_pass_itself: an optimizer whose step() takes grad_scaler gets the scaler
    (with a FutureWarning) and no grad_scale/found_inf; one without gets the two tensors."""
    seen = []

    class _PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params, defaults=None):
            super().__init__(params, defaults or {})
            self._step_supports_amp_scaling = True

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            assert isinstance(grad_scaler, torch.amp.GradScaler)
            assert type(grad_scaler) is scaler_cls
            assert not hasattr(self, "grad_scale")
            assert not hasattr(self, "found_inf")
            seen.append("o1")

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            assert isinstance(self.grad_scale, torch.Tensor)
            assert isinstance(self.found_inf, torch.Tensor)
            seen.append((self.grad_scale.clone(), self.found_inf.clone()))

    x = torch.randn(4, 4, device=device)
    m = torch.nn.Linear(4, 1).to(device)
    o1 = Optimizer1(m.parameters())
    o2 = Optimizer2(m.parameters())
    scaler = scaler_cls(device, init_scale=2.0)
    with torch.autocast(device_type=device, dtype=torch.half):
        y = m(x)
        loss = y.mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen[0] == "o1" and len(seen) == 2
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")
    return seen[1:] + [scaler.get_scale()]


def _case_will_not_overflow(device, scaler_cls):
    """test_grad_scale_will_not_overflow: growing 1e38 by 2**4 would overflow float32; the scale
    stays finite."""
    model = torch.nn.Linear(5, 1).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = scaler_cls(device, growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5, device=device)
    y = 1e-30 * torch.randn(1, 1, device=device)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler._scale != float("inf") and scaler._scale != float("nan")
    assert scaler._get_growth_tracker() == 0
    return _final_state([model], [optimizer], scaler)


def _case_grads_invalidated(device, scaler_cls, optim="Adam", impl="forloop"):
    """test_params_invalidated_with_grads_invalidated_between_unscale_and_step: grads broken after
    unscale_ (found_inf already computed as 0) reach the optimizer, whose params become nonsense
    (for fused optimizers too: grad_scale is None after unscale_)."""
    optimizer_ctor = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[optim]
    model, _, optimizer, _, data, loss_fn, _ = _create_scaling_case(
        device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=dict(IMPLS[impl])
    )
    scaler = scaler_cls(device, init_scale=128.0)
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.half):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        # deliberately break grads
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        scaler.step(optimizer)
        scaler.update()
    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())
    return _final_state([model], [optimizer], scaler)


# name -> (case, kwargs variants for the parametrization)
CASES: dict[str, Callable[..., Any]] = {
    "unscale": _case_unscale,
    "update_scale": _case_update_scale,
    "unscale_sparse": _case_unscale_sparse,
    "state_dict": _case_state_dict,
    "scale": _case_scale,
    "autocast[SGD-fused]": lambda d, c: _case_autocast(d, c, "SGD-momentum", "fused"),
    "autocast[SGD-nesterov-foreach]": lambda d, c: _case_autocast(d, c, "SGD-nesterov", "foreach"),
    "clipping": _case_clipping,
    "clipping_separate_unscale": _case_clipping_separate_unscale,
    "penalty": _case_penalty,
    "accumulation": _case_accumulation,
    "multiple": _case_multiple,
    "autocast_fused_optimizers[AdamW]": lambda d, c: _case_autocast_fused_optimizers(
        d, c, "AdamW", False
    ),
    "autocast_fused_optimizers[SGD-unscale]": lambda d, c: _case_autocast_fused_optimizers(
        d, c, "SGD", True
    ),
    "pass_itself": _case_pass_itself,
    "will_not_overflow": _case_will_not_overflow,
    "grads_invalidated[AdamW-fused]": lambda d, c: _case_grads_invalidated(d, c, "AdamW", "fused"),
}


def _seeded(case: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    torch.manual_seed(20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return case(*args, **kwargs)


# ------------------------------------------------------------------------- tests
def test_grad_scaling_unscale(device, scaler_cls):
    _seeded(_case_unscale, device, scaler_cls)


def test_grad_scaling_update_scale(device, scaler_cls):
    _seeded(_case_update_scale, device, scaler_cls)


def test_grad_scaling_unscale_sparse(device, scaler_cls):
    _seeded(_case_unscale_sparse, device, scaler_cls)


@pytest.mark.parametrize("source", ["same", "torch", "ampfused"])
def test_grad_scaling_state_dict(device, scaler_cls, source):
    source_cls = {"same": None, "torch": SCALERS[0], "ampfused": SCALERS[1]}[source]
    _seeded(_case_state_dict, device, scaler_cls, source_cls)


def test_grad_scaling_scale(device, scaler_cls):
    _seeded(_case_scale, device, scaler_cls)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("optim", list(AUTOCAST_OPTIMS))
def test_grad_scaling_autocast(device, scaler_cls, optim, impl):
    _seeded(_case_autocast, device, scaler_cls, optim, impl)


def test_grad_scaling_clipping(device, scaler_cls):
    _seeded(_case_clipping, device, scaler_cls)


def test_grad_scaling_clipping_separate_unscale(device, scaler_cls):
    _seeded(_case_clipping_separate_unscale, device, scaler_cls)


def test_grad_scaling_penalty(device, scaler_cls):
    _seeded(_case_penalty, device, scaler_cls)


def test_grad_scaling_accumulation(device, scaler_cls):
    _seeded(_case_accumulation, device, scaler_cls)


def test_grad_scaling_multiple(device, scaler_cls):
    _seeded(_case_multiple, device, scaler_cls)


@pytest.mark.parametrize("separate_unscale", [False, True], ids=["step", "unscale_step"])
@pytest.mark.parametrize("optim", list(FUSED_OPTIMS))
def test_grad_scaling_autocast_fused_optimizers(device, scaler_cls, optim, separate_unscale):
    _seeded(_case_autocast_fused_optimizers, device, scaler_cls, optim, separate_unscale)


def test_grad_scaler_pass_itself(device, scaler_cls):
    _seeded(_case_pass_itself, device, scaler_cls)


def test_grad_scale_will_not_overflow(device, scaler_cls):
    _seeded(_case_will_not_overflow, device, scaler_cls)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("optim", ["Adam", "AdamW"])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(
    device, scaler_cls, optim, impl
):
    _seeded(_case_grads_invalidated, device, scaler_cls, optim, impl)


def _assert_bitwise(a: Any, b: Any, path: str = "result") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and (a.dtype, a.shape, a.layout) == (b.dtype, b.shape, b.layout)
        if a.is_sparse:
            _assert_bitwise(a._indices(), b._indices(), path + "._indices()")
            _assert_bitwise(a._values(), b._values(), path + "._values()")
            return
        bits_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bits_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{path}: torch {a} vs ampfused {b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_bitwise(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_cases_agree_bitwise(device, case):
    results = [_seeded(CASES[case], device, cls) for cls in SCALERS]
    _assert_bitwise(results[0], results[1])
