"""The report of one iteration and its advice: :class:`StepReport` (``GradScaler.report()``),
its rows (:class:`GradStats` per parameter, :class:`ActivationStats` per traced module call, as
:mod:`ampfused.diagnostics` reads them from the pass's tables), and what it infers: where
an overflow started, the float32 island that would keep it finite, the scale that would fit, and
the float16 activation gradients left in the subnormal range.  Pure host code over the rows: no
kernel, no device tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

__all__ = ["ActivationStats", "GradStats", "StepReport"]

LISTED = 5  # parameter offenders printed under a traced origin (all are in report.offenders)
# The underflow lines' estimate puts a module in an island whose largest gradient sits this many
# times below float16's largest value (as scale islands do at the default headroom), and says
# which of its subnormal values that lifts into float16's normal range (exactly: by bits).
ESTIMATE_HEADROOM = 64.0
SUBNORMAL_BINADES = 10  # float16's subnormals: 2**-24 .. 2**-14


@dataclass(frozen=True)
class GradStats:
    """One parameter's gradient in one iteration, after unscaling.

    Attributes:
        name: the name given to :meth:`GradScaler.watch` (``"<param N>"`` for a parameter it was
            not given, N its position in the optimizer's ``param_groups``).
        norm: L2 norm of the unscaled gradient, float32 (inf or NaN when an element is).
        abs_max: largest magnitude among its finite unscaled elements (0.0 if none).
        pos_inf, neg_inf, nan: elements that were +inf, -inf, NaN.
        zeros: elements that are exactly zero after unscaling (underflow shows here).
        numel: elements in the gradient.
    """

    name: str
    norm: float
    abs_max: float
    pos_inf: int
    neg_inf: int
    nan: int
    zeros: int
    numel: int

    @property
    def non_finite(self) -> int:
        """Elements that were inf or NaN."""
        return self.pos_inf + self.neg_inf + self.nan

    def describe(self) -> str:
        kinds = [
            f"{n} {kind}"
            for n, kind in ((self.pos_inf, "+inf"), (self.neg_inf, "-inf"), (self.nan, "NaN"))
            if n
        ]
        return (
            f"{self.name}: {', '.join(kinds)} of {self.numel} elements "
            f"(largest finite |g| {self.abs_max:.4g})"
        )


def island_exponent(abs_max: float) -> int:
    """k of the largest factor 2**k that keeps `abs_max` ESTIMATE_HEADROOM times below
    float16's largest value (0 or less: no room)."""
    return (
        math.floor(math.log2(torch.finfo(torch.float16).max / (ESTIMATE_HEADROOM * abs_max)))
        if abs_max > 0
        else 0
    )


def island_estimate(abs_max: float) -> str:
    """What a scale island would do for a float16 gradient whose largest magnitude is
    `abs_max`: at 2**k, every value at or above 2**-(14 + k) becomes normal, so k >= 10 lifts
    all of its subnormals (the zeros it lost stay lost: only the next backward, run in the
    island, keeps them)."""
    k = island_exponent(abs_max)
    if k < 1:
        return ""
    at = f"; as a scale island at 2^{k} (its largest {ESTIMATE_HEADROOM:g}x below 65,504)"
    if k >= SUBNORMAL_BINADES:
        return f"{at}: none of them"
    return f"{at}: only those below 2**-{14 + k}"


@dataclass(frozen=True)
class ActivationStats:
    """One module call's outputs (forward) or their gradients (backward), as recorded.

    Attributes:
        module: the module's qualified name in the watched model ("" for the model itself).
        call: which call of the module in the iteration (0 for the first).
        direction: ``"forward"`` (the outputs) or ``"backward"`` (the gradients with respect to
            them, scaled by the loss scale, as backward computes them).
        abs_max: largest magnitude among the finite elements (0.0 if none).
        pos_inf, neg_inf, nan: elements that were +inf, -inf, NaN.
        numel: elements recorded (every floating tensor of the output together).
        dtype: the dtype of the outputs (the widest, when they differ).
        recompute: a forward call that activation checkpointing re-ran during backward.
        inputs_finite: (forward) its floating inputs held no inf/NaN; a module whose inputs did
            was not where the overflow started.
        zeros: elements exactly zero (in a float16 gradient, true zeros and values lost to
            underflow alike: only a float32 recompute tells them apart).
        subnormal: of float16 elements, the finite ones with 0 < |x| < 2**-14, float16's
            smallest normal (its subnormals: kept with fewer than 11 significant bits); 0 for
            the other dtypes, which hold such values in full.
    """

    module: str
    call: int
    direction: str
    abs_max: float
    pos_inf: int
    neg_inf: int
    nan: int
    numel: int
    dtype: torch.dtype
    recompute: bool = False
    inputs_finite: bool = True
    zeros: int = 0
    subnormal: int = 0

    @property
    def non_finite(self) -> int:
        return self.pos_inf + self.neg_inf + self.nan

    @property
    def subnormal_share(self) -> float:
        """subnormal as a fraction of the nonzero finite elements (0.0 if none)."""
        nonzero = self.numel - self.zeros - self.non_finite
        return self.subnormal / nonzero if nonzero > 0 else 0.0

    @property
    def headroom(self) -> float:
        """abs_max as a fraction of the dtype's largest value (1.0: at the edge of overflow)."""
        return self.abs_max / torch.finfo(self.dtype).max

    def describe(self) -> str:
        kinds = [
            f"{n} {kind}"
            for n, kind in ((self.pos_inf, "+inf"), (self.neg_inf, "-inf"), (self.nan, "NaN"))
            if n
        ]
        what = "output" if self.direction == "forward" else "output gradient"
        call = f" (call {self.call})" if self.call else ""
        found = ", ".join(kinds) if kinds else "finite"
        return (
            f"{self.module or '<model>'}{call} {what}: {found} of {self.numel} "
            f"{str(self.dtype).removeprefix('torch.')} elements (largest finite |x| "
            f"{self.abs_max:.4g}, {self.headroom:.1%} of the dtype's range)"
        )


@dataclass(frozen=True)
class StepReport:
    """The last iteration's gradients, as :meth:`GradScaler.report` returns them.

    Attributes:
        step: the iteration's index (``counters()["steps"]`` before its update, from 0).
        scale: the loss scale in force when the gradients were checked.
        skipped: whether inf/NaN was found, so the optimizer step was (or will be) skipped.
            With a distributed agreement (``found_inf_group``, DTensor gradients,
            ShardedGradScaler) it is the agreed verdict: True on every rank when any rank found
            inf/NaN, while ``grads`` and ``offenders`` are this rank's own (its shards).
        grads: every parameter that had a gradient, in parameter order (the order given to
            ``watch``, then parameters it was not given).
        total_norm: L2 norm over all those gradients, float32.
        rank: this process's rank in torch.distributed's default group when it is
            initialized (every line of ``str(report)`` then starts with it), else None.
        activations: with ``watch(model, activations=True)``: every traced module call, forward
            rows in forward execution order, then backward rows in backward execution order.
        reference: for a step skipped by a backward overflow (no forward origin), the report
            of the iteration before it when that one's traced gradients were all finite, else
            None.  A backward is linear in the loss scale, so its magnitudes times
            ``scale / reference.scale`` are what this step's gradients would have been without
            the overflow (the weights differ by that iteration's optimizer step):
            :attr:`fitting_scale` and :attr:`suggested_islands` read them.
        chains: with traced activations: the watched model's plain ``nn.Sequential`` modules,
            each with its children's names in call order (nothing runs between two of them but
            autocast's casts, so consecutive children make one island).
        islands: with ``GradScaler(islands=...)``: each scale island's factor over the global
            scale in this iteration, by module name; the traced rows of a module inside one
            are at the global scale times it.
    """

    step: int
    scale: float
    skipped: bool
    grads: list[GradStats] = field(repr=False)
    total_norm: float
    rank: int | None = None
    activations: list[ActivationStats] = field(default_factory=list, repr=False)
    reference: StepReport | None = field(default=None, repr=False)
    chains: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    islands: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def forward_origin(self) -> ActivationStats | None:
        """The first module, in forward execution order, whose output held inf/NaN (calls re-run
        by activation checkpointing left out): where a forward overflow started."""
        rows = [a for a in self._rows("forward") if a.non_finite]
        # The first that made inf/NaN from finite inputs; else (it started in code between the
        # traced modules) the first that held any.
        return next((a for a in rows if a.inputs_finite), rows[0] if rows else None)

    @property
    def backward_origin(self) -> ActivationStats | None:
        """The first module, in backward execution order, whose output gradient held inf/NaN."""
        return next((a for a in self._rows("backward") if a.non_finite), None)

    @property
    def backward_producer(self) -> str | None:
        """The module whose backward computed the backward origin's gradient, as far as the
        trace tells: the traced module whose backward ran just before (in a chain of modules,
        the one that consumed the origin's output).  None without a backward origin, or when it
        was the first backward row."""
        origin = self.backward_origin
        return None if origin is None else self._producer(origin)

    def _producer(self, row: ActivationStats) -> str | None:
        rows = self._rows("backward")
        i = rows.index(row)
        return rows[i - 1].module if i > 0 else None

    @functools.cached_property
    def _backward(self) -> _BackwardOverflow | None:
        """The analysis of a backward overflow (see _in_backward)."""
        return _BackwardOverflow(self) if self._in_backward else None

    @property
    def _in_backward(self) -> bool:
        """Traced activations, inf/NaN in a traced output gradient or a parameter gradient, and
        no forward origin: the overflow started in backward."""
        if not self.activations or self.forward_origin is not None:
            return False
        return self.backward_origin is not None or bool(self.offenders)

    @property
    def suggested_islands(self) -> list[str]:
        """Module names whose float32 island (``ampfused.keep_float32(model, names)``) the
        traced data shows would keep this step's overflow from happening; [] when it shows
        none (``str(report)`` says why and what else to do; ``keep_float32`` with [] changes
        nothing and warns).

        A forward overflow: the forward origin (its parent when its inputs already held
        inf/NaN).  A backward overflow (no forward origin): the smallest island holding every
        traced gradient that exceeded its dtype's range at this scale together with the module
        whose backward computed it (for a parameter gradient, its module): inside an island
        all of that runs in float32, while outside it the gradient is float16, in code between
        the modules or at the island's edge, where autocast's cast hands it back in float16.
        The island is one module, or consecutive children of a plain ``nn.Sequential``
        (:attr:`chains`: nothing runs between them but those casts).  Only gradients known to
        exceed the range count, which takes :attr:`reference` (an overflowed gradient is
        inf/NaN in this trace, which an op making NaN also gives); and it is suggested only
        when every traced gradient outside it is known to fit: finite in this trace, or in
        :attr:`reference` once scaled to this scale.  Gradients of untraced code between
        modules are not measured.  :attr:`needed_islands` is that island whether or not the
        trace shows it suffices.
        """
        forward = self.forward_origin
        if forward is not None:
            return [forward.module if forward.inputs_finite else forward.module.rpartition(".")[0]]
        backward = self._backward
        return [] if backward is None or backward.island is None else list(backward.island)

    @property
    def needed_islands(self) -> list[str]:
        """For a backward overflow: the modules a float32 island would have to hold at least
        (see :attr:`suggested_islands`: one module, or consecutive children of an
        ``nn.Sequential``), as ``keep_float32`` takes them, whether or not the trace shows that
        they suffice; [] when only the whole model would, or there is no backward overflow."""
        backward = self._backward
        return [] if backward is None or backward.run == ("",) else list(backward.run)

    @property
    def smallest_island(self) -> str | None:
        """For a backward overflow: the smallest single module a float32 island would have to
        hold (the one holding :attr:`needed_islands`), whether or not the trace shows that it
        suffices; None when only the whole model would, or there is no backward overflow."""
        backward = self._backward
        return None if backward is None else backward.region or None

    @property
    def fitting_scale(self) -> float | None:
        """The largest loss scale at which every traced gradient stays within the range of the
        dtype it was computed in (the traced output gradients, and the parameter gradients of
        traced modules, in their outputs' dtype): ``scale * 65504 / magnitude`` at the tightest
        one computed in float16.  From this
        trace when all of them were finite, else from :attr:`reference`; None when neither
        tells (an overflowed gradient is only known to have exceeded the range at
        ``scale``).  An upper bound: gradients in untraced code are not measured."""
        if not self.activations:
            return None
        backward = self._backward
        if backward is not None:
            return backward.fit[0] if backward.fit else None
        fit = _fit(self)
        return fit[0] if fit else None

    def closest_to_overflow(self, n: int = 5) -> list[ActivationStats]:
        """The n traced module calls whose largest finite magnitude came closest to their
        dtype's largest value (65,504 for float16; for gradients the scaled magnitude)."""
        rows = [a for a in self.activations if not a.recompute]
        return sorted(rows, key=lambda a: a.headroom, reverse=True)[:n]

    def _rows(self, direction: str) -> list[ActivationStats]:
        return [a for a in self.activations if a.direction == direction and not a.recompute]

    @property
    def offenders(self) -> list[GradStats]:
        """The gradients that held inf/NaN, first offender first."""
        return [g for g in self.grads if g.non_finite]

    @property
    def underflow(self) -> list[ActivationStats]:
        """The traced float16 activation gradients (backward rows) that held subnormal values
        (0 < |x| < 2**-14: kept with fewer bits, and a sign that more were lost to zero), the
        largest share of their nonzero elements first."""
        rows = [a for a in self._rows("backward") if a.dtype == torch.float16 and a.subnormal]
        return sorted(rows, key=lambda a: -a.subnormal_share)

    @property
    def subnormal_share(self) -> float | None:
        """The subnormal share of every traced float16 activation gradient's nonzero finite
        elements together (None without traced float16 gradients)."""
        rows = [a for a in self._rows("backward") if a.dtype == torch.float16]
        nonzero = sum(a.numel - a.zeros - a.non_finite for a in rows)
        return sum(a.subnormal for a in rows) / nonzero if nonzero else None

    def _underflow_lines(self) -> list[str]:
        share, rows = self.subnormal_share, self.underflow
        if share is None or not rows:
            return []
        lines = [
            f"  float16 activation gradients below 2**-14 (subnormal): {share:.2%} of the "
            "nonzero ones; most in:"
        ]
        for a in rows[:LISTED]:
            call = f" (call {a.call})" if a.call else ""
            island = self.island_of(a.module)
            at = f", in scale island {island} at 2^{self._log2(island)}" if island else ""
            lines.append(
                f"    {a.module or '<model>'}{call} output gradient: {a.subnormal_share:.2%} of "
                f"{a.numel - a.zeros - a.non_finite} nonzero (largest |x| {a.abs_max:.4g}{at})"
                + ("" if island else island_estimate(a.abs_max))
            )
        return lines

    def _island_lines(self) -> list[str]:
        if not self.islands:
            return []
        exponents = sorted(math.log2(f) for f in self.islands.values())
        return [
            f"  scale islands: {len(self.islands)}, at 2^{exponents[0]:g} to 2^{exponents[-1]:g} "
            "times the global scale (their modules' traced gradients are at that scale)"
        ]

    def island_of(self, module: str) -> str | None:
        """The innermost scale island holding `module` (its name), or None."""
        inside = [n for n in self.islands if module == n or module.startswith(n + ".")]
        return max(inside, key=len) if inside else None

    def _log2(self, island: str) -> str:
        return f"{math.log2(self.islands[island]):g}"

    def __str__(self) -> str:
        return "\n".join([self._summary(), *self._underflow_lines(), *self._island_lines()])

    def _summary(self) -> str:
        where = "" if self.rank is None else f" (rank {self.rank})"
        head = (
            f"ampfused step {self.step}{where}: scale {self.scale:g}, "
            f"total grad norm {self.total_norm:.4g}"
        )
        origin = self._origin_lines()
        bad = self.offenders
        if origin:
            lines = [f"{head}, step {'skipped' if self.skipped else 'taken'}", *origin]
            if bad:
                lines.append(
                    f"  parameter gradients with inf/NaN ({len(bad)} of {len(self.grads)}), "
                    "where it ended up:"
                )
                lines += [f"    {g.describe()}" for g in bad[:LISTED]]
                if len(bad) > LISTED:
                    lines.append(f"    ... {len(bad) - LISTED} more (report.offenders)")
            return "\n".join(lines)
        if not bad:
            if self.skipped:  # the agreed verdict: another rank's gradients held inf/NaN
                return (
                    f"{head}, step skipped: all {len(self.grads)} gradients of this rank are "
                    "finite, inf/NaN was found on another rank (its report names them)"
                )
            return f"{head}, all {len(self.grads)} gradients finite"
        lines = [
            f"{head}: inf/NaN in {len(bad)} of {len(self.grads)} gradients"
            f"{', step skipped' if self.skipped else ''}"
        ]
        lines += [f"  {g.describe()}" for g in bad]
        return "\n".join(lines)

    def _origin_lines(self) -> list[str]:
        """Where the overflow started, and the float32 island that would keep it finite; with
        no overflow traced, the module calls closest to one."""
        if not self.activations:
            return []
        forward, backward = self.forward_origin, self.backward_origin
        lines = []
        if forward is not None:
            lines.append(f"  overflow started in forward: {forward.describe()}")
            if not forward.inputs_finite:
                where = forward.module.rpartition(".")[0] or "<model>"
                lines.append(
                    f"    its inputs already held inf/NaN: it started in code of {where} that "
                    "no traced module covers"
                )
        if backward is not None:
            producer = self.backward_producer
            by = (
                "" if producer is None else f", computed in the backward of {producer or '<model>'}"
            )
            lines.append(f"  overflow started in backward: {backward.describe()}{by}")
        if forward is not None:
            island = self.suggested_islands[0]
            lines.append(f"  to run it in float32: ampfused.keep_float32(model, [{island!r}])")
            return lines
        if self._backward is not None:
            return lines + self._backward.lines()
        lines.append("  no traced activation held inf/NaN; closest to overflow:")
        return lines + [f"    {a.describe()}" for a in self.closest_to_overflow(3)]

    def grad_norms(self, group_separator: str = "/") -> dict[str, float]:
        """Per-parameter and total L2 norms keyed as Lightning's ``grad_norm`` keys them."""
        out = {f"grad_2.0_norm{group_separator}{g.name}": g.norm for g in self.grads}
        out["grad_2.0_norm_total"] = self.total_norm
        return out


@dataclass(frozen=True)
class _Quantity:
    """A gradient the backward computed in a precision that can overflow: a traced output
    gradient (a row) or a parameter gradient, as one report saw it."""

    key: tuple
    label: str
    module: str | None  # (None: a parameter watch() did not name)
    param: bool
    dtype: torch.dtype  # what it was computed in (an untraced module's: taken as float16)
    traced: bool  # (a parameter of an untraced module: its dtype is a guess)
    level: float | None  # largest magnitude at the report's scale; None: it held inf/NaN

    @property
    def limit(self) -> float:
        return torch.finfo(self.dtype).max

    def inside(self, run: tuple[str, ...]) -> bool:
        """Computed in float32 inside an island on the modules of `run` (one module, or
        consecutive children of an nn.Sequential): a parameter gradient of a module in it, or
        the output gradient of a module strictly inside, or of a module of the run but the last
        (computed by the next one's backward; the last one's is computed by its consumer,
        outside)."""
        if self.module is None:
            return False
        for k, region in enumerate(run):
            if region == "" or self.module.startswith(region + "."):
                return True
            if self.module == region and (self.param or k < len(run) - 1):
                return True
        return False


def _quantities(report: StepReport) -> list[_Quantity]:
    """The report's traced output gradients (backward execution order), then its parameter
    gradients, each computed in the narrowest dtype its module's outputs had."""
    computed: dict[str, torch.dtype] = {}
    for a in report.activations:
        if a.direction == "forward":
            d = computed.get(a.module, a.dtype)
            computed[a.module] = min(d, a.dtype, key=lambda t: torch.finfo(t).max)
    out = [
        _Quantity(
            ("row", a.module, a.call),
            f"{a.module or '<model>'}{f' (call {a.call})' if a.call else ''} output gradient",
            a.module,
            False,
            a.dtype,
            True,
            None if a.non_finite else a.abs_max,
        )
        for a in report._rows("backward")
    ]
    for g in report.grads:
        module = None if g.name.startswith("<param ") else g.name.rpartition(".")[0]
        dtype = computed.get(module) if module is not None else None
        level = None if g.non_finite else g.abs_max * report.scale
        label = f"{g.name} gradient"
        out.append(
            _Quantity(
                ("param", g.name), label, module, True, dtype or torch.float16, bool(dtype), level
            )
        )
    return out


def _fit(report: StepReport) -> tuple[float, _Quantity] | None:
    """The largest scale at which every traced quantity of a report with none non-finite stays
    within its dtype's range, and the one that binds; None when one held inf/NaN or all are
    zero."""
    found = _quantities(report)
    if any(q.level is None for q in found):
        return None
    bounds = [(report.scale * q.limit / q.level, q) for q in found if q.level and q.traced]
    return min(bounds, key=lambda b: b[0]) if bounds else None


def _common_module(names: list[str]) -> str:
    """The innermost module holding every named one ("" for the model)."""
    parts = [n.split(".") if n else [] for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    return ".".join(common)


def _child_holding(parent: str, name: str) -> str:
    """The child of module `parent` that holds module `name` (strictly inside it)."""
    rest = name[len(parent) + 1 :] if parent else name
    head = rest.split(".")[0]
    return f"{parent}.{head}" if parent else head


def _island_run(cover: list[str], chains: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The smallest island holding every module of `cover`: their innermost common module, or,
    where that is a plain nn.Sequential not itself in `cover`, the run of its consecutive
    children from the first holding one of them to the last (the gradient passes through every
    child between, and between two children nothing runs but autocast's casts)."""
    common = _common_module(cover)
    children = chains.get(common)
    if not children or common in cover:
        return (common,)
    index = {c: i for i, c in enumerate(children)}
    held = [index.get(_child_holding(common, name)) for name in cover]
    if any(i is None for i in held):  # (a name the chain does not know: keep to the module)
        return (common,)
    first, last = min(held), max(held)  # type: ignore[type-var]
    run = children[first : last + 1]
    return (common,) if len(run) == len(children) else run


def _consecutive(producer: str | None, origin: str, chains: dict[str, tuple[str, ...]]) -> bool:
    """Whether `origin`'s output goes straight into `producer` in an nn.Sequential: nothing
    between them but autocast's casts."""
    if producer is None:
        return False
    children = chains.get(origin.rpartition(".")[0] if "." in origin else "", ())
    return (
        origin in children
        and producer in children
        and children.index(producer) == children.index(origin) + 1
    )


def _names(run: tuple[str, ...]) -> str:
    """A run of modules for the report's text."""
    if len(run) == 1:
        return run[0] or "<model>"
    return f"{', '.join(run[:-1])} and {run[-1]}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _BackwardOverflow:
    """A step skipped by inf/NaN in its backward, with no forward origin: what the trace says
    about the scale that would have fit and the float32 island that would keep it finite.

    A backward overflow is a gradient computed in float16 (an activation gradient, or the
    weight gradient of a module that ran in float16) that exceeds 65,504.  The trace holds an
    overflowed gradient as inf/NaN, which says only that it exceeded the range (or that an op
    made NaN); the gradients below it in the backward are inf/NaN too.  What they would have
    been comes from the iteration before (``report.reference``) when its gradients were
    finite: a backward is linear in the loss scale, so each magnitude there times
    ``scale / reference.scale`` is the magnitude at this scale.

    An island runs a module and its submodules with autocast off: the gradients computed
    inside it are float32.  Code outside it still runs in float16 under autocast, and computes
    its gradients in float16 even where its input came from the island in float32 (the cast's
    backward widens the float16 gradient only afterwards).  A float16 gradient that overflowed
    was computed by the backward of the code between the module that took the origin's output
    in (the producer) and the origin's output; it stays float16 unless the island holds all of
    that code, so the island must hold the producer and the origin: the smallest module holding
    both.  Its backward then carries on in float32 through the origin's backward, which may
    bring the gradient back within range, and hands it on at its boundary, to code that may be
    float16 again.  So an island is suggested when it holds every gradient that exceeds the
    range at this scale with the module whose backward computed it (for a parameter gradient,
    its module), and every traced gradient outside it is known to fit at this scale: finite in
    this trace, or finite in the reference and within range once scaled.  (On the Llama layer
    whose o_proj weight is 4,096 times larger and v_proj's as much smaller: islands on v_proj,
    or on v_proj and o_proj, leave the attention's own code between them in float16 and the
    step skipped; the whole self_attn lets it through.)
    """

    def __init__(self, report: StepReport) -> None:
        self.report = report
        scale, reference = report.scale, report.reference
        self.now = _quantities(report)
        then = {q.key: q for q in _quantities(reference)} if reference is not None else {}
        ratio = scale / reference.scale if reference is not None else 0.0
        # Each quantity's largest magnitude at this scale, where known.
        self.level: dict[tuple, float | None] = {}
        for q in self.now:
            level = q.level
            if level is None and q.key in then and then[q.key].level is not None:
                level = then[q.key].level * ratio
            self.level[q.key] = level
        self.fit = _fit(reference) if reference is not None else None
        finite = [(scale * q.limit / q.level, q) for q in self.now if q.level and q.traced]
        self.finite_bound = min(finite, key=lambda b: b[0]) if finite else None
        self.exceeding = [q for q in self.now if (self.level[q.key] or 0.0) > q.limit]
        origin = report.backward_origin
        if origin is not None:
            producer = report.backward_producer
            cover = [origin.module, "" if producer is None else producer]
        else:
            cover = [q.module or "" for q in self.now if q.param and q.level is None]
        rows = {(a.module, a.call): a for a in report._rows("backward")}
        for q in self.exceeding:
            cover.append(q.module or "")
            if not q.param:
                producer = report._producer(rows[q.key[1:]])
                cover.append("" if producer is None else producer)
        self.region = _common_module(cover)
        # The island: that module, or the run of its children that holds them.
        self.run = _island_run(cover, report.chains)
        # Why no island, when none: what outside the island is not known to fit.
        self.outside = next(
            (
                q
                for q in self.now
                if not q.inside(self.run)
                and (self.level[q.key] is None or self.level[q.key] > q.limit)
            ),
            None,
        )
        shown = bool(self.exceeding) and self.run != ("",) and self.outside is None
        self.island = self.run if shown else None

    def lines(self) -> list[str]:
        report = self.report
        scale, reference = report.scale, report.reference
        lines = []
        if report.backward_origin is None:
            first = next(q for q in self.now if q.param and q.level is None)
            how = f", computed in {_dtype_name(first.dtype)}" if first.traced else ""
            lines.append(
                "  overflow started in backward, in a parameter gradient (no traced output "
                f"gradient held inf/NaN): first {first.label}{how}"
            )
        if reference is not None:
            then = (
                f"step {reference.step}'s gradients (scale {reference.scale:g}, all finite) "
                f"times {scale / reference.scale:g}"
            )
            if self.exceeding:
                top = max(self.exceeding, key=lambda q: self.level[q.key] / q.limit)
                lines.append(
                    f"  scale {scale:g} was too large for this backward: {then} (a backward is "
                    f"linear in the loss scale) put {top.label} at {self.level[top.key]:.4g}, "
                    f"over {_dtype_name(top.dtype)}'s {top.limit:,.0f}"
                )
            else:
                where = report.backward_producer or "untraced code"
                lines.append(
                    f"  the scale does not explain it: {then} (a backward is linear in the loss "
                    f"scale) keep every traced gradient within range at scale {scale:g}, so "
                    f"the inf/NaN was made from finite values, in the backward of {where} (an "
                    "op making inf/NaN: x/0, log 0, 0*inf; or a gradient of untraced code over "
                    "the range); torch.autograd.detect_anomaly() names an op that makes NaN"
                )
            if self.fit is not None:
                value, q = self.fit
                lines.append(
                    f"  the traced gradients would fit up to scale {value:.4g} ({q.label} the "
                    "tightest; an upper bound: gradients of untraced code are not measured)"
                )
        else:
            lines.append(
                f"  scale {scale:g}: if that inf/NaN is an overflow, a scale that fits is below "
                f"{scale:g}; by how much, this trace cannot tell (a gradient that overflowed is "
                "inf/NaN here: it says only that its magnitude passed the range)"
            )
            if self.finite_bound is not None:
                value, q = self.finite_bound
                lines.append(
                    f"  the traced gradients that stayed finite would fit up to scale "
                    f"{value:.4g} ({q.label} the tightest)"
                )
        lines.append(self._backoff_line())
        return [*lines, *self._island_lines()]

    def _backoff_line(self) -> str:
        scale = self.report.scale
        line = (
            "  update() backs off: it multiplies the scale by backoff_factor (0.5 by default: "
            f"{scale / 2:g} next) at each skipped step (with hysteresis=N, from the N-th in a "
            "row on), down to min_scale"
        )
        fit = self.fit[0] if self.fit is not None else None
        if fit is None:
            return line + ", until a step fits"
        if fit >= scale:
            return line + ": no help with what the scale does not explain"
        halvings = math.ceil(math.log2(scale / fit))
        ceiling = 2.0 ** math.floor(math.log2(fit))
        return (
            f"{line}: {halvings} halving{'s reach' if halvings > 1 else ' reaches'} "
            f"{scale / 2**halvings:g}; GradScaler(..., max_scale={ceiling:g}) keeps growth "
            "from going back past it"
        )

    def _island_lines(self) -> list[str]:
        report, run, region = self.report, self.run, self.region
        origin, producer = report.backward_origin, report.backward_producer
        if origin is not None:
            took_in = origin.module or "<model>"
            holding = (
                f"{producer or '<model>'}, whose backward computed the gradient, and {took_in}, "
                "which takes it in"
            )
            if _consecutive(producer, origin.module, report.chains):
                why = (
                    f"nothing runs between them but autocast's casts, yet an island on "
                    f"{producer} alone would hand the gradient back to {took_in} in float16, "
                    "through the cast at its edge"
                )
            else:
                why = "with a smaller island, code between them computes the gradient in float16"
            holding = f"{holding} ({why})"
        else:
            modules = sorted(
                {q.module or "<model>" for q in self.now if q.param and q.level is None}
            )
            holding = f"{', '.join(modules)}, whose parameter gradients it computes in float32"
        # The gradients over the range at this scale that widen the island beyond those.
        if origin is not None:
            named = {producer or "<model>", origin.module or "<model>"}
        else:
            named = set(modules)
        extra = [q.label for q in self.exceeding if (q.module or "<model>") not in named]
        if extra:
            more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            listed = ", ".join(extra[:3]) + more
            them = "it" if len(extra) == 1 else "them"
            holding += f"; and {listed}, over the range at this scale, with what computes {them}"
        if len(run) == 1:
            kind = f"the smallest module holding {holding}"
        else:
            kind = (
                f"consecutive children of the nn.Sequential {region or '<model>'}, the smallest "
                f"island holding {holding}"
            )
        if self.island is not None:
            ranked = [(self.level[q.key] / q.limit, q) for q in self.now if not q.inside(run)]
            _, q = max(ranked, key=lambda b: b[0])
            source = "" if q.level is not None else f", from step {report.reference.step}"
            return [
                f"  to run it in float32: ampfused.keep_float32(model, {list(run)!r}), {kind}",
                f"    every traced gradient outside it fits at scale {report.scale:g} (the "
                f"closest to its range: {q.label}, {self.level[q.key]:.4g}{source})",
            ]
        if report.reference is not None and not self.exceeding:
            return [
                "  no float32 island can be shown to help: the trace does not make it an overflow"
            ]
        otherwise = (
            "    what else: a lower scale (the backoff gets there at a skipped step per halving; "
            "GradScaler(..., init_scale=S) starts there, and policy='headroom' under "
            "watch(model, activations=True) moves the scale by the traced gradients' "
            "magnitudes before they overflow), or a model change that keeps the gradient within "
            f"range in the backward of {producer or 'the modules above'}"
        )
        if run == ("",):
            return [
                f"  no float32 island smaller than the whole model holds {holding}",
                otherwise,
            ]
        lines = [
            "  no float32 island can be shown to help from this trace; one would have to hold "
            f"at least {_names(run)}, {kind}; report.needed_islands lists them"
        ]
        q = self.outside
        if q is None:  # (nothing is known to have exceeded the range: no reference)
            lines.append(
                "    but nothing here tells an overflow from an op that makes inf/NaN; the "
                "trace of a finite step would: the report of an overflow right after one "
                "checks the island"
            )
        elif self.level[q.key] is not None:
            lines.append(
                f"    but {q.label}, outside it, would be {self.level[q.key]:.4g} at scale "
                f"{report.scale:g}, over {_dtype_name(q.dtype)}'s range"
            )
        else:
            lines.append(
                f"    but whether what it passes on fits is not in this trace: {q.label}, "
                "outside it, held inf/NaN, and no finite trace of the step before says what it "
                "would be (the report of an overflow right after a finite step checks the "
                "island against that step)"
            )
        return [*lines, otherwise]
