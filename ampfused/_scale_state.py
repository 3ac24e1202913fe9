"""The loss scale's state and policy: what the scaler keeps between iterations, and its rule.

torch's scaler keeps a float32 scale and an int32 growth tracker.  ampfused keeps them inside one
int32 tensor on the scale's device (``ScalerState`` in csrc/unscale_math.h)::

    [0] scale (float32 bits)   [1] growth tracker   [2] hysteresis left
    [3] steps  [4] skipped_steps  [5] consecutive_skips  [6] growths  [7] backoffs  [8] floor_hits
    [9] the iteration's measured magnitude (float32 bits)   [10..27] the headroom policy's
    ceiling, since_backoff and history   [28] its learned margin (float32 bits)

``GradScaler._scale`` and ``_growth_tracker`` are views of elements 0 and 1, so one copy
commits the whole update.  The fused pass computes the update torch's ``update()`` would make
(the same rule, plus the policy: bounds, hysteresis, counters) into a second such tensor, the
pending update, while it reads the gradients; ``update()`` commits it when nothing it depended
on changed since (:meth:`ScaleState.pending_holds`), and computes it again from the found_inf
tensors otherwise (:meth:`ScaleState.prepare_next`), so results never differ from torch's.

Bad values are refused when they are given, not steps later: each check below tries the value
the way torch will use it (``torch.full`` for the scale and the growth tracker,
``torch._amp_update_scale_``'s argument parser for the factors and the interval) and raises the
exception torch would raise then (so ``except TypeError:`` written against torch keeps working),
with a message naming the argument.  A checkpoint is checked whole before anything changes.

:class:`ScaleState` is testable on its own: made on a device, fed found_inf tensors, committed.
It holds no reference to the scaler; the scaler passes it torch's own attributes (the scale, the
tracker, the factors) where the rule needs them.
"""

from __future__ import annotations

import math
import numbers
import struct
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ampfused import ops
from ampfused._arguments import check_init_scale
from ampfused._torch_private import amp_update_scale_, tensor_version
from ampfused.reference import MARGIN_LEAST

__all__ = ["ScaleState", "Checkpoint", "read_checkpoint", "check_policy", "check_update_arg"]

# The state tensor's layout (ops.STATE_FIELDS: ScalerState in csrc/unscale_math.h).
STATE_SIZE = ops.STATE_SIZE
HYSTERESIS_LEFT = ops.STATE_FIELDS.index("hysteresis_left")
CONSECUTIVE_SKIPS = ops.STATE_FIELDS.index("consecutive_skips")
FLOOR_HITS = ops.STATE_FIELDS.index("floor_hits")
MAGNITUDE = ops.STATE_FIELDS.index("magnitude")
CEILING = ops.STATE_FIELDS.index("ceiling")  # then since_backoff, the caps and the margin
# steps, skipped_steps, consecutive_skips: what update(new_scale) advances
ITERATION_COUNTERS = slice(ops.STATE_FIELDS.index("steps"), CONSECUTIVE_SKIPS + 1)
COUNTERS = slice(HYSTERESIS_LEFT, FLOOR_HITS + 1)  # hysteresis left and the counters
COUNTER_NAMES = ops.STATE_FIELDS[HYSTERESIS_LEFT + 1 : FLOOR_HITS + 1]  # counters()'s keys
POLICIES = ("torch", "headroom")
DEFAULT_HEADROOM = 4.0  # a fixed headroom's default, and the most a learned margin takes
LEARNED = "learned"  # headroom="learned": the margin learned up to DEFAULT_HEADROOM
HEADROOM_START = 1.0  # the headroom policy's first scale where init_scale is torch's default


def _bits(value: float) -> int:
    """A float32's bits as an int32 (no tensor made)."""
    return struct.unpack("i", struct.pack("f", value))[0]


def _float(bits: int) -> float:
    """The float32 whose bits an int32 holds (the inverse of _bits)."""
    return struct.unpack("f", struct.pack("i", bits))[0]


AT_MIN_SCALE = ("clamp", "warn", "raise")
# state_dict()'s entry for what torch's scaler does not have (torch's load_state_dict ignores it).
CHECKPOINT_KEY = "ampfused"
POLICY_KEYS = ("min_scale", "max_scale", "hysteresis", "at_min_scale")
UPDATE_ARGS = ("growth_factor", "backoff_factor", "growth_interval")

_INF = float("inf")
HISTORY_LEN = ops.HISTORY
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_REAL_TYPES = (float, int)  # exact types only: bool is an int torch refuses as an interval
_ABSENT = object()

Factors = tuple[Any, Any, Any]  # (growth_factor, backoff_factor, growth_interval), as set


# ----------------------------------------------------------------------------- argument checks
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


def check_update_arg(where: str, name: str, value: Any) -> None:
    """Raises what torch's ``update()`` would raise for a growth/backoff factor or interval."""
    error = _update_arg_error(name, value)
    if error is not None:
        raise type(error)(
            f"{where}: {name} must be {_UPDATE_ARG_HELP[name]}; got {value!r} "
            f"({type(value).__name__}), which torch's scale update refuses: {error}"
        ) from error


def constructor_factor_error(
    error: Exception, growth_factor: Any, backoff_factor: Any
) -> Exception:
    """torch's constructor refusal of a factor, with the factor named.  torch compares the
    factors with 1.0 (growth_factor first): a factor out of range is an AssertionError, one that
    does not compare with a float a TypeError."""
    try:
        name = "growth_factor" if growth_factor <= 1.0 else "backoff_factor"
    except Exception:  # the comparison itself failed
        name = "growth_factor"
    value = growth_factor if name == "growth_factor" else backoff_factor
    if isinstance(error, AssertionError):  # torch's message first: users may match on it
        return AssertionError(f"{error} GradScaler got {name}={value!r}.")
    return type(error)(
        f"GradScaler: {name} must be {_UPDATE_ARG_HELP[name]}; got {value!r} "
        f"({type(value).__name__}), which does not compare with a float: {error}"
    )


def check_fill(where: str, value: Any, dtype: torch.dtype, into: torch.Tensor | None) -> None:
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


def f32(value: float) -> float:
    """value rounded to float32 (+-inf beyond its range), with no tensor made."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # rounds to +-inf
        return math.copysign(_INF, value)


Policy = tuple[float | None, float | None, int, str]  # min_scale, max_scale, hysteresis, at_min


def check_policy(
    where: str, min_scale: Any, max_scale: Any, hysteresis: Any, at_min_scale: Any
) -> Policy:
    """The scale policy as ScaleState keeps it, or the exception naming the argument: TypeError
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
            bound = f32(float(value))  # the kernels hold it as a float32, as the scale
        except OverflowError:  # an int beyond float64
            bound = _INF
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(
                f"{where}: {name} must be a positive number that float32 can hold (or None for "
                f"no bound); got {value!r}"
            )
        bounds.append(float(value))
    low, high = bounds
    if low is not None and high is not None and f32(low) > f32(high):
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
    _check_choice(where, "at_min_scale", at_min_scale, AT_MIN_SCALE)
    if at_min_scale != "clamp" and low is None:
        raise ValueError(
            f"{where}: at_min_scale={at_min_scale!r} acts when a backoff is held at min_scale, "
            "and min_scale is None: pass min_scale too"
        )
    return low, high, int(hysteresis), at_min_scale


def _check_choice(where: str, name: str, value: Any, choices: tuple, about: str = "") -> None:
    """A string option: TypeError for another type, ValueError for another string."""
    wanted = f"{where}: {name} must be one of {', '.join(map(repr, choices))}"
    if not isinstance(value, str):
        raise TypeError(f"{wanted}; got {value!r} ({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{wanted}{about}; got {value!r}")


def check_headroom(where: str, policy: Any, headroom: Any) -> float:
    """The headroom factor as the kernels take it (0.0: torch's rule; negative: "learned", a
    margin learned up to DEFAULT_HEADROOM), or the exception naming the argument."""
    _check_choice(
        where,
        "policy",
        policy,
        POLICIES,
        " ('torch' is torch's rule, 'headroom' moves the scale by measured magnitudes)",
    )
    if headroom is None or headroom == LEARNED:  # (None: the property under torch's rule)
        return -DEFAULT_HEADROOM if policy == "headroom" else 0.0
    if isinstance(headroom, bool) or not isinstance(headroom, numbers.Real):
        raise TypeError(
            f"{where}: headroom must be 'learned' (a margin learned from how the magnitudes move)"
            f" or a float from 1 to 65504 (how many times below float16's largest value the "
            f"headroom policy keeps the largest measured magnitude); got {headroom!r} "
            f"({type(headroom).__name__})"
        )
    if not 1.0 <= float(headroom) <= 65504.0:
        raise ValueError(
            f"{where}: headroom must be from 1 to 65504 (a factor below float16's largest "
            f"value, 65504); got {headroom!r}"
        )
    return f32(float(headroom)) if policy == "headroom" else 0.0


def check_constructor(enabled: bool, init_scale: Any, factors: Factors, policy: tuple) -> Policy:
    """The constructor's values beyond torch's own checks, in the order torch would meet them
    (the first scale(), update()), then the policy, then init_scale within its bounds.  torch
    checks nothing else, and uses nothing, when disabled.  Beyond torch: an init_scale that is
    zero, negative, inf or NaN, which torch accepts and trains into NaN or sign-flipped
    gradients."""
    if enabled:
        check_fill("GradScaler: init_scale", init_scale, torch.float32, None)
        check_init_scale("GradScaler", init_scale)
        for name, value in zip(UPDATE_ARGS, factors, strict=True):
            check_update_arg("GradScaler", name, value)
    checked = check_policy("GradScaler", *policy)
    if enabled and (policy[0] is not None or policy[1] is not None):
        _check_init_scale(init_scale, policy[0], policy[1])
    return checked


def _check_init_scale(init_scale: Any, min_scale: Any, max_scale: Any) -> None:
    """The constructor's init_scale within the policy's bounds (both held as float32)."""
    init = f32(float(init_scale))
    for name, bound, outside in (
        ("min_scale", min_scale, lambda b: init < b),
        ("max_scale", max_scale, lambda b: init > b),
    ):
        if bound is not None and outside(f32(bound)):
            raise ValueError(
                f"GradScaler: init_scale={init_scale!r} is outside the scale's bounds "
                f"({name}={bound!r}); pass an init_scale from min_scale to max_scale"
            )


def kernel_update_args(factors: Factors) -> tuple[float, float, int] | None:
    """The update arguments as the fused kernel's (double, double, int64), or None where torch's
    update() would refuse them (the caller then takes torch's path, which raises there)."""
    growth_factor, backoff_factor, growth_interval = factors
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
    if any(_update_arg_error(n, v) is not None for n, v in zip(UPDATE_ARGS, factors, strict=True)):
        return None
    return float(growth_factor), float(backoff_factor), int(growth_interval)


def check_new_scale(new_scale: Any, device_type: str) -> None:
    """update(new_scale)'s argument, refused as torch refuses it (its types, messages that say
    what was given).  A float is checked by writing it."""
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
    if device.type != device_type:
        raise AssertionError(
            f"{rule} update() got a tensor on {device}; the scaler's device is "
            f"{device_type!r}: move it there first."
        )
    if new_scale.numel() != 1:
        raise AssertionError(f"{rule} update() got {new_scale.numel()} elements.")
    if new_scale.requires_grad is True:
        raise AssertionError(f"{rule} update() got a tensor that requires grad: detach it.")


def write_new_scale(scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
    """update(new_scale): the scale set to it, or torch's exception with what was given."""
    if isinstance(new_scale, float):
        try:
            scale.fill_(new_scale)
        except RuntimeError as e:  # float32 cannot hold it; nothing was written
            raise RuntimeError(
                f"update(new_scale): new_scale={new_scale!r} cannot be the scale, a float32 "
                f"tensor: {e}"
            ) from e
        return
    try:
        scale.copy_(new_scale)
    except RuntimeError as e:  # e.g. shape [1] into the 0-dim scale, as torch fails
        raise RuntimeError(
            f"update(new_scale): new_scale of shape {tuple(new_scale.shape)} cannot be "
            f"copied into the 0-dim scale ({e}); pass new_scale.reshape(()) instead"
        ) from e


# ----------------------------------------------------------------------------- checkpoints
class Checkpoint(NamedTuple):
    """A state_dict, checked whole: torch's entries, then ours (None for a checkpoint of
    torch's scaler, which has none: the policy stays and the counters start afresh)."""

    scale: Any
    factors: list[Any]
    growth_tracker: Any
    policy: Policy | None
    counters: list[int] | None
    headroom: float | None = None  # the headroom factor (0.0: torch's rule); None: not saved
    # the headroom policy's [ceiling, since_backoff, *caps, margin]; None: not saved
    history: list[float] | None = None


def read_checkpoint(
    state_dict: Mapping[str, Any], scale: torch.Tensor | None, tracker: torch.Tensor | None
) -> Checkpoint:
    """Every entry of a state_dict checked, refused with the exception torch raises for it.

    torch's own load_state_dict assigns entry by entry (a bad one leaves the state half loaded)
    and defers most checks to the first ``scale()`` or ``update()``; the checks run here in the
    order torch meets the values (load, first scale(), update()), so that of several bad entries
    the one torch would raise for is reported, with torch's type.  `scale` and `tracker`: the
    scaler's tensors, None before its lazy init.
    """
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

    scale_where = "load_state_dict: state_dict['scale']"
    tracker_where = "load_state_dict: state_dict['_growth_tracker']"
    scale_value = entry("scale")
    if scale is not None:
        check_fill(scale_where, scale_value, torch.float32, scale)
    factors = [entry(name) for name in UPDATE_ARGS]
    tracker_value = entry("_growth_tracker")
    if tracker is not None:
        check_fill(tracker_where, tracker_value, torch.int32, tracker)
    if scale is None:
        check_fill(scale_where, scale_value, torch.float32, None)
        check_fill(tracker_where, tracker_value, torch.int32, None)
    for name, value in zip(UPDATE_ARGS, factors, strict=True):
        check_update_arg(f"load_state_dict: state_dict[{name!r}]", name, value)
    extra = _read_extra(state_dict.get(CHECKPOINT_KEY, _ABSENT))
    policy, counters, headroom, history = (None, None, None, None) if extra is None else extra
    return Checkpoint(scale_value, factors, tracker_value, policy, counters, headroom, history)


def _read_extra(
    entry: Any,
) -> tuple[Policy, list[int], float | None, list[float] | None] | None:
    """state_dict()["ampfused"] checked: (the policy, hysteresis left and the counters, the
    headroom factor and history, None where a checkpoint from before the headroom policy has
    none), or None when the checkpoint has no such entry (one of torch's scaler)."""
    if entry is _ABSENT:
        return None
    where = f"load_state_dict: state_dict[{CHECKPOINT_KEY!r}]"
    if not isinstance(entry, dict):
        raise TypeError(
            f"{where} must be the dict GradScaler.state_dict() writes there; got "
            f"{type(entry).__name__}"
        )
    names = (*POLICY_KEYS, "hysteresis_left", *COUNTER_NAMES)
    missing = [name for name in names if name not in entry]
    if missing:
        raise KeyError(
            f"{where} has no {', '.join(map(repr, missing))} entry; it needs "
            f"{', '.join(map(repr, names))}, as GradScaler.state_dict() writes them"
        )
    policy = check_policy(where, *(entry[name] for name in POLICY_KEYS))
    counters = []
    for name in names[len(POLICY_KEYS) :]:
        value = entry[name]
        if type(value) is not int:
            raise TypeError(
                f"{where}[{name!r}] must be an int (an int32 counter); got {value!r} "
                f"({type(value).__name__})"
            )
        check_fill(f"{where}[{name!r}]", value, torch.int32, None)
        counters.append(value)
    if not 0 <= counters[0] <= policy[2]:
        raise ValueError(
            f"{where}['hysteresis_left'] must be from 0 to hysteresis={policy[2]}; got "
            f"{counters[0]}"
        )
    headroom = history = None
    if "headroom" in entry:  # (0.0: torch's rule)
        value = entry["headroom"]
        zero = isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
        headroom = 0.0 if zero else check_headroom(f"{where}['headroom']", "headroom", value)
    if any(key in entry for key in HEADROOM_KEYS):
        history = _read_headroom_state(where, entry)
    return policy, counters, headroom, history


HEADROOM_KEYS = ("ceiling", "since_backoff", "history")  # (and "margin", since it is learned)
# [ceiling, since_backoff, *caps, margin] of a fresh start: no ceiling, no backoff yet, no cap,
# no margin learned.
FRESH_HEADROOM_STATE = (_INF, 2**31 - 1, *(_INF,) * HISTORY_LEN, 0.0)


def _read_headroom_state(where: str, entry: dict) -> list:
    """The headroom policy's state in a checkpoint: [ceiling, since_backoff, *caps, margin],
    the ceiling a positive float32 (+inf: none), the caps nonzero float32s (negative: an
    overflow's bound), since_backoff an int32 count, the margin a float32: 0 (none learned, as
    in checkpoints from before it was learned) or from sqrt(2) to 65504."""
    missing = [key for key in HEADROOM_KEYS if key not in entry]
    if missing:
        raise KeyError(
            f"{where} has no {', '.join(map(repr, missing))} entry; the headroom policy's state "
            f"is {', '.join(map(repr, HEADROOM_KEYS))}, as GradScaler.state_dict() writes it"
        )
    caps = entry["history"]
    if not isinstance(caps, (list, tuple)) or len(caps) != HISTORY_LEN:
        raise TypeError(
            f"{where}['history'] must be a list of {HISTORY_LEN} floats (the headroom policy's "
            f"scale caps, as GradScaler.state_dict() writes it); got {caps!r}"
        )
    out: list = []
    margin = entry.get("margin", 0.0)
    values = (("ceiling", entry["ceiling"]), *(("history", c) for c in caps), ("margin", margin))
    for name, v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{where}[{name!r}] must hold floats; got {v!r} ({type(v).__name__})")
        v = f32(float(v))
        if name == "ceiling" and not v > 0:
            raise ValueError(f"{where}['ceiling'] must be a positive float (inf: none); got {v!r}")
        if name == "history" and (v == 0 or math.isnan(v)):
            raise ValueError(
                f"{where}['history'] must hold nonzero floats (inf: none, negative: an overflow's "
                f"bound); got {v!r}"
            )
        if name == "margin" and not (v == 0 or MARGIN_LEAST <= v <= 65504):
            raise ValueError(
                f"{where}['margin'] must be 0 (none learned) or a float from sqrt(2) (the least "
                f"a margin is learned to) to 65504; got {v!r}"
            )
        out.append(v)
    since = entry["since_backoff"]
    if type(since) is not int or not 0 <= since <= 2**31 - 1:
        raise TypeError(
            f"{where}['since_backoff'] must be an int from 0 to 2**31 - 1 (clean steps since the "
            f"last backoff); got {since!r} ({type(since).__name__})"
        )
    out.insert(1, since)
    return out


def headroom_bits(values: Any) -> list[int]:
    """[ceiling, since_backoff, *caps, margin] as the state holds them (int32, the floats as
    bits)."""
    ceiling, since, *rest = values
    return [_bits(ceiling), since, *map(_bits, rest)]


# ----------------------------------------------------------------------------- the state
def unit_state(device: torch.device) -> torch.Tensor:
    """A state with scale 1 (and one hysteresis step left): what a read-only statistics pass
    reads over values already unscaled, or activations, leaving the scaler's state untouched."""
    unit = torch.zeros(STATE_SIZE, dtype=torch.int32, device=device)
    unit[0:1].view(torch.float32).fill_(1.0)
    unit[HYSTERESIS_LEFT] = 1
    return unit


# A read-only statistics pass's arguments after its state tensors: factors and a policy that
# make only an update nobody reads, check_only, no accumulation (and torch's rule: headroom 0.0
# where the op takes it).
READ_ONLY_PASS = (2.0, 0.5, 1, float("-inf"), float("inf"), 1, True, False)


class Pending:
    """What the fused passes of this iteration wrote into the pending update, and the inputs
    they saw, so update() can tell whether committing it equals torch's update."""

    __slots__ = ("scale", "tracker", "scale_version", "tracker_version", "factors", "found")

    def __init__(self, scale: torch.Tensor, tracker: torch.Tensor, factors: Factors) -> None:
        self.scale = scale
        self.tracker = tracker
        self.scale_version = tensor_version(scale)
        self.tracker_version = tensor_version(tracker)
        self.factors = factors
        self.found: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (found_inf, its version)

    def note(self, found_inf: torch.Tensor) -> None:
        """A fused pass wrote `found_inf` and, from it, the pending update."""
        self.found[id(found_inf)] = (found_inf, tensor_version(found_inf))


class ScaleState:
    """The int32 state tensor (made lazily on the scale's device), the pending update the fused
    passes compute, and the policy (bounds, hysteresis, what a floor hit does)."""

    def __init__(self, policy: Policy = (None, None, 1, "clamp"), headroom: float = 0.0) -> None:
        self.tensor: torch.Tensor | None = None
        # The headroom policy's factor (0.0: torch's rule), as the ops take it, and its state
        # for the lazy init ([ceiling, since_backoff, *caps]; None: a fresh start), as
        # init_counters.
        self.headroom = headroom
        self.init_history: list | None = None
        # Whether a fused pass of this iteration measured the magnitude in `next` (else
        # prepare_next zeroes it: nothing measured).
        self.measured = False
        # Whether the headroom policy has seen the gradients' dtypes (it warns once where they
        # are bfloat16: see _grad_pass.check_headroom_dtypes).
        self.dtypes_seen = False
        # (the scale view, the tracker view) made with `tensor`: the scaler's _scale and
        # _growth_tracker, as long as nobody replaced them
        self.views: tuple[torch.Tensor, torch.Tensor] | None = None
        self.next: torch.Tensor | None = None  # the pending update, same layout
        self.next_device: torch.device | None = None
        self.next_scale: torch.Tensor | None = None
        self.next_tracker: torch.Tensor | None = None
        self.pending: Pending | None = None
        # Hysteresis left and the counters for the lazy init (None: a fresh start), as torch
        # keeps _init_growth_tracker: loaded or unpickled ones.
        self.init_counters: list[int] | None = None
        self.set_policy(*policy)

    def set_policy(
        self, min_scale: float | None, max_scale: float | None, hysteresis: int, at_min_scale: str
    ) -> None:
        self.min_scale, self.max_scale = min_scale, max_scale
        self.hysteresis, self.at_min_scale = hysteresis, at_min_scale
        # (min_scale, max_scale, hysteresis) as the ops take them
        self.kernel_policy = (
            -_INF if min_scale is None else min_scale,
            _INF if max_scale is None else max_scale,
            hysteresis,
        )

    # -- the tensors
    def make(
        self, init_scale: Any, init_tracker: Any, dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The state made on `dev` (torch's lazy init, at the first scale()); returns the views
        that become the scaler's _scale and _growth_tracker.  torch.full converts (and refuses)
        the initial values as torch's lazy init does; all is made before anything is kept, so
        a failed first scale() leaves no state behind and the next one raises again."""
        scale = torch.full((), init_scale, dtype=torch.float32, device=dev)
        tracker = torch.full((), init_tracker, dtype=torch.int32, device=dev)
        rest = torch.tensor(
            [*self.counters_at_init(), 0, *self.headroom_bits_at_init()],
            dtype=torch.int32,
            device=dev,
        )
        self.tensor = torch.cat((scale.view(torch.int32).reshape(1), tracker.reshape(1), rest))
        self.views = (self.tensor[0].view(torch.float32), self.tensor[1])
        return self.views

    def owns(self, scale: torch.Tensor | None, tracker: torch.Tensor | None) -> bool:
        """Whether the scaler's _scale and _growth_tracker are still this state's views."""
        views = self.views
        return views is not None and scale is views[0] and tracker is views[1]

    def pass_input(self, scale: torch.Tensor, tracker: torch.Tensor) -> torch.Tensor:
        """The state the pass reads: the tensor, or, where _scale/_growth_tracker were replaced
        from outside, a copy of their values with the tensor's counters."""
        views = self.views  # (owns(), inline: every pass reads it)
        if views is not None and scale is views[0] and tracker is views[1]:
            return self.tensor  # type: ignore[return-value]
        return torch.cat(
            (
                scale.reshape(1).view(torch.int32),
                tracker.reshape(1),
                self.tensor[2:],  # type: ignore[index]
            )
        )

    def pending_buffer(self, dev: torch.device) -> torch.Tensor:
        nxt = self.next
        if nxt is None or self.next_device != dev:  # (reading nxt.device makes a new object)
            # A separate allocation: writing it must not bump the version counter of the scale,
            # which autograd saved for scaler.scale(loss).backward().
            nxt = self.next = torch.empty(STATE_SIZE, dtype=torch.int32, device=dev)
            self.next_device = dev
            self.next_scale = nxt[0].view(torch.float32)
            self.next_tracker = nxt[1]
        return nxt

    # -- counters
    def counters_at_init(self) -> list[int]:
        if self.init_counters is not None:
            return self.init_counters
        return [self.hysteresis] + [0] * len(COUNTER_NAMES)

    def counter_values(self) -> list[int]:
        """Hysteresis left and the counters, as ints (one device-to-host copy once the state
        exists)."""
        if self.tensor is None:
            return self.counters_at_init()
        return self.tensor[COUNTERS].tolist()

    def headroom_bits_at_init(self) -> list[int]:
        """The ceiling, since_backoff and the caps as the state holds them (int32, the floats
        as bits), for the lazy init (no tensor read)."""
        return headroom_bits(self.init_history or FRESH_HEADROOM_STATE)

    def history(self) -> list:
        """The headroom policy's state: [ceiling, since_backoff, *caps in slot order, margin]
        (a sync once the state exists); +inf: none."""
        if self.tensor is None:
            return list(self.init_history or FRESH_HEADROOM_STATE)
        ceiling, since, *rest = self.tensor[CEILING:].tolist()  # (one device-to-host copy)
        return [_float(ceiling), since, *map(_float, rest)]

    def magnitude(self) -> float:
        """The last committed iteration's measured magnitude (+inf: it found inf/NaN, 0: none
        measured); a sync."""
        if self.tensor is None:
            return 0.0
        return self.tensor[MAGNITUDE : MAGNITUDE + 1].view(torch.float32).item()

    def magnitude_view(self, nxt: torch.Tensor) -> torch.Tensor:
        """The pending update's magnitude as a float32 tensor of one element (a view)."""
        return nxt[MAGNITUDE : MAGNITUDE + 1].view(torch.float32)

    def counters(self) -> dict[str, int]:
        left, *counts = self.counter_values()
        return {**dict(zip(COUNTER_NAMES, counts, strict=True)), "hysteresis_left": left}

    def last_skipped(self) -> torch.Tensor:
        """Whether the last committed iteration was skipped, on the device (no sync)."""
        assert self.tensor is not None
        return self.tensor[CONSECUTIVE_SKIPS] > 0

    # -- the pending update
    def start_pending(
        self, scale: torch.Tensor, tracker: torch.Tensor, factors: Factors
    ) -> Pending:
        """The record of this iteration's first fused pass (the inputs it saw)."""
        self.pending = Pending(scale, tracker, factors)
        return self.pending

    def pending_holds(
        self,
        pending: Pending,
        scale: torch.Tensor,
        tracker: torch.Tensor,
        factors: Factors,
        found_infs: list[torch.Tensor],
    ) -> bool:
        """Whether the pending update is still the one torch's update() would compute: the
        same scale, tracker and factors, the same found_inf tensors, none written since."""
        if (
            scale is not pending.scale
            or tracker is not pending.tracker
            or tensor_version(scale) != pending.scale_version
            or tensor_version(tracker) != pending.tracker_version
            or pending.factors != factors
            or len(found_infs) != len(pending.found)
        ):
            return False
        for f in found_infs:
            seen = pending.found.get(id(f))
            if seen is None or seen[0] is not f or seen[1] != tensor_version(f):
                return False
        return True

    def take_pending(self) -> Pending | None:
        """The record of this iteration's passes, forgotten here (update() starts afresh)."""
        pending, self.pending = self.pending, None
        return pending

    def prepare_next(
        self,
        pending: Pending | None,
        scale: torch.Tensor,
        tracker: torch.Tensor,
        factors: Factors,
        found_infs: list[torch.Tensor],
        in_place: bool,
    ) -> bool:
        """Makes `next` hold this iteration's update: the one the fused passes computed
        (`pending`, from :meth:`take_pending`), when it still holds, else one computed now:
        scaler_update_ over the found_inf tensors summed as torch's update() sums them (into
        the first one, in place, when in_place, as torch does).  Returns False, having changed
        nothing, where only torch's update() can make it (a device without our kernels, values
        torch's update() refuses, a state replaced by tensors of other types)."""
        if pending is not None and self.pending_holds(pending, scale, tracker, factors, found_infs):
            return True
        state = self.tensor
        if state is None or not (scale.is_cuda or scale.is_cpu):
            return False
        if not self.owns(scale, tracker) and (
            scale.dtype != torch.float32
            or tracker.dtype != torch.int32
            or scale.device != state.device
            or tracker.device != state.device
        ):
            return False
        args = kernel_update_args(factors)
        if args is None:
            return False
        dev = scale.device
        # (a CPU kernel reads its input at once: no asynchronous copy to the CPU)
        moved = [f.to(device=dev, non_blocking=dev.type != "cpu") for f in found_infs]
        found = moved[0] if in_place else moved[0].clone()
        for f in moved[1:]:
            found += f
        nxt = self.pending_buffer(dev)
        if self.headroom and not self.measured:  # (no pass measured this iteration)
            nxt[MAGNITUDE] = 0
        ops.scaler_update_(
            found,
            self.pass_input(scale, tracker),
            nxt,
            *args,
            *self.kernel_policy,
            self.headroom,
        )
        return True

    def commit(self, scale: torch.Tensor, tracker: torch.Tensor) -> bool:
        """`next` becomes the state (into whatever _scale/_growth_tracker are, where they were
        replaced from outside).  Returns whether a floor hit is to be reported (a sync, only
        where at_min_scale asks for it)."""
        state, nxt = self.tensor, self.next
        assert state is not None and nxt is not None
        self.measured = False
        floor_hit = self.at_min_scale != "clamp" and bool(nxt[FLOOR_HITS] != state[FLOOR_HITS])
        views = self.views  # (owns(), inline: every update() commits)
        if views is not None and scale is views[0] and tracker is views[1]:
            state.copy_(nxt)
        else:
            scale.copy_(self.next_scale)  # type: ignore[arg-type]
            tracker.copy_(self.next_tracker)  # type: ignore[arg-type]
            state[2:].copy_(nxt[2:])
        return floor_hit

    def count_iteration(self) -> None:
        """update(new_scale): the iteration counts (steps, skips), the rule's state stays."""
        self.measured = False
        self.tensor[ITERATION_COUNTERS].copy_(self.next[ITERATION_COUNTERS])  # type: ignore[index]

    def report_floor_hit(self, scale: float) -> None:
        """at_min_scale's "warn" or "raise", for an update that held a backoff at min_scale."""
        counts = self.counters()
        message = (
            f"GradScaler: the gradients of step {counts['steps'] - 1} had inf/NaN (the optimizer "
            f"step was skipped) and the scale's backoff is held at min_scale={self.min_scale!r}:"
            f" the scale is {scale!r}, floor hit number {counts['floor_hits']}.  "
            "Gradients that overflow "
            "at the floor point at a diverging run or a bad batch rather than a scale too high: "
            "find the parameter with inf/NaN gradients, lower min_scale, or pass "
            "at_min_scale='clamp' to go on at the floor."
        )
        if self.at_min_scale == "raise":
            raise RuntimeError(message)
        warnings.warn(message, UserWarning, stacklevel=3)  # update()'s caller

    # -- checkpoints
    def checkpoint(self) -> dict[str, Any]:
        """state_dict()["ampfused"]: the policy, hysteresis left, the counters and the headroom
        policy's factor and history (a sync)."""
        left, *counts = self.counter_values()
        ceiling, since_backoff, *caps, margin = self.history()
        return {
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "at_min_scale": self.at_min_scale,
            "hysteresis_left": left,
            **dict(zip(COUNTER_NAMES, counts, strict=True)),
            "headroom": LEARNED if self.headroom < 0 else self.headroom,
            "ceiling": ceiling,
            "since_backoff": since_backoff,
            "history": caps,
            "margin": margin,
        }

    def load(
        self,
        policy: Policy | None,
        counters: list[int] | None,
        headroom: float | None = None,
        history: list[float] | None = None,
    ) -> None:
        """A checked checkpoint's part (read_checkpoint): its policy and headroom factor (None:
        kept), counters and history (None: a fresh start)."""
        if policy is not None:
            self.set_policy(*policy)
        if headroom is not None:
            self.headroom = headroom
        if counters is None:
            counters = [self.hysteresis] + [0] * len(COUNTER_NAMES)
        self.init_counters = counters
        self.init_history = history
        if self.tensor is not None:
            self.tensor[COUNTERS].copy_(torch.tensor(counters, dtype=torch.int32))
            bits = torch.tensor(self.headroom_bits_at_init(), dtype=torch.int32)
            self.tensor[CEILING:].copy_(bits)
            self.tensor[MAGNITUDE] = 0  # (the last iteration's measurement is not the loaded one's)
        self.pending = None

    # -- pickling: plain values under the scaler's own keys (no ampfused class in a pickle, and
    # the keys scalers have pickled since the policy exists)
    SNAPSHOT_KEYS = ("_min_scale", "_max_scale", "_hysteresis", "_at_min_scale")
    SNAPSHOT_EXTRA = ("_init_counters", "_headroom", "_init_history")

    def snapshot(self) -> dict[str, Any]:
        """The policy, the counters and the history (a sync once the tensor exists); the tensors
        are made again lazily from them and the scaler's _init_scale, _init_growth_tracker, as
        torch's scaler pickles its scale."""
        values = (self.min_scale, self.max_scale, self.hysteresis, self.at_min_scale)
        return {
            **dict(zip(self.SNAPSHOT_KEYS, values, strict=True)),
            "_init_counters": self.counter_values(),
            "_headroom": self.headroom,
            "_init_history": self.history(),
        }

    @classmethod
    def from_snapshot(cls, values: Mapping[str, Any]) -> ScaleState:
        """A state from :meth:`snapshot`'s values; missing ones (a scaler pickled before the
        policy existed) take the defaults."""
        defaults = (None, None, 1, "clamp")
        policy = tuple(values.get(k, d) for k, d in zip(cls.SNAPSHOT_KEYS, defaults, strict=True))
        state = cls(policy, values.get("_headroom", 0.0))  # type: ignore[arg-type]
        state.init_counters = values.get("_init_counters")
        history = values.get("_init_history")  # (without a margin: pickled before it)
        state.init_history = None if history is None else [*history, 0.0][: 3 + HISTORY_LEN]
        return state
