"""A whole training step captured in a CUDA graph, and the host syncs that would forbid it.

``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` with an optimizer that
unscales and skips on the device (``fused=True``; ``capturable=True`` so that torch lets its
step be captured) runs without a host sync, so ``torch.cuda.graph`` can capture it.  The CUDA
test replays the captured step and checks it against the same steps run eagerly, skipped steps
included.  Without a GPU, the CPU test checks the same route for every Python-level sync.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampfused

SCALER_KW: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}


# ------------------------------------------------------------------------------- CPU: no syncs
# (the no_host_sync fixture: conftest.py)
def _cpu_setup(
    opt_kw: dict[str, Any], iters: int = 4, policy: str = "torch"
) -> tuple[nn.Module, Any, Any, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, **opt_kw)
    scaler = ampfused.GradScaler("cpu", policy=policy, **SCALER_KW)
    data = [torch.randn(4, 6) for _ in range(iters)]
    return model, opt, scaler, data


def _run(model: nn.Module, opt: Any, scaler: Any, data: list, unscale: bool) -> None:
    for i, x in enumerate(data):
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if i == 1:
            model[0].weight.grad[0, 0] = float("inf")  # a skipped step and a backoff
        if unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("policy", ["torch", "headroom"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_clip_step"])
def test_fused_optimizer_route_never_syncs(no_host_sync: None, unscale: bool, policy: str) -> None:
    """scale, backward, unscale_ (+ clip), step with AdamW(fused=True) and update: no call that
    reads a tensor on the host, over iterations with growth and an inf; the headroom policy's
    measured update (with activations traced) included."""
    model, opt, scaler, data = _cpu_setup({"fused": True}, policy=policy)
    if policy == "headroom":
        scaler.watch(model, activations=True)
    _run(model, opt, scaler, data, unscale)


def test_ordinary_optimizer_route_syncs(no_host_sync: None) -> None:
    # The control: an ordinary optimizer's step is decided on the host (found_inf.item()), so
    # the patched calls above do catch a sync when there is one.
    model, opt, scaler, data = _cpu_setup({})
    with pytest.raises(AssertionError, match="Tensor.item called"):
        _run(model, opt, scaler, data, False)


# ------------------------------------------------------------------------------- CUDA graphs
SHAPES = [(1000,), (37, 5), (3,), (4, 64)]  # sizes off the vector width, a tail, a tiny one
REPLAYS, POISONED = 8, (1, 5)  # replays that get an inf through the static input


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES)

    def loss(self, xs: list[torch.Tensor], poison: torch.Tensor) -> torch.Tensor:
        # Elementwise math and plain sums (no matmul whose algorithm could differ under
        # capture); (1 + poison) is exactly 1 unless poison is inf.
        total = sum((p * x).square().sum() for p, x in zip(self.ps, xs, strict=True))
        return total * (1 + poison)


def _cuda_step(model: _Model, opt: Any, scaler: Any, xs: list, poison: Any, unscale: bool) -> None:
    scaler.scale(model.loss(xs, poison)).backward()
    if unscale:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    scaler.step(opt)
    scaler.update()


def _make(opt_cls: type, seed: int = 0, policy: str = "torch") -> tuple[_Model, Any, Any]:
    torch.manual_seed(seed)
    model = _Model()
    opt = opt_cls(model.parameters(), lr=0.01, fused=True, capturable=True)
    return model, opt, ampfused.GradScaler("cuda", policy=policy, **SCALER_KW)


def _assert_same_state(a: tuple, b: tuple, replay: int) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    for i, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters(), strict=True)):
        assert torch.equal(pa, pb), f"replay {replay}: parameter {i} differs"
    for i, (sta, stb) in enumerate(zip(oa.state.values(), ob.state.values(), strict=True)):
        for k in sta:
            assert torch.equal(sta[k], stb[k]), f"replay {replay}: state {i} {k!r} differs"
    assert torch.equal(sa._scale, sb._scale), f"replay {replay}: scale {sa._scale} {sb._scale}"
    assert torch.equal(sa._growth_tracker, sb._growth_tracker), f"replay {replay}: tracker"
    # (the counters, and the headroom policy's magnitude, ceiling and history)
    assert torch.equal(sa._scale_state.tensor, sb._scale_state.tensor), f"replay {replay}: state"


def _churn_launch_tables() -> None:
    # New gradient lists fill the op's launch-table cache and reuse freed device memory: a
    # table the captured launch baked in must survive this.
    found, inv = torch.zeros((), device="cuda"), torch.ones((), device="cuda")
    for n in range(1, 40):
        ampfused.ops.non_finite_check_and_unscale_(
            [torch.randn(n * 7 + k, device="cuda") for k in range(n % 5 + 1)], found, inv
        )


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["torch", "headroom"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_clip_step"])
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_captured_training_step_replays_like_eager(
    opt_cls: type, unscale: bool, policy: str
) -> None:
    captured, eager = _make(opt_cls, policy=policy), _make(opt_cls, policy=policy)
    static_xs = [torch.zeros(s, device="cuda") for s in SHAPES]
    static_poison = torch.zeros((), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)

    def next_inputs(poisoned: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        xs = [torch.randn(s, device="cuda", generator=gen) for s in SHAPES]
        return xs, torch.full((), float("inf") if poisoned else 0.0, device="cuda")

    # Warm-up on a side stream (torch's rule before capture): creates the scale, the optimizer
    # state and the gradients; the eager twin takes the same steps.  One of them runs with
    # sync debugging set to error, so a host sync anywhere on the route fails here.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in range(3):
            xs, poison = next_inputs(poisoned=False)
            for x, s in zip(xs, static_xs, strict=True):
                s.copy_(x)
            static_poison.copy_(poison)
            for model, opt, scaler in (captured, eager):
                opt.zero_grad(set_to_none=True)
                if w == 2:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    inputs = (static_xs, static_poison) if model is captured[0] else (xs, poison)
                    _cuda_step(model, opt, scaler, *inputs, unscale)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    _assert_same_state(captured, eager, -1)

    # Gradients are made inside the graph (set_to_none), so every replay writes fresh ones.
    model, opt, scaler = captured
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _cuda_step(model, opt, scaler, static_xs, static_poison, unscale)

    scales = []
    for r in range(REPLAYS):
        xs, poison = next_inputs(poisoned=r in POISONED)
        for x, s in zip(xs, static_xs, strict=True):
            s.copy_(x)
        static_poison.copy_(poison)
        graph.replay()
        eager[1].zero_grad(set_to_none=True)
        _cuda_step(*eager, xs, poison, unscale)
        torch.cuda.synchronize()
        _assert_same_state(captured, eager, r)
        scales.append(scaler._scale.item())
        _churn_launch_tables()
    # The replays must have skipped steps (and, by torch's rule, grown the scale again), or this
    # tests less than it says.  (The headroom policy holds the backed-off scale for 16 steps.)
    assert scales[POISONED[0]] < scales[POISONED[0] - 1], scales
    if policy == "torch":
        assert max(scales[POISONED[0] :]) > scales[POISONED[0]], scales
