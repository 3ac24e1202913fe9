"""Pure-PyTorch specification of the ampfused ops: slow, obvious, and shared by tests,
benchmarks and anyone who wants to know exactly what an op computes.

Each function equals its namesake in :mod:`ampfused.ops` bit for bit on non-overlapping
gradients (overlapping ones are covered by the ops' own tests).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _any_non_finite(grads: list[Tensor]) -> bool:
    return any(not bool(torch.isfinite(g.to(_opmath(g.dtype))).all()) for g in grads if g.numel())


def _unscale_(grads: list[Tensor], inv_scale: float) -> None:
    for g in grads:
        if g.numel() == 0:
            continue
        v = g.to(_opmath(g.dtype))
        if inv_scale != 1.0:
            v = v * torch.tensor(inv_scale, dtype=torch.float32).to(v.dtype)
        g.copy_(v)


def inv_scale_of(scale: Tensor) -> Tensor:
    """float32(1 / float64(scale)), exactly how torch.amp.GradScaler derives inv_scale."""
    return scale.double().reciprocal().float()


def update_rule(
    scale: float,
    growth_tracker: int,
    found: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[float, int]:
    """``torch._amp_update_scale_`` on Python numbers; the scale is rounded to float32."""

    def f32(x: float) -> float:
        return torch.tensor(x, dtype=torch.float32).item()

    if found:
        return f32(scale * backoff_factor), 0
    successful = growth_tracker + 1
    if successful == growth_interval:
        grown = f32(scale * growth_factor)
        return (grown if abs(grown) != float("inf") and grown == grown else f32(scale)), 0
    return f32(scale), successful


def non_finite_check_and_unscale_(
    grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    if _any_non_finite(grads):
        found_inf.fill_(1.0)
    _unscale_(grads, float(inv_scale.item()))


def non_finite_check_(grads: list[Tensor], found_inf: Tensor) -> None:
    if _any_non_finite(grads):
        found_inf.fill_(1.0)


def unscale_update_scale_(
    grads: list[Tensor],
    found_inf: Tensor,
    scale: Tensor,
    growth_tracker: Tensor,
    next_scale: Tensor,
    next_growth_tracker: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    check_only: bool = False,
    accumulate: bool = False,
) -> None:
    found = _any_non_finite(grads)
    if not check_only:
        _unscale_(grads, float(inv_scale_of(scale).item()))
    found_inf.fill_(1.0 if found else 0.0)
    if not accumulate or found:
        s, t = update_rule(
            float(scale.item()),
            int(growth_tracker.item()),
            found,
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        next_scale.fill_(s)
        next_growth_tracker.fill_(t)
