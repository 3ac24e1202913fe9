"""Where an overflow started: activation tracing (``watch(model, activations=True)``).

An fp16 overflow almost always starts in an activation (an attention score, a residual stream,
the input of a softmax or a norm) in the forward pass, or in an activation gradient in the
backward pass; parameter gradients are where it ends up.  Tracing records, for every call of a
watched module, the statistics of each floating tensor in its output (forward) and of the
gradient with respect to each of them (backward, scaled values: what overflows): the largest
finite magnitude, the +inf, -inf and NaN counts, the zeros, the element count and the dtype.

The statistics are written on the device by the scaler's own pass in its read-only form
(``ops.scaler_pass_`` with ``check_only``, scale 1: nothing is written, no host sync), into a
small table per module call and direction, kept in execution order until the report reads them
(one device-to-host copy per device).  Host work per module call is constant in the size of
the output.  A module called several times gets a row per call; the forward calls that
activation checkpointing re-runs during backward are recorded as such (``recompute``) and never
taken for an origin.

Under ``torch.compile(model)`` the hooks are not traced: dynamo calls them at a graph break and
they run eagerly (:mod:`ampfused._compile`), as the scaler's methods do, so the compiled model
is split into a graph per traced module call and the statistics are the eager ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ampfused import _C, ops
from ampfused._compile import compiled_region_active, eager, not_traced
from ampfused._scale_state import READ_ONLY_PASS, unit_state
from ampfused._torch_private import current_graph_task_id, has_internal_overlap
from ampfused.islands import select_modules

__all__ = ["Tracer", "floating_tensors"]

# What the statistics kernel reads; other floating dtypes (float8) are not recorded.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # (by range)
# ops.scaler_pass_ without its wrapper (one call per module call): its eager entry point in _C
# (~0.5 us, where torch.ops boxes every argument for ~4 us), else the op itself.
_SCALER_PASS = torch.ops.ampfused.scaler_pass_.default
_CHUNK, _FIELDS = ops.CHUNK_SIZE, len(ops.STAT_FIELDS)
_ZEROS, _SUBNORMAL = ops.STAT_FIELDS.index("zeros"), ops.STAT_FIELDS.index("subnormal")
assert _SUBNORMAL == _ZEROS + 1  # (read as one slice)


def _readable(t: torch.Tensor) -> bool:
    return t.dtype in _DTYPES and (t.is_cpu or t.is_cuda) and t.layout == torch.strided


def packed(t: torch.Tensor) -> torch.Tensor:
    """`t` as the statistics kernel can read it, element by element: a packed copy where its
    elements may share memory (an expanded tensor: the gradient of ``output.sum()``; a window
    view), else `t` itself.  (A view with gaps is copied too, as the kernel would copy it.)"""
    if t.is_contiguous() or has_internal_overlap(t) == 0:
        return t
    return t.contiguous()


def floating_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a module's output the kernel can read: tensors, and those inside tuples,
    lists, dicts and dataclasses (depth first, in order)."""
    if isinstance(value, torch.Tensor):  # (the common case, first: this runs per module call)
        return [value] if _readable(value) else []
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if _readable(v):
                found.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(reversed([getattr(v, f.name) for f in dataclasses.fields(v)]))
    return found


def chains(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """The model's plain ``nn.Sequential`` modules (``forward`` not overridden), each with its
    children's names in the order it calls them: nothing runs between two consecutive children
    but autocast's casts, so a run of them is an island as tight as one module (the report's
    island suggestions read this)."""
    out = {}
    for name, module in model.named_modules():
        if type(module).forward is torch.nn.Sequential.forward:
            children = [child for child, _ in module.named_children()]
            if len(children) == len(module):  # (a module held twice is called twice)
                out[name] = tuple(f"{name}.{c}" if name else c for c in children)
    return out


class _Scratch:
    """Per device: the unit state (scale 1) the read-only pass reads, and what it writes that
    nobody reads (the pending update, found_inf)."""

    def __init__(self, device: torch.device) -> None:
        self.state = unit_state(device)
        self.next = torch.empty_like(self.state)
        self.found = torch.zeros((), dtype=torch.float32, device=device)


def _in_compiled_code() -> bool:
    """Whether a hook runs in torch.compile'd code, where it must run eagerly.  Dynamo calls a
    hook at a graph break (it is marked not to be inlined), but then traces the hook's own frame
    (it holds tensors): there ``torch.compiler.is_compiling()`` reads True, before dynamo meets
    the builtin :func:`compiled_region_active` calls, which it warns it cannot trace.  Run with
    dynamo's frame evaluation on and not traced, the hook finds the callback set."""
    return torch.compiler.is_compiling() or compiled_region_active()


# (module name, call, direction, recompute, statistics table (the inputs' item rows first, then
# the outputs'), the outputs' numel, their dtype, the inputs' item rows): what
# diagnostics.read_activations reduces.
Row = tuple[str, int, str, bool, torch.Tensor, int, torch.dtype, int]


class Tracer:
    """The hooks on the traced modules and the tables they recorded: ``now`` (this iteration)
    and ``last`` (the last completed one)."""

    def __init__(self, model: Any, which: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                "watch: activations=... traces the modules of a model: pass the torch.nn.Module "
                f"itself as parameters, not {type(model).__name__}"
            )
        self.now: list[Row] = []
        self.last: list[Row] = []
        # Per device, since watch(): the traced float16 activation gradients' elements, zeros
        # and subnormals (nonzero, below 2^-14), summed on the device at each iteration's end.
        self.totals: dict[torch.device, torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._scratch: dict[torch.device, _Scratch] = {}
        self._handles = [
            module.register_forward_hook(functools.partial(self._forward, name), with_kwargs=True)
            for name, module in select_modules(model, which, "watch: activations")
        ]
        self.chains = chains(model)

    def remove(self) -> None:
        """Removes every hook (backward hooks already set on this iteration's outputs record
        nothing more)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close_iteration(self) -> None:
        self._count(self.now)
        self.last, self.now = self.now, []
        self._calls = {}

    def _count(self, rows: list[Row]) -> None:
        """The iteration's float16 backward rows into :attr:`totals` (a few device operations
        per device, no sync)."""
        parts: dict[torch.device, list[torch.Tensor]] = {}
        elements: dict[torch.device, int] = {}
        for _, _, direction, _, table, numel, dtype, input_rows in rows:
            if direction == "backward" and dtype == torch.float16:
                d = table.device
                parts.setdefault(d, []).append(table[1 + input_rows :, _ZEROS : _SUBNORMAL + 1])
                elements[d] = elements.get(d, 0) + numel
        for d, tables in parts.items():
            total = self.totals.get(d)
            if total is None:
                total = self.totals[d] = torch.zeros(3, dtype=torch.float64, device=d)
            total[0] += elements[d]
            total[1:] += torch.cat(tables).sum(0)

    def counts(self) -> tuple[int, int]:
        """The traced float16 activation gradients since watch(): nonzero elements and, of
        those, subnormal ones (one copy per device: a sync)."""
        nonzero = subnormal = 0
        for total in self.totals.values():
            elements, zeros, sub = total.tolist()
            nonzero += int(elements - zeros)
            subnormal += int(sub)
        return nonzero, subnormal

    # -- hooks
    @not_traced
    def _forward(self, name: str, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if _in_compiled_code():  # (torch.compile(model): run eagerly, at a graph break)
            return eager(Tracer._forward)(self, name, module, args, kwargs, output)
        if not self._handles:
            return
        tensors = floating_tensors(output)
        if not tensors:
            return
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        # Its inputs too, in the same launch: a module whose inputs already held inf/NaN did
        # not start the overflow.  Only those on the differentiable path when some are (not
        # masks, which may hold -inf on purpose).
        inputs = floating_tensors(args[0] if len(args) == 1 and not kwargs else (args, kwargs))
        if len(inputs) > 1 and any(t.requires_grad for t in inputs):
            inputs = [t for t in inputs if t.requires_grad]
        self._record(name, call, "forward", current_graph_task_id() != -1, tensors, inputs)
        if torch.is_grad_enabled():
            hook = functools.partial(self._backward, name, call)
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(hook)

    @not_traced
    def _backward(self, name: str, call: int, grad: torch.Tensor) -> None:
        if _in_compiled_code():  # (a backward inside a compiled function)
            return eager(Tracer._backward)(self, name, call, grad)
        if self._handles and grad.dtype in _DTYPES and grad.layout == torch.strided:
            self._record(name, call, "backward", False, [grad], [])

    def _record(
        self,
        name: str,
        call: int,
        direction: str,
        recompute: bool,
        outs: list[torch.Tensor],
        ins: list[torch.Tensor],
    ) -> None:
        out = outs[0]
        device = out.device
        if len(outs) == 1 and len(ins) <= 1:  # (most module calls: no generator, no loop)
            if ins and ins[0].device != device:
                ins = []
            numel, dtype = out.numel(), out.dtype
            input_rows = -(-ins[0].numel() // _CHUNK) if ins else 0  # (ops.grad_stats_rows)
            rows = 1 + input_rows + -(-numel // _CHUNK)
        else:
            if any(t.device != device for t in outs):  # (rare: a row per device)
                for t in outs:
                    same = [i for i in ins if i.device == t.device]
                    self._record(name, call, direction, recompute, [t], same)
                return
            ins = [t for t in ins if t.device == device]  # (inputs elsewhere: not compared)
            numel = sum(t.numel() for t in outs)
            dtype = max((t.dtype for t in outs), key=_DTYPES.index)  # (the widest range)
            input_rows = sum(-(-t.numel() // _CHUNK) for t in ins)
            rows = 1 + input_rows + sum(-(-t.numel() // _CHUNK) for t in outs)
        scratch = self._scratch.get(device)
        if scratch is None:
            scratch = self._scratch[device] = _Scratch(device)
        table = torch.empty((rows, _FIELDS), dtype=torch.float64, device=device)
        args = (
            [packed(t) for t in ins + outs],  # (the sizes above are the same packed)
            scratch.found,
            scratch.state,
            scratch.next,
            table,
            *READ_ONLY_PASS,
            0.0,
            (),
            None,
        )
        if _C.scaler_pass_(*args) is not None:  # (NotImplemented: a subclass, a mode: torch.ops)
            _SCALER_PASS(*args)
        self.now.append((name, call, direction, recompute, table, numel, dtype, input_rows))
