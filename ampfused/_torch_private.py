"""The private torch names ampfused relies on, in one place: why each is needed, and since when.

ampfused supports torch 2.11 to 2.14; every name below exists, with the meaning used here, in
all of them (the version each one first appeared in is noted).  If torch renames one, this is
the only file to change.

Not listed, because they are the drop-in contract itself: the private attributes and methods of
``torch.amp.GradScaler`` that torch's users, tests and subclasses reach into (``_scale``,
``_growth_tracker``, ``_per_optimizer_states``, ``_init_scale``, ``_init_growth_tracker``,
``_growth_factor``, ``_backoff_factor``, ``_growth_interval``, ``_enabled``, ``_device``,
``_unscale_grads_``, ``_check_inf_per_device``, ``_maybe_opt_step``, ``_get_scale_async``,
``_check_scale_growth_tracker``, ``_lazy_init_scale_growth_tracker``).  ``ampfused.GradScaler``
inherits or overrides them under the same names, so code written against torch's scaler keeps
working.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch

# The stages of torch's per-optimizer state (READY, UNSCALED, STEPPED).  The values stored in
# `_per_optimizer_states[...]["stage"]` must be torch's own members: torch's inherited methods
# and users' code compare them with `is`.  torch.amp.grad_scaler.OptState since torch 2.3
# (torch.cuda.amp.grad_scaler before); undocumented, not in any __all__.
from torch.amp.grad_scaler import OptState

# torch's scale update, used only to refuse bad growth/backoff factors and intervals when they
# are given, with the exception its own argument parser raises at update().  torch 1.9+.
amp_update_scale_ = torch._amp_update_scale_

# Tensor._version: the counter every in-place write bumps.  update() commits the pending scale
# only if neither the scale, the growth tracker nor a found_inf tensor was written since the
# fused pass saw them.  Exists since torch 0.4.
tensor_version = attrgetter("_version")


def supports_amp_scaling(optimizer: Any) -> bool:
    """Whether the optimizer unscales and skips on the device itself: the flag torch's fused
    optimizers (Adam, AdamW, SGD, Adagrad with ``fused=True``) set, and which torch's scaler
    reads to hand them ``grad_scale`` / ``found_inf`` instead of stepping on the host's
    decision.  ``Optimizer._step_supports_amp_scaling``, torch 2.0+."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


# ---------------------------------------------------------------------------- torch.compile
# torch's scaler is on dynamo's skip list (torch/amp is in trace_rules.MOD_SKIPLIST): compiled
# code calls its methods at a graph break instead of tracing them, and the frames they call
# (the optimizer's step) are compiled on their own.  ampfused.GradScaler does the same with the
# two names below.  The public torch.compiler.disable would give the first, but it wraps every
# method in an extra frame (paid on every eager call) and imports torch._dynamo (1-3 s) at
# `import ampfused`.


def mark_not_traced(fn: Any) -> None:
    """Makes dynamo call ``fn`` at a graph break instead of inlining it: the attribute
    ``torch.compiler.disable`` sets on the functions it returns, which dynamo checks before
    inlining a call (torch 2.0+)."""
    fn._torchdynamo_disable = True


_get_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def compiled_region_active() -> bool:
    """Whether this runs inside a ``torch.compile``'d function, where dynamo compiles every
    frame it has not been told to skip: the scaler's own helpers must then run with it off.
    dynamo's frame callback (None outside compiled code, False in run-only mode), read through
    ``torch._C._dynamo.eval_frame.get_eval_frame_callback`` (torch 2.6+; ``torch.compiler``'s
    set_stance reads it the same way)."""
    callback = _get_eval_frame_callback()
    return callback is not None and callback is not False


# The id of the backward pass autograd's engine is running on this thread, -1 outside one: a
# module's forward that runs inside one is activation checkpointing's recomputation (the tracer
# in ampfused/activations.py reads it per module call).  torch._C._current_graph_task_id, torch
# 1.13+.
current_graph_task_id = torch._C._current_graph_task_id

# The autograd sequence number the next backward node made on this thread will get (nodes made
# later get larger ones; ``Node._sequence_nr()``, public-ish, reads a node's): a block island
# (ampfused/scale_islands.py) takes it at its forward's start, and its walk of the graph its
# forward made stops at nodes made before.  torch._C._autograd._get_sequence_nr, torch 2.0+.
autograd_sequence_nr = torch._C._autograd._get_sequence_nr


# Whether a tensor's elements may share memory: 0 no, 1 yes (an expanded tensor: the gradient of
# a sum; a window view), 2 too hard to tell.  The statistics kernel reads a tensor element by
# element and refuses one whose elements overlap; the tracer and the islands give it a packed
# copy of such a tensor (ampfused/activations.py, packed).  torch._debug_has_internal_overlap,
# torch 1.1+ (at::has_internal_overlap).
has_internal_overlap = torch._debug_has_internal_overlap


def register_hook_first(t: torch.Tensor, hook: Any) -> Any:
    """``t.register_hook(hook)``, run before the hooks already on `t`: a block island's factor
    on its output (ampfused/scale_islands.py) must apply before the hooks its modules put on
    the same tensor in their own forward hooks (a tracer's, a nested island's).  A non-leaf
    tensor's hooks are the ``OrderedDict`` ``Tensor._backward_hooks`` (torch 1.0+;
    ``register_hook`` itself fills it), which autograd calls in the order of the plain dict
    beneath (``move_to_end`` does not change that one): emptied and filled again, ours first."""
    handle = t.register_hook(hook)
    hooks = t._backward_hooks
    others = [(key, h) for key, h in hooks.items() if key != handle.id]
    hooks.clear()
    hooks[handle.id] = hook
    hooks.update(others)
    return handle


# The attributes of a DTensor holding its local shard and its spec (a DTensorSpec, whose
# ``mesh`` and ``placements`` are public): what ``to_local()`` and ``device_mesh``/``placements``
# return, read by the C++ walk (grad_gather.cpp) for every DTensor gradient of every step (FSDP2,
# tensor parallel).  ``DTensor._local_tensor`` and ``DTensor._spec`` since torch 2.0 (then
# torch.distributed._tensor).
DTENSOR_LOCAL_ATTR = "_local_tensor"
DTENSOR_SPEC_ATTR = "_spec"


__all__ = [
    "OptState",
    "amp_update_scale_",
    "compiled_region_active",
    "current_graph_task_id",
    "autograd_sequence_nr",
    "has_internal_overlap",
    "register_hook_first",
    "DTENSOR_LOCAL_ATTR",
    "DTENSOR_SPEC_ATTR",
    "mark_not_traced",
    "supports_amp_scaling",
    "tensor_version",
]
