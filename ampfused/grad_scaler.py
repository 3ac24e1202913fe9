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

Whenever the pending update might not be what torch would compute (the scale or a found_inf
tensor was modified in between, factors changed, gradients on several devices, grads that are
tensor subclasses, found_inf all-reduced across ranks: ``found_inf_group``, DTensor gradients,
``ShardedGradScaler``; see ``ampfused/_dist.py``), ``update()`` computes it again from the
found_inf tensors, summed as torch sums them, by the same rule (``scaler_update_``), so results
never differ, and the scale policy and the counters hold on every path.

Bad values are refused when they are given, not steps later: the constructor, the setters and
``load_state_dict`` try each value the way torch will use it (``torch.full`` for the scale and
the growth tracker, ``torch._amp_update_scale_``'s argument parser for the factors and the
interval) and raise the exception torch would raise then, with a message naming the argument.
``load_state_dict`` changes nothing unless every entry is good, and a scale that could not be
written is never kept.

Under ``torch.compile`` the scaler behaves as torch's does there.  torch's scaler is on dynamo's
skip list: compiled code calls its methods at a graph break, they run eagerly, and the
optimizer's ``step`` they call is compiled as a frame of its own.  Tracing the scaler instead
would add a graph wherever its operations are not next to the user's (torch's optimizers break
the graph before and after every step under compile).  So each method torch.compile can meet is
marked not to be traced, and inside a compiled region it runs with dynamo's frame evaluation
off (``torch.compiler.disable``), except that ``step`` calls the optimizer's step with it on.
Graphs, graph breaks and results are those of torch's scaler; the work between the graphs is the
fused C++ path, at eager speed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
import struct
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ampfused import _C, _dist, diagnostics, ops
from ampfused._torch_private import (
    OptState,
    amp_update_scale_,
    compiled_region_active,
    mark_not_traced,
    supports_amp_scaling,
    tensor_version,
)
from ampfused.diagnostics import StepReport
from ampfused.master_weights import MasterWeights

__all__ = ["GradScaler", "OptState"]

_LOG = logging.getLogger("ampfused")

# Devices with ampfused kernels; others (mps, xpu, ...) use torch's implementation unchanged.
_KERNEL_DEVICES = ("cpu", "cuda")
# torch's stages, bound once: reading an Enum member off its class costs ~0.1 us each time.
_READY, _UNSCALED, _STEPPED = OptState.READY, OptState.UNSCALED, OptState.STEPPED
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_REAL_TYPES = (float, int)  # exact types only: bool is an int torch refuses as an interval
_ABSENT = object()
# The scaler's int32 state (ScalerState in csrc/unscale_math.h): scale bits, growth tracker,
# hysteresis left, then the counters.
_STATE_SIZE = 9
_HYSTERESIS_LEFT = 2
_CONSECUTIVE_SKIPS = 5
_FLOOR_HITS = 8
# steps, skipped_steps, consecutive_skips: what update(new_scale) advances
_ITERATION_COUNTERS = slice(3, 6)
_INF = float("inf")
_TABLE_NORMS = (2.0, _INF)  # the norms clip_factor_ computes from the pass's statistics
# counters()'s keys: the state's fields after hysteresis_left (ops.STATE_FIELDS).
_COUNTER_NAMES = ops.STATE_FIELDS[_HYSTERESIS_LEFT + 1 :]
_AT_MIN_SCALE = ("clamp", "warn", "raise")
# state_dict()'s entry for what torch's scaler does not have (torch's load_state_dict ignores it).
_CHECKPOINT_KEY = "ampfused"
_POLICY_KEYS = ("min_scale", "max_scale", "hysteresis", "at_min_scale")
# What step() does after the optimizer's step returned (see GradScaler._begin_step).
_FINISH_NOTHING, _FINISH_STAGE, _FINISH_ATTRIBUTES = 0, 1, 2


def _fresh_optimizer_state() -> dict[str, Any]:
    """A new entry of ``_per_optimizer_states``, the same dict torch's scaler makes."""
    return {"stage": _READY, "found_inf_per_device": {}}


def _not_traced(method: Callable) -> Callable:
    """Marks a method torch.compile calls instead of tracing (see the module docstring); the
    method itself goes _eager when it finds itself in a compiled region."""
    mark_not_traced(method)
    return method


def _not_traced_eager(method: Callable) -> Callable:
    """_not_traced, for methods off the per-step path: the wrapper goes _eager for them."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if compiled_region_active():
            return _eager(method)(*args, **kwargs)
        return method(*args, **kwargs)

    return _not_traced(wrapper)


def _as_is(fn: Callable) -> Callable:
    return fn


_EAGER_ISLANDS: dict[Callable, Callable] = {}


def _eager(fn: Callable) -> Callable:
    """fn with torch.compile's frame evaluation off while it runs, so that none of the scaler's
    own helpers is compiled.  Made on first use: torch.compiler.disable imports torch._dynamo,
    which is only loaded already when a compiled region is running."""
    island = _EAGER_ISLANDS.get(fn)
    if island is None:
        island = _EAGER_ISLANDS[fn] = torch.compiler.disable(fn, recursive=True)
    return island


# ----------------------------------------------------------------------------- argument checks
# Each check runs the value through the torch call that will consume it and re-raises that
# call's own exception type (so `except TypeError:` written against torch keeps working) with a
# message that names the argument and the fix.

_UPDATE_ARGS = ("growth_factor", "backoff_factor", "growth_interval")
_UPDATE_ARG_HELP = {
    "growth_factor": "a float > 1.0, the factor the scale grows by after growth_interval "
    "consecutive steps without inf/NaN",
    "backoff_factor": "a float < 1.0, the factor the scale shrinks by after a step with inf/NaN",
    "growth_interval": "a Python int, the number of consecutive steps without inf/NaN before "
    "the scale grows",
}


def _update_arg_error(name: str, value: Any) -> Exception | None:
    """The exception torch's ``update()`` would raise for this one argument, or None."""
    args = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1, name: value}
    scratch = torch.zeros(3)  # scale, found_inf, and the int32 tracker's bits
    try:
        amp_update_scale_(
            scratch[0],
            scratch[1].view(torch.int32),
            scratch[2],
            args["growth_factor"],
            args["backoff_factor"],
            args["growth_interval"],
        )
    except Exception as e:  # TypeError, ValueError (int64 overflow), OverflowError
        return e
    return None


def _check_update_arg(where: str, name: str, value: Any) -> None:
    error = _update_arg_error(name, value)
    if error is not None:
        raise type(error)(
            f"{where}: {name} must be {_UPDATE_ARG_HELP[name]}; got {value!r} "
            f"({type(value).__name__}), which torch's scale update refuses: {error}"
        ) from error


def _check_fill(where: str, value: Any, dtype: torch.dtype, into: torch.Tensor | None) -> None:
    """Raises what writing `value` into the scaler's state would raise: ``torch.full`` when the
    state is still to be created (torch's lazy init at the first scale()), ``fill_`` into a
    tensor like `into` when it exists (torch's load_state_dict)."""
    try:
        if into is None:
            torch.full((), value, dtype=dtype)
        else:
            torch.empty_like(into).fill_(value)
    except Exception as e:  # RuntimeError (overflow, shape), TypeError, OverflowError
        kind = "a float that float32 can hold" if dtype == torch.float32 else "an int32 count"
        raise type(e)(
            f"{where} must be {kind}; got {value!r} ({type(value).__name__}), which cannot be "
            f"written into the scaler's {dtype} state: {e}"
        ) from e


def _f32(value: float) -> float:
    """value rounded to float32 (+-inf beyond its range), with no tensor made."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # rounds to +-inf
        return math.copysign(_INF, value)


def _check_policy(
    where: str, min_scale: Any, max_scale: Any, hysteresis: Any, at_min_scale: Any
) -> tuple[float | None, float | None, int, str]:
    """The scale policy as GradScaler keeps it, or the exception naming the argument: TypeError
    for a wrong type, ValueError for a value out of range."""
    bounds: list[float | None] = []
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if value is None:
            bounds.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{where}: {name} must be None (no bound) or a positive float; got {value!r} "
                f"({type(value).__name__})"
            )
        try:
            bound = _f32(float(value))  # the kernels hold it as a float32, as the scale
        except OverflowError:  # an int beyond float64
            bound = _INF
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(
                f"{where}: {name} must be a positive number that float32 can hold (or None for "
                f"no bound); got {value!r}"
            )
        bounds.append(float(value))
    low, high = bounds
    if low is not None and high is not None and _f32(low) > _f32(high):
        raise ValueError(
            f"{where}: min_scale={min_scale!r} is above max_scale={max_scale!r}; pass "
            "min_scale <= max_scale"
        )
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, numbers.Integral):
        raise TypeError(
            f"{where}: hysteresis must be an int >= 1 (the number of consecutive steps with "
            f"inf/NaN that backs the scale off; 1 is torch's rule); got {hysteresis!r} "
            f"({type(hysteresis).__name__})"
        )
    if not 1 <= hysteresis <= 2**31 - 1:
        raise ValueError(
            f"{where}: hysteresis must be an int from 1 to 2**31 - 1 (1 is torch's rule); got "
            f"{hysteresis!r}"
        )
    if not isinstance(at_min_scale, str):
        raise TypeError(
            f"{where}: at_min_scale must be one of {', '.join(map(repr, _AT_MIN_SCALE))}; got "
            f"{at_min_scale!r} ({type(at_min_scale).__name__})"
        )
    if at_min_scale not in _AT_MIN_SCALE:
        raise ValueError(
            f"{where}: at_min_scale must be one of {', '.join(map(repr, _AT_MIN_SCALE))}; got "
            f"{at_min_scale!r}"
        )
    if at_min_scale != "clamp" and low is None:
        raise ValueError(
            f"{where}: at_min_scale={at_min_scale!r} acts when a backoff is held at min_scale, "
            "and min_scale is None: pass min_scale too"
        )
    return low, high, int(hysteresis), at_min_scale


def _checked_extra(entry: Any) -> tuple[tuple, list[int]] | None:
    """state_dict()["ampfused"] checked: (the policy, hysteresis left and the counters), or
    None when the checkpoint has no such entry (one of torch's scaler)."""
    if entry is _ABSENT:
        return None
    where = f"load_state_dict: state_dict[{_CHECKPOINT_KEY!r}]"
    if not isinstance(entry, dict):
        raise TypeError(
            f"{where} must be the dict GradScaler.state_dict() writes there; got "
            f"{type(entry).__name__}"
        )
    names = (*_POLICY_KEYS, "hysteresis_left", *_COUNTER_NAMES)
    missing = [name for name in names if name not in entry]
    if missing:
        raise KeyError(
            f"{where} has no {', '.join(map(repr, missing))} entry; it needs "
            f"{', '.join(map(repr, names))}, as GradScaler.state_dict() writes them"
        )
    policy = _check_policy(where, *(entry[name] for name in _POLICY_KEYS))
    counters = []
    for name in names[len(_POLICY_KEYS) :]:
        value = entry[name]
        if type(value) is not int:
            raise TypeError(
                f"{where}[{name!r}] must be an int (an int32 counter); got {value!r} "
                f"({type(value).__name__})"
            )
        _check_fill(f"{where}[{name!r}]", value, torch.int32, None)
        counters.append(value)
    if not 0 <= counters[0] <= policy[2]:
        raise ValueError(
            f"{where}['hysteresis_left'] must be from 0 to hysteresis={policy[2]}; got "
            f"{counters[0]}"
        )
    return policy, counters


def _kernel_update_args(
    growth_factor: Any, backoff_factor: Any, growth_interval: Any
) -> tuple[float, float, int] | None:
    """The update arguments as the fused kernel's (double, double, int64), or None where torch's
    update() would refuse them (the caller then takes torch's path, which raises there)."""
    if (
        type(growth_factor) in _REAL_TYPES
        and type(backoff_factor) in _REAL_TYPES
        and type(growth_interval) is int
        and _INT64_MIN <= growth_interval <= _INT64_MAX
    ):
        try:
            return float(growth_factor), float(backoff_factor), growth_interval
        except OverflowError:  # an int beyond double's range, refused by torch as well
            return None
    # Other types torch's parser may take (numpy scalars, 0-dim tensors): ask it.
    values = (growth_factor, backoff_factor, growth_interval)
    if any(_update_arg_error(n, v) is not None for n, v in zip(_UPDATE_ARGS, values, strict=True)):
        return None
    return float(growth_factor), float(backoff_factor), int(growth_interval)


# ----------------------------------------------------------------------------- optimizers
class _ParamGroups:
    """Stands in for an optimizer in torch's ``_unscale_grads_``, which reads only
    ``param_groups``: lets torch's walk reuse groups already read from a one-shot iterable."""

    __slots__ = ("param_groups",)

    def __init__(self, param_groups: list | tuple) -> None:
        self.param_groups = param_groups


def _read_param_groups(optimizer: Any) -> list | tuple:
    """``optimizer.param_groups`` as a list or tuple, read once: torch's scaler walks it with a
    for loop, so any iterable works there, a generator included (read once per pass)."""
    groups = optimizer.param_groups
    if type(groups) is list or type(groups) is tuple:
        return groups
    try:
        iterator = iter(groups)
    except TypeError as e:
        raise TypeError(
            "optimizer.param_groups must be an iterable of dicts with a 'params' entry, got "
            f"{type(groups).__name__}"
        ) from e
    return list(iterator)


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


def _refused_factor(growth_factor: Any) -> str:
    """Which factor torch's constructor refused: it checks growth_factor first."""
    try:
        return "growth_factor" if growth_factor <= 1.0 else "backoff_factor"
    except Exception:  # the comparison itself failed
        return "growth_factor"


class _Pending:
    """What the fused passes of this iteration wrote into the pending buffers, and the inputs they
    saw, so update() can tell whether committing them equals torch's update."""

    __slots__ = ("scale", "tracker", "scale_version", "tracker_version", "factors", "found")

    def __init__(self, scale: torch.Tensor, tracker: torch.Tensor, factors: tuple) -> None:
        self.scale = scale
        self.tracker = tracker
        self.scale_version = tensor_version(scale)
        self.tracker_version = tensor_version(tracker)
        self.factors = factors
        self.found: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (found_inf, its version)


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
        AssertionError: ``growth_factor <= 1`` or ``backoff_factor >= 1`` (as torch).
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
    ) -> None:
        found_inf_groups = _dist.check_found_inf_group(type(self).__name__, found_inf_group)
        if type(scaling) is not bool:
            raise TypeError(f"GradScaler: scaling must be True or False, got {scaling!r}")
        if type(allow_fp16) is not bool:
            raise TypeError(f"GradScaler: allow_fp16 must be True or False, got {allow_fp16!r}")
        if not scaling and (min_scale is not None or max_scale is not None or hysteresis != 1):
            raise ValueError(
                "GradScaler(scaling=False) keeps the scale at 1.0, so min_scale, max_scale and "
                "hysteresis have nothing to act on; leave them at their defaults"
            )
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
            # torch compares the factors with 1.0: a factor out of range is an AssertionError, one
            # that does not compare with a float a TypeError.  Same types, with the value named.
            name = _refused_factor(growth_factor)
            value = growth_factor if name == "growth_factor" else backoff_factor
            if isinstance(e, AssertionError):  # torch's message first: users may match on it
                message = f"{e} GradScaler got {name}={value!r}."
            else:
                message = (
                    f"GradScaler: {name} must be {_UPDATE_ARG_HELP[name]}; got {value!r} "
                    f"({type(value).__name__}), which does not compare with a float: {e}"
                )
            raise type(e)(message) from e
        self._init_fused_state()
        if self._enabled:  # torch checks nothing else, and uses nothing, when disabled
            _check_fill("GradScaler: init_scale", init_scale, torch.float32, None)
            for name, value in zip(
                _UPDATE_ARGS, (growth_factor, backoff_factor, growth_interval), strict=True
            ):
                _check_update_arg("GradScaler", name, value)
        self._scaling = scaling
        self._allow_fp16 = allow_fp16
        self._found_inf_plan = _dist.reductions(found_inf_groups, "max")
        if not scaling:
            # The guard: the scale is 1.0 and factors of 1.0 keep it there through torch's rule
            # and ours alike; passes only check (nothing is written) and steps with inf/NaN are
            # skipped as ever.
            self._init_scale = 1.0
            self._growth_factor = 1.0
            self._backoff_factor = 1.0
        policy = _check_policy("GradScaler", min_scale, max_scale, hysteresis, at_min_scale)
        if self._enabled and (min_scale is not None or max_scale is not None):
            init = _f32(float(init_scale))
            for name, bound, outside in (
                ("min_scale", min_scale, lambda b: init < b),
                ("max_scale", max_scale, lambda b: init > b),
            ):
                if bound is not None and outside(_f32(bound)):
                    raise ValueError(
                        f"GradScaler: init_scale={init_scale!r} is outside the scale's bounds "
                        f"({name}={bound!r}); pass an init_scale from min_scale to max_scale"
                    )
        self._set_policy(*policy)

    # Scalers pickled before these options existed:
    _allow_fp16 = False
    _found_inf_plan: list = []
    # The shape of the found_inf tensors unscale_() leaves in _per_optimizer_states (torch's
    # ShardedGradScaler makes them (1,)).
    _unscale_found_shape: tuple[int, ...] = ()
    # How many leading reductions of _found_inf_plan the unscale_ of the next class in the MRO
    # runs itself (torch's ShardedGradScaler's: the all-reduce over its process_group).
    _plan_done_by_torch_unscale = 0

    def _init_fused_state(self) -> None:
        # _state (int32, _STATE_SIZE elements: ScalerState in csrc/unscale_math.h) owns _scale
        # (float32 view of element 0), _growth_tracker (element 1), hysteresis left and the
        # counters, so one copy commits them all, as long as _scale and _growth_tracker are
        # still the views made with it (_state_views).  _next holds the pending update the
        # fused passes compute.
        self._state: torch.Tensor | None = None
        self._state_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next: torch.Tensor | None = None
        self._next_scale: torch.Tensor | None = None
        self._next_growth_tracker: torch.Tensor | None = None
        self._pending: _Pending | None = None
        self._scaling = True
        # watch(): names, and the statistics tables of this iteration and the last one.
        self._watch: _Watch | None = None
        self._stats_now: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        self._stats_last: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        # The policy (the constructor sets it), and the state after the growth tracker for the
        # lazy init (hysteresis left and the counters; None: a fresh start), as torch keeps
        # _init_growth_tracker.
        self._set_policy(None, None, 1, "clamp")
        self._init_counters: list[int] | None = None

    def _set_policy(
        self, min_scale: float | None, max_scale: float | None, hysteresis: int, at_min_scale: str
    ) -> None:
        self._min_scale, self._max_scale = min_scale, max_scale
        self._hysteresis, self._at_min_scale = hysteresis, at_min_scale
        # (min_scale, max_scale, hysteresis) as the ops take them
        self._kernel_policy = (
            -_INF if min_scale is None else min_scale,
            _INF if max_scale is None else max_scale,
            hysteresis,
        )

    @property
    def min_scale(self) -> float | None:
        """The floor of the scale (None: none); set by the constructor or load_state_dict."""
        return self._min_scale

    @property
    def max_scale(self) -> float | None:
        """The ceiling of the scale (None: none); set by the constructor or load_state_dict."""
        return self._max_scale

    @property
    def hysteresis(self) -> int:
        """Consecutive steps with inf/NaN that back the scale off (1: every one, as torch)."""
        return self._hysteresis

    @property
    def at_min_scale(self) -> str:
        """What a backoff held at min_scale does: "clamp", "warn" or "raise"."""
        return self._at_min_scale

    # ----------------------------------------------------------------------------- state
    @_not_traced_eager
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        # torch.full converts (and refuses) the initial values as torch's lazy init does; both
        # are made before anything is kept, so a failed first scale() leaves no state behind
        # and the next one raises again.
        scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        rest = torch.tensor(self._counters_at_init(), dtype=torch.int32, device=dev)
        state = torch.cat((scale.view(torch.int32).reshape(1), tracker.reshape(1), rest))
        self._state = state
        self._scale = state[0].view(torch.float32)
        self._growth_tracker = state[1]
        self._state_views = (self._scale, self._growth_tracker)

    def _counters_at_init(self) -> list[int]:
        """Hysteresis left and the counters for the lazy init: loaded or unpickled ones, or a
        fresh start."""
        if self._init_counters is not None:
            return self._init_counters
        return [self._hysteresis] + [0] * len(_COUNTER_NAMES)

    def _counter_values(self) -> list[int]:
        """Hysteresis left and the counters, as ints (one device-to-host copy once the state
        exists)."""
        if self._state is None:
            return self._counters_at_init()
        return self._state[_HYSTERESIS_LEFT:].tolist()

    @_not_traced_eager
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
            2**31 - 1.
        """
        if not self._enabled:
            return dict.fromkeys((*_COUNTER_NAMES, "hysteresis_left"), 0)
        left, *counts = self._counter_values()
        return {**dict(zip(_COUNTER_NAMES, counts, strict=True)), "hysteresis_left": left}

    def _owns_state(self) -> bool:
        views = self._state_views
        return views is not None and self._scale is views[0] and self._growth_tracker is views[1]

    def _pending_buffer(self, dev: torch.device) -> torch.Tensor:
        nxt = self._next
        if nxt is None or self._next_device != dev:  # (reading nxt.device makes a new object)
            # A separate allocation: writing it must not bump the version counter of _scale,
            # which autograd saved for scaler.scale(loss).backward().
            nxt = self._next = torch.empty(_STATE_SIZE, dtype=torch.int32, device=dev)
            self._next_device = dev
            self._next_scale = nxt[0].view(torch.float32)
            self._next_growth_tracker = nxt[1]
        return nxt

    def _pass_state(self) -> torch.Tensor:
        """The state the pass reads: _state, or, where _scale/_growth_tracker were replaced from
        outside, a copy of their values with _state's counters."""
        if self._owns_state():
            return self._state  # type: ignore[return-value]
        return torch.cat(
            (
                self._scale.reshape(1).view(torch.int32),  # type: ignore[union-attr]
                self._growth_tracker.reshape(1),  # type: ignore[union-attr]
                self._state[2:],  # type: ignore[index]
            )
        )

    @_not_traced_eager
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (of either scaler class), as torch's method.

        Every entry is checked before anything changes, and refused with the exception torch
        raises for it: torch's own method assigns entry by entry (a bad one leaves the state
        half loaded) and defers most checks to the first ``scale()`` or ``update()``.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler. Load a state_dict() taken from an enabled scaler."
            )

        def entry(key: str) -> Any:
            try:
                return state_dict[key]
            except KeyError as e:  # (indexing a non-mapping raises what it raises, as in torch)
                raise KeyError(
                    f"GradScaler.load_state_dict: the state dict has no {key!r} entry; it needs "
                    "'scale', 'growth_factor', 'backoff_factor', 'growth_interval' and "
                    "'_growth_tracker', as GradScaler.state_dict() returns them"
                ) from e

        # Checks in the order torch meets the values (load, first scale(), update()), so that of
        # several bad entries the one torch would raise for is reported, with torch's type.
        scale = entry("scale")
        if self._scale is not None:
            _check_fill("load_state_dict: state_dict['scale']", scale, torch.float32, self._scale)
        factors = [entry(name) for name in _UPDATE_ARGS]
        tracker = entry("_growth_tracker")
        if self._growth_tracker is not None:
            where = "load_state_dict: state_dict['_growth_tracker']"
            _check_fill(where, tracker, torch.int32, self._growth_tracker)
        if self._scale is None:
            _check_fill("load_state_dict: state_dict['scale']", scale, torch.float32, None)
            where = "load_state_dict: state_dict['_growth_tracker']"
            _check_fill(where, tracker, torch.int32, None)
        for name, value in zip(_UPDATE_ARGS, factors, strict=True):
            _check_update_arg(f"load_state_dict: state_dict[{name!r}]", name, value)
        # Ours: the policy and the counters.  A checkpoint of torch's scaler has none: the
        # policy stays and the counters start afresh.
        extra = _checked_extra(state_dict.get(_CHECKPOINT_KEY, _ABSENT))
        if extra is None:
            policy, counters = None, [self._hysteresis] + [0] * len(_COUNTER_NAMES)
        else:
            policy, counters = extra

        self._init_scale = scale
        if self._scale is not None:
            self._scale.fill_(scale)
        self._growth_factor, self._backoff_factor, self._growth_interval = factors
        self._init_growth_tracker = tracker
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(tracker)
        if policy is not None:
            self._set_policy(*policy)
        self._init_counters = counters
        if self._state is not None:
            self._state[_HYSTERESIS_LEFT:].copy_(torch.tensor(counters, dtype=torch.int32))
        self._pending = None

    @_not_traced_eager
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (``{}`` when disabled), plus an ``"ampfused"`` entry holding the
        scale policy, hysteresis left and the counters as Python values (torch's
        ``load_state_dict`` ignores it, so either class loads the other's checkpoint).  Syncs
        with the device, as torch's."""
        state = super().state_dict()
        if self._enabled:
            left, *counts = self._counter_values()
            state[_CHECKPOINT_KEY] = {
                "min_scale": self._min_scale,
                "max_scale": self._max_scale,
                "hysteresis": self._hysteresis,
                "at_min_scale": self._at_min_scale,
                "hysteresis_left": left,
                **dict(zip(_COUNTER_NAMES, counts, strict=True)),
            }
        return state

    @_not_traced_eager
    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor (checked as torch's ``update()`` will use it)."""
        if self._enabled:
            _check_update_arg("set_growth_factor", "growth_factor", new_factor)
        self._growth_factor = new_factor

    @_not_traced_eager
    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale backoff factor (checked as torch's ``update()`` will use it)."""
        if self._enabled:
            _check_update_arg("set_backoff_factor", "backoff_factor", new_factor)
        self._backoff_factor = new_factor

    @_not_traced_eager
    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (checked as torch's ``update()`` will use it)."""
        if self._enabled:
            _check_update_arg("set_growth_interval", "growth_interval", new_interval)
        self._growth_interval = new_interval

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            # Made again lazily from _init_scale, _init_growth_tracker (torch's) and ours:
            state["_init_counters"] = self._counter_values()
            state["_state"] = None
            state["_state_views"] = None
            state["_next"] = None
            state["_next_scale"] = None
            state["_next_growth_tracker"] = None
            state["_pending"] = None
        # Names are keyed by the parameters' identities, which do not survive pickling.
        state["_watch"] = None
        state["_stats_now"] = []
        state["_stats_last"] = []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._init_fused_state()
        self.__dict__.update(state)

    # ----------------------------------------------------------------------------- passes
    def _fused_found_inf(
        self,
        optimizer: torch.optim.Optimizer,
        check_only: bool,
        allow_fp16: bool,
        tables: list | None = None,
    ) -> dict[torch.device, torch.Tensor] | None:
        """One fused pass over the optimizer's gradients, with the pending update computed.

        Returns None, having read nothing, when torch's method must run instead (its own
        ``unscale_`` / ``_check_inf_per_device``, which call ``_unscale_grads_``).  With
        ``tables``, the pass writes statistics and appends (table, positions, groups) per device
        to it (none where gradients took torch's walk).
        """
        scale, tracker = self._scale, self._growth_tracker
        assert scale is not None and tracker is not None
        if not (scale.is_cuda or scale.is_cpu):
            return None
        allow_fp16 = allow_fp16 or self._allow_fp16  # as _unscale_grads_ for torch's walk
        if isinstance(optimizer, MasterWeights):
            # Low-precision gradients unscaled into the masters' float32 ones (a check-only pass
            # casts them unscaled, for an optimizer that divides by the scale itself).
            if type(self)._unscale_grads_ is not GradScaler._unscale_grads_:
                raise NotImplementedError(
                    f"{type(self).__name__} overrides _unscale_grads_ (e.g. to all-reduce "
                    "found_inf), which a MasterWeights optimizer's pass does not call; use "
                    "ampfused.GradScaler itself with MasterWeights"
                )
            if self._watch is not None:
                self._watch.not_covered("a MasterWeights optimizer's pass")
            if check_only:
                inv = torch.ones((), dtype=torch.float32, device=scale.device)
            else:
                inv = self._inv_scale()
            # (this pass records no statistics: the tables of earlier passes keep their verdict)
            return self._agree(optimizer._grads_to_masters(inv), (), len(self._stats_now))
        if type(self)._unscale_grads_ is not GradScaler._unscale_grads_:
            # A subclass hooks the unscale (e.g. to all-reduce found_inf, as sharded scalers
            # do): torch's unscale_/_check_inf_per_device call it, so take that path.
            return None
        factors = _kernel_update_args(
            self._growth_factor, self._backoff_factor, self._growth_interval
        )
        if factors is None:  # values set behind the setters' back: torch's update() raises
            return None
        groups = _read_param_groups(optimizer)
        dev = scale.device
        # DTensor gradients (FSDP2, tensor parallel) go through the pass as their local shards,
        # with found_inf then reduced over their meshes.
        unwrap = _dist.dtensor_unwrap()
        nxt = self._pending_buffer(dev)
        pending = self._pending
        result = _C.fused_pass(
            groups,
            self._pass_state(),
            nxt,
            *factors,
            *self._kernel_policy,
            check_only,
            pending is not None and bool(pending.found),
            allow_fp16,
            self._watch is not None or tables is not None,
            unwrap,
        )
        mesh_plan = _dist.mesh_plan(unwrap[3]) if unwrap is not None and unwrap[3] else []
        if result is not None and not result:
            # No gradient on this rank: it joins the all-reduces over its DTensor parameters'
            # meshes that the ranks with gradients run (checked only here: no cost per step).
            mesh_plan = _dist.mesh_plan(_dist.param_meshes(groups))
        if result is None:
            # A gradient needs torch's walk (a tensor subclass, a device without our kernels):
            # run it over the groups read above, with the inputs torch's methods give it.
            if check_only:
                inv_scale = torch.ones((), dtype=torch.float32, device=dev)
            else:
                inv_scale = scale.double().reciprocal().float()
            found_inf = torch.zeros((), dtype=torch.float32, device=dev)
            if self._watch is not None:
                self._watch.not_covered("torch's own unscale path")
            found = torch.amp.GradScaler._unscale_grads_(
                self, _ParamGroups(groups), inv_scale, found_inf, allow_fp16
            )
            return self._agree(found, (), len(self._stats_now))
        if pending is None:
            pending = self._pending = _Pending(
                scale, tracker, (self._growth_factor, self._backoff_factor, self._growth_interval)
            )
        found = {}
        first_table = len(self._stats_now)
        for device, found_inf, stats, positions in result:
            found[device] = found_inf
            if device == dev:
                pending.found[id(found_inf)] = (found_inf, tensor_version(found_inf))
            if stats is not None:
                if self._watch is not None:
                    self._stats_now.append((stats, positions, groups))
                if tables is not None and not mesh_plan:  # (sharded: the norm needs every rank)
                    tables.append((stats, positions, groups))
        return self._agree(found, mesh_plan, first_table)

    def _agree(
        self,
        found: dict[torch.device, torch.Tensor],
        mesh_plan: Any,
        first_table: int,
        plan_done: int = 0,
    ) -> dict[torch.device, torch.Tensor]:
        """found_inf made the same on every rank: each flag all-reduced over the DTensors'
        meshes (MAX), then over found_inf_group (MAX; ShardedGradScaler: SUM over its
        process_group), in place, before anything reads it.  A rank without gradients joins
        with a zero flag on the scale's device, which it keeps as its result.  The pending
        update, computed from this rank's flags, is dropped (update() computes it from the
        agreed ones), and the verdict in this pass's statistics tables becomes the agreed one.
        plan_done: how many of found_inf_group's reductions torch's own method already ran."""
        if not mesh_plan and not self._found_inf_plan:
            return found  # (single-process training: nothing to agree on)
        if not found:
            plan_done = 0  # torch's method had no flag to reduce: it ran none of the plan
        plan = _dist.unique([*mesh_plan, *self._found_inf_plan[plan_done:]])
        if not plan:
            return found
        if not found:
            dev = self._scale.device  # type: ignore[union-attr]
            found = {dev: torch.zeros((), dtype=torch.float32, device=dev)}
        flags = list(found.values())
        _dist.all_reduce_flags(flags, plan)
        self._pending = None
        tables = self._stats_now[first_table:]
        if tables:
            skipped = flags[0] > 0
            for f in flags[1:]:
                skipped = skipped | (f.to(skipped.device) > 0)
            for table, _, _ in tables:
                table[0, 2].copy_(skipped, non_blocking=True)
        return found

    @_not_traced_eager
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # torch's contract, one launch per device instead of one per (device, dtype), and no
        # Python loop over parameters.
        allow_fp16 = allow_fp16 or self._allow_fp16
        if inv_scale.device.type in _KERNEL_DEVICES:
            groups = _read_param_groups(optimizer)
            result = _C.unscale_grads(groups, inv_scale, found_inf, allow_fp16)
            if result is not None:
                return dict(result)
            optimizer = _ParamGroups(groups)  # type: ignore[assignment]  (read once, reused)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    @_not_traced
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Same contract as :meth:`torch.amp.GradScaler.unscale_` (call at most once per optimizer
        per iteration, before :meth:`step`); one fused pass, no host sync.
        """
        if compiled_region_active():
            return _eager(GradScaler.unscale_)(self, optimizer)
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is _UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Call unscale_() at most once per optimizer per iteration (step() does it for "
                "you if you did not), then step() and update()."
            )
        elif optimizer_state["stage"] is _STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). step() already unscaled the "
                "gradients; call unscale_() before step(), or call update() first to start the "
                "next iteration."
            )
        # Without scaling there is nothing to divide: the pass only checks (float16 included).
        scaling = self._scaling
        found = self._fused_found_inf(optimizer, check_only=not scaling, allow_fp16=not scaling)
        if found is None:
            # torch's path (its own stage checks pass: still READY); a ShardedGradScaler's has
            # all-reduced over its process_group already
            super().unscale_(optimizer)
            found = self._agree(
                optimizer_state["found_inf_per_device"],
                (),
                len(self._stats_now),
                self._plan_done_by_torch_unscale,
            )
        if self._unscale_found_shape:
            found = {d: f.reshape(self._unscale_found_shape) for d, f in found.items()}
        optimizer_state["found_inf_per_device"] = found
        optimizer_state["stage"] = _UNSCALED

    @_not_traced
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if compiled_region_active():
            return _eager(GradScaler._check_inf_per_device)(self, optimizer)
        self._check_scale_growth_tracker("_check_inf_per_device")
        found = self._fused_found_inf(optimizer, check_only=True, allow_fp16=True)
        if found is None:
            super()._check_inf_per_device(optimizer)
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            found = self._agree(found, (), len(self._stats_now))
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    # ----------------------------------------------------------------------------- clip
    @_not_traced
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
            RuntimeError: ``error_if_nonfinite`` and the total norm is inf/NaN (checking costs a
                host sync); the message names the first gradient that held inf/NaN, by the
                name given to :meth:`watch` or else by its place in ``optimizer.param_groups``.
                The gradients are left unscaled and unclipped, as torch leaves them.
            RuntimeError: called after :meth:`step` in this iteration.
        """
        if compiled_region_active():
            return _eager(GradScaler.clip_grad_norm_)(
                self, optimizer, max_norm, norm_type, error_if_nonfinite
            )
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not self._enabled:
            if isinstance(optimizer, MasterWeights):
                optimizer._cast_stale()  # the masters' gradients, as step() would take them
            return torch.nn.utils.clip_grad_norm_(
                _flat_params(_read_param_groups(optimizer)),
                max_norm,
                norm_type,
                error_if_nonfinite,
            )
        self._check_scale_growth_tracker("clip_grad_norm_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is _STEPPED:
            raise RuntimeError(
                "clip_grad_norm_() is being called after step(). Clip before step(): "
                "scaler.clip_grad_norm_(optimizer, max_norm), then scaler.step(optimizer)."
            )
        if isinstance(optimizer, MasterWeights) and optimizer_state["stage"] is _READY:
            self.unscale_(optimizer)  # into the masters' float32 gradients, then clip those
        unscaled = optimizer_state["stage"] is _UNSCALED
        tables: list = []
        if norm_type not in _TABLE_NORMS or (
            norm_type == _INF and _any_empty_grad(_read_param_groups(optimizer))
        ):
            found = None  # torch's clip (it refuses the inf norm of an empty gradient)
        elif unscaled:
            found = self._unit_pass(optimizer, tables)
        else:
            found = self._fused_found_inf(
                optimizer,
                check_only=True,
                allow_fp16=not self._scaling,
                tables=tables,
            )
        if found is not None and not unscaled:
            optimizer_state["found_inf_per_device"] = found
            optimizer_state["stage"] = _UNSCALED
        dev = self._scale.device  # type: ignore[union-attr]
        if found is None or len(tables) != 1 or len(found) != 1 or tables[0][0].device != dev:
            return self._clip_unfused(
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
        state = None if unscaled else self._pass_state()
        ops.clip_factor_(table, state, total, factor, max_norm, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            if not unscaled:  # torch raises after unscale_, before clipping
                self._multiply_grads(groups, self._inv_scale())
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
                + self._first_non_finite(table, positions, groups, optimizer)
            )
        self._multiply_grads(groups, factor)
        return total

    def _inv_scale(self) -> torch.Tensor:
        if not self._scaling:
            return torch.ones((), dtype=torch.float32, device=self._scale.device)  # type: ignore[union-attr]
        return self._scale.double().reciprocal().float()  # type: ignore[union-attr]

    def _multiply_grads(self, groups: Any, factor: torch.Tensor) -> None:
        """Every gradient of the groups times factor, in place (multiply-or-pass)."""
        flag = torch.zeros((), dtype=torch.float32, device=factor.device)
        # (DTensors: their local shards, with no collective)
        if _C.unscale_grads(groups, factor, flag, True, _dist.dtensor_unwrap()) is None:
            torch.amp.GradScaler._unscale_grads_(self, _ParamGroups(groups), factor, flag, True)

    def _unit_pass(self, optimizer: torch.optim.Optimizer, tables: list) -> dict | None:
        """A read-only pass with statistics over gradients already unscaled (scale 1, the
        scaler's state untouched); None where gradients need torch's walk."""
        dev = self._scale.device  # type: ignore[union-attr]
        unit = torch.zeros(_STATE_SIZE, dtype=torch.int32, device=dev)
        unit[0:1].view(torch.float32).fill_(1.0)
        unit[_HYSTERESIS_LEFT] = 1
        groups = _read_param_groups(optimizer)
        result = _C.fused_pass(
            groups,
            unit,
            torch.empty_like(unit),
            2.0,
            0.5,
            1,
            -_INF,
            _INF,
            1,
            True,
            False,
            True,
            True,
        )
        if result is None:
            return None
        for _, _, stats, positions in result:
            tables.append((stats, positions, groups))
        return {device: f for device, f, _, _ in result}

    def _clip_unfused(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        checked: bool,
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
    ) -> torch.Tensor:
        """unscale_ (or, after this call's read-only pass, the multiply it left out), then
        torch's clip_grad_norm_."""
        groups = _read_param_groups(optimizer)
        if checked:
            self._multiply_grads(groups, self._inv_scale())
        elif optimizer_state["stage"] is _READY:
            self.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(
            _flat_params(groups), max_norm, norm_type, error_if_nonfinite
        )

    def _first_non_finite(
        self, table: torch.Tensor, positions: torch.Tensor, groups: Any, optimizer: Any
    ) -> str:
        """'; first non-finite gradient: <name>' from a pass's table, or '' if no input was.
        A MasterWeights master is named by its model parameter (the one watch() knows)."""
        per_grad, _ = _C.reduce_grad_stats(table[1:].cpu(), positions[:, 1])
        bad = (per_grad[:, 2:5].sum(dim=1) > 0).nonzero()
        if bad.numel() == 0:
            return ""
        position = int(positions[int(bad[0, 0]), 0])
        param = _flat_params(groups)[position]
        if isinstance(optimizer, MasterWeights):
            param = optimizer.model_params[position]
        name = self._watch.names.get(id(param)) if self._watch is not None else None
        if name is None:
            g, i = _group_index(groups, position)
            name = f"optimizer.param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)})"
        return f" (first gradient with inf/NaN: {name})"

    # ----------------------------------------------------------------------------- step
    @_not_traced
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
        """
        # In a compiled region the scaler's own work runs eagerly and the optimizer's step is a
        # frame torch.compile compiles, as under torch's scaler.
        run = _eager if compiled_region_active() else _as_is
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
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled. Compute the "
                "loss and call scaler.scale(loss).backward() before scaler.step(optimizer)."
            )
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is _STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call scaler.update() "
                "once per iteration, after step() has run for every optimizer."
            )
        if not supports_amp_scaling(optimizer):
            # An ordinary optimizer sees finished gradients: unscale them (once), then let the
            # host decide from found_inf, which costs the iteration's one sync per device.
            if optimizer_state["stage"] is _READY:
                self.unscale_(optimizer)
            if not optimizer_state["found_inf_per_device"]:
                raise AssertionError(
                    "No inf checks were recorded for this optimizer. None of its parameters has "
                    "a .grad: run scaler.scale(loss).backward() before scaler.step(optimizer)."
                )
            # torch's hook: subclasses may override how the skip is decided.
            return self._maybe_opt_step, (optimizer, optimizer_state), kwargs, _FINISH_STAGE
        if _step_takes_grad_scaler(optimizer):
            # The older protocol: the optimizer is handed the scaler itself.
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
                stacklevel=3,
            )
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
    @_not_traced
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
            return _eager(GradScaler.update)(self, new_scale)
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        if self._watch is not None:
            self._close_iteration()
        pending, self._pending = self._pending, None
        found_infs = [
            f
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        if new_scale is not None:
            # torch reads no found_inf here: the sum is taken on copies.
            counted = bool(found_infs) and self._next_holds(pending, found_infs, False)
            self._set_scale(new_scale)
            if counted:
                self._state[_ITERATION_COUNTERS].copy_(self._next[_ITERATION_COUNTERS])  # type: ignore[index]
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
            return
        if len(found_infs) == 0:
            raise AssertionError(
                "No inf checks were recorded prior to update. Call scaler.step(optimizer) (or "
                "scaler.unscale_(optimizer)) for at least one optimizer with gradients before "
                "scaler.update()."
            )
        if pending is None or not self._pending_is_torch_update(pending, found_infs):
            if not self._compute_next(found_infs, True):
                super().update()
                return
        floor_hit = self._at_min_scale != "clamp" and bool(
            self._next[_FLOOR_HITS] != self._state[_FLOOR_HITS]  # type: ignore[index]
        )
        if self._owns_state():
            self._state.copy_(self._next)  # type: ignore[union-attr]
        else:  # _scale/_growth_tracker were replaced from outside: copy into whatever they are
            self._scale.copy_(self._next_scale)  # type: ignore[union-attr]
            self._growth_tracker.copy_(self._next_growth_tracker)  # type: ignore[union-attr]
            self._state[2:].copy_(self._next[2:])  # type: ignore[index]
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        if floor_hit:
            self._report_floor_hit()

    def _next_holds(
        self, pending: _Pending | None, found_infs: list[torch.Tensor], in_place: bool
    ) -> bool:
        """Whether _next holds this iteration's update: the one the fused passes computed, when
        it still holds, else one computed now by :meth:`_compute_next`."""
        if pending is not None and self._pending_is_torch_update(pending, found_infs):
            return True
        return self._compute_next(found_infs, in_place)

    def _compute_next(self, found_infs: list[torch.Tensor], in_place: bool) -> bool:
        """Puts this iteration's update into _next: scaler_update_ over the found_inf tensors
        summed as torch's update() sums them (into the first one, in place, when in_place, as
        torch does).  Returns False, having changed nothing, where only torch's update() can do
        it (a device without our kernels, values torch's update() refuses, a state replaced by
        tensors of other types)."""
        scale, tracker, state = self._scale, self._growth_tracker, self._state
        assert scale is not None and tracker is not None
        if state is None or not (scale.is_cuda or scale.is_cpu):
            return False
        if not self._owns_state() and (
            scale.dtype != torch.float32
            or tracker.dtype != torch.int32
            or scale.device != state.device
            or tracker.device != state.device
        ):
            return False
        factors = _kernel_update_args(
            self._growth_factor, self._backoff_factor, self._growth_interval
        )
        if factors is None:
            return False
        dev = scale.device
        # (a CPU kernel reads its input at once: no asynchronous copy to the CPU)
        moved = [f.to(device=dev, non_blocking=dev.type != "cpu") for f in found_infs]
        found = moved[0] if in_place else moved[0].clone()
        for f in moved[1:]:
            found += f
        ops.scaler_update_(
            found, self._pass_state(), self._pending_buffer(dev), *factors, *self._kernel_policy
        )
        return True

    def _report_floor_hit(self) -> None:
        """at_min_scale's "warn" or "raise", for an update that held a backoff at min_scale."""
        counts = self.counters()
        message = (
            f"GradScaler: the gradients of step {counts['steps']} had inf/NaN (the optimizer "
            f"step was skipped) and the scale's backoff is held at min_scale={self._min_scale!r}:"
            f" the scale is {self.get_scale()!r}, floor hit number {counts['floor_hits']}.  "
            "Gradients that overflow "
            "at the floor point at a diverging run or a bad batch rather than a scale too high: "
            "find the parameter with inf/NaN gradients, lower min_scale, or pass "
            "at_min_scale='clamp' to go on at the floor."
        )
        if self._at_min_scale == "raise":
            raise RuntimeError(message)
        warnings.warn(message, UserWarning, stacklevel=3)

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        # update(new_scale): torch's rules and exception types, messages that say what was given.
        scale = self._scale
        assert scale is not None
        if isinstance(new_scale, float):
            try:
                scale.fill_(new_scale)
            except RuntimeError as e:  # float32 cannot hold it; nothing was written
                raise RuntimeError(
                    f"update(new_scale): new_scale={new_scale!r} cannot be the scale, a float32 "
                    f"tensor: {e}"
                ) from e
            return
        rule = (
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
            "torch.FloatTensor with requires_grad=False."
        )
        device = getattr(new_scale, "device", _ABSENT)
        if device is _ABSENT:  # torch reads new_scale.device.type and fails the same way
            raise AttributeError(
                f"{rule} update() got {new_scale!r} ({type(new_scale).__name__}); pass "
                "float(new_scale)."
            )
        if device.type != self._device:
            raise AssertionError(
                f"{rule} update() got a tensor on {device}; the scaler's device is "
                f"{self._device!r}: move it there first."
            )
        if new_scale.numel() != 1:
            raise AssertionError(f"{rule} update() got {new_scale.numel()} elements.")
        if new_scale.requires_grad is True:
            raise AssertionError(f"{rule} update() got a tensor that requires grad: detach it.")
        try:
            scale.copy_(new_scale)
        except RuntimeError as e:  # e.g. shape [1] into the 0-dim scale, as torch fails
            raise RuntimeError(
                f"update(new_scale): new_scale of shape {tuple(new_scale.shape)} cannot be "
                f"copied into the 0-dim scale ({e}); pass new_scale.reshape(()) instead"
            ) from e

    def _pending_is_torch_update(self, pending: _Pending, found_infs: list[torch.Tensor]) -> bool:
        scale, tracker = self._scale, self._growth_tracker
        if (
            scale is not pending.scale
            or tracker is not pending.tracker
            or tensor_version(scale) != pending.scale_version
            or tensor_version(tracker) != pending.tracker_version
            or pending.factors != (self._growth_factor, self._backoff_factor, self._growth_interval)
            or len(found_infs) != len(pending.found)
        ):
            return False
        for f in found_infs:
            seen = pending.found.get(id(f))
            if seen is None or seen[0] is not f or seen[1] != tensor_version(f):
                return False
        return True

    # ----------------------------------------------------------------------------- diagnostics
    @_not_traced_eager
    def watch(
        self,
        parameters: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        *,
        log_skipped: bool | str = False,
    ) -> GradScaler:
        """Opt in to per-parameter statistics, recorded by the pass that unscales.

        From the next pass on, the pass also writes, per gradient, the L2 norm of the unscaled
        values, the largest finite magnitude and the counts of +inf, -inf, NaN and zeros, on
        the device and without a sync.  :meth:`report` and :meth:`grad_norms` read them (one
        device-to-host copy) and name each parameter.

        Args:
            parameters: a module (its ``named_parameters()``) or ``(name, parameter)`` pairs,
                named once; parameters of the optimizer not given here are reported as
                ``"<param N>"``.
            log_skipped: also report every skipped step: ``"log"`` (``logging`` warning on the
                ``"ampfused"`` logger), ``"warn"`` (``warnings.warn``) or False.  Either costs a
                sync in every :meth:`update` (to learn whether the step was skipped).

        Returns:
            self, so ``scaler = GradScaler("cuda").watch(model)`` works.
        """
        if log_skipped not in (False, "log", "warn"):
            raise ValueError(
                f"watch: log_skipped must be False, 'log' or 'warn', got {log_skipped!r}"
            )
        named = (
            parameters.named_parameters() if isinstance(parameters, torch.nn.Module) else parameters
        )
        names: dict[int, str] = {}
        order: dict[int, int] = {}
        keep = []
        for i, item in enumerate(named):
            try:
                name, param = item
            except (TypeError, ValueError) as e:
                raise TypeError(
                    "watch: parameters must be a torch.nn.Module or (name, parameter) pairs such "
                    f"as model.named_parameters(); item {i} is {type(item).__name__}"
                ) from e
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"watch: the parameter named {name!r} is a {type(param).__name__}, not a tensor"
                )
            names.setdefault(id(param), str(name))
            order.setdefault(id(param), i)
            keep.append(param)
        self._watch = _Watch(names, order, keep, log_skipped)
        return self

    @_not_traced_eager
    def unwatch(self) -> None:
        """Stop recording statistics: the pass goes back to doing only what torch's does."""
        self._watch = None
        self._stats_now, self._stats_last = [], []

    @_not_traced_eager
    def report(self) -> StepReport | None:
        """The statistics of the current iteration's passes (between :meth:`unscale_` and
        :meth:`update`) or else of the last completed iteration, by parameter name; None before
        any pass under :meth:`watch`.  Syncs: one device-to-host copy per device.

        ``print(report)`` lists the gradients that held inf/NaN, first offender first;
        ``report.grads`` holds every parameter's :class:`ampfused.diagnostics.GradStats`.
        """
        passes = self._stats_now or self._stats_last
        if self._watch is None or not passes:
            return None
        return diagnostics.build_report(
            [(t, pn, _flat_params(groups)) for t, pn, groups in passes],
            self._watch.names,
            self._watch.order,
        )

    @_not_traced_eager
    def grad_norms(self, norm_type: float = 2.0, group_separator: str = "/") -> dict[str, float]:
        """Per-parameter L2 norms of the unscaled gradients and their total, keyed as
        Lightning's ``grad_norm`` keys them (``grad_2.0_norm/<name>``, ``grad_2.0_norm_total``),
        as Python floats from one device-to-host copy: ready for ``self.log_dict``, W&B or
        TensorBoard.  Needs :meth:`watch`; empty before the first pass.  Syncs.  Under FSDP or
        tensor parallelism, the norms of this rank's shards."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"grad_norms: the fused pass computes L2 norms only (norm_type=2.0), got "
                f"norm_type={norm_type!r}; for other norms use torch.linalg.vector_norm on the "
                "gradients after scaler.unscale_(optimizer)"
            )
        if self._watch is None:
            raise RuntimeError(
                "grad_norms() needs per-parameter statistics: call scaler.watch(model) once "
                "before training"
            )
        passes = self._stats_now or self._stats_last
        if not passes:
            return {}
        return diagnostics.grad_norms(
            [(t, pn, _flat_params(groups)) for t, pn, groups in passes],
            self._watch.names,
            self._watch.order,
            group_separator,
        )

    @_not_traced_eager
    def step_skipped_tensor(self) -> torch.Tensor:
        """Whether the last iteration's optimizer step was skipped (inf/NaN found), as a 0-dim
        bool tensor on the scale's device, without a sync: valid from :meth:`step` on (before
        :meth:`update` it is computed from this iteration's found_inf; after, from the
        consecutive-skips counter)."""
        if not self._enabled or self._scale is None:
            return torch.zeros((), dtype=torch.bool)
        flags = [
            f
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        dev = self._scale.device
        if flags:
            # (0-dim whatever the flags' shape: ShardedGradScaler's are (1,))
            skipped = sum(f.to(dev, non_blocking=True) for f in flags) > 0  # type: ignore[operator]
            return skipped.reshape(())
        assert self._state is not None
        return self._state[_CONSECUTIVE_SKIPS] > 0

    @_not_traced_eager
    def step_skipped(self) -> bool:
        """:meth:`step_skipped_tensor` as a Python bool: one sync.  The pattern it serves::

        scaler.step(optimizer)
        scaler.update()
        if not scaler.step_skipped():
            scheduler.step()
        """
        return bool(self.step_skipped_tensor())

    def _close_iteration(self) -> None:
        """At update(): this iteration's tables become the last iteration's; a skipped step is
        reported when watch(log_skipped=...) asked for it."""
        watch = self._watch
        assert watch is not None
        self._stats_last, self._stats_now = self._stats_now, []
        if not watch.log_skipped or not self._stats_last:
            return
        report = self.report()
        if report is not None and report.skipped:
            if watch.log_skipped == "warn":
                warnings.warn(str(report), RuntimeWarning, stacklevel=3)
            else:
                _LOG.warning("%s", report)


def _any_empty_grad(groups: Any) -> bool:
    return any(p.grad is not None and p.grad.numel() == 0 for g in groups for p in g["params"])


def _flat_params(groups: Any) -> list:
    return [p for g in groups for p in g["params"]]


def _group_index(groups: Any, position: int) -> tuple[int, int]:
    """(group, index in the group) of a position in _flat_params(groups)."""
    for g, group in enumerate(groups):
        n = len(group["params"])
        if position < n:
            return g, position
        position -= n
    raise IndexError(position)


class _Watch:
    """What watch() was given: names and ranks by parameter identity (the parameters are kept,
    so an identity is never reused while watched)."""

    __slots__ = ("names", "order", "params", "log_skipped", "warned")

    def __init__(self, names: dict, order: dict, params: list, log_skipped: bool | str) -> None:
        self.names, self.order, self.params = names, order, params
        self.log_skipped = log_skipped
        self.warned = False

    def not_covered(self, path: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"ampfused GradScaler.watch: some gradients went through {path} (tensor "
                "subclasses other than DTensor, a device without ampfused kernels, a subclass "
                "overriding _unscale_grads_, or MasterWeights), which records no statistics: "
                "report() and grad_norms() do not cover that optimizer's gradients",
                RuntimeWarning,
                stacklevel=4,
            )
