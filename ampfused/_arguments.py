"""What a user passed, named for an error message, and the refusals of mix-ups torch accepts or
reports in its own terms: an argument that is not an optimizer where one goes, a number where the
device goes, a loss scale or factor that cannot work.  Kept apart from the pass
(:mod:`ampfused._grad_pass`) because the scaler without kernels (:mod:`ampfused._no_kernels`)
refuses the same mix-ups."""

from __future__ import annotations

import math
import numbers
import os
import sys
import types
from typing import Any

import torch


def describe_argument(value: Any) -> str:
    """What a user passed, for an error message: its kind, and the mix-up it most likely is
    (``model.parameters()`` where an optimizer goes, an optimizer where a model goes)."""
    if value is None:
        return "None"
    if isinstance(value, types.GeneratorType):
        return "a generator (model.parameters()?)"
    if isinstance(value, torch.nn.Module):
        return f"a module ({type(value).__name__}: the model?)"
    if hasattr(value, "param_groups"):
        return f"an optimizer ({type(value).__name__})"
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return f"a {type(value).__name__} of tensors (the parameters?)"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _not_an_optimizer(optimizer: Any, call: str, expected: str, fix: str) -> str:
    return (
        f"{call}: expected {expected}, got {describe_argument(optimizer)}; pass the optimizer: "
        f"{fix}"
    )


def check_optimizer(optimizer: Any, call: str, expected: str, fix: str) -> None:
    """Refuses, as a TypeError saying what was given, an argument that is not an optimizer:
    anything without ``param_groups`` (what the pass reads; a MasterWeights has them).  ``call``
    is the signature the message starts with, ``expected`` what goes there, ``fix`` the call
    corrected."""
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(_not_an_optimizer(optimizer, call, expected, fix))


def not_an_optimizer(optimizer: Any, method: str) -> AttributeError:
    """``step``'s and ``unscale_``'s refusal of an argument without ``param_groups`` (the model,
    ``model.parameters()``): the AttributeError torch raises there, its wording first (code may
    match on it), then what was given and the fix, as :func:`check_optimizer` says them."""
    torch_words = f"{type(optimizer).__name__!r} object has no attribute 'param_groups'"
    what = "to step" if method == "step" else "whose gradients to unscale"
    message = _not_an_optimizer(
        optimizer, f"{method}(optimizer)", f"the optimizer {what}", f"scaler.{method}(optimizer)"
    )
    return AttributeError(f"{torch_words}. {message}", name="param_groups", obj=optimizer)


def check_clip_optimizer(optimizer: Any, max_norm: Any) -> None:
    """``GradScaler.clip_grad_norm_``'s refusal of torch's ``clip_grad_norm_`` signature (the
    parameters where the optimizer goes), before anything is read or recorded."""
    check_optimizer(
        optimizer,
        "clip_grad_norm_(optimizer, max_norm)",
        "the optimizer whose gradients to clip",
        f"scaler.clip_grad_norm_(optimizer, {max_norm!r})",
    )


# ----------------------------------------------------------------------------- the constructor
def check_device(cls: str, device: Any) -> None:
    """Refuses a number where the device goes: ``torch.cuda.amp.GradScaler(65536.0)``'s
    positional init_scale, which ``torch.amp.GradScaler`` takes as the device (torch accepts it,
    and trains with the default init_scale, or the next positional argument as one)."""
    if not isinstance(device, numbers.Number):
        return
    if isinstance(device, bool):
        fix = f'{cls}("cuda", enabled={device!r})'
    else:
        fix = f'{cls}("cuda", init_scale={device!r})'
    raise TypeError(
        f"{cls}: device must be a device type such as 'cuda' or 'cpu', got {device!r} "
        f"({type(device).__name__}): the first argument of torch.amp.GradScaler is the device, "
        "not init_scale as in the deprecated torch.cuda.amp.GradScaler; write "
        f"{fix} (and name the arguments after it, each of which moved one place)"
    )


def check_init_scale(cls: str, init_scale: Any) -> None:
    """Refuses an init_scale that is zero, negative, inf or NaN (torch stores it: zero gives
    NaN parameters after a few steps, a negative one flips every gradient's sign) with the
    AssertionError torch's constructor raises for a factor out of range.  The value's type is
    checked before (torch's ``torch.full``)."""
    try:
        value = float(init_scale)
    except (TypeError, ValueError, OverflowError):  # (refused by the type check already)
        return
    if not (math.isfinite(value) and value > 0.0):
        raise AssertionError(
            f"The initial scale must be a positive finite number. {cls} got "
            f"init_scale={init_scale!r}: the loss is multiplied by it and the gradients divided "
            "by it (zero makes them NaN, a negative scale flips their sign); 2.0**16 is torch's "
            "default"
        )


def check_factor_range(where: str, name: str, value: Any) -> None:
    """Refuses, as the constructor does (torch's AssertionError and its wording first), a
    growth_factor <= 1.0 or a backoff_factor >= 1.0 given to a setter (torch stores it: a
    growth factor of -1.0 flips the scale's sign at every growth).  The value's type is checked
    before (torch's update() parser)."""
    growth = name == "growth_factor"
    try:
        bad = bool(value <= 1.0) if growth else bool(value >= 1.0)
    except Exception:  # (does not compare with a float: the type check's refusal)
        return
    if bad:
        rule, when = (
            ("The growth factor must be > 1.0.", "after growth_interval clean steps")
            if growth
            else ("The backoff factor must be < 1.0.", "after a step with inf/NaN")
        )
        raise AssertionError(
            f"{rule} {where} got {name}={value!r}, which the constructor refuses as well: the "
            f"scale is multiplied by it {when}"
        )


# ----------------------------------------------------------------------------- warnings
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """warnings.warn's stacklevel, from the caller of this function, for the first frame
    outside the package: the user's line, through however many of the scaler's frames (step()
    reaches a pass through two to four)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
