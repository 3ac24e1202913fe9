"""Pure-PyTorch specification of the ampfused ops: slow, obvious, and shared by tests,
benchmarks and anyone who wants to know exactly what an op computes.

Each function equals its namesake in :mod:`ampfused.ops` bit for bit on non-overlapping
gradients (overlapping ones are covered by the ops' own tests).
"""

from __future__ import annotations

import math

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


# ----------------------------------------------------------------------------- the scaler's state
# GradScaler's state as a list (ops.STATE_FIELDS): [scale, growth_tracker, hysteresis_left, steps,
# skipped_steps, consecutive_skips, growths, backoffs, floor_hits], the scale a Python float
# holding a float32 value, the rest Python ints.  The ops keep it in an int32 tensor.


def _f32(x: float) -> float:
    """x rounded to float32 (to +-inf beyond its range), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


def _wrap32(x: int) -> int:
    """x modulo 2**32, as an int32: the counters wrap instead of overflowing."""
    return (x + 2**31) % 2**32 - 2**31


def update_state(
    state: list[int | float],
    found: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float = float("-inf"),
    max_scale: float = float("inf"),
    hysteresis: int = 1,
) -> list[int | float]:
    """The scaler's state after one iteration: the rule of ``scaler_pass_`` and ``scaler_update_``.

    ``torch._amp_update_scale_`` (see :func:`update_rule`) with three additions, none of which
    changes anything at their defaults (-inf, inf, 1):

    * hysteresis (apex's ``update_scale_hysteresis``): an iteration that found inf/NaN uses up one
      of ``hysteresis_left`` (down to 0) and backs the scale off only when none is left, so the
      scale backs off on the ``hysteresis``-th overflowing iteration in a row and on every one
      after it; a clean iteration refills ``hysteresis_left`` to ``hysteresis``.  Every
      overflowing iteration resets the growth tracker, backing off or not.
    * min_scale: a backoff that would go below it stops there, or stays where it is when the scale
      already was below (an overflow never raises the scale); that counts as a floor hit.
    * max_scale: a growth that would go above it stops there, or stays where it is when the scale
      already was above (a clean iteration never lowers the scale).

    min_scale and max_scale are compared in float32, as the kernels hold them.  The counters
    (int32, wrapping): steps +1 every iteration; skipped_steps +1 and consecutive_skips +1 when
    found, consecutive_skips back to 0 when clean; growths / backoffs +1 when the scale went up /
    down; floor_hits +1 on a floor hit.
    """
    scale, tracker, left, steps, skipped, consecutive, growths, backoffs, floor_hits = state
    scale = _f32(float(scale))
    low, high = _f32(min_scale), _f32(max_scale)
    new_scale, floor_hit = scale, False
    if found:
        tracker = 0
        left = max(left - 1, 0)
        if left == 0:
            new_scale = _f32(scale * backoff_factor)
            if new_scale < low:
                new_scale, floor_hit = min(scale, low), True
    else:
        left = hysteresis
        tracker = _wrap32(tracker + 1)
        if tracker == growth_interval:
            tracker = 0
            grown = _f32(scale * growth_factor)
            if math.isfinite(grown):  # a growth that overflows float32 keeps the scale
                new_scale = grown if grown <= high else max(scale, high)
    return [
        new_scale,
        tracker,
        left,
        _wrap32(steps + 1),
        _wrap32(skipped + found),
        _wrap32(consecutive + 1) if found else 0,
        _wrap32(growths + (new_scale > scale)),
        _wrap32(backoffs + (new_scale < scale)),
        _wrap32(floor_hits + floor_hit),
    ]


def state_to_list(state: Tensor) -> list[int | float]:
    """An int32 state tensor as :func:`update_state` takes it."""
    return [state[0:1].view(torch.float32).item(), *state[1:].tolist()]


def state_from_list(values: list[int | float], into: Tensor) -> None:
    """Writes :func:`update_state`'s list into an int32 state tensor."""
    into[0:1].view(torch.float32).fill_(values[0])
    into[1:].copy_(torch.tensor(values[1:], dtype=torch.int32))


def _update_into(next_state: Tensor, state: Tensor, found: bool, *policy: float | int) -> None:
    state_from_list(update_state(state_to_list(state), found, *policy), next_state)


def scaler_update_(
    found_inf: Tensor,
    state: Tensor,
    next_state: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float = float("-inf"),
    max_scale: float = float("inf"),
    hysteresis: int = 1,
) -> None:
    policy = (growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis)
    # nonzero is found, NaN included, as torch's `if (*found_inf)`
    _update_into(next_state, state, found_inf.item() != 0, *policy)


def scaler_pass_(
    grads: list[Tensor],
    found_inf: Tensor,
    state: Tensor,
    next_state: Tensor,
    grad_stats: Tensor | None,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float = float("-inf"),
    max_scale: float = float("inf"),
    hysteresis: int = 1,
    check_only: bool = False,
    accumulate: bool = False,
) -> None:
    """:func:`unscale_update_scale_` over the whole state, by :func:`update_state`.  grad_stats
    is not written here (its specification is separate)."""
    found = _any_non_finite(grads)
    if not check_only:
        _unscale_(grads, float(inv_scale_of(state[0:1].view(torch.float32)).item()))
    found_inf.fill_(1.0 if found else 0.0)
    if not accumulate or found:
        policy = (growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis)
        _update_into(next_state, state, found, *policy)
