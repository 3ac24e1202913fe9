"""What a user passed, named for an error message, and the refusal of an argument that is not
an optimizer where one goes.  Kept apart from the pass (:mod:`ampfused._grad_pass`) because the
scaler without kernels (:mod:`ampfused._no_kernels`) refuses the same mix-ups."""

from __future__ import annotations

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


def check_optimizer(optimizer: Any, call: str, expected: str, fix: str) -> None:
    """Refuses, as a TypeError saying what was given, an argument that is not an optimizer:
    anything without ``param_groups`` (what the pass reads; a MasterWeights has them).  ``call``
    is the signature the message starts with, ``expected`` what goes there, ``fix`` the call
    corrected."""
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"{call}: expected {expected}, got {describe_argument(optimizer)}; pass the "
            f"optimizer: {fix}"
        )


def check_clip_optimizer(optimizer: Any, max_norm: Any) -> None:
    """``GradScaler.clip_grad_norm_``'s refusal of torch's ``clip_grad_norm_`` signature (the
    parameters where the optimizer goes), before anything is read or recorded."""
    check_optimizer(
        optimizer,
        "clip_grad_norm_(optimizer, max_norm)",
        "the optimizer whose gradients to clip",
        f"scaler.clip_grad_norm_(optimizer, {max_norm!r})",
    )
