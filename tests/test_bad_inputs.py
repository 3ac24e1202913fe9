"""Bad inputs, given to ``torch.amp.GradScaler`` and ``ampfused.GradScaler`` alike.

Each probe is a short script of user calls (construct a scaler, train, load a state dict, call a
setter, hand it an odd optimizer or odd gradients, call methods out of order) in which some
calls are wrong.  It runs three times, in a child process:

* ``torch``: on torch's scaler, the reference;
* ``ampfused``: on ours;
* ``clean``: on torch's scaler with each wrong call left out (or replaced by its correct form).

Every call is recorded with what it raised (the exception's class hierarchy and message) and a
snapshot taken right after it: the scaler's observable state (``state_dict()``, ``_scale``,
``_growth_tracker``, the optimizers' stages) and the bytes of every parameter and gradient.

The rule: ampfused raises where torch raises, an exception of torch's type or a subclass (so
``except RuntimeError:`` written against torch keeps working), and every snapshot is identical,
so a failed call changes the same things and training goes on (or keeps failing) the same way.

The exceptions are the probes in ``DELIBERATE``, where ampfused improves on torch on purpose.
For those, ampfused must match the ``clean`` run instead: a refused call keeps nothing and
training then goes on exactly as if the call had not been made, and it must raise at the wrong
call itself (an exception of the type torch raises for it, there or later).  Each reason is a
bullet of "Deliberate differences from torch" in docs/reference.md.

Probes run in batches in child processes (started by a fork server, not forked from the test
process: START_METHOD); a child that dies (segfault, abort) or hangs is retried one probe per
child, so the probe that crashed fails with the signal's name and the others still report.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import pickle
import re
import resource
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ampfused

TorchScaler = torch.amp.GradScaler
OurScaler = ampfused.GradScaler

SCALER_KW: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}
ITERS = range(4)  # iteration 1 gets an inf gradient: a back-off, then growth after two clean steps
INF_ITER = 1
GOOD_STATE = {
    "scale": 2.0**8,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 3,
    "_growth_tracker": 1,
}
SKIPPED = "skipped"  # the outcome of a wrong call left out of the clean run
BATCH = 24  # probes per child process
BATCH_TIMEOUT_S = 120.0


# ------------------------------------------------------------------------------- recording
def _bits(t: torch.Tensor) -> tuple:
    """A tensor's dtype, shape and exact bytes (NaN payloads and -0.0 included)."""
    t = t.detach()
    if t.device.type == "meta":
        return ("meta", str(t.dtype), tuple(t.shape))
    if t.layout == torch.sparse_coo:
        return ("coo", t.is_coalesced(), _bits(t._indices()), _bits(t._values()))
    if t.layout != torch.strided:
        return (str(t.layout), _bits(t.to_dense()))
    raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (str(t.dtype), tuple(t.shape), raw)


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", _bits(v))
    return (type(v).__name__, repr(v))


def _exception(e: BaseException) -> tuple[tuple[str, ...], str]:
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__), str(e)


class World:
    """One run of a probe: a scaler, a model's parameters and an optimizer, plus the record of
    every call made on them."""

    def __init__(self, cls: type, mode: str) -> None:
        self.cls, self.mode = cls, mode
        self.scaler: Any = None
        self.params: list[torch.Tensor] = [
            nn.Parameter(torch.arange(4.0)),
            nn.Parameter(torch.ones(2, 2)),
        ]
        self.opt: Any = torch.optim.SGD(self.params, lr=0.1)
        self.opts: list[Any] = [self.opt]
        self.forward: Callable[[World, int], None] = _autograd_forward
        self.events: list[tuple[str, Any, dict]] = []

    def make(self, device: str = "cpu", **kw: Any) -> None:
        self.scaler = self.cls(device, **{**SCALER_KW, **kw})

    def do(self, label: str, fn: Callable[[], Any], *, bad: bool = False, clean=None) -> None:
        """Makes one call and records it.  `bad`: a wrong call, which the clean run leaves out
        or, given `clean`, replaces by that correct form."""
        if bad and self.mode == "clean":
            if clean is None:
                self.events.append((label, SKIPPED, self.snapshot()))
                return
            fn = clean
        try:
            fn()
            outcome = None
        except Exception as e:
            outcome = _exception(e)
        self.events.append((label, outcome, self.snapshot()))

    def train(
        self,
        iters: range,
        *,
        unscale: bool = False,
        bad_forward: bool = False,
        clean_forward: Callable[[World, int], None] | None = None,
    ) -> None:
        """Iterations: forward (a wrong one if `bad_forward`, whose correct form for the clean
        run is `clean_forward`), optionally unscale_, step for each optimizer, update."""
        for i in iters:
            clean = None if clean_forward is None else partial(clean_forward, self, i)
            self.do(f"forward {i}", partial(self.forward, self, i), bad=bad_forward, clean=clean)
            if unscale:
                self.do(f"unscale_ {i}", partial(self.scaler_call, "unscale_", self.opt))
            for k, opt in enumerate(self.opts):
                label = f"step {i}" + (f" opt{k}" if k else "")
                self.do(label, partial(self.scaler_call, "step", opt))
            self.do(f"update {i}", partial(self.scaler_call, "update"))

    def scaler_call(self, method: str, *args: Any) -> Any:
        return getattr(self.scaler, method)(*args)

    def snapshot(self) -> dict:
        s = self.scaler
        scaler: Any = None
        if s is not None:
            try:
                # (less ampfused's own entry: torch's scaler has none)
                sd: Any = {k: _value(v) for k, v in s.state_dict().items() if k != "ampfused"}
            except Exception as e:
                sd = ("raises", _exception(e)[0][0])
            states = getattr(s, "_per_optimizer_states", {})
            scaler = {
                "enabled": s.is_enabled(),
                "state_dict": sd,
                "_scale": _opt_bits(getattr(s, "_scale", None)),
                "_growth_tracker": _opt_bits(getattr(s, "_growth_tracker", None)),
                # (an optimizer's entry appears on first access, READY: not a difference)
                "stages": [
                    str(states[id(o)]["stage"]) if id(o) in states else "OptState.READY"
                    for o in self.opts
                ],
            }
        return {
            "scaler": scaler,
            "params": [_bits(p) for p in self.params],
            "grads": [None if p.grad is None else _bits(p.grad) for p in self.params],
            # what the fused-optimizer protocol leaves on an optimizer whose step() raised
            "optimizers": [
                {a: _value(getattr(o, a)) for a in ("grad_scale", "found_inf") if hasattr(o, a)}
                for o in self.opts
            ],
        }


def _opt_bits(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else _bits(t)


def _autograd_forward(w: World, i: int) -> None:
    """Clears the gradients, then scaler.scale(loss).backward() for a loss with known gradients;
    an inf gradient in iteration INF_ITER.  (Not optimizer.zero_grad(): the optimizer may be the
    bad input, and only the scaler should meet it.)"""
    for p in w.params:
        p.grad = None
    p0, p1 = w.params[0], w.params[1]
    loss = (p0 * (i + 1.0)).sum() + (p1 * 0.5).sum()
    w.scaler.scale(loss).backward()
    if i == INF_ITER:
        with torch.no_grad():
            p1.grad[0, 0] = float("inf")


# ------------------------------------------------------------------------------- probes
@dataclass(frozen=True)
class Probe:
    script: Callable[[World], None]
    names: str | None = None  # what ampfused's first error message must name


PROBES: dict[str, Probe] = {}


def probe(name: str, names: str | None = None):
    def register(script: Callable[[World], None]) -> Callable[[World], None]:
        assert name not in PROBES, name
        PROBES[name] = Probe(script, names)
        return script

    return register


class _Unprintable:
    def __repr__(self) -> str:
        return "<unprintable>"


# Constructor arguments: bad ones, and odd ones both scalers accept.
CTOR_VALUES: dict[str, list[tuple[str, Any]]] = {
    "init_scale": [
        ("1e39", 1e39),
        ("-1e39", -1e39),
        ("float32 max as a double", 3.4028235e38),
        ("'2'", "2"),
        ("None", None),
        ("tensor([2.])", torch.tensor([2.0])),
        ("2**200", 2**200),
        ("2j", 2j),
        ("inf", math.inf),
        ("nan", math.nan),
        ("0.0", 0.0),
        ("-4.0", -4.0),
        ("-inf", -math.inf),
        ("True", True),
        ("np.float64", np.float64(4.0)),
        ("tensor(2.)", torch.tensor(2.0)),
        ("tensor(3)", torch.tensor(3)),
        ("int", 1024),
    ],
    "growth_factor": [
        ("'2'", "2"),
        ("None", None),
        ("2j", 2j),
        ("True", True),
        ("1.0", 1.0),
        ("0.5", 0.5),
        ("10**400", 10**400),
        ("object", _Unprintable()),
        ("nan", math.nan),
        ("inf", math.inf),
        ("int", 2),
        ("np.float64", np.float64(2.0)),
        ("tensor(2.)", torch.tensor(2.0)),
        ("2**70", 2**70),
    ],
    "backoff_factor": [
        ("'0.5'", "0.5"),
        ("None", None),
        ("1.0", 1.0),
        ("1.5", 1.5),
        ("2j", 2j),
        ("0", 0),
        ("False", False),
        ("-2", -2),
        ("nan", math.nan),
        ("tensor(0.5)", torch.tensor(0.5)),
        ("np.float64", np.float64(0.25)),
    ],
    "growth_interval": [
        ("2.5", 2.5),
        ("2.0", 2.0),
        ("'2'", "2"),
        ("True", True),
        ("False", False),
        ("None", None),
        ("2**63", 2**63),
        ("-2**63-1", -(2**63) - 1),
        ("tensor(2.)", torch.tensor(2.0)),
        ("0", 0),
        ("-1", -1),
        ("2**31", 2**31),
        ("2**63-1", 2**63 - 1),
        ("tensor(2)", torch.tensor(2)),
        ("np.int64", np.int64(2)),
    ],
    # torch.cuda.amp.GradScaler's positional init_scale, where torch.amp.GradScaler's device goes
    "device": [("65536.0", 65536.0), ("1024", 1024), ("True", True)],
}


def _ctor_probe(arg: str, label: str, value: Any, **extra: Any) -> None:
    suffix = "".join(f", {k}={v!r}" for k, v in extra.items())

    @probe(f"ctor: {arg}={label}{suffix}", names=arg)
    def script(w: World) -> None:
        w.do("GradScaler(...)", lambda: w.make(**{arg: value}, **extra), bad=True)
        w.train(ITERS)


for _arg, _values in CTOR_VALUES.items():
    for _label, _value_ in _values:
        _ctor_probe(_arg, _label, _value_)
# torch checks nothing of a disabled scaler (or of one it disables: "cuda" without a GPU)
_ctor_probe("growth_interval", "2.5", 2.5, enabled=False)
_ctor_probe("init_scale", "1e39", 1e39, enabled=False)
if not torch.cuda.is_available():
    _ctor_probe("growth_factor", "'2'", "2", device="cuda")


# load_state_dict: before the first scale() (state made lazily) and after an iteration.
LOAD_ENTRIES: dict[str, list[tuple[str, Any]]] = {
    "scale": [
        ("1e39", 1e39),
        ("-1e39", -1e39),
        ("'2'", "2"),
        ("None", None),
        ("tensor([2.])", torch.tensor([2.0])),
        ("2j", 2j),
        ("tensor(3.)", torch.tensor(3.0)),
        ("int", 64),
        ("nan", math.nan),
    ],
    "_growth_tracker": [
        ("2**40", 2**40),
        ("2**31", 2**31),
        ("'1'", "1"),
        ("None", None),
        ("2.5", 2.5),
        ("True", True),
        ("-1", -1),
    ],
    "growth_factor": [("'2'", "2"), ("None", None), ("10**400", 10**400), ("0.5", 0.5)],
    "backoff_factor": [("'0.5'", "0.5"), ("None", None), ("1.5", 1.5)],
    "growth_interval": [
        ("2.5", 2.5),
        ("'2'", "2"),
        ("True", True),
        ("None", None),
        ("2**63", 2**63),
        ("np.int64", np.int64(2)),
    ],
}


def _load_probe(when: str, label: str, state: Any, names: str | None = None) -> None:
    @probe(f"load {when}: {label}", names=names)
    def script(w: World) -> None:
        w.do("GradScaler(...)", w.make)
        first = 0
        if when == "after an iteration":
            w.train(range(1))
            first = 1
        w.do("load_state_dict", lambda: w.scaler.load_state_dict(copy.copy(state)), bad=True)
        w.train(range(first, first + 3))


for _when in ("before scale()", "after an iteration"):
    for _key, _values in LOAD_ENTRIES.items():
        for _label, _value_ in _values:
            _load_probe(_when, f"{_key}={_label}", {**GOOD_STATE, _key: _value_}, names=_key)
    for _key in GOOD_STATE:
        _state = {k: v for k, v in GOOD_STATE.items() if k != _key}
        _load_probe(_when, f"no {_key!r}", _state, names=_key)
    _load_probe(
        _when,
        "no 'growth_factor', bad scale",
        {k: (1e39 if k == "scale" else v) for k, v in GOOD_STATE.items() if k != "growth_factor"},
    )
    _load_probe(_when, "empty (a disabled scaler's)", {})
    _load_probe(_when, "None", None)
    _load_probe(_when, "a list of pairs", list(GOOD_STATE.items()))
    _load_probe(_when, "an extra key", {**GOOD_STATE, "extra": 1})
    _load_probe(_when, "good", dict(GOOD_STATE))


# Setters: torch stores anything; its update() then raises for what its parser refuses.
SETTER_VALUES: dict[str, list[tuple[str, Any]]] = {
    "set_growth_factor": [
        ("'2'", "2"),
        ("None", None),
        ("10**400", 10**400),
        ("0.5", 0.5),
        ("-1.0", -1.0),
        ("1.0", 1.0),
        ("np.float64", np.float64(3.0)),
        ("tensor(3.)", torch.tensor(3.0)),
    ],
    "set_backoff_factor": [
        ("'0.5'", "0.5"),
        ("None", None),
        ("1.5", 1.5),
        ("1.0", 1.0),
        ("np.float64", np.float64(0.25)),
    ],
    "set_growth_interval": [
        ("2.5", 2.5),
        ("True", True),
        ("'2'", "2"),
        ("2**63", 2**63),
        ("None", None),
        ("0", 0),
        ("np.int64", np.int64(1)),
        ("tensor(1)", torch.tensor(1)),
    ],
}
_SETTER_ARG = {
    "set_growth_factor": "growth_factor",
    "set_backoff_factor": "backoff_factor",
    "set_growth_interval": "growth_interval",
}


def _setter_probe(method: str, label: str, value: Any, enabled: bool = True) -> None:
    @probe(f"{method}({label})" + ("" if enabled else ", disabled"), names=_SETTER_ARG[method])
    def script(w: World) -> None:
        w.do("GradScaler(...)", lambda: w.make(enabled=enabled))
        w.train(range(1))
        w.do(method, lambda: getattr(w.scaler, method)(value), bad=True)
        w.train(range(1, 4))


for _method, _values in SETTER_VALUES.items():
    for _label, _value_ in _values:
        _setter_probe(_method, _label, _value_)
_setter_probe("set_growth_interval", "2.5", 2.5, enabled=False)


# update(new_scale), called after the iteration's step.
NEW_SCALES: list[tuple[str, Any]] = [
    ("1e39", 1e39),
    ("-1e39", -1e39),
    ("int", 4),
    ("True", True),
    ("'2'", "2"),
    ("[2.0]", [2.0]),
    ("ones(1)", torch.ones(1)),
    ("ones(2)", torch.ones(2)),
    ("requires grad", torch.tensor(2.0, requires_grad=True)),
    ("meta tensor", torch.tensor(2.0, device="meta")),
    ("float", 2.0**5),
    ("nan", math.nan),
    ("inf", math.inf),
    ("np.float64", np.float64(8.0)),
    ("float64 tensor", torch.tensor(16.0, dtype=torch.float64)),
    ("int64 tensor", torch.tensor(3)),
]


def _new_scale_probe(label: str, value: Any) -> None:
    @probe(f"update(new_scale={label})", names="new_scale")
    def script(w: World) -> None:
        w.do("GradScaler(...)", w.make)
        w.do("forward 0", lambda: w.forward(w, 0))
        w.do("step 0", lambda: w.scaler.step(w.opt))
        w.do("update(new_scale)", lambda: w.scaler.update(value))
        w.train(range(1, 4))


for _label, _value_ in NEW_SCALES:
    _new_scale_probe(_label, _value_)


# Optimizer shapes.
def _groups_generator_property(opt: torch.optim.Optimizer) -> None:
    """Serves opt.param_groups as a fresh generator at every access (from then on)."""

    class GroupsProperty(type(opt)):  # type: ignore[misc, valid-type]
        @property
        def param_groups(self):
            return (g for g in self.__dict__["param_groups"])

    opt.__class__ = GroupsProperty


class _AmpAware(torch.optim.SGD):
    """Unscales and skips by itself (torch's protocol for fused optimizers), in plain Python."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        scale, found = self.grad_scale, self.found_inf
        if float(found) != 0:
            return "skipped"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                    p.add_(grad.float() / (1.0 if scale is None else scale), alpha=-0.1)
        return "stepped"


class _Legacy(torch.optim.SGD):
    """The older protocol: step() takes the scaler itself."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # type: ignore[override]
        return type(grad_scaler).__name__


class _FailsOnce(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[override]
        if not getattr(self, "_failed", False):
            self._failed = True
            raise RuntimeError("optimizer step failed")
        return super().step(closure)


class _FailsOnceAmpAware(_AmpAware):
    def step(self, closure=None):  # type: ignore[override]
        if not getattr(self, "_failed", False):
            self._failed = True
            raise RuntimeError("optimizer step failed")
        return super().step(closure)


def _opt_probe(
    name: str, setup: Callable[[World], None], *, unscale: bool = False, bad_setup: bool = False
) -> None:
    @probe(f"optimizer: {name}")
    def script(w: World) -> None:
        w.do("GradScaler(...)", w.make)
        w.do("set up the optimizer", lambda: setup(w), bad=bad_setup)
        w.train(ITERS, unscale=unscale)


def _replace_opt(w: World, opt: Any) -> None:
    w.opt = opt
    w.opts = [opt]


def _meta_grads_too(w: World) -> None:
    cpu_forward = w.forward

    def forward(w: World, i: int) -> None:
        cpu_forward(w, i)
        w.params[-1].grad = torch.ones(3, device="meta")

    w.forward = forward


def _groups_generator(w: World) -> None:
    w.opt.param_groups = (g for g in list(w.opt.param_groups))


def _params_generator(w: World) -> None:
    w.opt.param_groups[0]["params"] = (p for p in list(w.opt.param_groups[0]["params"]))


def _two_opts_same_params(w: World) -> None:
    w.opts = [w.opt, torch.optim.SGD(w.params, lr=0.1)]


def _user_grad_scale(value: Any) -> Callable[[World], None]:
    def setup(w: World) -> None:
        _replace_opt(w, _AmpAware(w.params, lr=0.1))
        w.opt.grad_scale = value

    return setup


_opt_probe("param_groups a generator attribute", _groups_generator)
_opt_probe("param_groups a generator attribute, unscale_ first", _groups_generator, unscale=True)
_opt_probe(
    "param_groups a tuple", lambda w: setattr(w.opt, "param_groups", tuple(w.opt.param_groups))
)
_opt_probe("param_groups a generator property", lambda w: _groups_generator_property(w.opt))
_opt_probe(
    "param_groups a generator property, amp-aware",
    lambda w: (_replace_opt(w, _AmpAware(w.params, lr=0.1)), _groups_generator_property(w.opt)),
)
_opt_probe(
    "param_groups a dict view",
    lambda w: setattr(w.opt, "param_groups", dict(enumerate(w.opt.param_groups)).values()),
)
_opt_probe("param_groups an int", lambda w: setattr(w.opt, "param_groups", 3))
_opt_probe("param_groups empty", lambda w: setattr(w.opt, "param_groups", []))
_opt_probe(
    "params a tuple",
    lambda w: w.opt.param_groups[0].update(params=tuple(w.opt.param_groups[0]["params"])),
)
_opt_probe("params a generator", _params_generator)
_opt_probe("params a set", lambda w: w.opt.param_groups[0].update(params={w.params[0]}))
_opt_probe("group without 'params'", lambda w: w.opt.param_groups[0].pop("params"))
_opt_probe("a param that is a float", lambda w: w.opt.param_groups[0]["params"].append(1.5))
_opt_probe("a param that is None", lambda w: w.opt.param_groups[0]["params"].insert(0, None))
_opt_probe("the same param twice", lambda w: w.opt.param_groups[0]["params"].append(w.params[0]))
_opt_probe("two optimizers over the same params", _two_opts_same_params)
_opt_probe("amp-aware (fused protocol)", lambda w: _replace_opt(w, _AmpAware(w.params, lr=0.1)))
_opt_probe(
    "amp-aware, unscale_ first",
    lambda w: _replace_opt(w, _AmpAware(w.params, lr=0.1)),
    unscale=True,
)
_opt_probe("amp-aware with a user grad_scale tensor", _user_grad_scale(torch.tensor(2.0)))
_opt_probe("amp-aware with grad_scale=None set", _user_grad_scale(None))
_opt_probe("legacy grad_scaler keyword", lambda w: _replace_opt(w, _Legacy(w.params, lr=0.1)))
_opt_probe("step() raises once", lambda w: _replace_opt(w, _FailsOnce(w.params, lr=0.1)))
_opt_probe(
    "amp-aware step() raises once", lambda w: _replace_opt(w, _FailsOnceAmpAware(w.params, lr=0.1))
)
_opt_probe(
    "param_groups a generator attribute, grads on meta beside cpu",
    lambda w: (
        w.params.append(nn.Parameter(torch.ones(3, device="meta"))),
        w.opt.add_param_group({"params": [w.params[-1]]}),
        _meta_grads_too(w),
        _groups_generator(w),
    ),
)
_opt_probe(
    "torch fused SGD", lambda w: _replace_opt(w, torch.optim.SGD(w.params, lr=0.1, fused=True))
)


# Gradients of odd dtypes, layouts and devices, set directly ("meta" is the other device).
def _grads_probe(
    name: str,
    params: Callable[[], list[torch.Tensor]],
    grads: Callable[[list[torch.Tensor], int], list[torch.Tensor | None]],
    *,
    opt: Callable[[list[torch.Tensor]], Any] = lambda ps: torch.optim.SGD(ps, lr=0.1),
    unscale: bool = False,
    clean_grads: Callable[[list[torch.Tensor], int], list[torch.Tensor | None]] | None = None,
    bad_step0_then_drop_last: bool = False,
) -> None:
    def forward_with(make_grads):
        def forward(w: World, i: int) -> None:
            w.scaler.scale(torch.ones(()))
            for p, g in zip(w.params, make_grads(w.params, i), strict=True):
                p.grad = g

        return forward

    @probe(f"grads: {name}")
    def script(w: World) -> None:
        w.params = params()
        _replace_opt(w, opt(w.params))
        w.forward = forward_with(grads)
        w.do("GradScaler(...)", w.make)
        if bad_step0_then_drop_last:
            # the bad iteration, then the offending parameter leaves the optimizer
            w.do("forward 0", lambda: w.forward(w, 0))
            w.do("step 0", lambda: w.scaler.step(w.opt), bad=True)
            w.do("update 0", lambda: w.scaler.update())
            w.do("drop the last param", lambda: w.opt.param_groups[0]["params"].pop())
            w.params = w.params[:-1]
            w.train(range(1, 4), unscale=unscale)
            return
        good = None if clean_grads is None else forward_with(clean_grads)
        w.train(ITERS, unscale=unscale, bad_forward=good is not None, clean_forward=good)


def _params(*specs: tuple[tuple[int, ...], torch.dtype], device: str = "cpu"):
    def make() -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for shape, dtype in specs:
            t = torch.ones(shape, device=device).to(dtype)
            out.append(nn.Parameter(t) if dtype.is_floating_point or dtype.is_complex else t)
        return out

    return make


def _full(value_of: Callable[[int], float]):
    """Gradients full of value_of(i) * 2**10 (the scale), an inf in iteration INF_ITER."""

    def grads(params: list[torch.Tensor], i: int) -> list[torch.Tensor | None]:
        out = []
        inf_in = next((k for k, p in enumerate(params) if p.numel() and p.dtype == F32), -1)
        for k, p in enumerate(params):
            g = torch.full(p.shape, value_of(i) * 2.0**10 * (k + 1), device=p.device)
            if i == INF_ITER and k == inf_in and p.device.type != "meta":
                g.view(-1)[0] = float("inf")
            out.append(g.to(p.dtype))
        return out

    return grads


F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
_lin = _full(lambda i: 1.0 + i)

_grads_probe(
    "complex64 beside float32",
    _params(((3,), F32), ((3,), torch.complex64)),
    _lin,
    bad_step0_then_drop_last=True,
)
_grads_probe(
    "int64 after float32",
    _params(((3,), F32), ((3,), torch.int64)),
    _lin,
    bad_step0_then_drop_last=True,
)
_grads_probe(
    "bool after float32",
    _params(((3,), F32), ((3,), torch.bool)),
    _lin,
    bad_step0_then_drop_last=True,
)
_grads_probe(
    "float8 after float32",
    _params(((3,), F32), ((3,), torch.float8_e4m3fn)),
    _lin,
    bad_step0_then_drop_last=True,
)
_grads_probe("complex64 alone", _params(((3,), torch.complex64)), _lin)
_grads_probe("int64 before float32", _params(((3,), torch.int64), ((3,), F32)), _lin)
_grads_probe("float16 beside float32", _params(((3,), F32), ((3,), F16)), _lin)
_grads_probe(
    "float16 beside float32, unscale_", _params(((3,), F32), ((3,), F16)), _lin, unscale=True
)
_grads_probe(
    "float16, amp-aware optimizer",
    _params(((3,), F16), ((3,), F32)),
    _lin,
    opt=lambda ps: _AmpAware(ps, lr=0.1),
)
_grads_probe("bfloat16 + float64 + float32", _params(((3,), BF16), ((5,), F64), ((2,), F32)), _lin)
_grads_probe("zero-size", _params(((0,), F32), ((3,), F32)), _lin)
_grads_probe(
    "non-contiguous view",
    _params(
        ((3, 2), F32),
    ),
    lambda ps, i: [torch.full((2, 3), 2.0**10 * (i + 1)).t()],
)
_grads_probe(
    "expanded (overlapping)",
    _params(
        ((3,), F32),
    ),
    lambda ps, i: [torch.full((1,), 2.0**10 * (i + 1)).expand(3)],
    clean_grads=lambda ps, i: [torch.full((3,), 2.0**10 * (i + 1))],
)
_grads_probe(
    "sparse COO float32",
    _params(
        ((4,), F32),
    ),
    lambda ps, i: [
        torch.sparse_coo_tensor([[0, 2, 0]], [2.0**10, 2.0**11 * (i + 1), 2.0**9], (4,))
    ],
)
_grads_probe(
    "sparse COO float16 whose duplicates overflow, amp-aware",
    _params(
        ((4,), F16),
    ),
    lambda ps, i: [torch.sparse_coo_tensor([[1, 1]], [6e4, 6e4], (4,)).half()],
    opt=lambda ps: _AmpAware(ps, lr=0.1),
)
_grads_probe(
    "sparse CSR after float32",
    lambda: [nn.Parameter(torch.ones(3)), torch.ones(2, 2).to_sparse_csr()],
    lambda ps, i: [torch.full((3,), 2.0**10), torch.full((2, 2), 2.0**11).to_sparse_csr()],
    bad_step0_then_drop_last=True,
)
_grads_probe(
    "sparse CSR grad of a strided param",
    _params(
        ((2, 2), F32),
    ),
    lambda ps, i: [torch.full((2, 2), 2.0**10).to_sparse_csr()],
)
_grads_probe(
    "on meta beside cpu",
    lambda: _params(((3,), F32))() + _params(((3,), F32), device="meta")(),
    _lin,
)
_grads_probe("all on meta", _params(((3,), F32), device="meta"), _lin)
_grads_probe("None for every param", _params(((3,), F32), ((2,), F32)), lambda ps, i: [None, None])
_grads_probe(
    "nan in one, inf in another",
    _params(((3,), F32), ((2,), F32)),
    lambda ps, i: [torch.tensor([1.0, math.nan, 2.0]), torch.tensor([math.inf, 1.0])],
)


@probe("grads: require grad (backward with create_graph=True)")
def _create_graph(w: World) -> None:
    def forward(w: World, i: int) -> None:
        w.opt.zero_grad(set_to_none=True)
        loss = (w.params[0] ** 3).sum() + (w.params[1] * (i + 1.0)).sum()
        w.scaler.scale(loss).backward(create_graph=True)

    w.forward = forward
    w.do("GradScaler(...)", w.make)
    w.train(range(2))
    w.train(range(2, 4), unscale=True)


# Calls out of order and other misuse.
def _misuse_probe(
    name: str,
    before: Callable[[World], None],
    misuse: Callable[[World], Any],
    after_from: int = 1,
    then_update: bool = False,
    names: str | None = None,
    **scaler_kw: Any,
) -> None:
    @probe(f"misuse: {name}", names=names)
    def script(w: World) -> None:
        w.do("GradScaler(...)", lambda: w.make(**scaler_kw))
        before(w)
        w.do(name, lambda: misuse(w))
        if then_update:
            w.do("update", lambda: w.scaler.update())
        w.train(range(after_from, after_from + 3))


def _nothing(w: World) -> None:
    pass


def _forward0(w: World) -> None:
    w.do("forward 0", lambda: w.forward(w, 0))


def _stepped0(w: World) -> None:
    _forward0(w)
    w.do("step 0", lambda: w.scaler.step(w.opt))


def _unscaled0(w: World) -> None:
    _forward0(w)
    w.do("unscale_ 0", lambda: w.scaler.unscale_(w.opt))


_misuse_probe("step() before scale()", _nothing, lambda w: w.scaler.step(w.opt), 0)
_misuse_probe("update() before scale()", _nothing, lambda w: w.scaler.update(), 0)
_misuse_probe("unscale_() before scale()", _nothing, lambda w: w.scaler.unscale_(w.opt), 0)
_misuse_probe("update(new_scale) before scale()", _nothing, lambda w: w.scaler.update(4.0), 0)
_misuse_probe("get_scale() before scale()", _nothing, lambda w: w.scaler.get_scale(), 0)
_misuse_probe("update() without step()", _forward0, lambda w: w.scaler.update(), 0)
_misuse_probe("update() twice", lambda w: w.train(range(1)), lambda w: w.scaler.update())
_misuse_probe("unscale_() twice", _unscaled0, lambda w: w.scaler.unscale_(w.opt), then_update=True)
_misuse_probe(
    "unscale_() after step()", _stepped0, lambda w: w.scaler.unscale_(w.opt), then_update=True
)
_misuse_probe("step() twice", _stepped0, lambda w: w.scaler.step(w.opt), then_update=True)
_misuse_probe(
    "step() with a closure",
    _forward0,
    lambda w: w.scaler.step(w.opt, closure=lambda: 0.0),
    then_update=True,
)
_misuse_probe(
    "step() with a closure, disabled",
    _forward0,
    lambda w: w.scaler.step(w.opt, closure=lambda: 0.0),
    enabled=False,
)
_misuse_probe("pickle mid-iteration", _stepped0, lambda w: pickle.dumps(w.scaler), then_update=True)
_misuse_probe(
    "deepcopy mid-iteration", _stepped0, lambda w: copy.deepcopy(w.scaler), then_update=True
)
_misuse_probe(
    "state_dict() mid-iteration", _stepped0, lambda w: w.scaler.state_dict(), then_update=True
)
_misuse_probe(
    "load_state_dict() mid-iteration",
    _stepped0,
    lambda w: w.scaler.load_state_dict(dict(GOOD_STATE)),
    then_update=True,
)
_misuse_probe("scale('loss')", _nothing, lambda w: w.scaler.scale("loss"), 0)
_misuse_probe("scale(None)", _nothing, lambda w: w.scaler.scale(None), 0)
_misuse_probe("scale(3)", _nothing, lambda w: w.scaler.scale(3), 0)
_misuse_probe("scale([tensor, 'x'])", _nothing, lambda w: w.scaler.scale([torch.ones(()), "x"]), 0)
_misuse_probe(
    "first scale() of an int tensor", _nothing, lambda w: w.scaler.scale(torch.tensor(3)), 0
)
_misuse_probe(
    "first scale() of a meta tensor",
    _nothing,
    lambda w: w.scaler.scale(torch.ones((), device="meta")),
    0,
)
_misuse_probe(
    "step() of an optimizer without grads",
    _forward0,
    lambda w: w.scaler.step(torch.optim.SGD([nn.Parameter(torch.ones(2))])),
    then_update=True,
)
# The model (or its parameters) where the optimizer goes: torch's AttributeError for
# 'param_groups', with what was given and the fix.
for _label, _thing in (
    ("the model", lambda w: nn.Linear(2, 2)),
    ("model.parameters()", lambda w: iter(w.params)),
):
    for _method in ("step", "unscale_"):
        _misuse_probe(
            f"{_method}() of {_label}",
            _forward0,
            partial(lambda m, t, w: getattr(w.scaler, m)(t(w)), _method, _thing),
            then_update=True,
            names=f"scaler.{_method}(optimizer)",  # (the fix)
        )
_misuse_probe(
    "unscale_() of an optimizer without grads",
    _forward0,
    lambda w: w.scaler.unscale_(torch.optim.SGD([nn.Parameter(torch.ones(2))])),
    0,
)


def _write_attribute(name: str, value: Any) -> Callable[[World], None]:
    return lambda w: setattr(w.scaler, name, value)


def _unpickled_with(key: str, value: Any) -> Callable[[World], None]:
    """Restores the scaler from its pickled state with one entry changed (a hand-edited or
    foreign pickle): the value is used at the next scale()."""

    def restore(w: World) -> None:
        state = w.scaler.__getstate__()
        state[key] = value
        w.scaler.__setstate__(state)

    return restore


for _label, _value_ in (("2.5", 2.5), ("True", True), ("None", None)):
    # behind the setters' back: torch's update() must still be the one to refuse it
    _misuse_probe(
        f"_growth_interval={_label} written directly",
        _nothing,
        _write_attribute("_growth_interval", _value_),
        0,
    )
_misuse_probe(
    "unpickled state with _init_scale=1e39", _nothing, _unpickled_with("_init_scale", 1e39), 0
)
_misuse_probe(
    "unpickled state with _init_scale='2'", _nothing, _unpickled_with("_init_scale", "2"), 0
)


# ------------------------------------------------------------------------------- deliberate
# Probes where ampfused differs from torch on purpose: name patterns -> reason.  Each reason is
# a "Deliberate differences" bullet of docs/reference.md, found there by its key phrase.
REASONS: dict[str, tuple[str, str]] = {
    "refused when given": (
        "refused when they are given",
        "torch stores a value it cannot use and fails at the first scale() or update() (every "
        "time, or once and then stuck with 'step() has already been called'); ampfused raises "
        "the same exception type at the constructor, setter or load_state_dict call, naming the "
        "argument, and keeps training with the state it had",
    ),
    "atomic load": (
        "loads all of it or nothing",
        "torch's load_state_dict assigns entry by entry, so a bad or missing entry leaves the "
        "scaler half loaded; ampfused checks every entry first",
    ),
    "validated first": (
        "validates every gradient before unscaling any",
        "torch unscales the (device, dtype) groups that come before an unsupported dtype, then "
        "raises; ampfused raises the same NotImplementedError having changed nothing",
    ),
    "overlapping grads": (
        "unscaled once per memory location",
        "torch refuses gradients with overlapping memory (expanded views)",
    ),
    "a mistake torch accepts": (
        "refused although torch accepts them",
        "torch trains on with a zero, negative or non-finite init_scale, a factor its own "
        "constructor refuses given to a setter, or a number as the device; ampfused raises at "
        "the call, with the exception type torch's constructor uses for such a value "
        "(MISTAKE_TYPES), and keeps the state it had",
    ),
}

_BAD_INIT = (
    "1e39",
    "-1e39",
    "float32 max as a double",
    "'2'",
    "None",
    "tensor([2.])",
    "2**200",
    "2j",
)
_BAD_INTERVAL = ("2.5", "2.0", "'2'", "True", "False", "None", "2**63", "-2**63-1", "tensor(2.)")
DELIBERATE: dict[str, str] = {
    **{f"ctor: init_scale={v}": "refused when given" for v in _BAD_INIT},
    "ctor: growth_factor=10**400": "refused when given",
    **{f"ctor: growth_interval={v}": "refused when given" for v in _BAD_INTERVAL},
    **{
        f"load before scale(): scale={v}": "refused when given"
        for v in ("1e39", "-1e39", "'2'", "None", "tensor([2.])", "2j")
    },
    **{
        f"load before scale(): _growth_tracker={v}": "refused when given"
        for v in ("2**40", "2**31", "'1'", "None")
    },
    **{
        f"load *: {k}={v}": "refused when given"
        for k, v in (
            ("growth_factor", "'2'"),
            ("growth_factor", "None"),
            ("growth_factor", "10**400"),
            ("backoff_factor", "'0.5'"),
            ("backoff_factor", "None"),
            ("growth_interval", "2.5"),
            ("growth_interval", "'2'"),
            ("growth_interval", "True"),
            ("growth_interval", "None"),
            ("growth_interval", "2**63"),
        )
    },
    **{
        f"load after an iteration: _growth_tracker={v}": "atomic load"
        for v in ("2**40", "2**31", "'1'", "None")
    },
    **{
        f"load *: no {k!r}": "atomic load"
        for k in ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    },
    "load before scale(): no 'growth_factor', bad scale": "atomic load",
    **{f"set_growth_factor({v})": "refused when given" for v in ("'2'", "None", "10**400")},
    **{f"set_backoff_factor({v})": "refused when given" for v in ("'0.5'", "None")},
    **{
        f"set_growth_interval({v})": "refused when given"
        for v in ("2.5", "True", "'2'", "2**63", "None")
    },
    "grads: complex64 beside float32": "validated first",
    "grads: int64 after float32": "validated first",
    "grads: bool after float32": "validated first",
    "grads: float8 after float32": "validated first",
    "grads: expanded (overlapping)": "overlapping grads",
    **{
        f"ctor: init_scale={v}": "a mistake torch accepts"
        for v in ("inf", "-inf", "nan", "0.0", "-4.0")
    },
    "ctor: device=*": "a mistake torch accepts",
    **{f"set_growth_factor({v})": "a mistake torch accepts" for v in ("0.5", "-1.0", "1.0")},
    **{f"set_backoff_factor({v})": "a mistake torch accepts" for v in ("1.5", "1.0")},
}
# What ampfused raises for a mistake torch accepts (torch never raises, so nothing else says
# which type is right): the constructor's type for a value out of range, TypeError for a value
# of the wrong kind.
MISTAKE_TYPES: dict[str, str] = {
    "ctor: init_scale=*": "builtins.AssertionError",
    "ctor: device=*": "builtins.TypeError",
    "set_*_factor(*)": "builtins.AssertionError",
}


def mistake_type(name: str) -> str | None:
    return next((t for pattern, t in MISTAKE_TYPES.items() if _matches(name, pattern)), None)


def _matches(name: str, pattern: str) -> bool:
    """`*` is the only wildcard (probe names hold brackets)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), name) is not None


def deliberate_reason(name: str) -> str | None:
    hits = {r for pattern, r in DELIBERATE.items() if _matches(name, pattern)}
    assert len(hits) <= 1, f"{name}: matched by several DELIBERATE rows {hits}"
    return hits.pop() if hits else None


# ------------------------------------------------------------------------------- running
def _run_probe(name: str, ours: type) -> dict[str, list]:
    runs = {}
    for mode, cls in (("torch", TorchScaler), ("ampfused", ours), ("clean", TorchScaler)):
        torch.manual_seed(0)
        w = World(cls, mode)
        PROBES[name].script(w)
        runs[mode] = w.events
    return runs


def _child(conn, names: list[str], ours: type) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file behind
    torch.set_num_threads(1)  # tiny probes; pytest -n runs many workers, each with children
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = _run_probe(name, ours)
        except BaseException:
            out[name] = ("harness error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(out))
    conn.close()


# How the children start: from a fork server, a fresh interpreter that has imported
# CHILD_PRELOAD and run nothing, never by fork() of this process.  A forked child inherits the
# parent's autograd state: once a process has run a backward (this module's probes, any earlier
# test of the pytest worker) on a machine with a GPU, autograd's per-device threads exist and
# torch refuses autograd in every fork()ed child ("Unable to handle autograd's threading in
# combination with fork-based multiprocessing"), so every probe's first backward raised on the
# GPU machine.  Without a GPU the threads never start; a process with another device reproduces
# it on the CPU (test_probes_run_after_autograd_threads_started).
START_METHOD = "forkserver"
# What the children need, imported once by the server (torch._dynamo, ~1 s, is what the first
# optimizer step imports; each child still imports this module, ~0.1 s).  Only modules that
# leave CUDA uninitialised at import (a child of a process that initialised it cannot use it):
# not this module, which asks torch.cuda.is_available().
CHILD_PRELOAD = ["torch", "torch._dynamo", "ampfused", "numpy", "pytest"]


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(CHILD_PRELOAD)  # read when this process starts its server
    return ctx


def _run_batch(names: list[str], ours: type, timeout: float) -> dict[str, Any] | str:
    """The batch's results, or why the child gave none ("signal SIGSEGV", "timeout", ...)."""
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, names, ours), daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(timeout):
            try:
                return pickle.loads(recv.recv_bytes())
            except EOFError:
                pass  # the child died before it could answer
        else:
            proc.kill()
            proc.join()
            return f"no answer within {timeout:.0f} s (hung)"
    finally:
        recv.close()
    proc.join()
    code = proc.exitcode
    if code is not None and code < 0:
        return f"crashed with signal {signal.Signals(-code).name}"
    return f"child exited with code {code} without a result"


_SERVER_READY: list[bool] = []


def _start_server() -> None:
    """An empty batch first: the fork server's start (its imports, seconds) is not counted in
    a batch's timeout (2 s for the hang)."""
    if not _SERVER_READY:
        got = _run_batch([], OurScaler, BATCH_TIMEOUT_S)
        assert got == {}, f"the probe children do not start: {got}"
        _SERVER_READY.append(True)


def run_probes(
    names: list[str], ours: type = OurScaler, timeout: float = BATCH_TIMEOUT_S
) -> dict[str, Any]:
    """Results per probe name; a probe whose child crashed or hung maps to the reason (str)."""
    _start_server()
    results: dict[str, Any] = {}
    for start in range(0, len(names), BATCH):
        chunk = names[start : start + BATCH]
        got = _run_batch(chunk, ours, timeout)
        if isinstance(got, dict):
            results.update(got)
            continue
        for name in chunk:  # find the culprit: one probe per child
            single = _run_batch([name], ours, timeout / 2)
            results[name] = single[name] if isinstance(single, dict) else single
    return results


# ------------------------------------------------------------------------------- comparing
def _describe(outcome: Any) -> str:
    if outcome is None:
        return "returned"
    if outcome == SKIPPED:
        return "left out"
    return f"{outcome[0][0]}: {outcome[1][:300]}"


def _compatible(ours: Any, ref: Any) -> bool:
    """Both returned (or were left out), or ours raised ref's exception type or a subclass."""
    if ours is None or ref is None or ours == SKIPPED or ref == SKIPPED:
        return ours == ref
    return ref[0][0] in ours[0]


def _match(ours: list, ref: list, ref_name: str) -> list[str]:
    problems = []
    if [e[0] for e in ours] != [e[0] for e in ref]:
        return [f"different calls: {[e[0] for e in ours]} vs {[e[0] for e in ref]}"]
    for (label, out_a, snap_a), (_, out_r, snap_r) in zip(ours, ref, strict=True):
        if not _compatible(out_a, out_r):
            problems.append(
                f"{label!r}: ampfused {_describe(out_a)}; {ref_name} {_describe(out_r)}"
            )
        for part in snap_r:
            if snap_a[part] != snap_r[part]:
                problems.append(f"{label!r}: {part} after the call differ from {ref_name}'s")
    return problems


def check(name: str, runs: Any) -> list[str]:
    """What is wrong with ampfused's run of probe `name` (empty: nothing)."""
    if not isinstance(runs, dict):
        return [f"{name}: {runs}" if isinstance(runs, str) else f"{name}: {runs[1]}"]
    t, a, c = runs["torch"], runs["ampfused"], runs["clean"]
    problems: list[str] = []
    reason = deliberate_reason(name)
    if reason is None:
        problems += _match(a, t, "torch")
    else:
        if not _match(a, t, "torch"):
            problems.append(
                f"no longer differs from torch: remove it from DELIBERATE ({reason!r}) and "
                "check its bullet in docs/reference.md"
            )
        # ampfused must equal the clean run (the wrong call left out), except that it raises
        # at the wrong call: the type torch raises for it, there or at a later call.
        clean_out = [e[1] for e in c]
        patched = []
        for k, (label, out_a, snap_a) in enumerate(a):
            if clean_out[k] == SKIPPED:
                later = [e[1] for e in t[k:] if e[1] not in (None, SKIPPED)]
                expected = mistake_type(name) if reason == "a mistake torch accepts" else None
                if out_a is None:
                    problems.append(f"{label!r}: ampfused accepted it ({reason})")
                elif not later and expected is not None:
                    if expected not in out_a[0]:
                        problems.append(
                            f"{label!r}: ampfused {_describe(out_a)}, not the {expected} a "
                            "mistake torch accepts is refused with"
                        )
                elif not later:
                    problems.append(f"{label!r}: ampfused raised but torch never does")
                elif not _compatible(out_a, later[0]):
                    problems.append(
                        f"{label!r}: ampfused {_describe(out_a)}, not a subclass of what torch "
                        f"raises for it: {_describe(later[0])}"
                    )
                out_a = SKIPPED
            patched.append((label, out_a, snap_a))
        problems += _match(patched, c, "the clean run")
    names_arg = PROBES[name].names
    first = next((e for e in a if e[1] not in (None, SKIPPED)), None)
    if names_arg and first is not None and names_arg not in first[1][1]:
        problems.append(f"{first[0]!r}: the message does not name {names_arg!r}: {first[1][1]!r}")
    return problems


# ------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_probes(list(PROBES))


@pytest.mark.parametrize("name", list(PROBES))
def test_bad_input_like_torch(results, name):
    problems = check(name, results[name])
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


def test_deliberate_table_is_current():
    for pattern in DELIBERATE:
        assert any(_matches(n, pattern) for n in PROBES), f"no probe matches {pattern!r}"
    assert set(DELIBERATE.values()) == set(REASONS)
    for name, reason in ((n, deliberate_reason(n)) for n in PROBES):
        if reason == "a mistake torch accepts":
            assert mistake_type(name), f"{name}: no MISTAKE_TYPES row says what it raises"


def test_docs_list_the_deliberate_differences():
    reference = Path(__file__).resolve().parent.parent.joinpath("docs", "reference.md").read_text()
    match = re.search(r"#+ Deliberate differences.*?\n(.*?)(?=\n#+ |\Z)", reference, re.S)
    assert match, "docs/reference.md has no 'Deliberate differences' section"
    section = " ".join(match.group(1).split())
    for key, (phrase, _) in REASONS.items():
        assert phrase in section, f"docs 'Deliberate differences' lack {key!r}: {phrase!r}"


# ------------------------------------------------------------------------------- the harness
# Each check above, run once against a scaler broken on purpose: it must report the break.
class _RaisesValueError(OurScaler):
    def set_growth_interval(self, new_interval):
        if type(new_interval) is not int:
            raise ValueError("set_growth_interval: growth_interval must be an int")
        super().set_growth_interval(new_interval)


class _StoresThenRaises(OurScaler):
    def set_growth_interval(self, new_interval):
        self._growth_interval = new_interval
        super().set_growth_interval(new_interval)


class _AcceptsSilently(OurScaler):
    def set_growth_interval(self, new_interval):
        self._growth_interval = new_interval


class _UnnamedMessage(OurScaler):
    def set_growth_interval(self, new_interval):
        if type(new_interval) is not int:
            raise TypeError("bad value")
        super().set_growth_interval(new_interval)


class _DriftsAfterRefusing(OurScaler):
    """Refuses the bad state dict cleanly, then backs off twice as hard from then on."""

    def load_state_dict(self, state_dict):
        try:
            super().load_state_dict(state_dict)
        except TypeError:
            self._drift = True
            raise

    def update(self, new_scale=None):
        super().update(new_scale)
        if getattr(self, "_drift", False) and self._scale is not None:
            self._scale.mul_(0.5)


class _WrongMisuseType(OurScaler):
    def step(self, optimizer, *args, **kwargs):
        if self._per_optimizer_states[id(optimizer)]["stage"] is ampfused.OptState.STEPPED:
            raise ValueError("step() has already been called since the last update().")
        return super().step(optimizer, *args, **kwargs)


class _Aborts(OurScaler):
    def step(self, optimizer, *args, **kwargs):
        if any(
            p.grad is not None and p.grad.is_complex()
            for g in optimizer.param_groups
            for p in g["params"]
        ):
            signal.raise_signal(signal.SIGABRT)  # as a crashing kernel would
        return super().step(optimizer, *args, **kwargs)


class _RefusesWithValueError(OurScaler):
    def set_growth_factor(self, new_factor):
        if new_factor <= 1.0:
            raise ValueError("set_growth_factor: growth_factor must be > 1.0")
        super().set_growth_factor(new_factor)


class _Hangs(OurScaler):
    def update(self, new_scale=None):
        signal.pause()


BROKEN: dict[str, tuple[str, type, str]] = {
    "wrong exception type (deliberate probe)": (
        "set_growth_interval(2.5)",
        _RaisesValueError,
        "not a subclass of what torch raises",
    ),
    "wrong exception type (misuse)": (
        "misuse: step() twice",
        _WrongMisuseType,
        "ampfused builtins.ValueError",
    ),
    "a refused call changes state": (
        "set_growth_interval(2.5)",
        _StoresThenRaises,
        "scaler after the call differ",
    ),
    "a bad value accepted": ("set_growth_interval(2.5)", _AcceptsSilently, "accepted it"),
    "a mistake torch accepts, refused with another type": (
        "set_growth_factor(-1.0)",
        _RefusesWithValueError,
        "not the builtins.AssertionError",
    ),
    "a message that names nothing": (
        "set_growth_interval(2.5)",
        _UnnamedMessage,
        "does not name 'growth_interval'",
    ),
    "training drifts after a refusal": (
        "load after an iteration: growth_interval=2.5",
        _DriftsAfterRefusing,
        "'update 1': scaler after the call differ from the clean run's",
    ),
    "a deliberate difference that is gone": (
        "set_growth_interval(2.5)",
        TorchScaler,
        "no longer differs from torch",
    ),
    "a crash": ("grads: complex64 beside float32", _Aborts, "crashed with signal SIGABRT"),
    "a hang": ("ctor: init_scale=int", _Hangs, "hung"),
}


# A process where autograd's per-device threads have started, as in a pytest worker on a GPU
# machine: a device beside the CPU (torch's Python PrivateUse1 backend with its dummy guard, one
# device) and a backward.  Checks that this reproduces the failure (a fork()ed child's backward
# raises), then runs probes through the harness; prints what went wrong, as JSON.
_AFTER_AUTOGRAD_THREADS = """
import json, os, sys, warnings
import torch

torch.utils.backend_registration._setup_privateuseone_for_python_backend()
torch.ones(2, requires_grad=True).sum().backward()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fork() of a multi-threaded process (Python >= 3.12)
    pid = os.fork()
if pid == 0:
    try:
        torch.ones(2, requires_grad=True).sum().backward()
        os._exit(0)
    except RuntimeError as e:
        os._exit(3 if "fork-based multiprocessing" in str(e) else 4)
forked_backward = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

sys.path.insert(0, sys.argv[1])
import test_bad_inputs as t

names = sys.argv[2:]
results = t.run_probes(names)
print(json.dumps({
    "forked_backward": forked_backward,
    "problems": [p for n in names for p in t.check(n, results[n])],
    # torch, ampfused and clean runs failing alike would match: the refusal itself, anywhere
    "refused": [n for n in names if "fork-based multiprocessing" in repr(results[n])],
}))
"""


def test_probes_run_after_autograd_threads_started():
    """The harness's children run autograd even where the test process has autograd's
    per-device threads running: the GPU machine's failure ("Unable to handle autograd's
    threading in combination with fork-based multiprocessing" in every probe, when the children
    were fork()ed), reproduced on the CPU."""
    if not hasattr(torch.utils.backend_registration, "_setup_privateuseone_for_python_backend"):
        pytest.skip("this torch has no Python PrivateUse1 backend to start autograd's threads")
    assert START_METHOD != "fork"
    names = ["ctor: init_scale=int", "misuse: step() twice"]
    proc = subprocess.run(
        [sys.executable, "-c", _AFTER_AUTOGRAD_THREADS, str(Path(__file__).parent), *names],
        capture_output=True,
        text=True,
        timeout=2 * BATCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["forked_backward"] == 3, "the process does not reproduce the failure: " + str(got)
    assert got["refused"] == [] and got["problems"] == [], got


@pytest.mark.parametrize("case", list(BROKEN))
def test_harness_reports_a_broken_scaler(case):
    name, broken, expected = BROKEN[case]
    got = run_probes([name], broken, timeout=2.0 if broken is _Hangs else BATCH_TIMEOUT_S)
    problems = check(name, got[name])
    assert any(expected in p for p in problems), problems


# ------------------------------------------------------------------------------- the messages
# What the probes do not read: the words.  The same mix-up gets the same message from every
# method that meets it, and the scaler without kernels refuses what this one refuses.
def _no_kernels_scaler() -> type:
    from ampfused import _no_kernels

    return _no_kernels.GradScaler


@pytest.mark.parametrize("cls", [OurScaler, _no_kernels_scaler()], ids=["kernels", "no kernels"])
def test_the_model_where_the_optimizer_goes(cls):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cls("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    for method in ("step", "unscale_"):
        with pytest.raises(AttributeError) as e:
            getattr(scaler, method)(model)
        assert str(e.value) == (
            "'Linear' object has no attribute 'param_groups'. "
            f"{method}(optimizer): expected the optimizer "
            f"{'to step' if method == 'step' else 'whose gradients to unscale'}, got a module "
            f"(Linear: the model?); pass the optimizer: scaler.{method}(optimizer)"
        )
        with pytest.raises(AttributeError, match=r"got a generator \(model.parameters\(\)\?\)"):
            getattr(scaler, method)(model.parameters())
    with pytest.raises(TypeError, match=r"got a module \(Linear: the model\?\); pass the optim"):
        scaler.clip_grad_norm_(model, 1.0)
    assert id(model) not in scaler._per_optimizer_states  # (refused before it is recorded)
    scaler.step(opt)  # (the iteration goes on)
    scaler.update()


@pytest.mark.parametrize("cls", [OurScaler, _no_kernels_scaler()], ids=["kernels", "no kernels"])
def test_mistakes_torch_accepts(cls):
    with pytest.raises(TypeError, match=re.escape('write GradScaler("cuda", init_scale=65536.0)')):
        cls(65536.0)
    with pytest.raises(TypeError, match=re.escape('GradScaler("cuda", enabled=False)')):
        cls(False)
    for bad in (0.0, -1.0, math.inf, math.nan, torch.tensor(0.0)):
        with pytest.raises(AssertionError, match=r"^The initial scale must be a positive finite"):
            cls("cpu", init_scale=bad)
    cls("cpu", init_scale=0.0, enabled=False)  # (torch checks nothing of a disabled scaler)
    scaler = cls("cpu")
    with pytest.raises(AssertionError, match=r"^The growth factor must be > 1\.0\. .*=-1\.0"):
        scaler.set_growth_factor(-1.0)
    with pytest.raises(AssertionError, match=r"^The backoff factor must be < 1\.0\. .*=2\.0"):
        scaler.set_backoff_factor(2.0)
    assert (scaler._growth_factor, scaler._backoff_factor) == (2.0, 0.5)
