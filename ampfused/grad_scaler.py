"""``ampfused.GradScaler``: ``torch.amp.GradScaler`` with the per-step work fused.

Same constructor, methods, private attributes, state_dict and results (bit for bit) as torch's
scaler, which it subclasses.  What changes is the cost of a step:

* ``unscale_`` walks ``optimizer.param_groups`` in C++ and runs one fused pass per device
  (all dtypes, any count, one launch on CUDA).  The pass also computes the scale update torch
  would make at ``update()``, into a pending buffer, so
* ``update()`` commits that pending (scale, growth tracker) with one 8-byte copy: no kernel, no
  sum of found_inf tensors.
* Fused optimizers (``_step_supports_amp_scaling``) get a read-only check: gradients are read
  once and not written, where torch reads and rewrites them.

This module is the protocol: the public methods, each a short sequence of named steps, and the
per-optimizer stage bookkeeping torch's users rely on.  The parts it is made of:

* :mod:`ampfused._scale_state`: the scale's state and policy (the int32 state tensor, counters,
  bounds, hysteresis, the pending update, checkpoints) and the checks of the values it holds;
* :mod:`ampfused._grad_pass`: the pass, and which route an optimizer's gradients take through
  it (the C++ walk, torch's walk, MasterWeights, DTensor), with the agreement across ranks;
* :mod:`ampfused._clip`: fused unscale + clip; :mod:`ampfused.diagnostics`: ``watch()`` and its
  reports; :mod:`ampfused._compile`: how each method meets ``torch.compile``.

Whenever the pending update might not be what torch would compute (the scale or a found_inf
tensor was modified in between, factors changed, gradients on several devices, grads that are
tensor subclasses, found_inf all-reduced across ranks: ``found_inf_group``, DTensor gradients,
``ShardedGradScaler``; see ``ampfused/_dist.py``), ``update()`` computes it again from the
found_inf tensors, summed as torch sums them, by the same rule (``scaler_update_``), so results
never differ, and the scale policy and the counters hold on every path.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ampfused import _clip, _dist, _grad_pass, _scale_state
from ampfused._arguments import check_device, check_factor_range, not_an_optimizer
from ampfused._compile import as_is, compiled_region_active, eager, not_traced, not_traced_eager
from ampfused._scale_state import CHECKPOINT_KEY, ScaleState, check_update_arg
from ampfused._torch_private import OptState, supports_amp_scaling
from ampfused.diagnostics import StepReport, Watch
from ampfused.scale_islands import CHECKPOINT_KEY as ISLANDS_KEY
from ampfused.scale_islands import ScalerIslands, check_islands_argument

__all__ = ["GradScaler", "OptState"]

# torch's stages, bound once: reading an Enum member off its class costs ~0.1 us each time.
_READY, _UNSCALED, _STEPPED = OptState.READY, OptState.UNSCALED, OptState.STEPPED
_ABSENT = object()
# What step() does after the optimizer's step returned (see GradScaler._begin_step).
_FINISH_NOTHING, _FINISH_STAGE, _FINISH_ATTRIBUTES = 0, 1, 2


def _fresh_optimizer_state() -> dict[str, Any]:
    """A new entry of ``_per_optimizer_states``, the same dict torch's scaler makes."""
    return {"stage": _READY, "found_inf_per_device": {}}


# Whether an optimizer's step function takes a `grad_scaler` keyword (the legacy protocol for
# optimizers that handle scaling themselves).  inspect.signature costs ~30 us per call on a
# torch optimizer's wrapped step, so the answer is kept per function object.
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Callable, bool] = weakref.WeakKeyDictionary()


def _step_takes_grad_scaler(optimizer: Any) -> bool:
    step = optimizer.step
    func = getattr(step, "__func__", step)  # bound methods are new objects at every access
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):  # not seen yet, or not weak-referenceable / hashable
        pass
    takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:
        pass
    return takes


# ----------------------------------------------------------------------------- misuse
# torch's refusals of a call out of order: its exception types, its wording first, then the fix.
_STAGE_ERRORS = {
    ("unscale_", _UNSCALED): "unscale_() has already been called on this optimizer since the "
    "last update(). Call unscale_() at most once per optimizer per iteration (step() does it for "
    "you if you did not), then step() and update().",
    ("unscale_", _STEPPED): "unscale_() is being called after step(). step() already unscaled "
    "the gradients; call unscale_() before step(), or call update() first to start the next "
    "iteration.",
    ("step", _STEPPED): "step() has already been called since the last update(). Call "
    "scaler.update() once per iteration, after step() has run for every optimizer.",
}


def _check_switches(
    scaling: Any, allow_fp16: Any, min_scale: Any, max_scale: Any, hysteresis: Any
) -> None:
    """The constructor's scaling and allow_fp16, and the policy a guard has no use for."""
    if type(scaling) is not bool:
        raise TypeError(f"GradScaler: scaling must be True or False, got {scaling!r}")
    if type(allow_fp16) is not bool:
        raise TypeError(f"GradScaler: allow_fp16 must be True or False, got {allow_fp16!r}")
    if not scaling and (min_scale is not None or max_scale is not None or hysteresis != 1):
        raise ValueError(
            "GradScaler(scaling=False) keeps the scale at 1.0, so min_scale, max_scale and "
            "hysteresis have nothing to act on; leave them at their defaults"
        )


def _stage_error(method: str, stage: OptState) -> None:
    """Raises the refusal of `method` at `stage`, if it is one (the callers test the cheap
    common case inline: these run on every step)."""
    message = _STAGE_ERRORS.get((method, stage))
    if message is not None:
        raise RuntimeError(message)


def _closure_error() -> RuntimeError:
    return RuntimeError(
        "Closure use is not currently supported if GradScaler is enabled. Compute the "
        "loss and call scaler.scale(loss).backward() before scaler.step(optimizer)."
    )


def _no_inf_checks(where: str) -> AssertionError:
    if where == "update":
        return AssertionError(
            "No inf checks were recorded prior to update. Call scaler.step(optimizer) (or "
            "scaler.unscale_(optimizer)) for at least one optimizer with gradients before "
            "scaler.update()."
        )
    return AssertionError(
        "No inf checks were recorded for this optimizer. None of its parameters has "
        "a .grad: run scaler.scale(loss).backward() before scaler.step(optimizer)."
    )


def _warn_legacy_protocol() -> None:
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
        "directly.",
        FutureWarning,
        stacklevel=4,
    )


# What scalers pickled before the split into ScaleState held beside its snapshot's keys.
_LEGACY_KEYS = (
    "_state",
    "_state_views",
    "_next",
    "_next_device",
    "_next_scale",
    "_next_growth_tracker",
    "_pending",
    "_kernel_policy",
    "_stats_now",
    "_stats_last",
)


class GradScaler(torch.amp.GradScaler):
    """Drop-in replacement for :class:`torch.amp.GradScaler` (same arguments and defaults).

    Swap ``torch.amp.GradScaler("cuda")`` for ``ampfused.GradScaler("cuda")``; nothing else
    changes, results included.  ``isinstance(scaler, torch.amp.GradScaler)`` holds, and
    checkpoints move freely between the two classes.

    Args:
        device: device type of the scale (``"cuda"`` or ``"cpu"``; other devices use torch's
            implementation).
        init_scale: initial scale factor; a number float32 can hold (or a 0-dim tensor).
        growth_factor: factor applied to the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: factor applied to the scale after a step with inf/NaN gradients (< 1).
        growth_interval: consecutive clean steps before the scale grows (an int).
        enabled: if False, every method is a no-op, as in torch.

        The scale policy, keyword-only (the defaults are torch's rule, bit for bit), applied on
        the device by the update that applies the factors, and saved by :meth:`state_dict`:

        min_scale: a backoff that would take the scale below it stops at it (a "floor hit"); a
            scale already below it stays.  None: no floor.  Held as a float32, as the scale.
        max_scale: a growth that would take the scale above it stops at it; a scale already
            above it stays.  None: no ceiling.
        hysteresis: back off only on the ``hysteresis``-th consecutive step with inf/NaN (and
            on every one after it); any clean step refills it, as apex's
            ``update_scale_hysteresis`` (Megatron refills only when the scale grows).  Every
            step with inf/NaN is skipped and resets the growth tracker all the same.
        at_min_scale: what a floor hit does besides holding the scale: ``"clamp"`` nothing,
            ``"warn"`` a ``UserWarning`` from :meth:`update`, ``"raise"`` a ``RuntimeError``
            from :meth:`update`, after the update is committed (the scaler is consistent and
            ready for the next iteration; catching the error and going on is ``"clamp"``).
            "warn" and "raise" cost :meth:`update` a 4-byte device-to-host read (a sync).
        scaling: False makes the scaler a guard for bf16 (or float32) training, which needs no
            loss scaling: the scale stays 1.0, every pass only checks (gradients are never
            written, float16 ones included), and a step with inf/NaN is still skipped, with the
            counters and :meth:`watch` as usual.  No host sync with fused optimizers.
        allow_fp16: True unscales float16 gradients in place instead of raising torch's
            ``ValueError: Attempting to unscale FP16 gradients``.  Only for those who know the
            risk: dividing by the scale pushes small float16 gradients into subnormals or zero
            (up to 24 bits lost below 2**-14), and an optimizer stepping float16 parameters drops
            every update under half their ulp, so training can stall silently.  The supported
            ways: float32 parameters under ``torch.autocast``, or float16 parameters with
            float32 masters (:class:`ampfused.MasterWeights`).
        policy: how the scale moves on clean steps. ``"torch"`` (the default): torch's rule,
            growth by growth_factor every growth_interval clean steps, bit for bit.
            ``"headroom"``: the pass also measures the largest finite magnitude of the scaled
            gradients (and, under ``watch(model, activations=True)``, of the traced float16
            activation gradients), and the scale moves to keep the largest of the last 16
            iterations a margin below float16's largest value (65,504): up as soon as
            they leave room, down before they overflow.  An overflow still skips the step and
            backs off by backoff_factor, and holds the scale there while it is in the history;
            overflows the measurements miss (a backoff soon after a backoff) set a ceiling,
            probed one growth_factor higher every growth_interval clean steps.  Starts at 1.0
            where init_scale equals torch's default (2**16).  On the device, no host sync.
            Without activation tracing only parameter gradients are measured: see
            docs/loss-scale.md, "A loss scale that reads its headroom".  A rule for float16:
            where the gradients (or the traced activations) are bfloat16, which needs no loss
            scale, the first pass says once, in a UserWarning, to use ``scaling=False``.
        headroom: the headroom policy's margin: ``"learned"`` (the default), learned from how
            far the magnitudes have risen above their recent largest, from sqrt(2) up to 4; or
            a fixed factor from 1 to 65,504.  Only with ``policy="headroom"``.
        islands: scale islands (:mod:`ampfused.scale_islands`, docs/islands.md): module names
            (as ``model.named_modules()`` gives them), or ``"auto"`` to choose them from the
            first traced iteration; each island's backward runs at the global scale times its
            own power-of-two factor, which follows the headroom rule from the island's own
            gradients.  Needs ``policy="headroom"`` and ``watch(model, activations=True)``.
        found_inf_group: a ``torch.distributed`` process group, or a list of them, over which
            every found_inf flag is all-reduced (MAX) as soon as a pass has computed it, before
            the optimizer's step or :meth:`update` reads it, so every rank skips the same steps
            and keeps the same scale.  For DDP when gradients are changed per rank after the
            all-reduce, and for tensor/pipeline parallel groups (Megatron reduces over its
            model-parallel group).  One all-reduce per group per pass, on the flag's device (no
            host sync with NCCL); a rank with no gradients joins with a zero flag.  DTensor
            gradients (FSDP2, tensor parallel) are reduced over their meshes without it.  Left
            out: no reduction (None is refused: ``dist.group.WORLD`` is None until
            ``init_process_group()``, so make the scaler after it).  A scaler holding groups
            cannot be pickled (process groups cannot), as torch's ShardedGradScaler.

    Raises:
        AssertionError: ``growth_factor <= 1`` or ``backoff_factor >= 1`` (as torch); an
            ``init_scale`` that is zero, negative, inf or NaN (torch accepts it and trains into
            NaN or sign-flipped gradients).
        TypeError: a number as ``device`` (``GradScaler(65536.0)``, the positional init_scale of
            the deprecated ``torch.cuda.amp.GradScaler``): write
            ``GradScaler("cuda", init_scale=65536.0)``.
        TypeError, ValueError, OverflowError, RuntimeError: a value torch would fail on at the
            first ``scale()`` or ``update()``, with the exception torch raises there.
        TypeError, ValueError: a policy argument of the wrong type or out of range
            (``min_scale > max_scale``, ``hysteresis < 1``, ``init_scale`` outside
            ``[min_scale, max_scale]``, ``at_min_scale`` other than "clamp" without
            ``min_scale``).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        at_min_scale: str = "clamp",
        scaling: bool = True,
        allow_fp16: bool = False,
        found_inf_group: Any = _dist.NO_GROUP,
        policy: str = "torch",
        headroom: float | str = _scale_state.LEARNED,
        islands: Any = None,
    ) -> None:
        check_device(type(self).__name__, device)
        found_inf_groups = _dist.check_found_inf_group(type(self).__name__, found_inf_group)
        _check_switches(scaling, allow_fp16, min_scale, max_scale, hysteresis)
        headroom_factor = _scale_state.check_headroom(type(self).__name__, policy, headroom)
        islands = check_islands_argument(type(self).__name__, islands, policy, scaling)
        # (4.0, the fixed default before the margin was learned, is accepted as it was)
        keep = (None, _scale_state.LEARNED, _scale_state.DEFAULT_HEADROOM)
        if policy == "torch" and headroom not in keep:
            raise ValueError(
                f"{type(self).__name__}: headroom={headroom!r} acts only with "
                "policy='headroom'; pass policy='headroom' too, or leave headroom out"
            )
        if policy == "headroom" and init_scale == 2.0**16 and type(init_scale) is float:
            # torch's default: the headroom policy starts low and moves to the measured level
            init_scale = _scale_state.HEADROOM_START
            low, high = min_scale, max_scale
            if isinstance(low, numbers.Real) and init_scale < low:
                init_scale = float(low)
            if isinstance(high, numbers.Real) and init_scale > high:
                init_scale = float(high)
        try:
            super().__init__(
                device=device,
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                enabled=enabled,
            )
        except (AssertionError, TypeError) as e:
            raise _scale_state.constructor_factor_error(e, growth_factor, backoff_factor) from e
        self._init_fused_state()
        checked_policy = _scale_state.check_constructor(
            self._enabled,
            init_scale,
            (growth_factor, backoff_factor, growth_interval),
            (min_scale, max_scale, hysteresis, at_min_scale),
        )
        self._scale_state.set_policy(*checked_policy)
        self._scale_state.headroom = headroom_factor
        self._scaling = scaling
        self._island_set = None if islands is None else ScalerIslands(islands)
        self._allow_fp16 = allow_fp16
        self._found_inf_plan = _dist.reductions(found_inf_groups, "max")
        if not scaling:
            # The guard: the scale is 1.0 and factors of 1.0 keep it there through torch's rule
            # and ours alike; passes only check (nothing is written) and steps with inf/NaN are
            # skipped as ever.
            self._init_scale = 1.0
            self._growth_factor = 1.0
            self._backoff_factor = 1.0

    # Scalers pickled before these options existed:
    _allow_fp16 = False
    _found_inf_plan: list = []
    _island_set: ScalerIslands | None = None
    # The shape of the found_inf tensors unscale_() leaves in _per_optimizer_states (torch's
    # ShardedGradScaler makes them (1,)).
    _unscale_found_shape: tuple[int, ...] = ()
    # How many leading reductions of _found_inf_plan the unscale_ of the next class in the MRO
    # runs itself (torch's ShardedGradScaler's: the all-reduce over its process_group).
    _plan_done_by_torch_unscale = 0

    def _init_fused_state(self) -> None:
        # The scale's state and policy: _scale and _growth_tracker (torch's) are views of its
        # tensor once the lazy init has made it.
        self._scale_state = ScaleState()
        self._scaling = True
        self._watch: Watch | None = None  # watch(): names and statistics tables
        self._island_set = None  # islands=: the scale islands (ampfused.scale_islands)

    # ----------------------------------------------------------------------------- the policy
    @property
    def min_scale(self) -> float | None:
        """The floor of the scale (None: none); set by the constructor or load_state_dict."""
        return self._scale_state.min_scale

    @property
    def max_scale(self) -> float | None:
        """The ceiling of the scale (None: none); set by the constructor or load_state_dict."""
        return self._scale_state.max_scale

    @property
    def hysteresis(self) -> int:
        """Consecutive steps with inf/NaN that back the scale off (1: every one, as torch)."""
        return self._scale_state.hysteresis

    @property
    def at_min_scale(self) -> str:
        """What a backoff held at min_scale does: "clamp", "warn" or "raise"."""
        return self._scale_state.at_min_scale

    @property
    def policy(self) -> str:
        """How the scale moves on clean steps: "torch" or "headroom"."""
        return "headroom" if self._scale_state.headroom else "torch"

    @property
    def headroom(self) -> float | str | None:
        """The headroom policy's fixed factor, or "learned" (None under torch's rule)."""
        headroom = self._scale_state.headroom
        return _scale_state.LEARNED if headroom < 0 else headroom or None

    @not_traced_eager
    def magnitude(self) -> float:
        """The largest finite magnitude of the scaled gradients the last iteration measured
        (the headroom policy's measurement: parameter gradients on the scale's device, and
        traced float16 activation gradients under ``watch(model, activations=True)``), at the
        scale it ran with; +inf if it found inf/NaN; 0.0 if nothing was measured (torch's
        policy measures nothing).  A host sync."""
        return self._scale_state.magnitude()

    @not_traced
    def scale(self, outputs: Any) -> Any:
        """torch's ``scale()``; under :meth:`watch` it also marks the iteration as begun, so
        that :meth:`report` and :meth:`grad_norms` refuse to read the last iteration's figures
        as this one's before this iteration's pass."""
        if self._watch is not None:
            self._watch.begun = True
        return super().scale(outputs)

    # ----------------------------------------------------------------------------- state
    @not_traced_eager
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale, self._growth_tracker = self._scale_state.make(
            self._init_scale, self._init_growth_tracker, dev
        )

    def _factors(self) -> tuple[Any, Any, Any]:
        return self._growth_factor, self._backoff_factor, self._growth_interval

    def _found_infs(self) -> list[torch.Tensor]:
        """Every found_inf tensor of this iteration, in torch's order."""
        return [
            f
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]

    @not_traced_eager
    def counters(self) -> dict[str, int]:
        """The scaler's counters, read from the device with one copy (a host sync).

        Returns:
            ``steps`` (update() calls that ended an iteration), ``skipped_steps`` (of those,
            iterations that found inf/NaN: the optimizer step was skipped),
            ``consecutive_skips`` (skipped iterations since the last clean one), ``growths`` and
            ``backoffs`` (iterations that raised / lowered the scale), ``floor_hits`` (backoffs
            held at min_scale), then ``hysteresis_left`` (steps with inf/NaN still tolerated
            before the next backoff).  Zero before the first iteration (unless loaded from a
            checkpoint) and when the scaler is disabled.  int32 on the device: they wrap after
            2**31 - 1.  Under ``watch(model, activations=True)`` also
            ``activation_grads_nonzero`` and ``activation_grads_subnormal``: the traced float16
            activation gradients' nonzero elements since that ``watch()``, and of those the
            ones below float16's smallest normal (2**-14, held with fewer than 11 significant
            bits), counted on the device by the pass that reads them (this rank's own: not
            agreed across ranks, not in checkpoints).
        """
        if not self._enabled:
            return dict.fromkeys((*_scale_state.COUNTER_NAMES, "hysteresis_left"), 0)
        counters = self._scale_state.counters()
        tracer = self._watch.tracer if self._watch is not None else None
        if tracer is not None:
            nonzero, subnormal = tracer.counts()
            counters.update(activation_grads_nonzero=nonzero, activation_grads_subnormal=subnormal)
        return counters

    @not_traced_eager
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (of either scaler class), as torch's method.

        Every entry is checked before anything changes, and refused with the exception torch
        raises for it: torch's own method assigns entry by entry (a bad one leaves the state
        half loaded) and defers most checks to the first ``scale()`` or ``update()``.
        """
        if not self._enabled:
            return
        loaded = _scale_state.read_checkpoint(state_dict, self._scale, self._growth_tracker)
        if self._island_set is not None:  # (checked before it changes anything; first, so a
            # bad entry leaves the scale as it was)
            self._island_set.load(state_dict.get(ISLANDS_KEY), float(loaded.scale))
        self._init_scale = loaded.scale
        if self._scale is not None:
            self._scale.fill_(loaded.scale)
        self._growth_factor, self._backoff_factor, self._growth_interval = loaded.factors
        self._init_growth_tracker = loaded.growth_tracker
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(loaded.growth_tracker)
        self._scale_state.load(loaded.policy, loaded.counters, loaded.headroom, loaded.history)

    @not_traced_eager
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (``{}`` when disabled), plus an ``"ampfused"`` entry holding the
        scale policy, hysteresis left and the counters as Python values (torch's
        ``load_state_dict`` ignores it, so either class loads the other's checkpoint).  Syncs
        with the device, as torch's."""
        state = super().state_dict()
        if self._enabled:
            state[CHECKPOINT_KEY] = self._scale_state.checkpoint()
            islands = self._island_set.checkpoint() if self._island_set is not None else None
            if islands is not None:
                state[ISLANDS_KEY] = islands
        return state

    @not_traced_eager
    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor: checked as torch's ``update()`` will use it, and refused
        (``AssertionError``) where ``<= 1.0``, as the constructor refuses it."""
        if self._enabled:
            check_update_arg("set_growth_factor", "growth_factor", new_factor)
            check_factor_range("set_growth_factor", "growth_factor", new_factor)
        self._growth_factor = new_factor

    @not_traced_eager
    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale backoff factor: checked as torch's ``update()`` will use it, and refused
        (``AssertionError``) where ``>= 1.0``, as the constructor refuses it."""
        if self._enabled:
            check_update_arg("set_backoff_factor", "backoff_factor", new_factor)
            check_factor_range("set_backoff_factor", "backoff_factor", new_factor)
        self._backoff_factor = new_factor

    @not_traced_eager
    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (checked as torch's ``update()`` will use it)."""
        if self._enabled:
            check_update_arg("set_growth_interval", "growth_interval", new_interval)
        self._growth_interval = new_interval

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_scale_state"]  # as plain values: a copy gets a state of its own
        state.update(self._scale_state.snapshot())
        # Names are keyed by the parameters' identities, which do not survive pickling.
        state["_watch"] = None
        if self._island_set is not None:  # (the argument and the rows: no model, no hooks)
            islands = ScalerIslands(self._island_set.argument)
            entry = self._island_set.checkpoint()
            if entry is not None:
                islands.loaded = (entry, self.get_scale())
                islands.iterations = self._island_set.iterations
            state["_island_set"] = islands
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        scale_state = ScaleState.from_snapshot(state)
        for key in (*ScaleState.SNAPSHOT_KEYS, *ScaleState.SNAPSHOT_EXTRA, *_LEGACY_KEYS):
            state.pop(key, None)
        self._init_fused_state()
        self.__dict__.update(state)
        self._scale_state = scale_state

    # ----------------------------------------------------------------------------- unscale
    @not_traced_eager
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        allow_fp16 = allow_fp16 or self._allow_fp16
        found, optimizer = _grad_pass.unscale_grads(optimizer, inv_scale, found_inf, allow_fp16)
        if found is None:  # the next class's walk (torch's) over the groups already read
            found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return found

    @not_traced
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Same contract as :meth:`torch.amp.GradScaler.unscale_` (call at most once per optimizer
        per iteration, before :meth:`step`); one fused pass, no host sync.

        Raises:
            AttributeError: ``optimizer`` has no ``param_groups`` (the model, or
                ``model.parameters()``), as torch's; the message says what was given.
        """
        if compiled_region_active():
            return eager(GradScaler.unscale_)(self, optimizer)
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        if not hasattr(optimizer, "param_groups"):  # (the model, model.parameters())
            raise not_an_optimizer(optimizer, "unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is not _READY:
            _stage_error("unscale_", optimizer_state["stage"])
        # Without scaling there is nothing to divide: the pass only checks (float16 included).
        scaling = self._scaling
        found = _grad_pass.found_inf(
            self, optimizer, check_only=not scaling, allow_fp16=not scaling
        )
        if found is None:
            # torch's path (its own stage checks pass: still READY); a ShardedGradScaler's has
            # all-reduced over its process_group already
            super().unscale_(optimizer)
            found = _grad_pass.agree_torch_result(
                self, optimizer_state["found_inf_per_device"], self._plan_done_by_torch_unscale
            )
        if self._unscale_found_shape:
            found = {d: f.reshape(self._unscale_found_shape) for d, f in found.items()}
        optimizer_state["found_inf_per_device"] = found
        optimizer_state["stage"] = _UNSCALED

    @not_traced
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if compiled_region_active():
            return eager(GradScaler._check_inf_per_device)(self, optimizer)
        self._check_scale_growth_tracker("_check_inf_per_device")
        found = _grad_pass.found_inf(self, optimizer, check_only=True, allow_fp16=True)
        if found is None:
            super()._check_inf_per_device(optimizer)
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            found = _grad_pass.agree_torch_result(self, found)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    @not_traced
    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Unscale the optimizer's gradients and clip them by their total norm, in two passes.

        The same as ``scaler.unscale_(optimizer)`` then ``torch.nn.utils.clip_grad_norm_(params,
        max_norm, norm_type, error_if_nonfinite)`` over the optimizer's parameters: the same skip
        decision, gradients unscaled and multiplied by ``min(max_norm / (total_norm + 1e-6),
        1)``, and the pre-clip norm of the unscaled gradients returned as a tensor on their
        device.  After :meth:`unscale_` it only clips.  Then call :meth:`step` as usual (fused
        optimizers included: they get the unscaled gradients and the inf/NaN flag).

        For norm_type 2 and inf on one device it reads every gradient once (the inf/NaN check
        and the norm together) and writes it once (multiplied by ``inv_scale * clip_coef``):
        12 bytes per float32 element where the two torch calls move 20, and no host sync.  The
        norm is accumulated in float64 in a fixed order (:func:`ampfused.reference.
        clip_grad_norm_`), so it can differ from torch's in the last bits, and it is float32
        whatever the gradients' dtype (torch returns a float16/bfloat16 total for
        float16/bfloat16 gradients and computes the coefficient in that dtype, so clipped
        bfloat16 gradients can differ from torch's by more).  The gradients are multiplied once,
        by ``float32(inv_scale * clip_coef)``, where torch's pair multiplies twice: with a scale
        that is not a power of two, a last-bit difference.  Other norms, an inf norm with an
        empty gradient (torch raises), and gradients on several devices or of tensor
        subclasses take ``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` (correct, not
        fused).

        With :meth:`watch`, the per-parameter statistics of :meth:`report` and
        :meth:`grad_norms` come from the same read pass (pre-clip).

        Raises:
            TypeError: ``optimizer`` is not an optimizer (``model.parameters()``, as
                ``torch.nn.utils.clip_grad_norm_`` takes): nothing is read or changed.
            RuntimeError: ``error_if_nonfinite`` and the total norm is inf/NaN (checking costs a
                host sync); the message names the first gradient that held inf/NaN, by the
                name given to :meth:`watch` or else by its place in ``optimizer.param_groups``.
                The gradients are left unscaled and unclipped, as torch leaves them.
            RuntimeError: called after :meth:`step` in this iteration.
        """
        if compiled_region_active():
            return eager(GradScaler.clip_grad_norm_)(
                self, optimizer, max_norm, norm_type, error_if_nonfinite
            )
        return _clip.clip_grad_norm_(self, optimizer, max_norm, norm_type, error_if_nonfinite)

    # ----------------------------------------------------------------------------- step
    @not_traced
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Run ``optimizer.step(*args, **kwargs)`` on unscaled gradients, unless they hold
        inf/NaN, and return what it returned (None when the step was skipped).

        Gradients are unscaled here if :meth:`unscale_` was not called for this optimizer in
        this iteration.  Optimizers that unscale and skip on the device themselves
        (``_step_supports_amp_scaling``, e.g. ``torch.optim.Adam(fused=True)``) get the scale
        and the inf/NaN flag as tensors instead, with no host sync.

        Raises:
            RuntimeError: a ``closure`` keyword, or a second step() before :meth:`update`.
            AssertionError: no :meth:`scale` call yet, or the optimizer has no gradients.
            AttributeError: ``optimizer`` has no ``param_groups`` (the model, or
                ``model.parameters()``), as torch's; the message says what was given.
        """
        # In a compiled region the scaler's own work runs eagerly and the optimizer's step is a
        # frame torch.compile compiles, as under torch's scaler.
        run = eager if compiled_region_active() else as_is
        call, lead, call_kwargs, finish = run(GradScaler._begin_step)(self, optimizer, kwargs)
        retval = call(*lead, *args, **call_kwargs)
        # Only a step that returned counts: after an exception the optimizer may step again
        # (and the fused protocol's attributes stay in place, as torch leaves them).
        if finish != _FINISH_NOTHING:
            run(GradScaler._end_step)(self, optimizer, finish)
        return retval

    def _begin_step(
        self, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]
    ) -> tuple[Callable, tuple, dict[str, Any], int]:
        """Everything step() does before the optimizer's step: returns what to call (with
        these leading arguments, then step()'s own, and these keyword arguments) and what
        :meth:`_end_step` has to do after it returned."""
        if not self._enabled:
            return optimizer.step, (), kwargs, _FINISH_NOTHING
        # The refusals, in torch's order: which one a wrong call meets decides the type raised.
        if "closure" in kwargs:
            raise _closure_error()
        self._check_scale_growth_tracker("step")
        if not hasattr(optimizer, "param_groups") and not supports_amp_scaling(optimizer):
            raise not_an_optimizer(optimizer, "step")  # (before its state is made)
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is _STEPPED:
            _stage_error("step", _STEPPED)
        if not supports_amp_scaling(optimizer):
            # An ordinary optimizer sees finished gradients: unscale them (once), then let the
            # host decide from found_inf, which costs the iteration's one sync per device.
            if optimizer_state["stage"] is _READY:
                self.unscale_(optimizer)
            if not optimizer_state["found_inf_per_device"]:
                raise _no_inf_checks("step")
            # torch's hook: subclasses may override how the skip is decided.
            return self._maybe_opt_step, (optimizer, optimizer_state), kwargs, _FINISH_STAGE
        if _step_takes_grad_scaler(optimizer):
            # The older protocol: the optimizer is handed the scaler itself.
            _warn_legacy_protocol()
            return optimizer.step, (), {**kwargs, "grad_scaler": self}, _FINISH_STAGE
        self._set_fused_step_inputs(optimizer, optimizer_state)
        return optimizer.step, (), kwargs, _FINISH_ATTRIBUTES

    def _end_step(self, optimizer: torch.optim.Optimizer, finish: int) -> None:
        if finish == _FINISH_ATTRIBUTES:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        self._per_optimizer_states[id(optimizer)]["stage"] = _STEPPED

    def _set_fused_step_inputs(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any]
    ) -> None:
        """The inputs of an optimizer that unscales and skips on the device itself.

        The optimizer finds two tensors set as attributes for the duration of its step,
        ``grad_scale`` (what to divide the gradients by; None when :meth:`unscale_` already did
        it) and ``found_inf`` (nonzero: leave the parameters alone).  Both are fresh tensors, so
        nothing the optimizer does to them reaches the scaler.  No host sync.
        """
        if optimizer_state["stage"] is _READY:
            self._check_inf_per_device(optimizer)  # read-only: the optimizer divides
        scale = self._get_scale_async()
        assert scale is not None
        # A grad_scale the user set on the optimizer multiplies in (or, unscaled, is passed on).
        user_scale = getattr(optimizer, "grad_scale", _ABSENT)
        if optimizer_state["stage"] is _UNSCALED or not self._scaling:
            grad_scale = None if user_scale is _ABSENT else user_scale
        else:
            grad_scale = scale.clone() if user_scale is _ABSENT else scale * user_scale
        # The devices' flags summed on the scale's device, in a new tensor: the value of torch's
        # `sum(flags)` (int 0 if there is none), with a clone for its `0 + flag`, a third of the
        # cost (the flags are 0.0 or 1.0, never -0.0, so the bits are the same).
        found_inf: torch.Tensor | int = 0
        dev = scale.device
        # 0-dim for the optimizer, whose _foreach_sub_ of its 0-dim step counts refuses the
        # (1,) shape ShardedGradScaler's unscale_ gives the flags (torch's fails there).
        one_dim = bool(self._unscale_found_shape)
        for flag_device, flag in optimizer_state["found_inf_per_device"].items():
            if one_dim:
                flag = flag.reshape(())
            if flag_device != dev:
                flag = flag.to(dev, non_blocking=True)
            found_inf = flag.clone() if type(found_inf) is int else found_inf + flag
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]

    # ----------------------------------------------------------------------------- update
    @not_traced
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale for the next iteration, as :meth:`torch.amp.GradScaler.update`.

        Without ``new_scale`` this commits the update the fused passes already computed (one
        copy), unless something changed since, in which case it is computed again from the
        found_inf tensors, summed as torch sums them.  Either way the same rule applies: torch's,
        with the scale policy and the counters (:meth:`counters`); only a scale on a device
        other than cpu/cuda takes torch's own update (no policy, no counters).

        With ``new_scale`` (a float, or a one-element tensor on the scaler's device type that
        does not require grad) the scale is set to it and the rest of the rule's state (growth
        tracker, hysteresis left) is left as it is, as torch leaves the tracker.  An iteration
        that ran (an inf check was recorded) still counts in ``steps``, and in
        ``skipped_steps``/``consecutive_skips`` when it found inf/NaN; no growth, backoff or
        floor hit is counted.

        Raises:
            RuntimeError: ``at_min_scale="raise"`` and this update held a backoff at min_scale.
                Raised after the update is committed: the scale is min_scale, the counters
                include this step, and the scaler is ready for the next iteration.
        """
        if compiled_region_active():
            return eager(GradScaler.update)(self, new_scale)
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        state, scale, tracker = self._scale_state, self._scale, self._growth_tracker
        islands = self._island_set
        if islands is not None and new_scale is None:
            args = _scale_state.kernel_update_args(self._factors())
            if args is not None:
                islands.before_update(self, (*args, *state.kernel_policy, state.headroom))
        if self._watch is not None:
            self._watch.close_iteration()
        pending = state.take_pending()
        found_infs = self._found_infs()
        if new_scale is not None:
            self._update_to(new_scale, pending, found_infs)
            if islands is not None:
                islands.after_update(self)
            return
        if len(found_infs) == 0:
            raise _no_inf_checks("update")
        factors = (self._growth_factor, self._backoff_factor, self._growth_interval)
        if not state.prepare_next(pending, scale, tracker, factors, found_infs, True):
            super().update()
            if islands is not None:
                islands.after_update(self)
            return
        if islands is not None:
            islands.hold_global(state)
        floor_hit = state.commit(scale, tracker)
        if islands is not None:
            islands.after_update(self)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        if floor_hit:
            state.report_floor_hit(self.get_scale())

    def _update_to(self, new_scale: Any, pending: Any, found_infs: list[torch.Tensor]) -> None:
        """update(new_scale): the scale set, the iteration counted (steps, skips) when it ran;
        torch reads no found_inf here, so the sum is taken on copies."""
        state, scale = self._scale_state, self._scale
        counted = bool(found_infs) and state.prepare_next(
            pending, scale, self._growth_tracker, self._factors(), found_infs, False
        )
        if not isinstance(new_scale, float):
            _scale_state.check_new_scale(new_scale, self._device)
        _scale_state.write_new_scale(scale, new_scale)
        if counted:
            state.count_iteration()
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    # ----------------------------------------------------------------------------- diagnostics
    @not_traced_eager
    def watch(
        self,
        parameters: torch.nn.Module
        | Mapping[str, torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]],
        *,
        log_skipped: bool | str = False,
        activations: bool | Iterable[str | type] = False,
    ) -> GradScaler:
        """Opt in to per-parameter statistics, recorded by the pass that unscales.

        From the next pass on, the pass also writes, per gradient, the L2 norm of the unscaled
        values, the largest finite magnitude and the counts of +inf, -inf, NaN and zeros, on
        the device and without a sync.  :meth:`report` and :meth:`grad_norms` read them (one
        device-to-host copy) and name each parameter.

        Args:
            parameters: a module (its ``named_parameters()``), ``(name, parameter)`` pairs or
                a mapping of them (``dict(model.named_parameters())``), named once;
                parameters of the optimizer not given here are reported as ``"<param N>"``,
                and the first pass under this watch() that meets such parameters with
                gradients says which, once, in a ``UserWarning``.
            log_skipped: also report every skipped step: ``"log"`` (``logging`` warning on the
                ``"ampfused"`` logger), ``"warn"`` (``warnings.warn``) or False.  Either costs a
                sync in every :meth:`update` (to learn whether the step was skipped).
            activations: also trace activations, to find the module where an overflow started
                (:mod:`ampfused.activations`): True for every leaf module of ``parameters`` (a
                module), or module names (as ``named_modules()`` gives them) and module types.
                Each call of a traced module records the statistics of its floating outputs
                and, in backward, of their gradients, on the device and without a sync;
                :meth:`report` then names the origin (``report.forward_origin``,
                ``report.backward_origin``).  False (the default) registers no hook.

        Returns:
            self, so ``scaler = GradScaler("cuda").watch(model)`` works.

        Raises:
            TypeError: ``parameters`` is neither a module nor ``(name, parameter)`` pairs (an
                optimizer, ``model.parameters()``); the message says what was given.
        """
        watch = Watch(parameters, log_skipped, activations)
        if self._island_set is not None:
            try:
                self._island_set.attach("watch", parameters, activations, self._found_inf_plan)
            except BaseException:
                watch.remove()  # (its tracing hooks: a refused watch() changes nothing)
                raise
        if self._watch is not None:  # (the statistics recorded so far stay readable)
            watch.now, watch.last = self._watch.now, self._watch.last
            self._watch.remove()  # (its tracing hooks)
        self._watch = watch
        return self

    @not_traced_eager
    def unwatch(self) -> None:
        """Stop recording statistics (every tracing hook removed): the pass goes back to doing
        only what torch's does."""
        if self._watch is not None:
            self._watch.remove()
        self._watch = None
        if self._island_set is not None:  # (islands measure from the tracing: gone with it)
            self._island_set.detach()

    @not_traced_eager
    def report(self) -> StepReport:
        """The statistics of the current iteration's passes (between :meth:`unscale_` and
        :meth:`update`) or else of the last completed iteration, by parameter name.  Syncs: one
        device-to-host copy per device.

        ``print(report)`` names where an overflow started (with ``watch(activations=...)``),
        then the gradients that held inf/NaN, first offender first; ``report.grads`` holds
        every parameter's :class:`ampfused.diagnostics.GradStats`.

        Raises:
            RuntimeError: without :meth:`watch`, as :meth:`grad_norms`; before the first pass
                under :meth:`watch` (there are no statistics yet); between :meth:`scale` and
                this iteration's pass, where the figures at hand are the last iteration's
                (``report().step`` says which iteration a report is).
        """
        watch = self._watching("report")
        report = watch.report()
        if self._island_set is not None:  # (the islands in force in the report's iteration)
            factors = self._island_set.factors_of(current=bool(watch.now))
            report = dataclasses.replace(report, islands=factors)
        return report

    @not_traced_eager
    def island_factors(self) -> dict[str, float]:
        """Each scale island's factor f (its backward runs at the global scale times f), by
        module name: ``{}`` without islands, or before ``islands="auto"`` has chosen them.  A
        sync (one device-to-host copy)."""
        islands = self._island_set.islands if self._island_set is not None else None
        return {} if islands is None else islands.factors()

    @not_traced_eager
    def grad_norms(self, norm_type: float = 2.0, group_separator: str = "/") -> dict[str, float]:
        """Per-parameter L2 norms of the unscaled gradients and their total, keyed as
        Lightning's ``grad_norm`` keys them (``grad_2.0_norm/<name>``, ``grad_2.0_norm_total``),
        as Python floats from one device-to-host copy: ready for ``self.log_dict``, W&B or
        TensorBoard.  Needs :meth:`watch`; refused before the first pass under it and between
        :meth:`scale` and this iteration's pass, as :meth:`report` (a RuntimeError).  Syncs.
        Under FSDP or tensor parallelism, the norms of this rank's shards."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"grad_norms: the fused pass computes L2 norms only (norm_type=2.0), got "
                f"norm_type={norm_type!r}; for other norms use torch.linalg.vector_norm on the "
                "gradients after scaler.unscale_(optimizer)"
            )
        return self._watching("grad_norms").grad_norms(group_separator)

    def _watching(self, method: str) -> Watch:
        if self._watch is None:
            raise RuntimeError(
                f"{method}() needs per-parameter statistics: call scaler.watch(model) once "
                "before training"
            )
        return self._watch

    @not_traced_eager
    def step_skipped_tensor(self) -> torch.Tensor:
        """Whether the last iteration's optimizer step was skipped (inf/NaN found), as a 0-dim
        bool tensor on the scale's device, without a sync: valid from :meth:`step` on (before
        :meth:`update` it is computed from this iteration's found_inf; after, from the
        consecutive-skips counter)."""
        if not self._enabled or self._scale is None:
            return torch.zeros((), dtype=torch.bool)
        flags = self._found_infs()
        if not flags:
            return self._scale_state.last_skipped()
        dev = self._scale.device
        # (0-dim whatever the flags' shape: ShardedGradScaler's are (1,))
        skipped = sum(f.to(dev, non_blocking=True) for f in flags) > 0  # type: ignore[operator]
        return skipped.reshape(())

    @not_traced_eager
    def step_skipped(self) -> bool:
        """:meth:`step_skipped_tensor` as a Python bool: one sync.  The pattern it serves::

        scaler.step(optimizer)
        scaler.update()
        if not scaler.step_skipped():
            scheduler.step()
        """
        return bool(self.step_skipped_tensor())


# The pass takes torch's methods for a subclass that overrides _unscale_grads_: the class whose
# _unscale_grads_ is the fused walk (see ampfused/_grad_pass.py).
GradScaler._pass_base = GradScaler
