"""``ampfused.ShardedGradScaler``: ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
(FSDP1) on ampfused's fused passes.

Same constructor (``backoff_factor`` before ``growth_factor``, then ``process_group``), same
results, ``isinstance`` of both torch's ShardedGradScaler and ``torch.amp.GradScaler``.  What
torch's does and this one keeps: float16 gradients are unscaled in place (FSDP1's mixed precision
keeps them in float16), gradients offloaded to the CPU are unscaled there, the loss is scaled
on its own device and keeps its dtype, each found_inf is all-reduced (SUM) over
``process_group``, and ``unscale_()`` leaves found_inf tensors of shape ``(1,)``.

Where it differs, on purpose:

* the all-reduce also runs on the fused-optimizer path (``Adam(fused=True)``, ...): torch's
  ``_check_inf_per_device`` skips it, so a rank that saw an inf skips while the others step;
* a rank with no local gradients joins every collective, in the same order, with a zero flag;
* one pass per device, the scale update computed on the device (torch's takes a Python path
  with ``.item()`` for a CPU scale, which also lets a growing scale overflow to inf where torch's
  ``_amp_update_scale_``, and ampfused, keep the last finite one);
* ``clip_grad_norm_`` (ampfused's addition to GradScaler) is refused: FSDP1 clips with its own
  ``model.clip_grad_norm_``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import (
    ShardedGradScaler as _TorchShardedGradScaler,
)

from ampfused import _dist
from ampfused.grad_scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler, _TorchShardedGradScaler):
    """Drop-in replacement for torch's FSDP1 ``ShardedGradScaler`` (same arguments and
    defaults), with :class:`ampfused.GradScaler`'s fused passes, scale policy, counters and
    diagnostics.

    Args:
        device, init_scale, backoff_factor, growth_factor, growth_interval, enabled: as
            torch's ShardedGradScaler (note the order: backoff before growth).
        process_group: the group every found_inf is all-reduced (SUM) over; None (the default,
            as torch's ``dist.group.WORLD`` before ``init_process_group``) is the default group,
            looked up at each all-reduce, so the scaler may be made before the process group.
        **kwargs: :class:`ampfused.GradScaler`'s keyword-only options (``min_scale``,
            ``max_scale``, ``hysteresis``, ``at_min_scale``, ``found_inf_group``: further
            groups to reduce over, with MAX, after ``process_group``).
    """

    _unscale_found_shape = (1,)

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        **kwargs: Any,
    ) -> None:
        if "scaling" in kwargs or "allow_fp16" in kwargs:
            name = "scaling" if "scaling" in kwargs else "allow_fp16"
            raise TypeError(
                f"ShardedGradScaler got an unexpected keyword argument {name!r}: it always "
                "scales, and always unscales float16 gradients (as torch's ShardedGradScaler); "
                "use ampfused.GradScaler for that option"
            )
        # (a rank outside process_group, given GroupMember.NON_GROUP_MEMBER, reduces over none)
        own = ()
        if process_group is not None:
            own = _dist.check_found_inf_group("ShardedGradScaler", process_group, "process_group")
        GradScaler.__init__(
            self,
            device,
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            enabled,
            allow_fp16=True,
            **kwargs,
        )
        if self._enabled:
            self.process_group = process_group
            # SUM over process_group first, as torch's (the flags users see count the ranks
            # that found inf/NaN), then MAX over found_inf_group.
            # (None: the default group)
            sum_plan = _dist.reductions((None,) if process_group is None else own, "sum")
            self._found_inf_plan = sum_plan + self._found_inf_plan
            self._plan_done_by_torch_unscale = len(sum_plan)

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Refused: FSDP1's gradients are shards (flat parameters split across the ranks, or
        not, with NO_SHARD and HYBRID_SHARD), so their total norm needs the sharding FSDP knows.
        Unscale, then clip with FSDP's own method::

            scaler.unscale_(optimizer)
            model.clip_grad_norm_(max_norm)
            scaler.step(optimizer)

        Raises:
            NotImplementedError: always, before anything changes.
        """
        raise NotImplementedError(
            "ShardedGradScaler.clip_grad_norm_: FSDP1's gradients are shards, so their total norm "
            "needs every rank's (this rank's shards alone would clip by a wrong norm). Clip with "
            "FSDP's own method after unscaling: scaler.unscale_(optimizer); "
            "model.clip_grad_norm_(max_norm); scaler.step(optimizer)"
        )
