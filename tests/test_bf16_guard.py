"""``GradScaler(scaling=False)``: the bf16 guard.

bf16 training needs no loss scaling but still wants steps with inf/NaN gradients skipped.  With
``scaling=False`` the scale stays 1.0, every pass is the read-only check (gradients are never
written), a step with inf/NaN is skipped, and the fused-optimizer route has no host sync.  The
reference is the loop people write by hand: check the gradients, step only when all are finite.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import ampfused

# Iterations whose gradients get an inf/NaN injected, and where.
BAD = {2: ("inf", 0), 3: ("nan", -1), 6: ("-inf", 0)}


def _model(dtype: torch.dtype, device: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return model.to(device=device, dtype=dtype)


def _inject(model: nn.Module, i: int) -> None:
    if i in BAD:
        kind, which = BAD[i]
        params = list(model.parameters())
        params[which].grad.view(-1)[1] = float(kind)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.itemsize == 2 else torch.int32)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _by_hand(model: nn.Module, opt: Any, data: list[torch.Tensor]) -> list[bool]:
    stepped = []
    for i, x in enumerate(data):
        opt.zero_grad()
        _loss(model, x).backward()
        _inject(model, i)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        if finite:
            opt.step()
        stepped.append(finite)
    return stepped


def _guarded(model: nn.Module, opt: Any, data: list[torch.Tensor], unscale: bool) -> list[bool]:
    scaler = ampfused.GradScaler(model[0].weight.device.type, scaling=False)
    stepped = []
    for i, x in enumerate(data):
        opt.zero_grad()
        scaler.scale(_loss(model, x)).backward()
        _inject(model, i)
        if unscale:
            before = [(p.grad.clone(), p.grad._version) for p in model.parameters()]
            scaler.unscale_(opt)
            for (b, version), p in zip(before, model.parameters(), strict=True):  # never written
                assert torch.equal(_bits(b), _bits(p.grad))
                assert p.grad._version == version
        scaler.step(opt)
        scaler.update()
        stepped.append(not scaler.step_skipped())
        assert scaler.get_scale() == 1.0
    return stepped


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, foreach=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
}


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_step"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_guard_equals_skipping_by_hand(
    device: str, dtype: torch.dtype, opt_name: str, unscale: bool
) -> None:
    ref = _model(dtype, device)
    ours = copy.deepcopy(ref)
    opt_ref = OPTIMIZERS[opt_name](ref.parameters())
    opt_ours = OPTIMIZERS[opt_name](ours.parameters())
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(5, 8, generator=gen).to(device=device, dtype=dtype) for _ in range(8)]
    expected = _by_hand(ref, opt_ref, data)
    assert expected == [i not in BAD for i in range(8)]
    assert _guarded(ours, opt_ours, data, unscale) == expected
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(opt_ref.state.values(), opt_ours.state.values(), strict=True):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


def test_guard_takes_fp16_gradients_without_writing_them() -> None:
    """Nothing is unscaled, so float16 gradients are no risk and are not refused."""
    model = _model(torch.float16, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampfused.GradScaler("cpu", scaling=False)
    scaler.scale(_loss(model, torch.randn(3, 8, dtype=torch.float16))).backward()
    scaler.unscale_(opt)  # a scaling scaler raises "Attempting to unscale FP16 gradients"
    scaler.step(opt)
    scaler.update()
    assert not scaler.step_skipped()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        s = ampfused.GradScaler("cpu")
        opt.zero_grad()
        s.scale(_loss(model, torch.randn(3, 8, dtype=torch.float16))).backward()
        s.unscale_(opt)


def test_guard_scale_never_moves_and_checkpoints_as_torch_reads_them() -> None:
    model = _model(torch.float32, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampfused.GradScaler("cpu", growth_interval=1, scaling=False)
    for i in range(4):
        opt.zero_grad()
        scaler.scale(_loss(model, torch.randn(3, 8))).backward()
        _inject(model, i + 1)  # iterations 1 and 2 overflow, others grow at interval 1
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 1.0
    state = scaler.state_dict()
    assert (state["scale"], state["growth_factor"], state["backoff_factor"]) == (1.0, 1.0, 1.0)
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(state)
    assert torch_scaler.get_scale() == 1.0


def test_guard_fused_optimizer_never_syncs(no_host_sync: None) -> None:
    model = _model(torch.bfloat16, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = ampfused.GradScaler("cpu", scaling=False)
    for i in range(4):
        opt.zero_grad()
        scaler.scale(_loss(model, torch.randn(3, 8, dtype=torch.bfloat16))).backward()
        _inject(model, i)
        scaler.step(opt)
        scaler.update()
        scaler.step_skipped_tensor()  # the flag is there without a sync


def test_scaling_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="scaling must be True or False"):
        ampfused.GradScaler("cpu", scaling="no")  # type: ignore[arg-type]
