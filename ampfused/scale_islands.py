"""Scale islands: parts of a model whose backward runs at their own loss scale.

One loss scale cannot keep every activation gradient inside float16's range when a network's
gradients span more binades than float16 holds: the largest sit at the overflow edge while a
layer's own gradients sit many binades lower, in float16's subnormals or at zero.  An island is
a module whose backward runs at the global scale times its own power-of-two factor f:

* on entry to its backward (the gradients of its outputs) the gradient is multiplied by f; on
  exit (the gradients of its inputs) by 1 / f.  Every tensor that meets another outside the
  island is at the global scale, so residual additions, outputs with several consumers, inputs
  that need no gradient and nested islands (a factor relative to the enclosing island's) are
  correct by construction;
* its parameters' gradients carry the global scale times f: the scaler's fused pass unscales
  each gradient by its own factor, in the same single pass (``ops.scaler_pass_``'s
  ``islands``/``island_inv``);
* f follows the headroom rule from the island's own measurements, with its own history: the
  largest traced activation gradient of the modules inside it, its parameters' largest
  gradient, the gradients crossing its edges and, in a block, the gradients of the tensors
  its forward made between its modules (:meth:`Islands._interior`), at the island's scale.
  An overflow that started inside an island skips the step as any does, backs the island off
  and holds the global scale (Islands.prepare_next says how it is told apart).  The global scale
  reads every gradient at the global scale (an island's divided by its factor), so it
  moves as it would without islands: an island only moves its own part.

Powers of two make the scaling exact except where a value leaves float16's range: a gradient
leaving an island at 1 / f can still flush to zero where it is below float16's smallest
subnormal at the global scale (it would have there without the island too; inside the island
it no longer does).
The one other difference from the same run without islands is rounding in the last bit where
an island's input is read more than once inside it and also outside it: its gradient is summed
in another grouping (the contributions from inside first, at the island's scale, then the
outside ones), as reordering any sum may round differently; the factor changes nothing there.

float32 islands (:mod:`ampfused.islands`, ``keep_float32``) are the other remedy: they change
the dtype a part of the model runs in, which covers the forward pass as well and costs its
speed; scale islands change nothing in the forward pass and cost two multiplies per edge in
backward.  A float32 island's gradients need no scale island.

``islands="auto"`` chooses quiet leaves and blocks of quiet leaves from a traced iteration with
no inf/NaN (:func:`choose`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ampfused import _C, _dist, ops
from ampfused._compile import eager, not_traced
from ampfused._scale_state import (
    CEILING,
    FRESH_HEADROOM_STATE,
    HYSTERESIS_LEFT,
    ITERATION_COUNTERS,
    MAGNITUDE,
    READ_ONLY_PASS,
    STATE_SIZE,
    headroom_bits,
)
from ampfused._torch_private import (
    autograd_sequence_nr,
    current_graph_task_id,
    register_hook_first,
)
from ampfused.activations import _in_compiled_code, _Scratch, packed

__all__ = ["Islands", "ScalerIslands", "check_islands_argument", "choose", "AUTO_GAP"]

# islands="auto": a traced leaf module with parameters becomes an island where its largest
# output gradient sits at least AUTO_GAP binades below the whole model's largest; chosen after
# the first clean traced iteration, and looked at again after these many updates (a module
# whose gradients fall below the rest's later in training joins; none leaves).
AUTO_GAP = 4
AUTO_REVIEW = (10, 100, 1000)
_F32_MAX = torch.finfo(torch.float32).max
_HALF_MAX = 65504.0
# An island's headroom is the global one's most (4 by default) times this (64 in all, at most
# 65,504), fixed: a model holds many islands, each at its own edge, each a chance to overflow.
# Measured on the islands question's runs with islands="auto" (the closing note of issue 36):
# fixed at 16 in all, llama-tiny's islands overflowed twice in its first 50 steps; narrowing
# from 64 to 16 over 200 steps, or learned from 64 as the global margin is, once near step 600
# (and bert-tiny once, narrowing); at 64 neither did, though bert-tiny's worst module then
# keeps several times more of its activation gradients subnormal.
ISLAND_MARGIN = 16.0
# An island whose largest measured gradient is a float16 subnormal rises as if it were this much
# larger (prepare_next): to about 1, not to the edge, where values that had flushed inside it
# could overflow.
BLIND_RISE = 2.0**10
_NORMAL_MIN = 2.0**-14
# an island's edges: its outputs' gradients, its inputs' gradients; and the gradients inside a
# block island (of the tensors its forward made between its modules: :meth:`Islands._interior`)
ENTRY, EXIT, INTERIOR = 0, 1, 2
# Backward nodes of views that keep every value (their input's gradient holds their output's
# values, rearranged, and is measured where it is made): their gradients are not measured again.
_VIEWS = "View UnsafeView Transpose T Permute Unsqueeze Squeeze Alias ReshapeAlias Clone Contiguous"
# (and a parameter's gradient: measured in the pass)
_ACCUMULATE = "torch::autograd::AccumulateGrad"
_SAME_VALUES = frozenset(f"{n}Backward0" for n in _VIEWS.split()) | {_ACCUMULATE}
# statistics table columns (ops.STAT_FIELDS) that choose() reads
ABS_MAX = ops.STAT_FIELDS.index("abs_max")
NON_FINITE = slice(ABS_MAX + 1, ops.STAT_FIELDS.index("nan") + 1)
SUBNORMAL = ops.STAT_FIELDS.index("subnormal")
_EDGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = len(ops.STAT_FIELDS)
_FACTOR_EXPONENT = 100  # factors are kept within 2^-100 .. 2^100
# The edge tables kept between updates before they are reduced to one per island, edge and dtype
# (Islands._compact): backward passes without an update() would otherwise pile them up.
EDGES_KEPT = 4096


def check_islands_argument(where: str, islands: Any, policy: str, scaling: bool) -> Any:
    """The constructor's ``islands``: None, "auto" or module names; islands need the headroom
    policy (their factors follow it) and scaling."""
    if islands is None:
        return None
    if isinstance(islands, str) and islands != "auto":
        raise ValueError(
            f"{where}: islands must be None, 'auto' or a list of module names (as "
            f"model.named_modules() gives them), got {islands!r}; for one module pass "
            f"islands=[{islands!r}]"
        )
    if not isinstance(islands, str):
        try:
            names = list(islands)
        except TypeError as e:
            raise TypeError(
                f"{where}: islands must be None, 'auto' or module names, got "
                f"{type(islands).__name__}"
            ) from e
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(
                f"{where}: islands names modules by their names in model.named_modules(); got "
                f"{bad[0]!r} ({type(bad[0]).__name__})"
            )
        if not names:
            raise ValueError(f"{where}: islands=[] names no module; leave islands out (None)")
        islands = tuple(names)
    if policy != "headroom":
        raise ValueError(
            f"{where}: islands={islands!r} need policy='headroom' (each island's factor follows "
            "the headroom rule from its own measured gradients); pass policy='headroom' too"
        )
    if not scaling:
        raise ValueError(
            f"{where}: islands scale parts of the backward pass, and scaling=False keeps every "
            "scale at 1; leave islands out"
        )
    return islands


def _inside(name: str, island: str) -> bool:
    return name == island or name.startswith(island + ".")


class Islands:
    """The islands of one model: the hooks that scale their edges, each island's state (a
    scaler state row, the scale in force inside it = global scale times its factor), its
    factor, and which parameters and traced modules belong to it."""

    def __init__(
        self, model: torch.nn.Module, names: Iterable[str], where: str, forgiving: bool = False
    ) -> None:
        modules = dict(model.named_modules())
        names = list(names)
        for n in names:
            if n not in modules:
                raise ValueError(
                    f"{where}: islands names {n!r}, which the model does not have; pass names "
                    "as model.named_modules() gives them"
                )
            if n == "":
                raise ValueError(
                    f"{where}: the island '' is the whole model, which is the global scale "
                    "itself; name the modules inside it"
                )
            if not _called(modules[n]):
                raise ValueError(
                    f"{where}: islands names {n!r}, a {type(modules[n]).__name__} with no "
                    "forward of its own (a container: its modules are called, never it), so "
                    "its hooks would never run while its parameters' gradients were unscaled "
                    "by its factor; name the modules inside it"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: islands names a module twice: {names!r}")
        # Outer islands first, so an island's parent (the innermost enclosing one) comes before
        # it; island k (1-based in the pass) is self.names[k - 1].
        self.names = sorted(names, key=lambda n: (n.count("."), n))
        self.parent = [
            max(
                (j for j in range(k) if _inside(self.names[k], self.names[j])),
                key=lambda j: len(self.names[j]),
                default=-1,
            )
            for k in range(len(self.names))
        ]
        # Parameters by identity: the innermost island holding each.
        self.of_param: dict[int, int] = {}
        for k, n in enumerate(self.names):
            for p in modules[n].parameters():
                self.of_param[id(p)] = k + 1
        self._check_tied(model, where)
        self._of_module: dict[str, int] = {}
        self._named_params = list(model.named_parameters())
        self.model_params = [p for _, p in self._named_params]  # (keeps the ids valid)
        self._param_ids = {id(p) for p in self.model_params}
        device = next((p.device for p in self.model_params), torch.device("cpu"))
        count = len(self.names)
        # The factors (f, relative to the global scale), their inverses (the pass's island_inv)
        # and each island's factor relative to its parent (what its edges multiply by), on the
        # model's device; updated in place, so the hooks read the iteration's.
        self.factor = torch.ones(count, dtype=torch.float32, device=device)
        self.inv = torch.ones(count, dtype=torch.float32, device=device)
        self.edge = torch.ones(count, dtype=torch.float32, device=device)
        self.edge_inv = torch.ones(count, dtype=torch.float32, device=device)
        # ("auto"'s islands, `forgiving`: one doing what an island cannot scale is pinned at
        # the scale around it instead of refused, :meth:`_unscalable`)
        self.forgiving = forgiving
        self.pinned = torch.zeros(count, dtype=torch.bool, device=device)
        self._pinned = [False] * count  # (the same, on the host)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self.state: torch.Tensor | None = None  # [count, STATE_SIZE] int32, made with the scale's
        self.next: torch.Tensor | None = None
        self.loaded: list | None = None  # a checkpoint's rows, for the lazy init
        self.committable = False  # whether `next` holds this iteration's update
        self.hold: torch.Tensor | None = None  # whether the global update is held (prepare_next)
        self.dev = device
        # (each island's parent index, 0 for none, and whether it has one: made once, on the
        # device, so a refresh copies nothing from the host)
        self._parents = (
            torch.tensor([max(p, 0) for p in self.parent], device=device),
            torch.tensor([p >= 0 for p in self.parent], device=device),
        )
        self._ids: dict[tuple, torch.Tensor] = {}  # island ids on the device, by their values
        # This iteration's edge statistics: (island, ENTRY, EXIT or INTERIOR, dtype, table), in
        # backward order.
        self.edges: list[tuple[int, int, torch.dtype, torch.Tensor]] = []
        # The island calls open in the forward pass (innermost last): per call, [the island,
        # the autograd sequence number at its start, the nodes of its input views (its exits),
        # whether its graph can be walked, (input, its view, the view's version) per input,
        # (f, 1 / f) where the call is not inside its parent by name, else None]; and the
        # regions of the island calls that ended inside an open one (their outputs' nodes ->
        # their exits' nodes), which the enclosing block's walk leaves to them.
        self._open: list[list] = []
        self._regions: dict[Any, list] = {}
        self._scratch: _Scratch | None = None
        self._handles = []
        self._entry_scale = [functools.partial(self._entry_grad, k, None) for k in range(count)]
        for k, n in enumerate(self.names):
            module = modules[n]
            self._handles.append(
                module.register_forward_pre_hook(self._entering(k, module), with_kwargs=True)
            )
            # prepend: before a tracer's hook, which then records the island's own scale
            leaf = next(module.children(), None) is None
            self._handles.append(
                module.register_forward_hook(self._leaving(k, leaf), prepend=True, always_call=True)
            )

    def _check_tied(self, model: torch.nn.Module, where: str) -> None:
        """A parameter an island shares with a module outside it would get the sum of
        gradients at two scales: refused."""
        for name, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                k = self.of_param.get(id(p), 0)
                if k and not _inside(name, self.names[k - 1]):
                    raise ValueError(
                        f"{where}: the parameter {name + '.' if name else ''}{pname} is shared "
                        f"by the island {self.names[k - 1]!r} and a module outside it (tied "
                        "weights): its gradient would sum two scales.  Leave that island out, "
                        "or name the module that holds both uses"
                    )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the edges (torch.compile traces the module hooks; the gradient hooks it calls instead
    # of tracing, and they run eagerly: they read the gradient's statistics)
    def _entering(self, k: int, island: torch.nn.Module) -> Any:
        """The pre-hook: each input that needs a gradient goes in as a view whose gradient
        (what leaves the island in backward) is multiplied by the island's 1 / f, one view per
        tensor (a tensor passed twice is one tensor inside too).  It opens the call
        (:attr:`_open`: the island, the autograd sequence number at its start, its exits'
        nodes, whether its graph can be walked, its input views with their versions, and the
        island it is called in where that is not its parent), which the forward hook closes.

        An island runs at the global scale times its factor wherever it is called: inside its
        parent island by name, its edges multiply by its factor over the parent's (the shared
        :attr:`edge`); called elsewhere (outside its parent, inside another island), by its
        factor over the island it is called in (:meth:`_over`, read in backward).

        A copy of the module (``copy.deepcopy`` of the model copies its hooks) is not the
        island: its parameters are not the scaler's, and it runs at the global scale
        untouched.  A ``torch.nn.DataParallel`` replica is refused: its parameters' gradients
        reach the island's own at the global scale, from other threads."""
        where = f"scale islands: an input of the island {self.names[k]!r}"
        exit_scale = functools.partial(self._exit_grad, k, None)

        def hook(module: Any, args: tuple, kwargs: dict) -> Any:
            if module is not island:
                if getattr(module, "_is_replica", False):
                    raise NotImplementedError(
                        f"scale islands: the island {self.names[k]!r} ran as a "
                        "torch.nn.DataParallel replica, whose gradients reach the island's "
                        "parameters at the global scale; use DistributedDataParallel (one "
                        "process per device), or a scaler without islands"
                    )
                return None
            # (torch.compile traces this hook, and a compiled graph has no autograd nodes of
            # its own to walk: nothing is kept for a walk there, and an enclosing call's
            # walk, which would enter this region unknowing, is called off)
            compiling = torch.compiler.is_compiling()
            if compiling:
                for call in self._open:
                    call[3] = False
            # (called elsewhere than inside its parent: the island it is called in, read at
            # backward time, as the shared edges are)
            enclosing = self._open[-1][0] if self._open else -1
            elsewhere = None if enclosing == self.parent[k] else enclosing
            if not self._open and not compiling and current_graph_task_id() != -1:
                elsewhere = None  # (reentrant checkpointing's recomputation, alone in backward:
                # taken as called where it was in the forward, inside its parent)
            exits: list = []
            views: list = []  # (an input, its view, the view's version)
            # (under torch.compile the call keeps no tensor: dynamo would guard on them)
            kept = [] if compiling else views
            # (eager: the sequence number at the call's start, at least 1; 0 under compile)
            start = 0 if compiling else max(autograd_sequence_nr(), 1)
            call = [k, start, exits, True, kept, elsewhere]
            self._open.append(call)
            if not torch.is_grad_enabled():
                return None
            scale = exit_scale
            if elsewhere is not None:
                scale = functools.partial(self._exit_grad, k, elsewhere)

            def wrap(v: Any) -> Any:
                if isinstance(v, torch.Tensor):
                    if not (v.requires_grad and _scaled(v)):
                        return v
                    if v.device != self.dev:
                        raise RuntimeError(
                            f"scale islands: the island {self.names[k]!r} runs on {v.device}, "
                            f"its factors are on {self.dev} (the model's device when watch() "
                            "was called); call scaler.watch(model, activations=True) again "
                            "after moving the model, or keep an island's gradients on the "
                            "scale's device"
                        )
                    for t, view, _ in views:
                        if t is v:
                            return view
                    view = v.view_as(v)
                    view.register_hook(scale)
                    views.append((v, view, view._version))
                    if not compiling:
                        exits.append(view.grad_fn)
                    return view
                if type(v) in (tuple, list):
                    return type(v)(wrap(x) for x in v)
                if type(v) is dict:
                    return {key: wrap(x) for key, x in v.items()}
                return _rebuilt(v, wrap, where)  # (other containers: rare)

            return wrap(args), wrap(kwargs)

        return hook

    def _leaving(self, k: int, leaf: bool) -> Any:
        """The forward hook (always called: it closes the call :meth:`_entering` opened): the
        gradient of each output that needs one (what enters the island in backward) is
        multiplied by the island's f, once per tensor (:meth:`_leave`), and a block's interior
        is measured (:meth:`_interior`).  An input the forward modified in place cannot be
        scaled (:meth:`_unscalable`): its view, rebased, has lost its hook."""

        def hook(module: Any, args: tuple, output: Any) -> Any:
            # (the call this pre-hook opened: none where another pre-hook raised before it)
            call = self._open.pop() if self._open and self._open[-1][0] == k else None
            result = None  # (output None: its forward raised)
            if call is not None and output is not None and torch.is_grad_enabled():
                if any(view._version != version for _, view, version in call[4]):
                    # (its view, rebased, has lost the hook that multiplies by 1 / f)
                    self._unscalable(
                        k,
                        "modified an input in place (an inplace=True activation, x.add_(...))",
                        "that input's gradient would leave the island without its 1 / f",
                        "make that operation out of place, or leave the module out of the islands",
                    )
                result = self._leave(k, leaf, output, call)
            if not self._open:  # (the outermost call ended: no walk needs the regions; no
                # try/finally, which torch.compile splits the graph for)
                self._regions.clear()
            return result

        return hook

    def _unscalable(self, k: int, what: str, why: str, fix: str) -> None:
        """Island k does something an island cannot scale (`what`, `why`): refused for a named
        island (RuntimeError, with the `fix`); one "auto" chose is pinned, with a warning: it
        runs at the scale around it (its factor its parent's, its edges' multiplications, read
        in backward, 1: this call's and this iteration's earlier ones too; gradients its
        parameters got earlier in the iteration moved to that factor), and the update leaves
        it out (ScalerIslands.after_update)."""
        if not self.forgiving:
            self._regions.clear()
            raise RuntimeError(f"scale islands: the island {self.names[k]!r} {what}: {why}; {fix}")
        if not self._pinned[k]:
            warnings.warn(
                f"islands='auto': the island {self.names[k]!r} {what}, which an island cannot "
                "scale; it runs at the scale around it from now on (it is left out at the "
                "next update)",
                stacklevel=3,
            )
        old = self.factor[k].clone()
        self._pinned[k] = True
        self.pinned[k] = True
        self._set_factors(self._pinned_factors(self.factor))
        # (an earlier backward of this iteration left its parameters' gradients at the old
        # factor: moved to the new one, exactly, both being powers of two)
        if any(edge[0] == k + 1 for edge in self.edges):
            ratio = self.factor[k] / old
            for p in self.model_params:
                if p.grad is not None and self.of_param.get(id(p)) == k + 1:
                    p.grad.mul_(ratio.to(p.grad.dtype))

    def _pinned_factors(self, factor: torch.Tensor) -> torch.Tensor:
        """`factor` with each pinned island's made its parent's (1 with none: its edges then
        multiply by 1, and it runs at the scale around it); outer islands first."""
        factor = factor.clone()
        for j, pinned in enumerate(self._pinned):
            if pinned:
                factor[j] = factor[self.parent[j]] if self.parent[j] >= 0 else 1.0
        return factor

    def _leave(self, k: int, leaf: bool, output: Any, call: list) -> Any:
        """The entries of a call's outputs, and a block's interior walk.  An island returning
        one tensor that needs a gradient gets the factor on that tensor itself, ahead of the
        hooks its modules put on it (a tracer's, a nested island's): an in-place op on it
        outside keeps the factor on the value before the op.  One returning several, or one of
        its inputs as it came, returns views made in :class:`ScaleIslandOutput` (an output its
        forward also read to make another carries the island's own gradient beside what
        enters it: the factor goes on the view, on what enters only), which autograd refuses
        to modify in place.  Under torch.compile: plain views with the hook."""
        _, start, exits, walkable, views, elsewhere = call
        scale = self._entry_scale[k]
        if elsewhere is not None:
            scale = functools.partial(self._entry_grad, k, elsewhere)
        # (torch.compiler.is_compiling() read where needed: a local holding it across the
        # graph break at register_hook made dynamo compile this frame again for each call)
        seen: dict[int, torch.Tensor] = {}
        if not leaf and walkable and not self._pinned[k] and not torch.compiler.is_compiling():
            self._interior(k, output, start, exits)
        entering = [t for t in _tensors(output) if t.requires_grad and _scaled(t)]
        one = entering[0] if entering and all(t is entering[0] for t in entering) else None
        direct = one is not None and (leaf or not torch.compiler.is_compiling())
        if direct and start:  # (eager, where `start` is the call's: made in this call, not a
            # parameter returned as it is, which would keep the hook, nor a tensor from before
            # it, nor one of its inputs as it came)
            direct = _made_in(one, start) and not (
                views and _holds_any(one, [v for _, v, _ in views])
            )
        result = None
        if direct:
            seen[id(one)] = one
            if leaf:
                one.register_hook(scale)  # (first: the islands' forward hook is prepended)
            else:
                register_hook_first(one, scale)
        elif entering:

            def wrap(t: torch.Tensor) -> torch.Tensor:
                if not (t.requires_grad and _scaled(t)):
                    return t
                view = seen.get(id(t))
                if view is None:
                    if torch.compiler.is_compiling():  # (the Function's backward is traced)
                        view = t.view_as(t)
                        view.register_hook(scale)
                    else:
                        view = ScaleIslandOutput.apply(t, self, k, elsewhere)
                    seen[id(t)] = view
                return view

            result = _rebuilt(output, wrap, f"scale islands: the output of {self.names[k]!r}")
        if self._open and not torch.compiler.is_compiling():  # (inside an enclosing island's
            # call: its walk leaves this region to it)
            for t in seen.values():
                if t.grad_fn is not None:
                    self._regions[t.grad_fn] = exits
        return result

    def _interior(self, k: int, output: Any, start: int, exits: list) -> None:
        """A block island's interior: the backward nodes its forward made between its modules
        (an attention's scores and softmax, an activation function), walked from its outputs to
        its exits, each given a hook that measures the float16 gradient of what it made (at the
        island's scale: its factor is then bounded by every gradient inside it, not only its
        modules').  Left out: the regions of islands nested in it (measured by their own),
        views that keep every value, and the parameters' (measured in the pass).

        Refused: a parameter the island does not hold, read inside it (a parameter of a module
        outside it, or of an island nested in it read directly), and a tensor made before the
        call that reaches it other than as an input (an attribute, a closure): their gradients
        would carry its factor where the outside expects the global scale.  A tensor made
        before the call from the island's own parameters alone (autocast's cached cast of a
        weight, from an earlier call) is its own."""
        measure = functools.partial(self._interior_grad, k)
        stop = {id(n) for n in exits}
        seen: dict[int, Any] = {}  # (the nodes held: an id is not reused while walking)
        stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or id(node) in stop:
                continue
            seen[id(node)] = node
            inner = self._regions.get(node)
            if inner is not None:  # (a nested island: on from its exits)
                stack.extend(n for e in inner for n, _ in e.next_functions)
                continue
            if node._sequence_nr() < start:  # (made before the call; a parameter's node is
                # numbered after every other)
                if not self._made_from_own(k, node):
                    return self._unscalable(
                        k,
                        f"reads a tensor that needs a gradient and was made before its call "
                        f"({node.name()}), not as an input (an attribute or a closure holding "
                        "it)",
                        "its gradient would leave the island without its 1 / f",
                        "pass the tensor to the module's forward, or leave the module out of "
                        "the islands",
                    )
                continue
            name = node.name()
            if name == _ACCUMULATE:
                j = self.of_param.get(id(node.variable), 0)
                if j != k + 1 and id(node.variable) in self._param_ids:
                    # (a model's parameter it does not hold; another leaf may be made inside
                    # the call: a bias of zeros that needs a gradient, as T5's attention makes
                    # under activation checkpointing)
                    holder = f"the island {self.names[j - 1]!r}" if j else "no island"
                    return self._unscalable(
                        k,
                        f"reads the parameter {self._param_name(node.variable)}, which "
                        f"{holder} holds, directly inside its forward",
                        "its gradient would carry the wrong factor",
                        "name as the island the module that holds every parameter its forward "
                        "reads, or leave it out",
                    )
                continue
            if name not in _SAME_VALUES:
                node.register_prehook(measure)
            stack += [n for n, _ in node.next_functions]

    def _made_from_own(self, k: int, node: Any) -> bool:
        """Whether only island k's own parameters lie behind `node`, made before its call and
        reached from inside it (autocast's cached cast of one of its weights)."""
        stack, seen = [node], 0
        while stack:
            n = stack.pop()
            if n is None:
                continue
            if n.name() == _ACCUMULATE:
                if self.of_param.get(id(n.variable), 0) != k + 1:
                    return False  # (a leaf made before the call, a parameter or not, not its own)
                continue
            seen += 1
            if seen > 64 or not n.next_functions:
                return False
            stack.extend(m for m, _ in n.next_functions)
        return True

    def _param_name(self, p: torch.Tensor) -> str:
        for n, q in self._named_params:
            if q is p:
                return n
        return f"of shape {tuple(p.shape)}"

    @not_traced
    def _interior_grad(self, k: int, grads: tuple) -> None:
        if _in_compiled_code():
            return eager(Islands._interior_grad)(self, k, grads)
        for g in grads:
            if g is not None and g.dtype == torch.float16:
                self._record(k, INTERIOR, g)
        return None

    @not_traced
    def _exit_grad(self, k: int, elsewhere: int | None, g: torch.Tensor) -> torch.Tensor:
        if _in_compiled_code():
            return eager(Islands._exit_grad)(self, k, elsewhere, g)
        self._record(k, EXIT, g)  # (at the island's scale: what its backward made)
        return g * (self.edge_inv[k] if elsewhere is None else 1.0 / self._over(k, elsewhere))

    @not_traced
    def _entry_grad(self, k: int, elsewhere: int | None, g: torch.Tensor) -> torch.Tensor:
        if _in_compiled_code():
            return eager(Islands._entry_grad)(self, k, elsewhere, g)
        self._record(k, ENTRY, g)  # (before the factor: what arrives)
        return g * (self.edge[k] if elsewhere is None else self._over(k, elsewhere))

    def _over(self, k: int, enclosing: int) -> torch.Tensor:
        """Island k's factor over that of the island it was called in (-1: none); 1 for a
        pinned island."""
        if self._pinned[k]:
            return self._one
        return self.factor[k] if enclosing < 0 else self.factor[k] / self.factor[enclosing]

    def _record(self, k: int, edge: int, g: torch.Tensor) -> None:
        """The statistics of a gradient crossing island k's edge before its factor (ENTRY:
        at the enclosing scale, EXIT: at the island's), on its device and without a sync, into
        :attr:`edges`."""
        if not (g.dtype in _EDGE_DTYPES and g.layout == torch.strided and g.device == self.dev):
            return
        g = packed(g)
        if self._scratch is None:
            self._scratch = _Scratch(g.device)
        table = torch.empty(
            (ops.grad_stats_rows([g]), _FIELDS), dtype=torch.float64, device=g.device
        )
        sc = self._scratch
        args = ([g], sc.found, sc.state, sc.next, table, *READ_ONLY_PASS, 0.0, (), None)
        if _C.scaler_pass_(*args) is not None:  # (NotImplemented: a mode, a subclass)
            torch.ops.ampfused.scaler_pass_.default(*args)
        self.edges.append((k + 1, edge, g.dtype, table))
        if len(self.edges) >= EDGES_KEPT:
            self._compact()

    def _compact(self) -> None:
        """:attr:`edges` reduced to one table per (island, edge, dtype), of one row: the
        largest magnitude and the summed counts, all prepare_next reads of them (many backward
        passes without an update(): a loop of saliency maps, evaluation with gradients)."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for k, edge, dtype, table in self.edges:
            groups.setdefault((k, edge, dtype), []).append(table[1:])
        compacted = []
        for (k, edge, dtype), parts in groups.items():
            rows = torch.cat(parts)
            table = torch.zeros(2, _FIELDS, dtype=torch.float64, device=rows.device)
            table[1] = rows.sum(0)
            table[1, ABS_MAX] = rows[:, ABS_MAX].max()
            compacted.append((k, edge, dtype, table))
        self.edges = compacted

    # -- membership
    def island_of_module(self, name: str) -> int:
        """The innermost island (1-based) holding the module `name`, 0 for none."""
        k = self._of_module.get(name)
        if k is None:
            k = 0
            for j in range(len(self.names) - 1, -1, -1):  # (inner islands are later)
                if _inside(name, self.names[j]):
                    k = j + 1
                    break
            self._of_module[name] = k
        return k

    def of_groups(self, flat: list) -> list[int]:
        """Each parameter position's island (the pass's ``island_of``)."""
        get = self.of_param.get
        return [get(id(p), 0) for p in flat]

    # -- the state
    def ensure_state(self, scale: torch.Tensor, global_state: torch.Tensor) -> None:
        """Each island's state, made at the first pass from the global one (factor 1) or from a
        loaded checkpoint."""
        if self.state is not None and self.state.device == scale.device:
            return
        if self.factor.device != scale.device:
            raise NotImplementedError(
                f"scale islands: the model is on {self.factor.device} but the scale on "
                f"{scale.device}; islands need both on one device"
            )
        if self.loaded is not None:
            self.state = torch.tensor(self.loaded, dtype=torch.int32, device=scale.device)
        else:
            self.state = torch.tensor(
                [fresh_row()] * len(self.names), dtype=torch.int32, device=scale.device
            )
            self.state[:, 0] = global_state[0]
            self.state[:, HYSTERESIS_LEFT] = global_state[HYSTERESIS_LEFT]
        self.next = torch.empty_like(self.state)
        self.refresh(scale)

    def scales(self) -> torch.Tensor:
        assert self.state is not None
        return self.state[:, 0].view(torch.float32)

    def refresh(self, scale: torch.Tensor) -> None:
        """Each factor from the island's scale and the global one, rounded to a power of two;
        the island's scale made exactly the global scale times it (no sync)."""
        ratio = self.scales().double() / scale.double()
        exponent = torch.log2(ratio).round().clamp(-_FACTOR_EXPONENT, _FACTOR_EXPONENT)
        exponent = torch.where(torch.isfinite(ratio) & (ratio > 0), exponent, 0.0)
        factor = torch.exp2(exponent).float()
        if any(self._pinned):
            factor = self._pinned_factors(factor)
        self._set_factors(factor)
        self.scales().copy_((scale.double() * factor.double()).float())

    def _set_factors(self, factor: torch.Tensor) -> None:
        factor = factor.to(self.factor.device)
        self.factor.copy_(factor)
        self.inv.copy_(factor.reciprocal())
        parents, has_parent = self._parents
        edge = torch.where(has_parent, factor / factor[parents], factor)
        self.edge.copy_(edge)
        self.edge_inv.copy_(edge.reciprocal())

    def load_rows(self, rows: list, scale: float) -> None:
        """A checkpoint's state rows, with the global scale it holds: the factors set now (the
        next forward pass runs at them), the state made again at the next pass."""
        self.loaded, self.state, self.next, self.committable = rows, None, None, False
        bits = torch.tensor([r[0] for r in rows], dtype=torch.int32)
        ratio = bits.view(torch.float32).double() / scale
        exponent = torch.log2(ratio).round().clamp(-_FACTOR_EXPONENT, _FACTOR_EXPONENT)
        exponent = torch.where(torch.isfinite(ratio) & (ratio > 0), exponent, 0.0)
        self._set_factors(torch.exp2(exponent).float())

    def prepare_next(
        self,
        scale: torch.Tensor,
        tables: list,
        rows: list,
        policy: tuple,
        plan: list,
    ) -> None:
        """Each island's update into `next`, from this iteration's statistics tables (its
        parameters' rows), traced rows (its modules' backward rows) and edges: the largest
        float16 magnitude at the island's scale, and whether an overflow started in it.

        An overflow started in an island where inf/NaN shows inside it (its traced modules'
        backward rows, its parameters' gradients, its inputs' gradients before the factor, its
        outputs' gradients once multiplied by it) and had not arrived at its entry.  An island
        backs off only for an overflow that started in it, and the global scale is held (not
        backed off; the step is still skipped) where one started in an island:
        ``self.hold``, which :meth:`hold_global` applies.

        `policy`: the rule's arguments, its headroom the global margin's most (each island's
        is that times :data:`ISLAND_MARGIN`).

        `plan`: the found_inf reductions (group, op) of a distributed run: the islands'
        magnitudes and verdicts are agreed over them (MAX) before the rule reads them, so every
        rank holds the same factors and DDP sums gradients at equal scales."""
        assert self.state is not None and self.next is not None
        dev = self.state.device
        count = len(self.names)
        top = torch.zeros(count + 1, dtype=torch.float64, device=dev)
        param_bad = torch.zeros(count + 1, dtype=torch.float64, device=dev)
        for table, positions, groups in tables:
            if table.device != dev:
                continue
            ids = self._param_row_ids(positions, groups)
            items = table[1:]
            top.scatter_reduce_(0, ids, items[:, 1], "amax")
            param_bad.scatter_add_(0, ids, items[:, 2:5].sum(1))
        # (the parameters' abs-max is of unscaled values: at the island's scale)
        top[1:] *= self.scales().double()
        # Per island: its traced modules' backward rows and its edges (float16 rows measure:
        # the headroom rule is float16's), and inf/NaN inside it (its modules, parameters and
        # exit) or arriving at its entry.
        # (every row in one table: a handful of operations per iteration, not a few per row)
        # shape: per table, (island, whether an entry, float16, rows left out, rows read)
        parts, shape = [], []
        half = torch.float16
        for name, _, direction, _, table, _, dtype, input_rows in rows:
            k = self.island_of_module(name) if direction == "backward" else 0
            if k and table.device == dev:
                parts.append(table)
                shape.append((k, False, dtype == half, 1 + input_rows, table.shape[0]))
        for k, edge, dtype, table in self.edges:
            parts.append(table)
            shape.append((k, edge == ENTRY, dtype == half, 1, table.shape[0]))
        inside = param_bad[1:] > 0
        arrived = torch.zeros(count, dtype=torch.bool, device=dev)
        if parts:
            at, is_entry, half = self._row_ids(tuple(shape))
            stats = torch.cat(parts)
            row_top = torch.where(half, stats[:, 1], 0.0)
            # (an entry at the island's scale once multiplied: it may overflow there)
            row_top = torch.where(is_entry, row_top * self.edge.double()[at - 1], row_top)
            bad = stats[:, 2:5].sum(1)
            top.scatter_reduce_(0, at, row_top, "amax")
            counts = torch.zeros(count + 1, dtype=torch.float64, device=dev)
            inside |= counts.scatter_add(0, at, torch.where(is_entry, 0.0, bad))[1:] > 0
            # (an entry overflowing by the island's factor: started inside)
            grown = (is_entry & (row_top > _HALF_MAX)).double()
            inside |= counts.scatter_add(0, at, grown)[1:] > 0
            arrived |= counts.scatter_add(0, at, torch.where(is_entry, bad, 0.0))[1:] > 0
        # An overflow started in an island where it shows inside and did not arrive at its
        # entry; there the island backs off and the global scale is held.
        if plan:
            agreed = torch.stack((top[1:], inside.double(), arrived.double()))
            _dist.all_reduce_flags([agreed], [(group, _dist.max_op()) for group, _ in plan])
            top[1:], inside, arrived = agreed[0], agreed[1] > 0, agreed[2] > 0
        started = inside & ~arrived & ~self.pinned  # (a pinned island is about to leave)
        found = started.float()
        self.hold = started.any()
        # (a largest value in float16's subnormals says little: what flushed to zero inside the
        # island may be far larger (a block's interior, an edge); read as BLIND_RISE larger,
        # the island rises to put it near 1, 16 binades below the edge, and measures again)
        top = torch.where((top > 0) & (top < _NORMAL_MIN), top * BLIND_RISE, top)
        magnitude = top[1:].clamp(max=_F32_MAX).float()
        self.next[:, MAGNITUDE] = magnitude.view(torch.int32)
        *rule, most = policy
        headroom = min(most * ISLAND_MARGIN, _HALF_MAX)
        for k in range(count):
            ops.scaler_update_(found[k], self.state[k], self.next[k], *rule, headroom)

    def _row_ids(self, shape: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row of the tables `shape` describes ((island, entry, float16, rows left out, rows)
        each): its island (0 for a row left out: a header, an input's), whether an entry's,
        whether float16's; on the device, made once per shape."""
        t = self._ids.get(shape)
        if t is None:
            # (per table two runs of rows: those left out, island 0, then the island's)
            runs = [(k * on, e, h) for k, e, h, _, _ in shape for on in (0, 1)]
            lengths = [m for *_, skip, n in shape for m in (min(skip, n), max(n - skip, 0))]
            rows = torch.tensor(runs).repeat_interleave(torch.tensor(lengths), dim=0)
            rows = self._copied(rows)
            t = self._cached(shape, (rows[:, 0], rows[:, 1].bool(), rows[:, 2].bool()))
        return t

    def _param_row_ids(self, positions: torch.Tensor, groups: list) -> torch.Tensor:
        """Per item row of a statistics table (the gradients at `positions`, [position, numel]
        each, of the parameters in `groups`): its island, 0 for none; on the device, made once
        per distinct positions and parameters (the same each step: no copy after the first)."""
        flat = [p for g in groups for p in g["params"]]
        # (positions are on the host, a new tensor each pass)
        key = (positions.numpy().tobytes(), *map(id, flat))
        t = self._ids.get(key)
        if t is None:
            of = torch.tensor(self.of_groups(flat))
            rows_per_grad = (positions[:, 1] + ops.CHUNK_SIZE - 1) // ops.CHUNK_SIZE
            t = self._cached(
                key, self._copied(of[positions[:, 0]].repeat_interleave(rows_per_grad))
            )
        return t

    def _cached(self, key: tuple, value: Any) -> Any:
        if len(self._ids) > 64:  # (a model whose calls vary: keep the cache small)
            self._ids.clear()
        self._ids[key] = value
        return value

    def _copied(self, host: torch.Tensor) -> torch.Tensor:
        """`host` on the islands' device; on a GPU from pinned memory, without waiting: a copy
        from pageable memory waits for the work queued before it (a sync each iteration where
        the shapes vary and the ids are made again)."""
        if self.dev.type != "cuda":
            return host.to(self.dev)
        return host.pin_memory().to(self.dev, non_blocking=True)

    def hold_global(self, state: torch.Tensor, nxt: torch.Tensor) -> None:
        """The global update in `nxt` undone where :attr:`hold` says (the iteration still
        counts, as a skipped one): the scale and the rule's state stay as in `state`."""
        held = state.clone()
        held[ITERATION_COUNTERS] = nxt[ITERATION_COUNTERS]
        held[MAGNITUDE] = nxt[MAGNITUDE]
        nxt.copy_(torch.where(self.hold, held, nxt))

    def commit(self, scale: torch.Tensor) -> None:
        """`next` becomes each island's state; the factors follow the new global scale."""
        assert self.state is not None and self.next is not None
        self.state.copy_(self.next)
        self.refresh(scale)
        self.edges = []

    def global_scale(self) -> float | None:
        """The global scale the state rows go with (their scale over their factor; a sync)."""
        if self.state is None:
            return None
        return float(self.scales()[0].double() / self.factor[0].double())

    def checkpoint(self) -> dict[str, Any]:
        rows = self.state.tolist() if self.state is not None else self.loaded
        return {"names": list(self.names), "states": rows}

    def factors(self) -> dict[str, float]:
        """Each island's factor f (relative to the global scale), by name (a sync)."""
        return dict(zip(self.names, self.factor.tolist(), strict=True))


def fresh_row(scale_bits: int = 0, hysteresis_left: int = 0) -> list[int]:
    """A new island's state row: the global scale (its bits) and hysteresis left; no count, no
    measurement, no history (the global scale's caps are not the island's: its first measured
    step moves it)."""
    row = [0] * CEILING + headroom_bits(FRESH_HEADROOM_STATE)
    row[0], row[HYSTERESIS_LEFT] = scale_bits, hysteresis_left
    return row


def _called(module: torch.nn.Module) -> bool:
    """Whether `module` has a forward of its own (ModuleList, ModuleDict and other containers
    have none: only their modules are called)."""
    return type(module).forward is not torch.nn.Module.forward


def _scaled(t: torch.Tensor) -> bool:
    """Whether an island's edge scales `t`'s gradient: floating point and complex tensors."""
    return t.is_floating_point() or t.dtype.is_complex


class ScaleIslandOutput(torch.autograd.Function):
    """An island's output as the forward returns it: a view whose gradient (what enters the
    island in backward) is multiplied by the island's factor (over its parent's, or over that
    of the island it was called in, `elsewhere`).  Made in a Function, whose views autograd
    refuses to modify in place: an in-place op on a hooked view would take its gradient around
    the factor."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, islands: Islands, k: int, elsewhere: Any) -> Any:
        ctx.islands, ctx.k, ctx.elsewhere = islands, k, elsewhere
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return ctx.islands._entry_grad(ctx.k, ctx.elsewhere, g), None, None, None


def _made_in(t: torch.Tensor, start: int) -> bool:
    """Whether `t` was made by an operation numbered from `start` on (in an island's call)."""
    return t.grad_fn is not None and t.grad_fn._sequence_nr() >= start


def _holds_any(value: Any, tensors: list) -> bool:
    """Whether `value` holds one of `tensors` itself (not a view of it)."""
    return any(t is u for t in _tensors(value) for u in tensors)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside `value`: in tuples, lists and dicts (their subclasses too) and
    dataclasses."""
    if isinstance(value, torch.Tensor):
        return [value]
    out: list[torch.Tensor] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
    return out


def _rebuilt(value: Any, fn: Any, where: str) -> Any:
    """`value` with each tensor in it replaced by fn(tensor): tuples, lists and dicts rebuilt
    (a namedtuple, a dict subclass and a dataclass as their own type), never changed in place.
    A container of another kind, or one that cannot be made again, is refused where it holds a
    tensor that needs a gradient (left as it is, that tensor's gradient would cross the
    island's edge without its factor)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) in (tuple, list):
        return type(value)(_rebuilt(x, fn, where) for x in value)
    if type(value) is dict:
        return {key: _rebuilt(x, fn, where) for key, x in value.items()}
    if not any(t.requires_grad for t in _tensors(value)):
        return value
    try:
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # (a PackedSequence too)
            return type(value)(*(_rebuilt(x, fn, where) for x in value))
        if isinstance(value, dict):
            return type(value)((key, _rebuilt(x, fn, where)) for key, x in value.items())
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = [f.name for f in dataclasses.fields(value) if f.init]
            if len(fields) < len(dataclasses.fields(value)):  # (a field replace() cannot set)
                raise TypeError("a field with init=False")
            return dataclasses.replace(
                value, **{n: _rebuilt(getattr(value, n), fn, where) for n in fields}
            )
    except Exception as e:  # noqa: BLE001 - any failure to make it again is the refusal below
        raise NotImplementedError(
            f"{where} is a {type(value).__name__} holding tensors that need gradients, which "
            "the island cannot make again with its gradient hooks on them; return tensors, "
            "tuples, lists or dicts from it, or leave the module out of islands"
        ) from e
    raise NotImplementedError(
        f"{where} is a {type(value).__name__} holding tensors that need gradients, which the "
        "island cannot make again with its gradient hooks on them; return tensors, tuples, "
        "lists, dicts or dataclasses from it, or leave the module out of islands"
    )


def choose(model: torch.nn.Module, rows: list) -> list[str] | None:
    """``islands="auto"``: from one iteration's traced backward float16 rows (scaled values),
    the islands to make.  A traced module is *quiet* where its largest output gradient sits at
    least AUTO_GAP binades below the whole model's largest.  Chosen:

    * every quiet traced leaf module with parameters (a Linear, a convolution, a norm; not an
      embedding) whose output gradients held float16 subnormals (values an island's factor
      would lift: a module whose gradients all sit in float16's normal range loses nothing at
      the global scale, and an island would cost its hooks for nothing);
    * every block of leaves (a module whose children are all leaves: an attention, an MLP)
      holding such a leaf, whose traced leaves are all quiet: the functional ops between its
      modules (an attention's scores and softmax, an activation) then run at its factor too,
      measured whole (:meth:`Islands._interior`).  Where it holds two or more such leaves they
      are islands nested in it, each at its own factor (an attention's query and key sit below
      its value and its scores' softmax); a single one runs at the block's (what bounds the
      block's factor bounds it too: its output gradient is what the block's functional ops
      hand it, its input gradient is the block's, so a factor of its own would cost its edges
      for a binade or two).

    Parameters another module outside the island holds (tied weights) keep a module or block
    out.  Returns [] where none qualifies, None where the iteration held inf/NaN (a sync: one
    copy of the rows' figures).  Embeddings are left out: a weight read outside its module (tied
    to an output projection by a direct call) would get gradients at two scales."""
    values = [
        (name, table[1 + input_rows :])
        for name, _, direction, _, table, _, dtype, input_rows in rows
        if direction == "backward" and dtype == torch.float16
    ]
    if not values:
        return []
    # (per row: the largest finite magnitude, inf/NaN counts and the subnormal count)
    figures = torch.stack(
        [
            torch.stack((v[:, ABS_MAX].max(), v[:, NON_FINITE].sum(), v[:, SUBNORMAL].sum())).cpu()
            for _, v in values
        ]
    ).tolist()
    if any(non_finite > 0 for _, non_finite, _ in figures):
        return None  # (an overflowing iteration: the next clean one decides)
    tops: dict[str, float] = {}
    subnormal: dict[str, float] = {}
    for (name, _), (top, _, count) in zip(values, figures, strict=True):
        tops[name] = max(tops.get(name, 0.0), top)
        subnormal[name] = subnormal.get(name, 0.0) + count
    overall = max(tops.values())
    if not overall > 0:
        return []
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    modules = dict(model.named_modules())

    def quiet(name: str) -> bool:
        return tops[name] > 0 and math.log2(overall / tops[name]) >= AUTO_GAP

    def owned(name: str) -> bool:  # (its parameters held by no module outside it)
        params = modules[name].parameters()
        return all(all(_inside(o, name) for o in owners[id(p)]) for p in params)

    embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    leaves = [
        name
        for name in tops
        if name in modules
        and next(modules[name].children(), None) is None
        and not isinstance(modules[name], embeddings)
        and next(modules[name].parameters(), None) is not None
        and quiet(name)
        and subnormal[name] > 0
        and owned(name)
    ]
    blocks = []
    name_of = {id(m): n for n, m in modules.items()}  # (a module held twice: its first name)
    for name, module in modules.items():
        children = list(module.children())
        if (
            not name
            or not children
            or not _called(module)
            or any(next(c.children(), None) is not None for c in children)
        ):
            continue
        traced = [name_of[id(c)] for c in children if name_of[id(c)] in tops]
        held = [c for c in traced if c in leaves]
        if (
            held
            and all(quiet(c) for c in traced)
            and not any(isinstance(c, embeddings) for c in children)
            and owned(name)
        ):
            blocks.append(name)
            if len(held) == 1:  # (it runs at the block's factor: see the docstring)
                leaves.remove(held[0])
    return blocks + leaves


# ----------------------------------------------------------------------------- the scaler's side
CHECKPOINT_KEY = "ampfused_islands"


class ScalerIslands:
    """What a GradScaler with ``islands=`` keeps: the argument, the model (from ``watch``),
    the installed :class:`Islands` (for "auto": once chosen), a checkpoint's rows."""

    __slots__ = (
        "argument",
        "model",
        "islands",
        "loaded",
        "iterations",
        "last",
        "settled",
        "left_out",
    )

    def __init__(self, argument: Any) -> None:
        self.argument = argument
        self.model: torch.nn.Module | None = None
        self.islands: Islands | None = None
        self.loaded: dict | None = None
        # Updates counted for "auto" (from the first; with named islands, from their first
        # pass): it chooses in the first AUTO_REVIEW[0], and looks again at each AUTO_REVIEW
        self.iterations = 0
        # The last completed iteration's islands and factors (no sync: a copy on the device)
        self.last: tuple[list[str], torch.Tensor] | None = None
        # "auto" before its choice: the scale of the last iteration it looked at
        self.settled: float | None = None
        # "auto": the islands it left out (one did what an island cannot scale), not chosen
        # again; kept in the checkpoint
        self.left_out: set[str] = set()

    def attach(self, where: str, parameters: Any, activations: Any, plan: list) -> None:
        """watch(model, activations=...): the model the islands live in.  Several ranks need
        found_inf_group (`plan`): the islands' measurements are agreed over it."""
        dist = _dist._dist()
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not plan and ranks > 1:
            raise RuntimeError(
                f"{where}: islands={self.argument!r} on {ranks} ranks: each rank traces its own "
                "batch, so the islands' factors would drift apart and DDP would sum gradients "
                "at different scales; make the scaler with "
                "found_inf_group=torch.distributed.group.WORLD (the islands' measurements are "
                "agreed in one all-reduce per step)"
            )
        if not isinstance(parameters, torch.nn.Module) or activations is False:
            raise ValueError(
                f"{where}: a scaler with islands={self.argument!r} measures each island from "
                "its traced activation gradients: call watch(model, activations=True) with the "
                "model itself"
            )
        # The islands' rows go on: a watch() again keeps the factors, and "auto" resumes a
        # checkpoint's islands (else it would run its first iteration without them).
        rows = self._rows() if self.islands is not None else None
        rows = rows if rows is not None else self.loaded
        names = self.argument if self.argument != "auto" else rows and rows[0]["names"]
        # (made, and so checked, before anything changes: a refused watch() changes nothing)
        auto = self.argument == "auto"
        islands = Islands(parameters, names, where, forgiving=auto) if names else None
        if self.islands is not None:
            self.islands.remove()
        self.model, self.islands, self.loaded = parameters, None, rows
        if islands is not None:
            self._adopt(islands)

    def detach(self) -> None:
        """unwatch(): the hooks removed; a later watch() installs the islands again."""
        if self.islands is not None:
            self.islands.remove()
            rows = self._rows()
            if rows is not None:
                self.loaded = rows
        self.islands = None
        self.model = None

    def _rows(self) -> tuple[dict, float] | None:
        """The installed islands' checkpoint entry and the global scale it goes with (None
        before their first pass)."""
        assert self.islands is not None
        entry = self.islands.checkpoint()
        scale = self.islands.global_scale()
        return None if entry["states"] is None or scale is None else (entry, scale)

    def _install(self, names: Iterable[str], where: str) -> None:
        assert self.model is not None
        self._adopt(Islands(self.model, names, where, forgiving=self.argument == "auto"))

    def _adopt(self, islands: Islands) -> None:
        self.islands = islands
        if self.loaded is not None and self.loaded[0]["names"] == list(islands.names):
            islands.load_rows(self.loaded[0]["states"], self.loaded[1])
        self.loaded = None

    def active(self, where: str) -> Islands | None:
        """The islands of a pass (None: none yet, "auto" before its choice); a scaler with
        islands but no watched model is refused, and so is a pass captured in a CUDA graph (the
        edges' measurements, the traced rows and the islands' update are kept by Python hooks,
        which a replay does not run: replays would read the capture's tables)."""
        if self.model is None:
            raise RuntimeError(
                f"{where}: the scaler was made with islands={self.argument!r} but no model is "
                "watched; call scaler.watch(model, activations=True) before the first step"
            )
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                f"{where} inside CUDA graph capture with scale islands: the islands' "
                "measurements and factors are kept by Python hooks that a graph replay does "
                "not run; capture without islands=, or run the islands' steps eagerly"
            )
        return self.islands

    def before_update(self, scaler: Any, policy: tuple) -> None:
        """update(), before the global scale is committed: each island's update computed from
        this iteration's tables and traced rows, or, for "auto", the islands chosen."""
        watch = scaler._watch
        if self.model is None or watch is None or watch.tracer is None:
            return
        if self.islands is None:
            # ("auto": each of the first AUTO_REVIEW[0] updates may choose once the scale has
            # settled from its start (the same as the last iteration's: the rows' subnormals
            # are then the settled scale's, not the start's); then only at the reviews; a
            # choice costs a sync)
            if (
                self.argument == "auto"
                and watch.tracer.now
                and watch.now
                and (self.iterations < AUTO_REVIEW[0] or self.iterations in AUTO_REVIEW)
            ):
                scale = float(scaler._scale)
                if scale != self.settled and self.iterations not in AUTO_REVIEW:
                    self.settled = scale
                    return
                names = [
                    n for n in choose(self.model, watch.tracer.now) or [] if n not in self.left_out
                ]
                if names:
                    self._install(names, "GradScaler(islands='auto')")
            return
        if self.islands.state is not None and watch.now:
            *rule, headroom = policy  # (an island's margin: from abs of a learned one's most)
            policy = (*rule, abs(headroom))
            self.islands.prepare_next(
                scaler._scale, watch.now, watch.tracer.now, policy, scaler._found_inf_plan
            )
            self.islands.committable = True

    def hold_global(self, scale_state: Any) -> None:
        """update(), between the global update's computation and its commit: held where this
        iteration's overflow started in an island."""
        islands = self.islands
        if islands is not None and islands.committable and islands.hold is not None:
            islands.hold_global(scale_state.tensor, scale_state.next)

    def after_update(self, scaler: Any) -> None:
        """update(), after: the islands' updates committed and their factors moved with the
        global scale."""
        islands = self.islands
        if islands is None and self.argument == "auto":  # (counting toward the next look)
            self.iterations += 1
        if islands is None or islands.state is None:
            return
        self.last = (list(islands.names), islands.factor.clone())
        if islands.committable:
            islands.commit(scaler._scale)
            islands.committable = False
        else:
            islands.refresh(scaler._scale)
            islands.edges = []
        self.iterations += 1
        if any(self.islands._pinned):
            self._leave_out_pinned(scaler._scale)
        watch = scaler._watch
        if (
            self.argument == "auto"
            and self.islands is not None
            and self.iterations in AUTO_REVIEW
            and watch is not None
        ):
            self._review(watch.tracer.last, scaler._scale)

    def _leave_out_pinned(self, scale: torch.Tensor) -> None:
        """ "auto"'s islands pinned in this iteration (Islands._unscalable) are left out: the
        others go on as they were (a sync: their rows), and none of those is chosen again."""
        islands = self.islands
        assert islands is not None and islands.state is not None and self.model is not None
        pinned = [n for n, p in zip(islands.names, islands._pinned, strict=True) if p]
        self.left_out.update(pinned)
        keep = [n for n in islands.names if n not in pinned]
        if keep:
            self._remake(keep, scale, None)
        else:
            islands.remove()
            self.islands = None

    def _review(self, rows: list, scale: torch.Tensor) -> None:
        """ "auto" again: the modules that qualify now join the islands (none leaves), at factor
        1 with fresh histories; the others go on as they were."""
        islands = self.islands
        assert islands is not None and islands.state is not None and self.model is not None
        # (an overflowing iteration chooses nothing: None)
        names = [
            n
            for n in choose(self.model, rows) or []
            if n not in islands.names and n not in self.left_out
        ]
        if not names:
            return
        global_bits = int(scale.reshape(1).view(torch.int32).item())
        left = int(islands.state[0, HYSTERESIS_LEFT])
        self._remake([*islands.names, *names], scale, fresh_row(global_bits, left))

    def _remake(self, names: list[str], scale: torch.Tensor, fresh: list[int] | None) -> None:
        """The islands made again as `names` (made, and so checked, before the old ones go):
        each that was one keeps its row, a new one starts from `fresh` (a sync: the rows)."""
        islands = self.islands
        assert islands is not None and islands.state is not None and self.model is not None
        rows_of = dict(zip(islands.names, islands.state.tolist(), strict=True))
        made = Islands(self.model, names, "GradScaler(islands='auto')", forgiving=True)
        islands.remove()
        made.load_rows([rows_of.get(n, fresh) for n in made.names], float(scale))
        self.islands = made

    def factors_of(self, current: bool) -> dict[str, float]:
        """The factors in force in the current iteration, or the last completed one (a
        sync)."""
        if current:
            islands = self.islands
            return {} if islands is None else islands.factors()
        if self.last is None:
            return {}
        names, factor = self.last
        return dict(zip(names, factor.tolist(), strict=True))

    def checkpoint(self) -> dict | None:
        """state_dict()'s entry: the islands' rows once they exist (before their first pass
        there is nothing to resume: the islands start afresh, "auto" chooses again)."""
        if self.islands is not None and (
            self.islands.state is not None or self.islands.loaded is not None
        ):
            entry = {**self.islands.checkpoint(), "iterations": self.iterations}
            return {**entry, "left_out": sorted(self.left_out)} if self.left_out else entry
        return None if self.loaded is None else self.loaded[0]

    def load(self, entry: Any, scale: float) -> None:
        """load_state_dict: the islands' rows (checked), with the global scale loaded."""
        if entry is None:
            return
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("names"), list)
            and isinstance(entry.get("states"), list)
            and all(
                isinstance(r, list)
                and len(r) in (STATE_SIZE - 1, STATE_SIZE)  # (- 1: before the learned margin)
                and all(type(v) is int for v in r)
                for r in entry["states"]
            )
            and len(entry["states"]) == len(entry["names"])
            and type(entry.get("iterations", 0)) is int
            and isinstance(entry.get("left_out", []), list)
            and all(isinstance(n, str) for n in entry.get("left_out", []))
        ):
            raise ValueError(
                f"load_state_dict: state_dict[{CHECKPOINT_KEY!r}] must be what state_dict() "
                f"wrote (island names and a state row of {STATE_SIZE} ints each), got "
                f"{type(entry).__name__}"
            )
        names = entry["names"]
        entry = {**entry, "states": [[*r, 0][:STATE_SIZE] for r in entry["states"]]}
        # ("auto": the checkpoint's choice wins, as a checkpoint's policy does)
        have = list(self.islands.names) if self.islands is not None else None
        if self.argument != "auto":
            have = have if have is not None else list(self.argument)
        else:
            have = None
        if have is not None and sorted(names) != sorted(have):
            raise ValueError(
                f"load_state_dict: the checkpoint's scale islands are {names}, this scaler's "
                f"are {have}; make the scaler with islands={names!r} to resume them (or leave "
                f"state_dict[{CHECKPOINT_KEY!r}] out to start the islands afresh)"
            )
        if self.islands is not None and entry["names"] == list(self.islands.names):
            self.islands.load_rows(entry["states"], scale)
            self.loaded = None
        elif self.argument == "auto" and self.model is not None:
            # (made, and so checked, before anything changes)
            islands = Islands(self.model, entry["names"], "load_state_dict", forgiving=True)
            if self.islands is not None:
                self.islands.remove()
            self.loaded = (entry, scale)
            self._adopt(islands)
        else:
            self.loaded = (entry, scale)
        self.iterations = entry.get("iterations", 0)
        self.left_out = set(entry.get("left_out", []))
