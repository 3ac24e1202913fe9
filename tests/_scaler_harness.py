"""The parity harness of the GradScaler tests: ``ampfused.GradScaler`` against
``torch.amp.GradScaler``, step for step, bit for bit.

Used by test_grad_scaler.py (the drop-in protocol), test_scale_state.py (the scale state and its
checkpoints), test_grad_pass.py (the pass over the gradients) and test_scaler_scenarios.py.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampfused
import ampfused._scale_state

TorchScaler = torch.amp.GradScaler
FusedScaler = ampfused.GradScaler
SCALERS = (TorchScaler, FusedScaler)

VOCAB, D_IN, D_HID, D_OUT, BATCH = 20, 16, 32, 8, 8
ITERS = 10
# init_scale 2**20 with float16 autocast: the first steps overflow and back off, then the scale
# grows every growth_interval clean steps until it overflows again.
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**20, "growth_interval": 2}
INF_ITER, NAN_ITER = 3, 8  # iterations that get an injected inf / NaN gradient


# ------------------------------------------------------------------------------- comparison
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a dense tensor (so NaN == NaN with the same payload, and -0.0 != 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "value") -> None:
    """Bitwise equality of (nested dicts/lists/tuples of) tensors and Python values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (
            f"{path}: {type(a).__name__} vs {type(b).__name__}"
        )
        meta_a = (a.dtype, tuple(a.shape), a.layout, a.device)
        meta_b = (b.dtype, tuple(b.shape), b.layout, b.device)
        assert meta_a == meta_b, f"{path}: {meta_a} vs {meta_b}"
        if a.is_sparse:
            assert a.is_coalesced() == b.is_coalesced(), f"{path}: is_coalesced differs"
            assert_same(a._indices(), b._indices(), f"{path}._indices()")
            assert_same(a._values(), b._values(), f"{path}._values()")
            return
        assert torch.equal(_bits(a), _bits(b)), f"{path} differs:\n torch: {a}\n ampfused: {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), (
            f"{path}: keys {list(a)} vs {list(b) if isinstance(b, dict) else b!r}"
        )
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: nan vs {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


# ------------------------------------------------------------------------------- harness
@dataclass
class Side:
    """One side of a parity run: models, optimizers and a scaler, built from the same seed."""

    scaler: torch.amp.GradScaler
    models: list[nn.Module]
    opts: list[torch.optim.Optimizer]
    device: str
    log: list[Any] = field(default_factory=list)

    @property
    def model(self) -> nn.Module:
        return self.models[0]

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.opts[0]


Build = Callable[[str], tuple[list[nn.Module], list[torch.optim.Optimizer]]]


def make_sides(device: str, build: Build, classes=SCALERS, **scaler_kw: Any) -> list[Side]:
    sides = []
    for cls in classes:
        torch.manual_seed(0)
        models, opts = build(device)
        sides.append(Side(cls(device, **scaler_kw), models, opts, device))
    return sides


def torch_state_dict(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """scaler.state_dict() less ampfused's own entry (policy and counters, which torch's scaler
    does not have; tests/test_scale_policy.py checks it): what must equal torch's."""
    state = scaler.state_dict()
    state.pop(ampfused._scale_state.CHECKPOINT_KEY, None)
    return state


def scaler_state(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    return {
        "_scale": getattr(scaler, "_scale", None),
        "_growth_tracker": getattr(scaler, "_growth_tracker", None),
        "state_dict": torch_state_dict(scaler),
        "is_enabled": scaler.is_enabled(),
    }


def snapshot(side: Side) -> dict[str, Any]:
    params = [p for m in side.models for p in m.parameters()]
    opt_state = []
    for opt in side.opts:
        for group in opt.param_groups:
            for p in group["params"]:
                opt_state.append(dict(opt.state.get(p, {})))
    return {
        "params": params,
        "grads": [p.grad for p in params],
        "optimizer_state": opt_state,
        "scaler": scaler_state(side.scaler),
    }


def compare_sides(sides: list[Side], where: str) -> None:
    ref = snapshot(sides[0])
    for side in sides[1:]:
        assert_same(ref, snapshot(side), f"{where}, {type(side.scaler).__module__}")


StepFn = Callable[[Side, int], Any]


def lockstep(sides: list[Side], train_step: StepFn, iters: range | int = ITERS) -> list[Any]:
    """Runs train_step(side, i) for every side, comparing everything after each iteration.
    Returns what train_step returned on the first side, iteration by iteration."""
    history = []
    for i in range(iters) if isinstance(iters, int) else iters:
        outs = [train_step(side, i) for side in sides]
        for side, out in zip(sides[1:], outs[1:], strict=True):
            assert_same(outs[0], out, f"iteration {i}: train_step of {type(side.scaler)}")
        compare_sides(sides, f"after iteration {i}")
        history.append(outs[0])
    return history


def batch(i: int, device: str, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(n, D_IN, generator=g)
    idx = torch.randint(0, VOCAB, (n,), generator=g)
    y = torch.randn(n, D_OUT, generator=g)
    return x.to(device), idx.to(device), y.to(device)


class Net(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_IN, sparse=sparse)
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_HID)
        self.head = nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = x + self.emb(idx)
        h = F.relu(self.fc1(h))
        h = F.relu(self.fc2(h))
        return self.head(h)


def forward_loss(model: nn.Module, i: int, device: str, dtype=torch.float16, scale=1.0):
    x, idx, y = batch(i, device)
    with torch.autocast(device_type=device, dtype=dtype):
        out = model(x * scale, idx)
    return F.mse_loss(out.float(), y)


def inject_specials(model: nn.Module, i: int) -> None:
    """An inf in one weight gradient in INF_ITER, a NaN in the last gradient in NAN_ITER."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and not p.grad.is_sparse]
    with torch.no_grad():
        if i == INF_ITER:
            grads[1].view(-1)[3] = float("inf")
        if i == NAN_ITER:
            grads[-1].view(-1)[-1] = float("nan")


def device_key(device: str) -> torch.device:
    """The key both scalers file a device's found_inf under: a gradient's ``.device``.  That is
    ``cuda:0`` (the current index) for ``"cuda"``, a different key from ``torch.device("cuda")``."""
    return torch.empty(0, device=device).device


def found_infs(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> float:
    return sum(float(v) for v in scaler._found_inf_per_device(opt).values())


def mid_iteration(scaler: torch.amp.GradScaler, opts: list[torch.optim.Optimizer]) -> dict:
    """What a user can observe between step() and update()."""
    return {
        "get_scale": scaler.get_scale(),
        "_scale": scaler._scale.clone(),
        "_growth_tracker": scaler._growth_tracker.clone(),
        # cloned: torch's update() sums the found_inf tensors into the first one, in place
        "found_inf_per_device": [
            {dev: f.clone() for dev, f in scaler._found_inf_per_device(o).items()} for o in opts
        ],
        "stage": [scaler._per_optimizer_states[id(o)]["stage"] for o in opts],
        "fused_attrs_left": [hasattr(o, "grad_scale") or hasattr(o, "found_inf") for o in opts],
    }


def spy_step(opt: torch.optim.Optimizer) -> list[dict]:
    """Records what optimizer.step() sees of the fused-optimizer protocol (grad_scale and
    found_inf attributes), by value.  Remove with `del opt.step`."""
    seen: list[dict] = []
    inner = opt.step

    def step(*args, **kwargs):
        rec = {}
        for name in ("grad_scale", "found_inf"):
            v = getattr(opt, name, "absent")
            rec[name] = v.clone() if isinstance(v, torch.Tensor) else v
        seen.append(rec)
        return inner(*args, **kwargs)

    opt.step = step  # type: ignore[method-assign]
    return seen


def scaler_step(scaler, opt, *args, **kwargs) -> tuple[Any, list[dict]]:
    seen = spy_step(opt)
    try:
        ret = scaler.step(opt, *args, **kwargs)
    finally:
        del opt.step
    return ret, seen


def make_train_step(
    dtype=torch.float16,
    *,
    inject: bool = True,
    unscale_first: bool = False,
    set_to_none: bool = True,
    between: Callable[[Side, int], Any] | None = None,
) -> StepFn:
    """The canonical AMP iteration on side.model/side.opt; `between(side, i)` runs between
    step() and update()."""

    def train_step(side: Side, i: int) -> dict:
        model, opt, scaler = side.model, side.opt, side.scaler
        opt.zero_grad(set_to_none=set_to_none)
        loss = forward_loss(model, i, side.device, dtype)
        scaler.scale(loss).backward()
        if inject:
            inject_specials(model, i)
        if unscale_first:
            scaler.unscale_(opt)
        ret, seen = scaler_step(scaler, opt)
        out = {"loss": loss.detach(), "step_returned": ret, "seen_by_step": seen}
        out["mid"] = mid_iteration(scaler, [opt])
        out["found"] = found_infs(scaler, opt)
        if between is not None:
            out["between"] = between(side, i)
        scaler.update()
        out["scale_after_update"] = scaler.get_scale()
        return out

    return train_step


def assert_exercised_skip_and_growth(history: list[dict], natural_overflow: bool) -> None:
    """Guards against a parity test that compares nothing interesting."""
    found = [h["found"] for h in history]
    assert found[INF_ITER] and found[NAN_ITER], "injected specials were not detected"
    if natural_overflow:
        natural = [f for i, f in enumerate(found) if i not in (INF_ITER, NAN_ITER)]
        assert any(natural), "no natural float16 overflow happened"
    scales = [h["mid"]["get_scale"] for h in history] + [history[-1]["scale_after_update"]]
    steps = list(zip(scales[:-1], scales[1:], strict=True))
    assert any(b > a for a, b in steps), f"the scale never grew: {scales}"
    assert any(b < a for a, b in steps), f"the scale never backed off: {scales}"


def _sgd_momentum(params, **kw) -> torch.optim.SGD:
    # torch's fused SGD allocates momentum buffers with empty_like on its first step and leaves
    # them uninitialized when that step is skipped for inf/NaN (with either scaler), so both sides
    # would train on garbage.  Zero buffers up front give the same math and defined memory.
    params = list(params)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, **kw)
    for p in params:
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return opt


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": _sgd_momentum,
    "adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-2, **kw),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw),
}


IMPLS: dict[str, dict[str, bool]] = {
    "forloop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def build_net(opt_name: str = "sgd", impl: str = "forloop", sparse: bool = False) -> Build:
    def build(device: str):
        model = Net(sparse=sparse).to(device)
        return [model], [OPTIMIZERS[opt_name](model.parameters(), **IMPLS[impl])]

    return build


def found_from(h: dict) -> float:
    return sum(float(v) for d in h["mid"]["found_inf_per_device"] for v in d.values())


def build_three(device: str):
    m0, m1, m2 = (Net().to(device) for _ in range(3))
    opts = [
        torch.optim.SGD(m0.parameters(), lr=0.05, momentum=0.9),
        torch.optim.Adam(m1.parameters(), lr=1e-2, foreach=True),
        torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True),
    ]
    return [m0, m1, m2], opts


def multi_step(hook: Callable[[Side, int], None] | None = None) -> StepFn:
    """Three models, three optimizers (for-loop, foreach, fused), two losses on one scaler.
    Single models overflow in some iterations (model 1 in iteration 1, model 2, whose fused
    optimizer is unscaled first, in iteration 4): torch steps the other optimizers, skips that
    one, and backs the scale off.  hook(side, i) runs between the first two steps."""

    def train_step(side: Side, i: int) -> dict:
        m0, m1, m2 = side.models
        for o in side.opts:
            o.zero_grad()
        x, idx, y = batch(i, side.device)
        with torch.autocast(device_type=side.device, dtype=torch.float16):
            o0, o1, o2 = m0(x, idx), m1(x, idx), m2(x, idx)
            loss0 = F.mse_loss((0.3 * o0 + 0.7 * o1).float(), y)
            loss1 = F.mse_loss((0.6 * o0 - 0.4 * o2).float(), y)
        side.scaler.scale(loss0).backward(retain_graph=True)
        side.scaler.scale(loss1).backward()
        with torch.no_grad():
            if i == 1:  # the middle optimizer's pass finds it
                m1.fc2.weight.grad[1, 1] = float("inf")
            if i == 4:  # the first pass finds it, the later passes must not erase it
                m2.head.bias.grad[0] = float("nan")
        side.scaler.unscale_(side.opts[2])  # one separately unscaled, fused optimizer
        rets = [scaler_step(side.scaler, side.opts[0])]
        if hook is not None:
            hook(side, i)
        rets += [scaler_step(side.scaler, o) for o in side.opts[1:]]
        out = {"rets": rets, "mid": mid_iteration(side.scaler, side.opts)}
        out["found"] = [found_infs(side.scaler, o) for o in side.opts]
        side.scaler.update()
        return out

    return train_step


def _prepared(side: Side, i: int = 0) -> None:
    side.opt.zero_grad()
    side.scaler.scale(forward_loss(side.model, i, side.device)).backward()
