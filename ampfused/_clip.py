"""Fused unscale + clip: ``GradScaler.clip_grad_norm_`` (its contract is in its docstring).

For norm_type 2 and inf on one device, the pass that checks the gradients for inf/NaN also
writes their statistics table (:mod:`ampfused._grad_pass`); ``ops.clip_factor_`` turns the
table into the total norm and one factor, ``inv_scale * clip_coef``, and a second pass multiplies
every gradient by it.  Every other case (other norms, an inf norm with an empty gradient, which
torch refuses, gradients on several devices or of tensor subclasses, sharded statistics) takes
``unscale_`` + ``torch.nn.utils.clip_grad_norm_``: correct, not fused.
"""

from __future__ import annotations

from typing import Any

import torch

from ampfused import _C, _grad_pass, ops
from ampfused._arguments import check_clip_optimizer
from ampfused._grad_pass import flat_params, group_index, read_param_groups
from ampfused._scale_state import READ_ONLY_PASS, unit_state
from ampfused._torch_private import OptState
from ampfused.master_weights import MasterWeights

__all__ = ["clip_grad_norm_"]

_INF = float("inf")
_TABLE_NORMS = (2.0, _INF)  # the norms clip_factor_ computes from the pass's statistics


def clip_grad_norm_(
    scaler: Any, optimizer: Any, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    # torch.nn.utils.clip_grad_norm_ takes the parameters where this takes the optimizer: refused
    # before anything is read or recorded (the stage table is keyed by the argument's id).
    check_clip_optimizer(optimizer, max_norm)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not scaler._enabled:
        if isinstance(optimizer, MasterWeights):
            optimizer._cast_stale()  # the masters' gradients, as step() would take them
        return torch.nn.utils.clip_grad_norm_(
            flat_params(read_param_groups(optimizer)), max_norm, norm_type, error_if_nonfinite
        )
    scaler._check_scale_growth_tracker("clip_grad_norm_")
    optimizer_state = scaler._per_optimizer_states[id(optimizer)]
    if optimizer_state["stage"] is OptState.STEPPED:
        raise RuntimeError(
            "clip_grad_norm_() is being called after step(). Clip before step(): "
            "scaler.clip_grad_norm_(optimizer, max_norm), then scaler.step(optimizer)."
        )
    if optimizer_state["stage"] is OptState.READY and (
        isinstance(optimizer, MasterWeights) or scaler._island_set is not None
    ):
        # into the masters' float32 gradients (scale islands: each by its own factor), then
        # clip those
        scaler.unscale_(optimizer)
    unscaled = optimizer_state["stage"] is OptState.UNSCALED
    tables: list = []
    if norm_type not in _TABLE_NORMS or (
        norm_type == _INF and _any_empty_grad(read_param_groups(optimizer))
    ):
        found = None  # torch's clip (it refuses the inf norm of an empty gradient)
    elif unscaled:
        found = _unit_pass(scaler._scale.device, optimizer, tables)
    else:
        found = _grad_pass.found_inf(
            scaler,
            optimizer,
            check_only=True,
            allow_fp16=not scaler._scaling,
            tables=tables,
            caller_depth=1,  # (GradScaler.clip_grad_norm_, then this function)
        )
    if found is not None and not unscaled:
        optimizer_state["found_inf_per_device"] = found
        optimizer_state["stage"] = OptState.UNSCALED
    dev = scaler._scale.device
    if found is None or len(tables) != 1 or len(found) != 1 or tables[0][0].device != dev:
        return _clip_unfused(
            scaler,
            optimizer,
            optimizer_state,
            found is not None and not unscaled,
            max_norm,
            norm_type,
            error_if_nonfinite,
        )
    table, positions, groups = tables[0]
    total = torch.empty((), dtype=torch.float32, device=dev)
    factor = torch.empty((), dtype=torch.float32, device=dev)
    state = None
    if not unscaled:
        state = scaler._scale_state.pass_input(scaler._scale, scaler._growth_tracker)
    ops.clip_factor_(table, state, total, factor, max_norm, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        if not unscaled:  # torch raises after unscale_, before clipping
            _grad_pass.multiply_grads(scaler, groups, _grad_pass.inv_scale(scaler))
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            + _first_non_finite(scaler._watch, table, positions, groups, optimizer)
        )
    _grad_pass.multiply_grads(scaler, groups, factor)
    return total


def _any_empty_grad(groups: Any) -> bool:
    return any(p.grad is not None and p.grad.numel() == 0 for g in groups for p in g["params"])


def _unit_pass(dev: torch.device, optimizer: Any, tables: list) -> dict | None:
    """A read-only pass with statistics over gradients already unscaled (scale 1, the
    scaler's state untouched); None where gradients need torch's walk."""
    unit = unit_state(dev)
    groups = read_param_groups(optimizer)
    result = _C.fused_pass(groups, unit, torch.empty_like(unit), *READ_ONLY_PASS, True, True)
    if result is None:
        return None
    for _, _, stats, positions in result:
        tables.append((stats, positions, groups))
    return {device: f for device, f, _, _ in result}


def _clip_unfused(
    scaler: Any,
    optimizer: Any,
    optimizer_state: dict[str, Any],
    checked: bool,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """unscale_ (or, after this call's read-only pass, the multiply it left out), then torch's
    clip_grad_norm_."""
    groups = read_param_groups(optimizer)
    if checked:
        _grad_pass.multiply_grads(scaler, groups, _grad_pass.inv_scale(scaler))
    elif optimizer_state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_(
        flat_params(groups), max_norm, norm_type, error_if_nonfinite
    )


def _first_non_finite(
    watch: Any, table: torch.Tensor, positions: torch.Tensor, groups: Any, optimizer: Any
) -> str:
    """' (first gradient with inf/NaN: <name>)' from a pass's table, or '' if no input was.
    A MasterWeights master is named by its model parameter (the one watch() knows)."""
    per_grad, _ = _C.reduce_grad_stats(table[1:].cpu(), positions[:, 1])
    bad = (per_grad[:, 2:5].sum(dim=1) > 0).nonzero()
    if bad.numel() == 0:
        return ""
    position = int(positions[int(bad[0, 0]), 0])
    param = flat_params(groups)[position]
    if isinstance(optimizer, MasterWeights):
        param = optimizer.model_params[position]
    name = watch.names.get(id(param)) if watch is not None else None
    if name is None:
        g, i = group_index(groups, position)
        name = f"optimizer.param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)})"
    return f" (first gradient with inf/NaN: {name})"
