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
}


class GradScaler(torch.amp.GradScaler):
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
        for name, value in options.items():
            if name not in _POLICY_DEFAULTS:
                raise TypeError(f"GradScaler got an unexpected keyword argument {name!r}")
            if value is not _POLICY_DEFAULTS[name] and value != _POLICY_DEFAULTS[name]:
                raise unavailable(f"GradScaler({name}={value!r})")
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )

    min_scale = None
    max_scale = None
    hysteresis = 1
    at_min_scale = "clamp"

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """``unscale_(optimizer)``, then torch's ``clip_grad_norm_`` over its parameters."""
        self.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    def _needs_kernels(self, name: str) -> NoReturn:
        raise unavailable(f"GradScaler.{name}()")

    def counters(self) -> NoReturn:
        self._needs_kernels("counters")

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


class MasterWeights:
    """Stands in for :class:`ampfused.MasterWeights`, whose fused pass needs the kernels."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unavailable("ampfused.MasterWeights")
