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
tensor subclasses), ``update()`` falls back to torch's own computation, so results never differ.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from ampfused import _C

__all__ = ["GradScaler", "OptState"]

# Devices with ampfused kernels; others (mps, xpu, ...) use torch's implementation unchanged.
_KERNEL_DEVICES = ("cpu", "cuda")


class _Pending:
    """What the fused passes of this iteration wrote into the pending buffers, and the inputs they
    saw, so update() can tell whether committing them equals torch's update."""

    __slots__ = ("scale", "tracker", "scale_version", "tracker_version", "factors", "found")

    def __init__(self, scale: torch.Tensor, tracker: torch.Tensor, factors: tuple) -> None:
        self.scale = scale
        self.tracker = tracker
        self.scale_version = scale._version
        self.tracker_version = tracker._version
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
        init_scale: initial scale factor.
        growth_factor: factor applied to the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: factor applied to the scale after a step with inf/NaN gradients (< 1).
        growth_interval: consecutive clean steps before the scale grows.
        enabled: if False, every method is a no-op, as in torch.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__(
            device=device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._init_fused_state()

    def _init_fused_state(self) -> None:
        # _state owns _scale (float32 view of element 0) and _growth_tracker (element 1), so one
        # copy commits both.  _next holds the pending update the fused passes compute.
        self._state: torch.Tensor | None = None
        self._next: torch.Tensor | None = None
        self._next_scale: torch.Tensor | None = None
        self._next_growth_tracker: torch.Tensor | None = None
        self._pending: _Pending | None = None

    # ----------------------------------------------------------------------------- state
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        state = torch.empty(2, dtype=torch.int32, device=dev)
        self._state = state
        self._scale = state[0].view(torch.float32)
        self._growth_tracker = state[1]
        self._scale.fill_(self._init_scale)
        self._growth_tracker.fill_(self._init_growth_tracker)

    def _owns_state(self) -> bool:
        state = self._state
        return (
            state is not None
            and self._scale is not None
            and self._growth_tracker is not None
            and self._scale._base is state
            and self._growth_tracker._base is state
        )

    def _pending_buffers(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        nxt = self._next
        if nxt is None or nxt.device != dev:
            # A separate allocation: writing it must not bump the version counter of _scale,
            # which autograd saved for scaler.scale(loss).backward().
            nxt = self._next = torch.empty(2, dtype=torch.int32, device=dev)
            self._next_scale = nxt[0].view(torch.float32)
            self._next_growth_tracker = nxt[1]
        return self._next_scale, self._next_growth_tracker  # type: ignore[return-value]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._pending = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_state"] = None
            state["_next"] = None
            state["_next_scale"] = None
            state["_next_growth_tracker"] = None
            state["_pending"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._init_fused_state()
        self.__dict__.update(state)

    # ----------------------------------------------------------------------------- passes
    def _fused_found_inf(
        self, optimizer: torch.optim.Optimizer, check_only: bool, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor] | None:
        """One fused pass over the optimizer's gradients; None if torch's path must run."""
        scale, tracker = self._scale, self._growth_tracker
        assert scale is not None and tracker is not None
        if scale.device.type not in _KERNEL_DEVICES:
            return None
        if type(self)._unscale_grads_ is not GradScaler._unscale_grads_:
            # A subclass hooks the unscale (e.g. to all-reduce found_inf, as sharded scalers
            # do): torch's unscale_/_check_inf_per_device call it, so take that path.
            return None
        next_scale, next_tracker = self._pending_buffers(scale.device)
        pending = self._pending
        result = _C.fused_pass(
            optimizer.param_groups,
            scale,
            tracker,
            next_scale,
            next_tracker,
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
            check_only,
            pending is not None and bool(pending.found),
            allow_fp16,
        )
        if result is None:
            return None
        if pending is None:
            pending = self._pending = _Pending(
                scale, tracker, (self._growth_factor, self._backoff_factor, self._growth_interval)
            )
        for device, found_inf in result:
            if device == scale.device:
                pending.found[id(found_inf)] = (found_inf, found_inf._version)
        return dict(result)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # torch's contract, one launch per device instead of one per (device, dtype), and no
        # Python loop over parameters.
        if inv_scale.device.type in _KERNEL_DEVICES:
            result = _C.unscale_grads(optimizer.param_groups, inv_scale, found_inf, allow_fp16)
            if result is not None:
                return dict(result)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and check them for inf/NaN.

        Same contract as :meth:`torch.amp.GradScaler.unscale_` (call at most once per optimizer
        per iteration, before :meth:`step`); one fused pass, no host sync.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Call unscale_() at most once per optimizer per iteration (step() does it for "
                "you if you did not), then step() and update()."
            )
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). step() already unscaled the "
                "gradients; call unscale_() before step(), or call update() first to start the "
                "next iteration."
            )
        found = self._fused_found_inf(optimizer, check_only=False, allow_fp16=False)
        if found is None:
            super().unscale_(optimizer)  # torch's path (its own stage checks pass: still READY)
            return
        optimizer_state["found_inf_per_device"] = found
        optimizer_state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self._check_scale_growth_tracker("_check_inf_per_device")
        found = self._fused_found_inf(optimizer, check_only=True, allow_fp16=True)
        if found is None:
            return super()._check_inf_per_device(optimizer)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """Unscale (if not done yet), then ``optimizer.step(*args, **kwargs)`` unless the
        gradients held inf/NaN.  Returns what ``optimizer.step`` returned (None if skipped).

        Same contract as :meth:`torch.amp.GradScaler.step`.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled. Compute the "
                "loss and call scaler.scale(loss).backward() before scaler.step(optimizer)."
            )
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call scaler.update() "
                "once per iteration, after step() has run for every optimizer."
            )

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_optimizer_step(optimizer, optimizer_state, args, kwargs)

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError(
                "No inf checks were recorded for this optimizer. None of its parameters has a "
                ".grad: run scaler.scale(loss).backward() before scaler.step(optimizer)."
            )
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def _fused_optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        args: tuple,
        kwargs: dict[str, Any],
    ) -> Any:
        # torch's protocol for optimizers that unscale and skip on the device themselves
        # (e.g. Adam(fused=True)): hand them grad_scale and found_inf, no host sync.
        has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
        if has_grad_scaler_kwarg:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs.update({"grad_scaler": self})
        else:
            if optimizer_state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            scale = self._get_scale_async()
            assert scale is not None
            # The optimizer gets fresh tensors, as torch's sum([...]) and scale * 1 give it: what
            # it does to them cannot reach this iteration's found_inf or the scale.  A copy is
            # the same value without an arithmetic kernel.
            found = list(optimizer_state["found_inf_per_device"].values())
            if len(found) == 1 and found[0].device == scale.device:
                found_inf = found[0].clone()
            else:
                found_inf = sum(t.to(scale.device, non_blocking=True) for t in found)
            existing = getattr(optimizer, "grad_scale", None)
            if optimizer_state["stage"] is OptState.UNSCALED:
                optimizer.grad_scale = existing  # type: ignore[attr-defined]
            else:
                optimizer.grad_scale = (  # type: ignore[attr-defined]
                    scale.clone() if existing is None else scale * existing
                )
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        retval = optimizer.step(*args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        if not has_grad_scaler_kwarg:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        return retval

    # ----------------------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale for the next iteration, as :meth:`torch.amp.GradScaler.update`.

        Without ``new_scale`` this commits the update the fused passes already computed (one
        8-byte copy), unless something changed since, in which case torch's computation runs.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        pending, self._pending = self._pending, None
        if new_scale is not None:
            super().update(new_scale)
            return
        found_infs = [
            f
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        if len(found_infs) == 0:
            raise AssertionError(
                "No inf checks were recorded prior to update. Call scaler.step(optimizer) (or "
                "scaler.unscale_(optimizer)) for at least one optimizer with gradients before "
                "scaler.update()."
            )
        if pending is None or not self._pending_is_torch_update(pending, found_infs):
            super().update()
            return
        if self._owns_state():
            self._state.copy_(self._next)  # type: ignore[union-attr]
        else:  # _scale/_growth_tracker were replaced from outside: copy into whatever they are
            self._scale.copy_(self._next_scale)  # type: ignore[union-attr]
            self._growth_tracker.copy_(self._next_growth_tracker)  # type: ignore[union-attr]
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _pending_is_torch_update(self, pending: _Pending, found_infs: list[torch.Tensor]) -> bool:
        scale, tracker = self._scale, self._growth_tracker
        if (
            scale is not pending.scale
            or tracker is not pending.tracker
            or scale._version != pending.scale_version
            or tracker._version != pending.tracker_version
            or pending.factors != (self._growth_factor, self._backoff_factor, self._growth_interval)
            or len(found_infs) != len(pending.found)
        ):
            return False
        for f in found_infs:
            seen = pending.found.get(id(f))
            if seen is None or seen[0] is not f or seen[1] != f._version:
                return False
        return True
