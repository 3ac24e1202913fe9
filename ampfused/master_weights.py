"""float32 master weights for models whose parameters are float16 or bfloat16.

``model.half()`` halves a model's memory, but an optimizer stepping float16 parameters loses
every update smaller than half a float16 ulp, and ``GradScaler`` refuses to unscale float16
gradients.  The classic cure (apex's O2 / FP16_Optimizer) keeps a float32 copy of each
low-precision parameter for the optimizer:

    model.half()
    optimizer = ampfused.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = ampfused.GradScaler("cuda")
    ...
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

Each step: the float16 gradients are unscaled into the masters' float32 gradients in the pass
that checks them for inf/NaN (:func:`ampfused.ops.unscale_into_`), the wrapped optimizer steps
the masters, and the masters are copied back to the model's parameters (rounded, one
``torch._foreach_copy_``).  The recipe, written out in plain PyTorch, is
:func:`ampfused.reference.master_weights_step`.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ampfused import ops

__all__ = ["MasterWeights"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_KERNEL_DEVICES = ("cpu", "cuda")
# The attributes a scaler sets on an optimizer that unscales and skips on the device itself.
_FUSED_STEP_INPUTS = ("grad_scale", "found_inf")
_STATE_KEY = "master_weights"


class MasterWeights(torch.optim.Optimizer):
    """Wraps an optimizer built on a low-precision model so that it steps float32 masters.

    Build the optimizer on the model's parameters as usual (any torch optimizer, ``fused=True``
    included), then wrap it before its first step.  Every float16/bfloat16 parameter of its
    groups is replaced, in the optimizer, by a float32 copy (its master); other parameters stay
    as they are.  The wrapper is the optimizer from then on: hand it to the scaler, to LR
    schedulers and to frameworks; ``param_groups``, ``state`` and ``defaults`` are the wrapped
    optimizer's (the masters in place of the low-precision parameters).

    With :class:`ampfused.GradScaler`, :meth:`~ampfused.GradScaler.unscale_` (or ``step``) reads
    each low-precision gradient once and writes its master's float32 gradient once, unscaled,
    while checking for inf/NaN; a step with inf/NaN is skipped with parameters, masters and
    optimizer state untouched, as the scaler skips any step.  With a fused optimizer the masters'
    gradients are cast unscaled and the optimizer divides them by the scale on the device, as
    with float32 parameters (no host sync).  ``scaler.clip_grad_norm_(optimizer, ...)`` clips the
    masters' float32 gradients.  Without a scaler (bfloat16 training), :meth:`step` casts the
    gradients itself.

    The masters are the truth: after :meth:`step` the model's parameters are the masters
    rounded (round to nearest even).  Change parameters through the masters
    (:attr:`master_params`), or call :meth:`load_state_dict`.  :meth:`state_dict` holds the
    wrapped optimizer's state plus the masters, so training resumes bit for bit.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters, not stepped yet
            (its state must be empty), parameters on cpu or cuda.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or is a MasterWeights.
        ValueError: the optimizer already holds state (wrap it before its first step, then load
            a checkpoint into the wrapper).
        NotImplementedError: a low-precision parameter on a device other than cpu or cuda.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"MasterWeights wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "pass e.g. torch.optim.AdamW(model.parameters())"
            )
        if isinstance(optimizer, MasterWeights):
            raise TypeError("MasterWeights got an optimizer that is already a MasterWeights")
        if any(optimizer.state.values()):
            raise ValueError(
                "MasterWeights got an optimizer that already holds state (it has stepped): its "
                "state belongs to the low-precision parameters. Wrap the optimizer right after "
                "creating it, and load checkpoints with MasterWeights.load_state_dict"
            )
        # Optimizer.__init__'s hook tables, without its param_groups (the wrapped optimizer's).
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict = OrderedDict()
        self._patch_step_function()
        self.optimizer = optimizer
        # Flat, in group order (the order of the optimizer's state_dict indices): the model's
        # parameters and what the optimizer steps in their place (the parameter itself when it
        # is not low precision).
        self._params: list[Tensor] = []
        self._masters: list[Tensor] = []
        # The masters' gradients hold this iteration's gradients (the scaler's pass ran).
        self._grads_ready = False
        for group in optimizer.param_groups:
            self._adopt(group)

    # --------------------------------------------------------------------- the optimizer's face
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> defaultdict:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: defaultdict) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    @property
    def master_params(self) -> list[Tensor]:
        """What the optimizer steps, one per model parameter, in group order: the float32
        master of a low-precision parameter, else the parameter itself."""
        return list(self._masters)

    @property
    def model_params(self) -> list[Tensor]:
        """The model's parameters, in the order of :attr:`master_params`."""
        return list(self._params)

    def __repr__(self) -> str:
        return f"MasterWeights({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``, with masters for the new parameters."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)  # a generator, once
        known = {id(p) for p in self._params} | {id(m) for m in self._masters}
        if any(id(p) in known for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        self.optimizer.add_param_group({**param_group, "params": params})
        self._adopt(self.optimizer.param_groups[-1])

    def _adopt(self, group: dict[str, Any]) -> None:
        masters = []
        for p in group["params"]:
            m = p
            if p.dtype in _LOW_PRECISION:
                if p.device.type not in _KERNEL_DEVICES:
                    raise NotImplementedError(
                        f"MasterWeights keeps masters for parameters on cpu or cuda; a {p.dtype} "
                        f"parameter of shape {tuple(p.shape)} is on {p.device}"
                    )
                with torch.no_grad():
                    m = torch.empty_like(p, dtype=torch.float32).copy_(p)
                m.requires_grad_(p.requires_grad)
            masters.append(m)
            self._params.append(p)
            self._masters.append(m)
        group["params"] = masters

    def _low_pairs(self) -> list[tuple[Tensor, Tensor]]:
        return [(p, m) for p, m in zip(self._params, self._masters, strict=True) if m is not p]

    # --------------------------------------------------------------------- gradients
    def _grads_to_masters(self, inv_scale: Tensor) -> dict[torch.device, Tensor]:
        """The scaler's pass (and :meth:`step`'s cast without one).

        Every low-precision gradient is unscaled by ``inv_scale`` into its master's float32
        ``.grad`` (allocated on first use, reused after), every other gradient in place; a
        master whose parameter has no gradient gets none.  Returns one found_inf per device
        (float32, 1.0 where an input element was inf/NaN), as ``_unscale_grads_`` does.
        """
        # device -> (low-precision grads, their master grads, other grads)
        work: dict[torch.device, tuple[list, list, list]] = {}
        for p, m in zip(self._params, self._masters, strict=True):
            g = p.grad
            if m is p:
                if g is not None:
                    work.setdefault(g.device, ([], [], []))[2].append(g)
                continue
            if g is None:
                m.grad = None
                continue
            if g.layout != torch.strided:
                raise NotImplementedError(
                    f"MasterWeights: a {p.dtype} parameter of shape {tuple(p.shape)} has a "
                    f"{g.layout} gradient; keep parameters with sparse gradients (e.g. "
                    "nn.Embedding(sparse=True)) in float32"
                )
            # The master's gradient takes the layout of the parameter's (reused while it
            # holds); same sizes and strides as a dense tensor make g dense too.
            out = m.grad
            if out is None or out.stride() != g.stride():
                out = torch.empty_like(g, dtype=torch.float32)
                if out.stride() != g.stride():  # g has gaps or overlaps: empty_like packed it
                    g = g.contiguous()
                    out = torch.empty_like(g, dtype=torch.float32)
                m.grad = out
            lows, outs, _ = work.setdefault(g.device, ([], [], []))
            lows.append(g)
            outs.append(out)
        found = {}
        for device, (lows, outs, others) in work.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            inv = inv_scale.to(device, non_blocking=True)
            if lows:
                ops.unscale_into_(lows, outs, flag, inv)
            if others:
                ops.non_finite_check_and_unscale_(others, flag, inv)
            found[device] = flag
        self._grads_ready = True
        return found

    @torch.no_grad()
    def _copy_to_model(self) -> None:
        pairs = self._low_pairs()
        if pairs:
            params, masters = zip(*pairs, strict=True)
            torch._foreach_copy_(list(params), list(masters))

    # --------------------------------------------------------------------- Optimizer API
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step the masters with the wrapped optimizer, then copy them to the model.

        Without a scaler's pass in this iteration (training without loss scaling), the
        low-precision gradients are first cast to the masters' gradients (not unscaled, not
        checked).  A ``closure`` is evaluated first (with grad enabled) and its gradients cast.
        Returns what the wrapped optimizer's ``step`` returned (the closure's loss).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._grads_ready = False
        if not self._grads_ready:
            one = torch.ones((), dtype=torch.float32)
            self._grads_to_masters(one)
        inner = self.optimizer
        # A scaler hands an optimizer that unscales and skips itself these two tensors.
        given = [n for n in _FUSED_STEP_INPUTS if hasattr(self, n)]
        for name in given:
            setattr(inner, name, getattr(self, name))
        try:
            result = inner.step()
        finally:
            for name in given:
                if hasattr(inner, name):
                    delattr(inner, name)
            self._grads_ready = False
        self._copy_to_model()
        return loss if closure is not None else result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients of the masters and of the model's parameters."""
        self.optimizer.zero_grad(set_to_none)
        for p, _ in self._low_pairs():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()
        self._grads_ready = False

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict`` plus ``"master_weights"``: the float32
        masters by their parameter index (the indices of ``"state"``)."""
        state = self.optimizer.state_dict()
        state[_STATE_KEY] = {
            i: m
            for i, (p, m) in enumerate(zip(self._params, self._masters, strict=True))
            if m is not p
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict`: the masters, the wrapped optimizer's state, then the
        model's parameters from the masters (rounded).

        A state dict without masters (saved from the plain optimizer) is loaded into the
        wrapped optimizer and the masters are taken from the model's current parameters.

        Raises:
            ValueError: the saved masters do not match this wrapper's (other indices, shapes).
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        low = {
            i: m
            for i, (p, m) in enumerate(zip(self._params, self._masters, strict=True))
            if m is not p
        }
        if saved is not None:
            if set(saved) != set(low):
                raise ValueError(
                    f"loaded state dict holds masters for parameters {sorted(saved)} but this "
                    f"MasterWeights keeps masters for {sorted(low)}; build the optimizer over "
                    "the same model, made low precision the same way"
                )
            for i, m in low.items():
                if tuple(saved[i].shape) != tuple(m.shape):
                    raise ValueError(
                        f"loaded master {i} has shape {tuple(saved[i].shape)}, expected "
                        f"{tuple(m.shape)}"
                    )
        self.optimizer.load_state_dict(state_dict)
        with torch.no_grad():
            for i, m in low.items():
                m.copy_(saved[i] if saved is not None else self._params[i])
        self._copy_to_model()
        self._grads_ready = False
