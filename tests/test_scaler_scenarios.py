"""GradScaler behaviour scenarios, each checked for both scalers and between them, bit for bit.

Two kinds of scenario:

* **Recipes** (``RECIPES``): a small training loop run three times from the same weights and
  data: unscaled in float32 (the control), with ``torch.amp.GradScaler`` and with
  ``ampfused.GradScaler``.  The two scaled runs go through the parity harness of
  ``_scaler_harness.py`` (``lockstep``: everything compared bit for bit after every
  iteration); each is then held against the control, to the recipe's tolerance, and its final
  scale against the number of growth and backoff steps the recipe implies.  The scaled runs get an
  inf in one weight gradient in ``OVERFLOW_ITER``; the control skips the step the overflow would
  skip.
* **Probes**: one behaviour (``_unscale_grads_`` on odd gradient sets, sparse gradients, the
  scale update sequence, ``state_dict``, ``scale()`` of nested outputs, the fused-optimizer
  protocol, fused against for-loop optimizers, gradients broken after ``unscale_``, a scale that
  would overflow) run once per scaler class: each run asserts the expected outcome and returns
  what it observed, and the two observations must be identical.

The scenarios and their numbers (model and data shapes, scales, growth factors, overflow
iteration, expected growth/backoff counts, tolerances) are those PyTorch uses to test its own
GradScaler; the structure and code are ours.
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _scaler_harness import SCALERS, Side, assert_same, device_key, lockstep, torch_state_dict
from torch import nn
from torch.torch_version import TorchVersion

# torch warns once per process that it does not check sparse invariants by default
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")

WIDTH, N_BATCHES, OVERFLOW_ITER = 8, 4, 2
SEED = 20
INIT_SCALE, GROWTH = 128.0, 2.0  # growth_interval 1: every clean step grows the scale
MAX_NORM = 0.2  # small enough that clipping changes the gradients of this model
Optim = tuple[type[torch.optim.Optimizer], dict[str, Any]]


# ------------------------------------------------------------------------------- building blocks
def two_layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def batches(device: str, seed: int = SEED) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """N_BATCHES (input, target) pairs of WIDTH x WIDTH standard-normal float32 values."""
    g = torch.Generator().manual_seed(seed)
    pairs = [torch.randn(2, WIDTH, WIDTH, generator=g) for _ in range(N_BATCHES)]
    return [(p[0].to(device), p[1].to(device)) for p in pairs]


def fresh_models(n: int, seed: int = SEED) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [two_layers() for _ in range(n)]


def optimizer_for(model: nn.Module, optim: Optim, **extra: Any) -> torch.optim.Optimizer:
    ctor, kwargs = optim
    return ctor(model.parameters(), **{"lr": 1.0, **kwargs, **extra})


def state_tensors(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)}


def close(actual: Any, expected: Any, **tol: float) -> str | None:
    """None when actual is within tol of expected, else torch's description of the mismatch.
    Optimizer state such as ``step`` sits on the CPU for for-loop optimizers and on the
    parameter's device for fused ones, so expected is brought to actual's device first."""
    if torch.is_tensor(actual) and torch.is_tensor(expected):
        expected = expected.to(actual.device).reshape(actual.shape)
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as exc:
        return str(exc)
    return None


def each_scaler(probe: Callable[..., Any], *args: Any) -> None:
    """Runs probe(scaler_cls, *args) for torch's class and ours (same seed, FutureWarnings of
    the fused-optimizer protocol silenced); their observations must match bit for bit."""
    seen = []
    for cls in SCALERS:
        torch.manual_seed(SEED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            seen.append(probe(cls, *args))
    assert_same(seen[0], seen[1], f"{probe.__name__}: torch vs ampfused")


# ------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    """One training loop.  Scaled runs use init_scale=INIT_SCALE, growth_factor=GROWTH and
    growth_interval=1, so the final scale counts the clean and the overflowing steps."""

    grows: int  # steps that grew the scale
    backoffs: int  # steps that overflowed and backed it off
    atol: float = 1e-7  # against the control; rtol is 1e-5
    optim: Optim = (torch.optim.SGD, {})
    fp16_autocast: bool = False  # scaled runs only: the control stays float32 throughout
    clip: str | None = None  # "scaled": clip to MAX_NORM * scale; "unscaled": unscale_, clip
    penalty: bool = False  # add the norm of autograd.grad(loss) to the loss
    overflow: bool = True  # an inf in the last model's second weight gradient in OVERFLOW_ITER
    accumulate: int = 1  # backward passes per optimizer step
    two_models: bool = False  # two models, two optimizers, two losses through both
    pickle_scaler: bool = False  # replace the scaler by a pickled copy after every iteration
    meets_tolerance: bool = True  # False: the control comparison is known to miss atol


class Unscaled:
    """The control's side of each recipe step: plain float32 autograd; the optimizer whose
    gradients the scaled runs overflow in OVERFLOW_ITER does not step then."""

    scaled = False

    def backward(self, loss: torch.Tensor, retain: bool) -> None:
        loss.backward(retain_graph=retain)

    def penalty_grads(self, loss: torch.Tensor, params: list) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(loss, params, create_graph=True)

    def clip_limit(self) -> float:
        return MAX_NORM

    def overflow(self, grad: torch.Tensor) -> None:
        pass

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        pass

    def step(self, opt: torch.optim.Optimizer, overflowed: bool) -> None:
        if not overflowed:
            opt.step()

    def end(self) -> None:
        pass


class Scaled:
    """A scaled run's side of each recipe step, through side.scaler (which may be replaced)."""

    scaled = True

    def __init__(self, side: Side, pickle_scaler: bool) -> None:
        self.side, self.pickle_scaler = side, pickle_scaler

    def backward(self, loss: torch.Tensor, retain: bool) -> None:
        self.side.scaler.scale(loss).backward(retain_graph=retain)

    def penalty_grads(self, loss: torch.Tensor, params: list) -> list[torch.Tensor]:
        # the gradients of the scaled loss, unscaled by hand: the penalty must not see the scale
        scaled = torch.autograd.grad(self.side.scaler.scale(loss), params, create_graph=True)
        factor = 1.0 / self.side.scaler.get_scale()
        return [g * factor for g in scaled]

    def clip_limit(self) -> float:
        return MAX_NORM * self.side.scaler.get_scale()  # the gradients are still scaled

    def overflow(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            grad.fill_(float("inf"))

    def unscale(self, opt: torch.optim.Optimizer) -> None:
        self.side.scaler.unscale_(opt)

    def step(self, opt: torch.optim.Optimizer, overflowed: bool) -> None:
        self.side.scaler.step(opt)  # the scaler finds the overflow itself

    def end(self) -> None:
        self.side.scaler.update()
        if self.pickle_scaler:
            self.side.scaler = pickle.loads(pickle.dumps(self.side.scaler))


def recipe_step(
    r: Recipe, side: Side, run: Unscaled | Scaled, i: int, data: list, overflow_at: int | None
) -> None:
    """Iteration i of recipe r on side's models and optimizers."""
    x, y = data[i]
    params = [p for m in side.models for p in m.parameters()]
    if i % r.accumulate == 0:
        for opt in side.opts:
            opt.zero_grad()
    autocast = r.fp16_autocast and run.scaled
    with torch.autocast(device_type=side.device, dtype=torch.float16, enabled=autocast):
        outs = [m(x) for m in side.models]
        if r.two_models:
            losses = [F.mse_loss(0.3 * outs[0] + 0.7 * outs[1], y)]
            losses.append(F.mse_loss(0.6 * outs[0] - 0.4 * outs[1], y))
        else:
            losses = [F.mse_loss(outs[0], y) / r.accumulate]
    if r.penalty:
        grads = run.penalty_grads(losses[0], params)
        losses[0] = losses[0] + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
    for k, loss in enumerate(losses):
        run.backward(loss, retain=k + 1 < len(losses))
    if (i + 1) % r.accumulate:
        return  # more micro-batches before the next step
    if r.clip == "scaled":
        nn.utils.clip_grad_norm_(params, run.clip_limit())
    overflowed = i == overflow_at
    if overflowed:
        run.overflow(side.models[-1][1].weight.grad)
    if r.clip == "unscaled" or r.two_models:  # two models: one optimizer unscaled separately
        run.unscale(side.opts[0])
    if r.clip == "unscaled":
        nn.utils.clip_grad_norm_(params, MAX_NORM, error_if_nonfinite=False)
    for opt in side.opts:
        run.step(opt, overflowed and opt is side.opts[-1])
    run.end()


AUTOCAST_OPTIMS: dict[str, Optim] = {
    "SGD": (torch.optim.SGD, {}),
    "SGD-momentum-decay": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    "SGD-nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "Adam": (torch.optim.Adam, {}),
    "Adam-amsgrad-decay": (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1}),
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW-amsgrad-maximize": (torch.optim.AdamW, {"amsgrad": True, "maximize": True}),
}
IMPLS: dict[str, dict[str, bool]] = {
    "forloop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}

RECIPES: dict[str, Recipe] = {
    "clip_scaled_grads": Recipe(3, 1, atol=1e-5, clip="scaled"),
    "unscale_then_clip": Recipe(3, 1, clip="unscaled"),
    "gradient_penalty": Recipe(3, 1, penalty=True),
    "accumulate_2": Recipe(2, 0, accumulate=2, overflow=False),
    "two_models_two_losses": Recipe(3, 1, two_models=True),
}
# float16 autocast against float32 within atol=1e-3; Adam and AdamW (lr 1.0) are known to miss it
for _name, (_ctor, _kw) in AUTOCAST_OPTIMS.items():
    for _impl, _impl_kw in IMPLS.items():
        for _pickled in (False, True):
            RECIPES[f"autocast-{_name}-{_impl}{'-pickled' if _pickled else ''}"] = Recipe(
                3,
                1,
                atol=1e-3,
                optim=(_ctor, {**_kw, **_impl_kw}),
                fp16_autocast=True,
                pickle_scaler=_pickled,
                meets_tolerance=_ctor not in (torch.optim.Adam, torch.optim.AdamW),
            )


def mismatches(control: Side, side: Side, atol: float) -> list[str]:
    """Where side's gradients, optimizer state and parameters leave the control's tolerance."""
    found = []
    pairs = zip(control.models, control.opts, side.models, side.opts, strict=True)
    for m_c, o_c, m_s, o_s in pairs:
        for (name, c), s in zip(m_c.named_parameters(), m_s.parameters(), strict=True):
            state_c, state_s = state_tensors(o_c, c), state_tensors(o_s, s)
            checks = [("grad", s.grad, c.grad), ("value", s, c)]
            checks += [(k, state_s[k], state_c[k]) for k in state_c]
            for what, actual, expected in checks:
                diff = close(actual, expected, atol=atol, rtol=1e-5)
                if diff is not None:
                    found.append(f"{name} {what}: {diff}")
    return found


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_against_unscaled_control(device, name, enabled):
    r = RECIPES[name]
    data = batches(device)
    template = fresh_models(2 if r.two_models else 1)

    def side_for(scaler: Any) -> Side:
        models = [copy.deepcopy(m).to(device) for m in template]
        return Side(scaler, models, [optimizer_for(m, r.optim) for m in models], device)

    # a disabled scaler never skips a step, so nothing is injected then
    overflow_at = OVERFLOW_ITER if enabled and r.overflow else None
    control = side_for(None)
    for i in range(N_BATCHES):
        recipe_step(r, control, Unscaled(), i, data, overflow_at)

    kw = {"init_scale": INIT_SCALE, "growth_factor": GROWTH, "growth_interval": 1}
    sides = [side_for(cls(device, enabled=enabled, **kw)) for cls in SCALERS]

    def scaled_step(side: Side, i: int) -> None:
        recipe_step(r, side, Scaled(side, r.pickle_scaler), i, data, overflow_at)

    lockstep(sides, scaled_step, N_BATCHES)

    expected_scale = INIT_SCALE * GROWTH**r.grows * 0.5**r.backoffs if enabled else 1.0
    for side, cls in zip(sides, SCALERS, strict=True):
        assert type(side.scaler) is cls
        assert side.scaler.get_scale() == expected_scale, cls
        off = mismatches(control, side, r.atol)
        if r.meets_tolerance:
            assert not off, f"{cls.__module__}: " + "\n".join(off)
        else:  # the gap is float16 autocast's against float32, scaler enabled or not
            assert off, f"{cls.__module__} met atol={r.atol}, which torch's own scaler does not"


# ------------------------------------------------------------------------------- probes
def probe_unscale_grads_sorting(cls: type, device: str) -> list:
    """_unscale_grads_ groups float32 and float16 gradients (contiguous and strided slices) and
    finds an inf placed in any one of them; clean ones come out as 4.0 * 0.25 == 1.0."""
    inv_scale = torch.full((1,), 0.25, device=device)
    base = torch.full((20, 20), 4.0, device=device)
    variants = [
        lambda: base.clone(),
        lambda: base.clone()[:, :5],  # not dense
        lambda: base.to(torch.float16),
        lambda: base.to(torch.float16),
    ]
    params = [torch.empty_like(make()) for make in variants]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = cls(device)
    seen = []
    for poisoned in [None, *range(len(variants))]:
        grads = [make() for make in variants]
        if poisoned is not None:
            grads[poisoned][2, 2] = float("inf")
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        found = scaler._unscale_grads_(opt, inv_scale, torch.zeros(1, device=device), True)
        assert sum(f.item() for f in found.values()) == (poisoned is not None)
        if poisoned is None:
            for g in grads:
                diff = close(g, torch.ones_like(g), rtol=1e-5, atol=1e-7)
                assert diff is None, diff
        seen.append((dict(found), grads))
    return seen


def test_unscale_grads_sorts_dtypes_and_layouts(device):
    each_scaler(probe_unscale_grads_sorting, device)


@dataclass(frozen=True)
class SparseGrad:
    """A sparse COO gradient of shape (2, 3), unscaled by 0.25 (float16 allowed for float16)."""

    values: tuple[float, ...]
    dtype: torch.dtype
    overflows: bool
    indices: tuple[tuple[int, ...], ...] = ((0, 1, 1), (2, 0, 2))


SPARSE_CASES = {
    "float32": SparseGrad((16.0, 32.0, 64.0), torch.float32, False),
    "float32-inf": SparseGrad((16.0, 32.0, math.inf), torch.float32, True),
    "float32-nan": SparseGrad((16.0, 32.0, math.nan), torch.float32, True),
    "float16": SparseGrad((16.0, 32.0, 64.0), torch.float16, False),
    # duplicated indices: 64000 + 64000 overflows float16 only once the tensor is coalesced
    "float16-dup-overflow": SparseGrad(
        (64000.0, 32.0, 64000.0), torch.float16, True, ((0, 1, 0), (2, 0, 2))
    ),
}


def probe_sparse_grad(cls: type, device: str, case: str) -> tuple:
    c = SPARSE_CASES[case]
    i = torch.tensor(c.indices, dtype=torch.int64, device=device)
    v = torch.tensor(c.values, device=device)
    grad = torch.sparse_coo_tensor(i, v, (2, 3), device=device, dtype=c.dtype)
    param = grad.clone()
    param.grad = grad.clone()
    opt = torch.optim.SGD([param], lr=1.0)
    inv_scale = torch.full((1,), 0.25, device=device)
    found_inf = torch.zeros(1, device=device)
    allow_fp16 = c.dtype == torch.float16
    f = cls(device)._unscale_grads_(opt, inv_scale, found_inf, allow_fp16)[device_key(device)]
    assert f.item() == float(c.overflows)
    if not c.overflows:
        diff = close(param.grad.to_dense(), (grad / 4).to_dense())
        assert diff is None, diff
    return f, param.grad


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_grad_unscale(device, case):
    each_scaler(probe_sparse_grad, device, case)


# growth 2.0, backoff 0.25, interval 2 from scale 4.0: (gradient value, tracker, scale) after
# each step: two clean steps grow the scale once, an overflow backs it off and resets the count
UPDATE_SEQUENCE = [(1.0, 1, 4.0), (1.0, 0, 8.0), (math.inf, 0, 2.0)]


def probe_update_sequence(cls: type, device: str) -> list:
    scaler = cls(device, init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    p = torch.zeros(3, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    seen = []
    for value, tracker, scale in UPDATE_SEQUENCE:
        scaler.scale(torch.ones((), device=device))
        p.grad = torch.full((3,), value, device=device)
        scaler.step(opt)
        scaler.update()
        now = (scaler._get_growth_tracker(), scaler.get_scale())
        assert now == (tracker, scale), (value, now)
        seen.append(now)
    return seen


def test_update_sequence(device):
    each_scaler(probe_update_sequence, device)


@pytest.mark.parametrize("lazy_init", [True, False], ids=["scale_exists", "no_scale_yet"])
@pytest.mark.parametrize("source", ["same", "torch", "ampfused"])
def test_load_state_dict_overwrites_everything(device, source, lazy_init):
    src_cls = {"torch": SCALERS[0], "ampfused": SCALERS[1]}.get(source)
    saved = {"init_scale": 3.0, "growth_factor": 4.0, "backoff_factor": 0.5, "growth_interval": 2}

    def probe(cls: type) -> dict:
        dst = cls(device, init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        dst._init_growth_tracker = 7  # something for load_state_dict to overwrite
        if lazy_init:
            dst.scale(torch.full((1,), 4.0, device=device))
            assert dst._scale.dtype == torch.float32 and dst._scale.device.type == device
        dst.load_state_dict((src_cls or cls)(device, **saved).state_dict())
        got = (dst.get_scale(), dst.get_growth_factor(), dst.get_backoff_factor())
        assert got + (dst.get_growth_interval(), dst._init_growth_tracker) == (3.0, 4.0, 0.5, 2, 0)
        return torch_state_dict(dst)

    probe.__name__ = f"load_state_dict from {source}"
    each_scaler(probe)


def probe_nested_outputs(cls: type, device: str) -> Any:
    """scale() keeps the nesting and container types and multiplies every tensor."""
    scaler = cls(device, init_scale=2.0)
    a, b = (torch.full((1,), 4.0, device=device) for _ in range(2))
    scaled = scaler.scale((b.clone(), (a.clone(), b.clone()), [a.clone(), (b.clone(), a.clone())]))
    assert isinstance(scaled, tuple) and isinstance(scaled[2], list)
    leaves = [scaled[0], *scaled[1], scaled[2][0], *scaled[2][1]]
    assert all(t.item() == 8.0 for t in leaves)
    assert scaler._scale.device == b.device
    return scaled


def test_scale_nested_outputs(device):
    each_scaler(probe_nested_outputs, device)


def probe_grad_scaler_argument(cls: type, device: str) -> list:
    """An amp-aware optimizer whose step() takes grad_scaler receives the scaler (with a
    FutureWarning) and no grad_scale/found_inf attributes; one without it gets both tensors."""
    seen: list = []

    class AmpAware(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class TakesScaler(AmpAware):
        def step(self, closure=None, *, grad_scaler=None):
            assert isinstance(grad_scaler, torch.amp.GradScaler) and type(grad_scaler) is cls
            assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")
            seen.append("grad_scaler")

    class ReadsAttributes(AmpAware):
        def step(self, closure=None):
            assert torch.is_tensor(self.grad_scale) and torch.is_tensor(self.found_inf)
            seen.append((self.grad_scale.clone(), self.found_inf.clone()))

    layer = nn.Linear(4, 1).to(device)
    first, second = TakesScaler(layer.parameters()), ReadsAttributes(layer.parameters())
    scaler = cls(device, init_scale=2.0)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = layer(torch.randn(4, 4, device=device)).mean()
    scaler.scale(loss).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.step(first)
    assert any(issubclass(w.category, FutureWarning) for w in caught)
    scaler.step(second)
    scaler.update()
    assert seen[0] == "grad_scaler" and len(seen) == 2
    assert not hasattr(second, "grad_scale") and not hasattr(second, "found_inf")
    return [*seen[1:], scaler.get_scale()]


def test_optimizer_taking_grad_scaler(device):
    each_scaler(probe_grad_scaler_argument, device)


def probe_growth_past_float32(cls: type, device: str) -> tuple:
    """init_scale 1e38 grown by 2**4 would overflow float32: the scale is kept, not inf/NaN."""
    model = nn.Linear(5, 1).to(device)
    opt = torch.optim.Adam(model.parameters())
    scaler = cls(device, growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    x, y = torch.randn(1, 5, device=device), 1e-30 * torch.randn(1, 1, device=device)
    scaler.scale((model(x) - y).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert math.isfinite(scaler.get_scale()) and scaler._get_growth_tracker() == 0
    assert scaler.get_scale() == torch.tensor(1e38).item()
    return scaler.get_scale(), [p.detach() for p in model.parameters()]


def test_growth_past_float32_max_keeps_scale(device):
    each_scaler(probe_growth_past_float32, device)


def probe_grads_broken_after_unscale(cls: type, device: str, optim: Optim) -> list:
    """Gradients overwritten with NaN/inf after unscale_ (found_inf already computed, 0) reach
    the optimizer, whose parameters turn non-finite: for fused optimizers too, which get
    grad_scale None after unscale_."""
    (model,) = [m.to(device) for m in fresh_models(1)]
    opt = optimizer_for(model, optim)
    scaler = cls(device, init_scale=INIT_SCALE)
    for x, y in batches(device):
        opt.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):
            p.grad.copy_(torch.full_like(p.grad, math.inf if j % 2 else math.nan))
        scaler.step(opt)
        scaler.update()
    assert all(not p.isfinite().all() for p in model.parameters())
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("optim", ["Adam", "AdamW"])
def test_grads_broken_between_unscale_and_step(device, optim, impl):
    each_scaler(probe_grads_broken_after_unscale, device, (AUTOCAST_OPTIMS[optim][0], IMPLS[impl]))


# fused=True against the for-loop form of the same optimizer, each with its own scaler
FUSED_OPTIMS: dict[str, Optim] = {
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "Adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"amsgrad": True}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}
# torch 2.11's Adagrad refuses fused=True for CUDA parameters (its step() checks the device with
# cuda_unsupported=True, "supported devices: ['cpu', ...]"); 2.12.0 allows it (pytorch#177672).
ADAGRAD_FUSED_CUDA = TorchVersion(torch.__version__) >= (2, 12)


def probe_fused_against_forloop(cls: type, device: str, optim: Optim, unscale_first: bool):
    """Both sides train under float16 autocast with init_scale INIT_SCALE.  Every iteration the
    fused side's loss, gradients, parameters and state must be within float32's default
    tolerance of the for-loop side's (2e-5 for parameters and second moments when betas are
    Python floats), and are then reset to the for-loop side's values so errors do not add up."""
    data = batches(device)
    forloop_model, fused_model = (copy.deepcopy(m).to(device) for m in fresh_models(1) * 2)
    forloop_opt = optimizer_for(forloop_model, optim, fused=False)
    fused_opt = optimizer_for(fused_model, optim, fused=True)
    betas = forloop_opt.param_groups[0].get("betas")
    float_betas = betas is not None and not torch.is_tensor(betas[0])
    loose = {"atol": 2e-5, "rtol": 2e-5} if float_betas else {}
    runs = [(forloop_model, forloop_opt, cls(device, init_scale=INIT_SCALE))]
    runs.append((fused_model, fused_opt, cls(device, init_scale=INIT_SCALE)))
    history = []
    for x, y in data:
        losses = []
        for k, (model, opt, scaler) in enumerate(runs):
            opt.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if unscale_first and k == 1:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        pairs = [(losses[1], losses[0], {})]
        for p_f, p_l in zip(fused_model.parameters(), forloop_model.parameters(), strict=True):
            pairs += [(p_f.grad, p_l.grad, {}), (p_f.detach(), p_l.detach(), loose)]
            fused_state = state_tensors(fused_opt, p_f)
            for k, expected in state_tensors(forloop_opt, p_l).items():
                tol = loose if k in ("exp_avg_sq", "max_exp_avg_sq") else {}
                pairs.append((fused_state[k], expected, tol))
        history.append([actual.clone() for actual, _, _ in pairs])
        for actual, expected, tol in pairs:
            diff = close(actual, expected, **tol)
            assert diff is None, diff
            actual.copy_(expected.reshape(actual.shape))
    return history


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_step"])
@pytest.mark.parametrize("optim", list(FUSED_OPTIMS))
def test_fused_optimizer_against_forloop(device, optim, unscale_first):
    if optim == "Adagrad" and device == "cuda" and not ADAGRAD_FUSED_CUDA:
        pytest.skip(
            f"Adagrad(fused=True) on CUDA needs torch >= 2.12 (this is {torch.__version__})"
        )
    each_scaler(probe_fused_against_forloop, device, FUSED_OPTIMS[optim], unscale_first)
