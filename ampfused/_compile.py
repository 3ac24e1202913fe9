"""How the scaler's methods meet ``torch.compile``: called at a graph break, run eagerly.

torch's scaler is on dynamo's skip list: compiled code calls its methods at a graph break, they
run eagerly, and the optimizer's ``step`` they call is compiled as a frame of its own.  Tracing
the scaler instead would add a graph wherever its operations are not next to the user's (torch's
optimizers break the graph before and after every step under compile).  So each method
torch.compile can meet is marked not to be traced (:func:`not_traced`), and inside a compiled
region it runs with dynamo's frame evaluation off (:func:`eager`), except that ``step`` calls the
optimizer's step with it on.  Graphs, graph breaks and results are those of torch's scaler; the
work between the graphs is the fused C++ path, at eager speed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ampfused._torch_private import compiled_region_active, mark_not_traced

__all__ = ["as_is", "compiled_region_active", "eager", "not_traced", "not_traced_eager"]


def not_traced(method: Callable) -> Callable:
    """Marks a method torch.compile calls instead of tracing; the method itself goes
    :func:`eager` when it finds itself in a compiled region (on the per-step path, where a
    wrapper's frame would cost every eager call)."""
    mark_not_traced(method)
    return method


def not_traced_eager(method: Callable) -> Callable:
    """:func:`not_traced`, for methods off the per-step path: the wrapper goes eager for them."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if compiled_region_active():
            return eager(method)(*args, **kwargs)
        return method(*args, **kwargs)

    return not_traced(wrapper)


def as_is(fn: Callable) -> Callable:
    return fn


_EAGER_ISLANDS: dict[Callable, Callable] = {}


def eager(fn: Callable) -> Callable:
    """fn with torch.compile's frame evaluation off while it runs, so that none of the scaler's
    own helpers is compiled.  Made on first use: torch.compiler.disable imports torch._dynamo,
    which is only loaded already when a compiled region is running."""
    island = _EAGER_ISLANDS.get(fn)
    if island is None:
        island = _EAGER_ISLANDS[fn] = torch.compiler.disable(fn, recursive=True)
    return island
