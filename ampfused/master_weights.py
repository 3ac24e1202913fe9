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
from torch.compiler import is_compiling

from ampfused import _C, ops

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
    masters' float32 gradients; changing the model's gradients after the scaler's pass (torch's
    ``clip_grad_norm_(model.parameters())`` after ``unscale_``) is refused by :meth:`step`, as
    the change would be lost.  ``torch.amp.GradScaler`` finds no master gradients to unscale and
    fails (use ampfused's).  Without a scaler (bfloat16 training), :meth:`step` casts the
    gradients itself; :meth:`cast_grads` does it earlier, to clip or log the masters'.

    After :meth:`step` the model's parameters are the masters rounded (round to nearest even).
    A parameter written with another value between steps (an init, a ``load_state_dict`` of
    the model) passes that value to its master; rewriting the same value keeps the master's
    extra bits.  :meth:`state_dict` holds the wrapped optimizer's state plus the masters, so
    training resumes bit for bit.

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
        # Position in _params of each low-precision parameter, by identity.
        self._low: dict[int, int] = {}
        # The low-precision parameters and their masters, in that order (the copy back's
        # lists), and each parameter's version when it last equalled its master (rounded).
        self._low_params: list[Tensor] = []
        self._low_masters: list[Tensor] = []
        self._synced_versions: list[int] = []
        # Per low-precision position: (gradient, its version) last cast into the master's
        # gradient, with (the master's gradient, its version) right after the cast.
        self._cast_from: dict[int, tuple[Tensor, int, Tensor, int]] = {}
        # A scaler's pass filled the masters' gradients since the last step / zero_grad.
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
        state = self.__dict__.copy()
        # What an LR scheduler patched into this instance (torch's Optimizer leaves it out too).
        for key in ("step", "_opt_called"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._patch_step_function()

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
        added = {}
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
                added[id(p)] = len(self._params)
                self._low_params.append(p)
                self._low_masters.append(m)
                self._synced_versions.append(p._version)
            masters.append(m)
            self._params.append(p)
            self._masters.append(m)
        group["params"] = masters
        self._low.update(added)

    # --------------------------------------------------------------------- gradients
    def _master_grad(self, i: int, g: Tensor) -> tuple[Tensor, Tensor]:
        """(g, or a dense copy of it; the master's float32 gradient in g's layout, allocated
        when it has none of that layout, reused after)."""
        m = self._masters[i]
        out = m.grad
        # Same sizes and strides as a dense tensor make g dense too.
        if out is None or out.stride() != g.stride():
            out = torch.empty_like(g, dtype=torch.float32)
            if out.stride() != g.stride():  # g has gaps or overlaps: empty_like packed it
                g = g.contiguous()
                out = torch.empty_like(g, dtype=torch.float32)
            m.grad = out
        return g, out

    @torch.no_grad()
    def _cast(self, i: int) -> None:
        """The master's gradient from its parameter's, not unscaled (no scaler)."""
        g = self._params[i].grad
        if g is None:
            self._masters[i].grad = None
        else:
            self._check_layout(i, g)
            src, out = self._master_grad(i, g)
            out.copy_(src)
            self._cast_from[i] = (g, g._version, out, out._version)

    def _check_layout(self, i: int, g: Tensor) -> None:
        if g.layout != torch.strided:
            p = self._params[i]
            raise NotImplementedError(
                f"MasterWeights: a {p.dtype} parameter of shape {tuple(p.shape)} has a "
                f"{g.layout} gradient; keep parameters with sparse gradients (e.g. "
                "nn.Embedding(sparse=True)) in float32"
            )

    def _grads_to_masters(
        self, inv_scale: Tensor, islands: Any = None
    ) -> dict[torch.device, Tensor]:
        """A scaler's pass: every low-precision gradient unscaled by ``inv_scale`` into its
        master's float32 ``.grad`` (:func:`ampfused.ops.unscale_into_`), every other gradient
        in place; a master whose parameter has no gradient gets none.  Returns one found_inf
        per device (float32, 1.0 where an input element was inf/NaN), as ``_unscale_grads_``.
        `islands`: scale islands (:class:`ampfused.scale_islands.Islands`) or None; a gradient
        of island k is unscaled by ``inv_scale`` times the island's inverse factor (exact: a
        power of two), one launch per island and device.
        """
        cast_from: dict[int, tuple[Tensor, int, Tensor, int]] = {}
        of = islands.of_groups(self._params) if islands is not None else None
        if of is None and not is_compiling():  # the common case in C++ (master_gather.cpp)
            found = _C.masters_pass(self._params, self._masters, inv_scale, cast_from)
            if found is not None:
                self._cast_from = cast_from
                self._grads_ready = True
                return dict(found)
        # (device, island) -> (low-precision grads, their master grads, other grads): the walk
        # that allocates the masters' gradients and takes every layout.
        work: dict[tuple[torch.device, int], tuple[list, list, list]] = {}
        strided = torch.strided
        for i, (p, m) in enumerate(zip(self._params, self._masters, strict=True)):
            g = p.grad
            if g is None:
                if m is not p:
                    m.grad = None
                continue
            key = (g.device, of[i] if of is not None else 0)
            if m is p:
                if g.is_sparse:  # as torch's scaler: the values (float32: no coalescing)
                    g = g.coalesce()._values() if g.dtype == torch.float16 else g._values()
                work.setdefault(key, ([], [], []))[2].append(g)
                continue
            if g.layout is not strided:
                self._check_layout(i, g)
            src, out = g, m.grad
            # The kernel needs the same strides (both contiguous is not enough: a size-1
            # dimension may have any stride); _master_grad reuses or allocates, and packs g.
            if out is None or out.stride() != g.stride() or not g.is_contiguous():
                src, out = self._master_grad(i, g)
            # The master's version is not recorded (-1): after a scaler's pass, step() checks
            # only the model's side (_check_unchanged_since_pass).
            cast_from[i] = (g, g._version, out, -1)
            lows, outs, _ = work.setdefault(key, ([], [], []))
            lows.append(src)
            outs.append(out)
        found: dict[torch.device, Tensor] = {}
        for (device, k), (lows, outs, others) in work.items():
            flag = found.get(device)
            if flag is None:
                flag = found[device] = torch.zeros((), dtype=torch.float32, device=device)
            inv = inv_scale.to(device, non_blocking=True)
            if k:
                if islands.inv.device != device:
                    raise NotImplementedError(
                        f"scale islands: a gradient of island {islands.names[k - 1]!r} is on "
                        f"{device}, the islands' factors on {islands.inv.device}; islands need "
                        "the model on one device"
                    )
                inv = inv * islands.inv[k - 1]
            if lows:
                ops.unscale_into_(lows, outs, flag, inv)
            if others:
                ops.non_finite_check_and_unscale_(others, flag, inv)
        self._cast_from = cast_from
        self._grads_ready = True
        return found

    def _check_unchanged_since_pass(self) -> None:
        """After a scaler's pass the masters' gradients are what the optimizer reads: refuse a
        step whose model gradients were written after it (their change would be lost)."""
        i = _C.masters_first_changed(self._params, list(self._low.values()), self._cast_from)
        if i >= 0:
            p = self._params[i]
            raise RuntimeError(
                f"MasterWeights: the gradient of a {p.dtype} parameter of shape "
                f"{tuple(p.shape)} changed after the scaler unscaled it into its float32 "
                "master, so the change would not reach the optimizer (e.g. "
                "torch.nn.utils.clip_grad_norm_(model.parameters()) after "
                "scaler.unscale_(optimizer)). Clip with scaler.clip_grad_norm_(optimizer, "
                "max_norm), or modify the gradients of optimizer.master_params"
            )

    @torch.no_grad()
    def _take_model_changes(self) -> None:
        """A model parameter written since it last equalled its master with a value other than
        the master's, rounded (an init after wrapping, a model.load_state_dict of other
        weights), gives its master its new value.  The same value (a checkpoint's model
        weights loaded after its optimizer state) keeps the master's extra bits."""
        synced = self._synced_versions
        for k in _C.versions_changed(self._low_params, synced):
            p, m = self._low_params[k], self._low_masters[k]
            if not torch.equal(p, m.to(p.dtype)):
                m.copy_(p)
            synced[k] = p._version

    @torch.no_grad()
    def _copy_to_model(self) -> None:
        if self._low_params:
            torch._foreach_copy_(self._low_params, self._low_masters)
            self._synced_versions = _C.versions_of(self._low_params)

    def cast_grads(self) -> None:
        """Cast the model's gradients into the masters' now (float32, exactly; not unscaled).

        :meth:`step` does it when no :class:`ampfused.GradScaler` pass did, so call this only
        to read or change the masters' gradients before ``step()`` without a scaler: clipping
        them (``torch.nn.utils.clip_grad_norm_(optimizer.master_params, ...)``, or a
        framework's clip through ``param_groups``, e.g. Lightning's ``bf16-true`` with
        ``gradient_clip_val``: call it in ``on_before_optimizer_step``), or logging them.
        ``step()`` then keeps what you did to them.

        Raises:
            RuntimeError: a model gradient changed after an earlier cast whose master gradient
                was changed too (the two cannot be reconciled).
        """
        self._cast_stale()

    def _cast_stale(self) -> None:
        """Without a scaler: cast the gradients not cast yet, or changed since their cast.  A
        gradient changed on both sides since the cast (the model's rewritten, the master's
        clipped) cannot be reconciled: refused."""
        for i in self._low.values():
            g = self._params[i].grad
            seen = self._cast_from.get(i)
            if g is None or seen is None:
                self._cast(i)
                continue
            if g is seen[0] and g._version == seen[1]:
                continue  # the master's gradient holds it (clipped or not)
            mg = self._masters[i].grad
            if mg is not seen[2] or mg._version != seen[3]:
                p = self._params[i]
                raise RuntimeError(
                    f"MasterWeights: the gradient of a {p.dtype} parameter of shape "
                    f"{tuple(p.shape)} changed after cast_grads() cast it into its float32 "
                    "master, and the master's gradient was changed since too: the two cannot "
                    "be reconciled. Finish writing the model's gradients, then call "
                    "cast_grads() and change the masters' gradients"
                )
            self._cast(i)

    # --------------------------------------------------------------------- Optimizer API
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step the masters with the wrapped optimizer, then copy them to the model.

        After a scaler's pass, the masters' gradients are the ones it unscaled.  Without one
        (training without loss scaling), they are the model's gradients cast to float32 (as
        backward produced them, or as changed since).  A ``closure`` (LBFGS) is handed to the
        wrapped optimizer as one that first copies the masters to the model, then evaluates
        the user's closure with grad enabled and casts its gradients.  Returns what the
        wrapped optimizer's ``step`` returned.

        Raises:
            RuntimeError: a model gradient changed after the scaler's pass (the change would
                be lost): clip or modify the masters' gradients instead.
        """
        self._take_model_changes()
        inner = self.optimizer
        if closure is not None:

            def master_closure() -> Any:
                self._copy_to_model()
                with torch.enable_grad():
                    loss = closure()
                self._cast_stale()
                return loss

            try:
                result = inner.step(master_closure)
            finally:
                self._grads_ready = False
            self._copy_to_model()
            return result
        if self._grads_ready:
            self._check_unchanged_since_pass()
        else:
            self._cast_stale()
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
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients of the masters and of the model's parameters."""
        self.optimizer.zero_grad(set_to_none)
        for i in self._low.values():
            p = self._params[i]
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().requires_grad_(False).zero_()
        self._cast_from = {}
        self._grads_ready = False

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict`` plus ``"master_weights"``: the float32
        masters by their parameter index (the indices of ``"state"``).  This wrapper's own
        state-dict hooks run around it, as torch's Optimizer runs them."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._take_model_changes()
        state = self.optimizer.state_dict()
        state[_STATE_KEY] = {i: self._masters[i] for i in sorted(self._low.values())}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict`: the masters, the wrapped optimizer's state, then the
        model's parameters from the masters (rounded).

        A state dict without masters (saved from the plain optimizer) is loaded into the
        wrapped optimizer and the masters are taken from the model's current parameters.

        Raises:
            ValueError: the saved masters do not match this wrapper's (other indices, shapes).
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        low = sorted(self._low.values())
        if saved is not None:
            if sorted(saved) != low:
                raise ValueError(
                    f"loaded state dict holds masters for parameters {sorted(saved)} but this "
                    f"MasterWeights keeps masters for {low}; build the optimizer over the same "
                    "model, made low precision the same way"
                )
            for i in low:
                if tuple(saved[i].shape) != tuple(self._masters[i].shape):
                    raise ValueError(
                        f"loaded master {i} has shape {tuple(saved[i].shape)}, expected "
                        f"{tuple(self._masters[i].shape)}"
                    )
        self.optimizer.load_state_dict(state_dict)
        with torch.no_grad():
            for i in low:
                self._masters[i].copy_(saved[i] if saved is not None else self._params[i])
        self._copy_to_model()
        self._cast_from = {}
        self._grads_ready = False
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
