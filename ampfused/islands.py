"""Float32 islands: ``ampfused.keep_float32(model, modules)`` runs the named modules in float32.

The fix the debugging guides give for an fp16 overflow that starts in one layer (a softmax, a
norm, an attention score): run that layer in float32 and leave the rest of the model in mixed
precision.  An island wraps each chosen module's forward (an attribute on the module, so its
class, parameters and buffers are untouched): its floating inputs (float16 and bfloat16 tensors,
also inside tuples, lists and dicts) are cast to float32 and the forward runs with autocast off.
Its parameters must be float32, as they are when training under ``torch.autocast``.  Its outputs
are float32: the module computes in float32, and the next autocast op casts them to what it runs
in.  ``state_dict``, hooks (they run around the island), ``deepcopy`` and ``torch.compile`` work
as before, and ``island.remove()`` takes it away.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["Island", "keep_float32", "select_modules"]

_LOW = (torch.float16, torch.bfloat16)


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, (tuple, list)):
        cast = [_to_float32(v) for v in value]
        return type(value)(cast) if type(value) in (tuple, list) else type(value)(*cast)
    if isinstance(value, dict):
        return {k: _to_float32(v) for k, v in value.items()}
    return value


def _device_type(args: Any, kwargs: dict, module: torch.nn.Module) -> str:
    """The device type whose autocast the island turns off: its inputs', else its parameters'."""
    stack = [args, kwargs]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            return v.device.type
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    param = next(module.parameters(), None)
    return "cpu" if param is None else param.device.type


class _Float32Forward:
    """An island module's forward: its class's forward (or the one it had set on itself)
    called with float32 inputs and autocast off, inside one ``with`` that torch.compile
    traces.  Holds the module itself, not a bound method, so a deepcopy's island calls the
    copy."""

    def __init__(self, module: torch.nn.Module, previous: Any) -> None:
        self.module, self.previous = module, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        args, kwargs = _to_float32(args), _to_float32(kwargs)
        with torch.autocast(_device_type(args, kwargs, module), enabled=False):
            if self.previous is not None:
                return self.previous(*args, **kwargs)
            return type(module).forward(module, *args, **kwargs)


def select_modules(model: torch.nn.Module, which: Any, where: str) -> list[tuple[str, Any]]:
    """The modules of `model` that `which` names: True for every leaf module, else module names
    (as ``named_modules()`` gives them) and module types, alone or in an iterable."""
    if which is True:
        return [(n, m) for n, m in model.named_modules() if next(m.children(), None) is None]
    if isinstance(which, (str, type)):
        which = [which]
    try:
        wanted = list(which)
    except TypeError as e:
        raise TypeError(
            f"{where} must be True (every leaf module) or module names and types, got "
            f"{type(which).__name__}"
        ) from e
    for w in wanted:
        if not isinstance(w, (str, type)):
            raise TypeError(
                f"{where} must be True or module names (str) and module types; got {w!r} "
                f"({type(w).__name__})"
            )
    names = {w for w in wanted if isinstance(w, str)}
    types = tuple(w for w in wanted if isinstance(w, type))
    modules = dict(model.named_modules())
    missing = sorted(names - modules.keys())
    if missing:
        raise ValueError(
            f"{where} names {', '.join(map(repr, missing))}, which the model does not have; "
            "pass names as model.named_modules() gives them"
        )
    chosen = [(n, m) for n, m in modules.items() if n in names or (types and isinstance(m, types))]
    if not chosen:
        raise ValueError(f"{where} selects no module of the model")
    return chosen


class Island:
    """The modules :func:`keep_float32` turned into float32 islands; ``remove()`` restores
    their forward."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]) -> None:
        self.names = [name for name, _ in modules]
        self._modules = []
        for _, module in modules:
            previous = module.__dict__.get("forward")
            if isinstance(previous, _Float32Forward):  # already an island
                continue
            module.forward = _Float32Forward(module, previous)
            self._modules.append(module)

    def remove(self) -> None:
        for module in self._modules:
            island = module.__dict__.get("forward")
            if isinstance(island, _Float32Forward):
                if island.previous is None:
                    del module.forward
                else:
                    module.forward = island.previous
        self._modules = []

    def __repr__(self) -> str:
        return f"ampfused.Island({self.names!r})"


def keep_float32(model: torch.nn.Module, modules: Any) -> Island:
    """Run the chosen modules of `model` in float32, with autocast off, from the next call on.

    Args:
        model: the model (a ``torch.nn.Module``).
        modules: module names as ``model.named_modules()`` gives them (the name
            ``print(scaler.report())`` suggests), module types (every module of that type), or
            an iterable of both.

    Returns:
        the :class:`Island`; ``island.remove()`` goes back to mixed precision.  An empty list
        (``scaler.report().suggested_islands`` where the trace shows no island that helps)
        changes nothing: an empty Island, and a ``UserWarning`` saying where to look instead.

    Raises:
        TypeError: `modules` is neither names nor types; a chosen module holds float16 or
            bfloat16 parameters (a model converted with ``.half()``: its layers cannot compute
            in float32 without float32 weights; train it under ``torch.autocast`` instead, or
            keep that module's parameters float32).
        ValueError: a name the model does not have, or types no module of the model has.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"keep_float32: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not isinstance(modules, (str, type, bool)):
        try:
            modules = list(modules)
        except TypeError:
            pass  # (refused by select_modules, which names what it takes)
        else:
            if not modules:
                warnings.warn(
                    "keep_float32: no module given, so nothing runs in float32.  An empty "
                    "scaler.report().suggested_islands means the trace shows no island that "
                    "lets the step through: print(scaler.report()) says why, which modules an "
                    "island would have to hold at least (report.needed_islands) and what else "
                    "to do (a lower scale, policy='headroom').",
                    UserWarning,
                    stacklevel=2,
                )
                return Island([])
    chosen = select_modules(model, modules, "keep_float32: modules")
    for name, module in chosen:
        low = next((p for p in module.parameters() if p.dtype in _LOW), None)
        if low is not None:
            raise TypeError(
                f"keep_float32: module {name or '<model>'!r} holds {low.dtype} parameters, which "
                "cannot compute in float32; keep its parameters float32 (train under "
                "torch.autocast, or module.float() for this module alone)"
            )
    return Island(chosen)
