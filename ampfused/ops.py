"""Typed Python faces of the ``torch.ops.ampfused`` ops, with their fake (meta) kernels.

Contracts in full: ``csrc/unscale.h``; executable specification: :mod:`ampfused.reference`.
Every op is one kernel launch on CUDA for the whole list (any count, float16/bfloat16/float32/
float64 mixed), never syncs with the host, and accepts non-dense gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.compiler import is_compiling

from ampfused import _C, _extension

_extension.require("ampfused.ops")  # the ops below are the compiled kernels'

__all__ = [
    "non_finite_check_and_unscale_",
    "non_finite_check_",
    "unscale_update_scale_",
    "scaler_pass_",
    "scaler_update_",
    "clip_factor_",
    "unscale_into_",
    "grad_stats_rows",
    "STATE_SIZE",
    "STAT_FIELDS",
    "CHUNK_SIZE",
]

# The scaler's int32 state (ScalerState in csrc/unscale_math.h): element 0 holds the float32
# scale's bits, then the growth tracker, hysteresis left and the counters, in this order, then
# the headroom policy's: the iteration's measured magnitude and the ceiling (float32 bits), the
# clean iterations since the last backoff, HISTORY entries (float32 bits: caps, overflows'
# bounds negated) and the learned margin (float32 bits; 0: none learned).
HISTORY = 16
STATE_FIELDS = (
    "scale",
    "growth_tracker",
    "hysteresis_left",
    "steps",
    "skipped_steps",
    "consecutive_skips",
    "growths",
    "backoffs",
    "floor_hits",
    "magnitude",
    "ceiling",
    "since_backoff",
    *(f"history{i}" for i in range(HISTORY)),
    "margin",
)
STATE_SIZE = len(STATE_FIELDS)
# grad_stats columns (StatField): a header row (scale in force, step, found), then one row per
# CHUNK_SIZE elements of each gradient.
STAT_FIELDS = ("sum_squares", "abs_max", "pos_inf", "neg_inf", "nan", "zeros", "subnormal")
CHUNK_SIZE = 65536


def grad_stats_rows(grads: list[Tensor]) -> int:
    """Rows of the ``grad_stats`` table for ``grads``: the header, then ceil(numel / CHUNK_SIZE)
    per gradient."""
    return 1 + sum(-(-g.numel() // CHUNK_SIZE) for g in grads)


# Each op first tries its eager entry point in ampfused._C (csrc/python_module.cpp), which calls
# the op's typed handle with plain tensors as they are: ~0.3 us, where torch.ops boxes every
# argument for ~2 us.  For anything else (tensor subclasses, a None, a torch function mode) it
# returns NotImplemented and the call takes torch.ops (_call), as it does while torch.compile
# traces, which must see the op.


def _call(op, grads: list[Tensor], *args, out: list[Tensor] | None = None) -> None:
    # torch's schema parser rejects a None inside a Tensor[], or a tensor where the list goes,
    # with a RuntimeError; torch's own ops raise TypeError there.  Only the failing call pays
    # for the scan.
    try:
        if out is None:
            op(grads, *args)
        else:
            op(grads, out, *args)
    except RuntimeError:
        lists = [("grads", grads)] + ([("out", out)] if out is not None else [])
        for name, tensors in lists:
            if isinstance(tensors, Tensor):
                raise TypeError(
                    f"{name} must be a list of tensors, not a Tensor; pass [{name}] for a single "
                    "tensor"
                ) from None
            for i, g in enumerate(tensors):
                if g is None:
                    raise TypeError(
                        f"{name}[{i}] is None; pass only the gradients that exist "
                        "(leave parameters whose .grad is None out of the list)"
                        if name == "grads"
                        else f"out[{i}] is None; pass one float32 tensor per gradient"
                    ) from None
        raise


def non_finite_check_and_unscale_(
    grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    """Unscale ``grads`` in place and flag inf/NaN (torch's foreach check-and-unscale op).

    Args:
        grads: float16/bfloat16/float32/float64 tensors on one device; mutated: every element
            ``v`` becomes ``v if inv_scale == 1 else v * inv_scale`` (float math, double for
            float64), rounded to its dtype.
        found_inf: one-element float32 tensor on that device; set to 1.0 if any input element
            was inf or NaN, otherwise left as it was (zero it first).
        inv_scale: one-element float32 tensor on that device.

    In plain PyTorch: ``found_inf.fill_(1.0) if not all(torch.isfinite(g).all() for g in grads)``
    then ``torch._foreach_mul_(grads, inv_scale)``, except that torch's CUDA kernel rejects
    bfloat16 and launches once per dtype.
    """
    if is_compiling() or _C.non_finite_check_and_unscale_(grads, found_inf, inv_scale) is not None:
        _call(torch.ops.ampfused.non_finite_check_and_unscale_, grads, found_inf, inv_scale)


def non_finite_check_(grads: list[Tensor], found_inf: Tensor) -> None:
    """Flag inf/NaN in ``grads`` without writing them (reads each element once).

    Args:
        grads: float16/bfloat16/float32/float64 tensors on one device; not modified.
        found_inf: one-element float32 tensor; set to 1.0 if any element is inf or NaN,
            otherwise left as it was.

    In plain PyTorch: ``if not all(torch.isfinite(g).all() for g in grads): found_inf.fill_(1.0)``.
    """
    if is_compiling() or _C.non_finite_check_(grads, found_inf) is not None:
        _call(torch.ops.ampfused.non_finite_check_, grads, found_inf)


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
    """GradScaler's whole per-optimizer pass: unscale (or only check), then the scale update.

    Args:
        grads: as in :func:`non_finite_check_and_unscale_`; unscaled by
            ``inv_scale = float32(1 / float64(scale))`` unless ``check_only`` (then untouched).
        found_inf: one-element float32 tensor, overwritten with 1.0 (inf/NaN seen) or 0.0.
        scale: one-element float32 tensor; read only.
        growth_tracker: one-element int32 tensor; read only.
        next_scale, next_growth_tracker: one-element float32 / int32 tensors receiving the result
            of ``torch._amp_update_scale_`` applied to copies of (scale, growth_tracker): always
            when ``accumulate`` is False; only when inf/NaN was seen when it is True (so several
            passes of one iteration combine like torch's sum of found_inf values).
        growth_factor, backoff_factor, growth_interval: as in ``torch._amp_update_scale_``.
        check_only: read-only pass (no gradient is written).
        accumulate: this is not the first pass of the iteration (see next_scale).
    """
    args = (
        grads,
        found_inf,
        scale,
        growth_tracker,
        next_scale,
        next_growth_tracker,
        growth_factor,
        backoff_factor,
        growth_interval,
        check_only,
        accumulate,
    )
    if is_compiling() or _C.unscale_update_scale_(*args) is not None:
        _call(torch.ops.ampfused.unscale_update_scale_, *args)


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
    headroom: float = 0.0,
    islands: Sequence[int] = (),
    island_inv: Tensor | None = None,
) -> None:
    """ampfused.GradScaler's pass: :func:`unscale_update_scale_` over the scaler's whole state.

    Args:
        state, next_state: int32 tensors of ``STATE_SIZE`` elements (``STATE_FIELDS``); state is
            read, next_state receives the update (as next_scale/next_growth_tracker above) with
            min_scale/max_scale (a backoff or growth beyond them is held there), hysteresis (back
            off on that many consecutive overflowing iterations; a clean one refills it) and the
            counters.
        grad_stats: None, or a float64 ``[grad_stats_rows(grads), len(STAT_FIELDS)]`` tensor
            receiving the header and per-item statistics (:func:`ampfused.reference.grad_stats`
            defines each value).
        headroom: 0 for torch's rule; > 0 (from 1 to 65504) the headroom policy: the pass also
            measures the largest finite magnitude of the scaled values into
            ``next_state[magnitude]`` and the update reads it
            (:func:`ampfused.reference.update_state`); < 0: the same with a margin learned up
            to ``-headroom``.
        islands, island_inv: scale islands (:mod:`ampfused.scale_islands`): each gradient's
            island (0 for none, k >= 1 for island k; empty: none) and a 1-D float32 tensor on
            the gradients' device with island k's inverse factor 1 / f_k at k - 1.  A gradient
            of island k carries the scale times f_k (a power of two): it is multiplied by the
            pass's inverse scale times ``island_inv[k - 1]``, its statistics are of those truly
            unscaled values, and its measured magnitude is taken at the global scale (times
            ``island_inv[k - 1]``).
        The rest: as in :func:`unscale_update_scale_`.
    """
    args = (
        grads,
        found_inf,
        state,
        next_state,
        grad_stats,
        growth_factor,
        backoff_factor,
        growth_interval,
        min_scale,
        max_scale,
        hysteresis,
        check_only,
        accumulate,
        headroom,
        list(islands),
        island_inv,
    )
    if is_compiling() or _C.scaler_pass_(*args) is not None:
        _call(torch.ops.ampfused.scaler_pass_, *args)


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
    headroom: float = 0.0,
) -> None:
    """next_state from state by :func:`scaler_pass_`'s rule, with found_inf (nonzero: inf/NaN
    found) as the verdict: the update when the verdict was computed elsewhere.  The magnitude is
    the one next_state holds (where the passes, or an all-reduce, left it)."""
    torch.ops.ampfused.scaler_update_(
        found_inf,
        state,
        next_state,
        growth_factor,
        backoff_factor,
        growth_interval,
        min_scale,
        max_scale,
        hysteresis,
        headroom,
    )


def clip_factor_(
    grad_stats: Tensor,
    state: Tensor | None,
    total_norm: Tensor,
    factor: Tensor,
    max_norm: float,
    norm_type: float = 2.0,
) -> None:
    """The total norm of a pass's gradients and their clip factor, from the pass's statistics.

    Args:
        grad_stats: the table :func:`scaler_pass_` wrote (header row, then item rows).
        state: the scaler's state whose scale the table's pass unscaled by (the factor then
            includes ``1 / scale``), or None (the gradients are already unscaled).
        total_norm, factor: one-element float32 outputs: ``float32`` of the norm of order
            ``norm_type`` (2 or inf) of the unscaled gradients, and what to multiply the
            gradients by to unscale and clip them, ``inv_scale * min(max_norm / (total_norm +
            1e-6), 1)`` with torch's rounding (:func:`ampfused.reference.clip_factor_`).
    """
    torch.ops.ampfused.clip_factor_(grad_stats, state, total_norm, factor, max_norm, norm_type)


def unscale_into_(
    grads: list[Tensor], out: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    """Unscale low-precision gradients into float32 tensors, and flag inf/NaN (reads only grads).

    Args:
        grads: float16/bfloat16/float32 tensors on one device, each non-overlapping and dense;
            not modified.
        out: one float32 tensor per gradient, of its shape and strides
            (``torch.empty_like(g, dtype=torch.float32)``), sharing no memory with it; mutated:
            every element becomes ``v if inv_scale == 1 else v * inv_scale``, ``v`` the
            gradient's element widened to float32.
        found_inf: one-element float32 tensor on that device; set to 1.0 if any gradient element
            was inf or NaN, otherwise left as it was (zero it first).
        inv_scale: one-element float32 tensor on that device.

    In plain PyTorch: ``torch._foreach_copy_(out, grads)`` then
    ``torch._amp_foreach_non_finite_check_and_unscale_(out, found_inf, inv_scale)``, in one pass
    (a float16 element costs 2 bytes read and 4 written).  ampfused.MasterWeights' unscale.
    """
    _call(torch.ops.ampfused.unscale_into_, grads, found_inf, inv_scale, out=out)


# Fake kernels: the ops only mutate their arguments and return nothing, so tracing needs no
# shape logic.
@torch.library.register_fake("ampfused::non_finite_check_and_unscale_")
def _(grads, found_inf, inv_scale):
    return None


@torch.library.register_fake("ampfused::non_finite_check_")
def _(grads, found_inf):
    return None


@torch.library.register_fake("ampfused::unscale_update_scale_")
def _(
    grads,
    found_inf,
    scale,
    growth_tracker,
    next_scale,
    next_growth_tracker,
    growth_factor,
    backoff_factor,
    growth_interval,
    check_only,
    accumulate,
):
    return None


@torch.library.register_fake("ampfused::scaler_pass_")
def _(grads, found_inf, state, next_state, grad_stats, *args):
    return None


@torch.library.register_fake("ampfused::scaler_update_")
def _(found_inf, state, next_state, *args):
    return None


@torch.library.register_fake("ampfused::clip_factor_")
def _(grad_stats, state, total_norm, factor, max_norm, norm_type):
    return None


@torch.library.register_fake("ampfused::unscale_into_")
def _(grads, out, found_inf, inv_scale):
    return None
