"""ampfused without its compiled kernels: torch's own scaler under ampfused's names.

Where no kernels could be built or loaded (ampfused/_extension.py says why, once, in a
warning), ``ampfused.GradScaler`` is this subclass of ``torch.amp.GradScaler``: training runs
through torch's unscale and update, so its results are torch's, bit for bit.  What has a correct
path without the kernels takes it (``clip_grad_norm_``: torch's ``unscale_`` then
``torch.nn.utils.clip_grad_norm_``, the recipe the fused one equals); everything else that needs
them (the scale policy options, ``watch()`` and its reports, the counters, ``MasterWeights``)
raises :class:`~ampfused._extension.KernelsUnavailableError` naming the missing build, so no
result changes silently.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch.amp.grad_scaler import OptState

from ampfused import _dist
from ampfused._arguments import (
    check_clip_optimizer,
    check_device,
    check_factor_range,
    check_init_scale,
    not_an_optimizer,
)
from ampfused._extension import unavailable

__all__ = ["GradScaler", "MasterWeights", "OptState"]

# ampfused.GradScaler's keyword-only options, with the defaults that keep torch's rule.
_POLICY_DEFAULTS = {
    "min_scale": None,
    "max_scale": None,
    "hysteresis": 1,
    "at_min_scale": "clamp",
    "scaling": True,
    "allow_fp16": False,
    "found_inf_group": _dist.NO_GROUP,
    "policy": "torch",
    "headroom": "learned",
    "islands": None,
}


def _check_options(cls: str, options: dict[str, Any]) -> None:
    for name, value in options.items():
        if name not in _POLICY_DEFAULTS:
            raise TypeError(f"{cls} got an unexpected keyword argument {name!r}")
        if value is not _POLICY_DEFAULTS[name] and value != _POLICY_DEFAULTS[name]:
            raise unavailable(f"{cls}({name}={value!r})")


class _Refusals:
    """What ampfused's scalers add to torch's and cannot do without the kernels."""

    min_scale = None
    max_scale = None
    hysteresis = 1
    at_min_scale = "clamp"
    policy = "torch"
    headroom = None

    def _check_init_scale(self) -> None:
        """init_scale, after torch's constructor (which may have disabled the scaler: then
        nothing is checked, as torch checks nothing)."""
        if self._enabled:
            check_init_scale(type(self).__name__, self._init_scale)

    def _needs_kernels(self, name: str) -> NoReturn:
        raise unavailable(f"{type(self).__name__}.{name}()")

    # The mistakes ampfused's scaler refuses and torch's accepts or reports in its own terms (a
    # number as the device, a zero, negative or non-finite init_scale, a factor the constructor
    # refuses given to a setter, the model where the optimizer goes) are refused here too, after
    # torch's own refusals that come first (before scale(), a closure): the same code must not
    # train with the kernels and fail without them.
    def unscale_(self, optimizer: Any) -> None:
        if self._enabled and self._scale is not None and not hasattr(optimizer, "param_groups"):
            raise not_an_optimizer(optimizer, "unscale_")
        super().unscale_(optimizer)  # type: ignore[misc]

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            self._enabled
            and self._scale is not None
            and "closure" not in kwargs
            and not hasattr(optimizer, "param_groups")
            and not getattr(optimizer, "_step_supports_amp_scaling", False)
        ):
            raise not_an_optimizer(optimizer, "step")
        return super().step(optimizer, *args, **kwargs)  # type: ignore[misc]

    def set_growth_factor(self, new_factor: float) -> None:
        if self._enabled:
            check_factor_range("set_growth_factor", "growth_factor", new_factor)
        super().set_growth_factor(new_factor)  # type: ignore[misc]

    def set_backoff_factor(self, new_factor: float) -> None:
        if self._enabled:
            check_factor_range("set_backoff_factor", "backoff_factor", new_factor)
        super().set_backoff_factor(new_factor)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint of ampfused's scaler with a scale policy: torch's rule would drop it.
        policy = state_dict.get("ampfused") or {}
        for name in ("min_scale", "max_scale", "hysteresis", "at_min_scale"):
            if name in policy and policy[name] != _POLICY_DEFAULTS[name]:
                raise unavailable(f"load_state_dict() of a checkpoint with {name}={policy[name]!r}")
        if "ampfused_islands" in state_dict:  # (scale islands: GradScaler(islands=...))
            raise unavailable("load_state_dict() of a checkpoint with ampfused_islands (islands)")
        if policy.get("headroom"):  # (0.0: torch's rule)
            raise unavailable(
                f"load_state_dict() of a checkpoint with headroom={policy['headroom']!r} (the "
                "headroom policy)"
            )
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def counters(self) -> NoReturn:
        self._needs_kernels("counters")

    def magnitude(self) -> NoReturn:
        self._needs_kernels("magnitude")

    def island_factors(self) -> NoReturn:
        self._needs_kernels("island_factors")

    def watch(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_kernels("watch")

    def unwatch(self) -> NoReturn:
        self._needs_kernels("unwatch")

    def report(self) -> NoReturn:
        self._needs_kernels("report")

    def grad_norms(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_kernels("grad_norms")

    def step_skipped_tensor(self) -> NoReturn:
        self._needs_kernels("step_skipped_tensor")

    def step_skipped(self) -> NoReturn:
        self._needs_kernels("step_skipped")


class GradScaler(_Refusals, torch.amp.GradScaler):
    """``torch.amp.GradScaler``, standing in for ampfused's while its kernels are missing."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        **options: Any,
    ) -> None:
        _check_options("GradScaler", options)
        check_device("GradScaler", device)
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self._check_init_scale()

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """``unscale_(optimizer)`` (unless done in this iteration), then torch's
        ``clip_grad_norm_`` over its parameters."""
        check_clip_optimizer(optimizer, max_norm)
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is not (
            OptState.UNSCALED
        ):
            self.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)


class MasterWeights:
    """Stands in for :class:`ampfused.MasterWeights`, whose fused pass needs the kernels."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unavailable("ampfused.MasterWeights")


def sharded_grad_scaler() -> type:
    """torch's FSDP1 ShardedGradScaler under ampfused's name and refusals (made on first use:
    it imports torch's FSDP package)."""
    global _SHARDED
    if _SHARDED is None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as Torch

        class ShardedGradScaler(_Refusals, Torch):
            """torch's ShardedGradScaler, standing in for ampfused's without its kernels."""

            def __init__(
                self,
                device: str = "cuda",
                init_scale: float = 2.0**16,
                backoff_factor: float = 0.5,
                growth_factor: float = 2.0,
                growth_interval: int = 2000,
                enabled: bool = True,
                process_group: Any = None,
                **options: Any,
            ) -> None:
                for name in ("scaling", "allow_fp16"):
                    if name in options:
                        raise TypeError(
                            f"ShardedGradScaler got an unexpected keyword argument {name!r}"
                        )
                _check_options("ShardedGradScaler", options)
                check_device("ShardedGradScaler", device)
                kwargs = {} if process_group is None else {"process_group": process_group}
                super().__init__(
                    device,
                    init_scale,
                    backoff_factor,
                    growth_factor,
                    growth_interval,
                    enabled,
                    **kwargs,
                )
                self._check_init_scale()

            def clip_grad_norm_(self, *args: Any, **kwargs: Any) -> NoReturn:
                raise NotImplementedError(
                    "ShardedGradScaler.clip_grad_norm_: the shards' total norm needs FSDP's "
                    "sharding; call scaler.unscale_(optimizer), then model.clip_grad_norm_(...)"
                )

        _SHARDED = ShardedGradScaler
    return _SHARDED


_SHARDED: type | None = None
