"""What the scaler's pass saw, by parameter name: ``GradScaler.watch`` and its reports.

Under ``watch()`` the fused pass writes a float64 statistics table per device (``grad_stats``,
see :func:`ampfused.reference.grad_stats`): a header (scale in force, step, verdict) and, per
work item of each gradient, the sum of squares of the unscaled values, the largest finite
magnitude, and the counts of +inf, -inf, NaN and zeros.  :class:`Watch` keeps the names given to
``watch()`` and the tables of the current and the last iteration.  Nothing here runs unless a
report is asked for; building one copies every table to the host (one copy per device) and
reduces it there.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampfused import _C
from ampfused._grad_pass import describe_argument, flat_params
from ampfused.activations import Row, Tracer

__all__ = ["ActivationStats", "GradStats", "StepReport"]

_LOG = logging.getLogger("ampfused")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LOG_SKIPPED = (False, "log", "warn")
_LISTED = 5  # parameter offenders printed under a traced origin (all are in report.offenders)

# Watch.name_check: whether a pass still checks that watch() named its parameters (see there).
_CHECKED, _FIRST_PASS, _CHECKING = 0, 1, 2

# (statistics table, [position, numel] per gradient, the param_groups the positions index)
Table = tuple[torch.Tensor, torch.Tensor, Any]


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

    @property
    def non_finite(self) -> int:
        return self.pos_inf + self.neg_inf + self.nan

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
    """

    step: int
    scale: float
    skipped: bool
    grads: list[GradStats] = field(repr=False)
    total_norm: float
    rank: int | None = None
    activations: list[ActivationStats] = field(default_factory=list, repr=False)

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
        rows = self._rows("backward")
        origin = self.backward_origin
        if origin is None:
            return None
        i = rows.index(origin)
        return rows[i - 1].module if i > 0 else None

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

    def __str__(self) -> str:
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
                lines += [f"    {g.describe()}" for g in bad[:_LISTED]]
                if len(bad) > _LISTED:
                    lines.append(f"    ... {len(bad) - _LISTED} more (report.offenders)")
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
        start = forward or backward
        if start is None:
            lines.append("  no traced activation held inf/NaN; closest to overflow:")
            return lines + [f"    {a.describe()}" for a in self.closest_to_overflow(3)]
        island = start.module if start.inputs_finite else start.module.rpartition(".")[0]
        lines.append(f"  to run it in float32: ampfused.keep_float32(model, [{island!r}])")
        return lines

    def grad_norms(self, group_separator: str = "/") -> dict[str, float]:
        """Per-parameter and total L2 norms keyed as Lightning's ``grad_norm`` keys them."""
        out = {f"grad_2.0_norm{group_separator}{g.name}": g.norm for g in self.grads}
        out["grad_2.0_norm_total"] = self.total_norm
        return out


def _norm(sum_squares: float) -> float:
    """float32(sqrt(sum)): the norm from a float64 sum of squares (inf and NaN pass through)."""
    return float(torch.tensor(sum_squares, dtype=torch.float64).sqrt().float())


class _Reduced:
    """The iteration's tables reduced per gradient, in report order (see build_report): the
    per-parameter work is a name lookup each; the numbers stay in tensors until the end."""

    def __init__(
        self,
        passes: list[tuple[torch.Tensor, torch.Tensor, list]],
        names: dict[int, str],
        order: dict[int, int],
    ) -> None:
        tables = _to_host([t for t, _, _ in passes])
        per_pass, ranks, self.names, numels = [], [], [], []
        self.scale, self.step, self.skipped = 1.0, 0, False
        total_sq = 0.0
        for (_, pos_numel, params), table in zip(passes, tables, strict=True):
            header = table[0].tolist()
            self.scale, self.step = header[0], int(header[1])
            self.skipped = self.skipped or bool(header[2])
            per_grad, total = _C.reduce_grad_stats(table[1:], pos_numel[:, 1])
            per_pass.append(per_grad)
            total_sq += total
            positions, sizes = pos_numel.t().tolist()
            numels += sizes
            keys = [id(params[i]) for i in positions]
            n_watched = len(order)
            self.names += [
                names.get(k) or f"<param {i}>" for k, i in zip(keys, positions, strict=True)
            ]
            ranks += [order.get(k, n_watched + i) for k, i in zip(keys, positions, strict=True)]
        rows = torch.cat(per_pass) if per_pass else torch.zeros(0, 6, dtype=torch.float64)
        # Parameter order: watched ones by their rank, then the others by position.
        perm = sorted(range(len(ranks)), key=ranks.__getitem__)
        self.names = [self.names[i] for i in perm]
        self.numels = [numels[i] for i in perm]
        rows = rows[perm]
        self.norms = rows[:, 0].sqrt().float().tolist()
        self.rows = rows
        self.total_norm = _norm(total_sq)


def _to_host(tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tables on the host, with one device-to-host copy per device (a device's tables are
    concatenated there first)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tables):
        by_device.setdefault(t.device, []).append(i)
    host: list[torch.Tensor] = list(tables)
    for idx in by_device.values():
        joined = torch.cat([tables[i] for i in idx]).cpu() if len(idx) > 1 else None
        offset = 0
        for i in idx:
            if joined is None:
                host[i] = tables[i].cpu()
            else:
                host[i] = joined[offset : offset + tables[i].shape[0]]
                offset += tables[i].shape[0]
    return host


def build_report(
    passes: list[tuple[torch.Tensor, torch.Tensor, list]],
    names: dict[int, str],
    order: dict[int, int],
    activations: list[ActivationStats] | None = None,
) -> StepReport:
    """Reduces the iteration's tables into a report: one (grad_stats, [position, numel] per
    gradient, the optimizer's flat parameter list the positions index) per pass and device.
    ``names``/``order`` map id(param) to its watched name and rank."""
    r = _Reduced(passes, names, order)
    grads = [
        GradStats(name, norm, row[1], int(row[2]), int(row[3]), int(row[4]), int(row[5]), numel)
        for name, norm, row, numel in zip(r.names, r.norms, r.rows.tolist(), r.numels, strict=True)
    ]
    return StepReport(r.step, r.scale, r.skipped, grads, r.total_norm, _rank(), activations or [])


def read_activations(rows: Iterable[Row]) -> list[ActivationStats]:
    """The rows reduced on the host (one copy per device), merged per (module, call,
    direction) in the order each first ran."""
    rows = list(rows)
    if not rows:
        return []
    host = _to_host([r[4][1:] for r in rows])  # (without the header row)
    merged: dict[tuple[str, int, str, bool], list] = {}
    for row, items in zip(rows, host, strict=True):
        name, call, direction, recompute, _, numel, dtype, input_rows = row
        inputs_bad = bool(items[:input_rows, 2:5].sum() > 0)
        items = items[input_rows:]
        abs_max = float(items[:, 1].max()) if len(items) else 0.0
        counts = items[:, 2:5].sum(dim=0).tolist() if len(items) else [0.0, 0.0, 0.0]
        key = (name, call, direction, recompute)
        entry = merged.get(key)
        if entry is None:
            merged[key] = [abs_max, *counts, numel, dtype, not inputs_bad]
        else:
            entry[0] = max(entry[0], abs_max)
            entry[1:4] = [a + b for a, b in zip(entry[1:4], counts, strict=True)]
            entry[4] += numel
            if torch.finfo(dtype).max > torch.finfo(entry[5]).max:
                entry[5] = dtype
            entry[6] = entry[6] and not inputs_bad
    return [
        ActivationStats(
            name, call, direction, v[0], int(v[1]), int(v[2]), int(v[3]), v[4], v[5], rc, v[6]
        )
        for (name, call, direction, rc), v in merged.items()
    ]


def _rank() -> int | None:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def grad_norms(
    passes: list[tuple[torch.Tensor, torch.Tensor, list]],
    names: dict[int, str],
    order: dict[int, int],
    group_separator: str,
) -> dict[str, float]:
    """StepReport.grad_norms without building the report."""
    r = _Reduced(passes, names, order)
    prefix = f"grad_2.0_norm{group_separator}"
    out = {prefix + name: norm for name, norm in zip(r.names, r.norms, strict=True)}
    out["grad_2.0_norm_total"] = r.total_norm
    return out


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel, from the caller of this function, for the first frame
    outside the package: the user's line, through however many of the scaler's frames (step()
    reaches a pass through two to four)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _not_named(given: Any, detail: str = "") -> TypeError:
    """watch()'s refusal of an argument that names no parameters."""
    return TypeError(
        "watch(model): expected the model whose parameters to name (a torch.nn.Module) or "
        f"(name, parameter) pairs such as model.named_parameters(), got "
        f"{describe_argument(given)}{detail}; pass the module that owns the optimizer's "
        "parameters: scaler.watch(model)"
    )


def _not_read_yet(method: str, any_pass: bool) -> RuntimeError:
    """report()'s and grad_norms()' refusal where no statistics of the iteration asked about
    exist yet: before any pass under watch(), or (any_pass) between this iteration's scale()
    and its pass, where the tables at hand are the last iteration's."""
    if any_pass:
        when = (
            "after scaler.scale(loss) and before this iteration's pass, so the statistics at "
            "hand are the last iteration's"
        )
        fix = (
            "Call it after scaler.unscale_(optimizer) or scaler.step(optimizer) for this "
            "iteration's, or before scaler.scale(loss) for the last one's (report().step says "
            "which iteration a report is)."
        )
    else:
        when = "before any pass under watch(), so there are no statistics yet"
        fix = "Call it after scaler.unscale_(optimizer) or scaler.step(optimizer)."
    return RuntimeError(
        f"{method}() was called {when}.  {fix}  (If the pass ran, its gradients took a path "
        "that records no statistics: see the warning watch() gave.)"
    )


class Watch:
    """What ``watch()`` was given (names and ranks by parameter identity; the parameters are
    kept, so an identity is never reused while watched) and the statistics tables of this
    iteration's passes (``now``) and of the last completed iteration (``last``)."""

    __slots__ = (
        "names",
        "order",
        "params",
        "log_skipped",
        "warned",
        "now",
        "last",
        "tracer",
        "begun",
        "name_check",
    )

    def __init__(
        self,
        parameters: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        log_skipped: Any,
        activations: Any = False,
    ) -> None:
        if log_skipped not in _LOG_SKIPPED:
            raise ValueError(
                f"watch: log_skipped must be False, 'log' or 'warn', got {log_skipped!r}"
            )
        if isinstance(parameters, torch.nn.Module):
            items = parameters.named_parameters()
        else:  # (an optimizer is no iterable: refused here)
            try:
                items = iter(parameters)
            except TypeError as e:
                raise _not_named(parameters) from e
        # (made before anything is kept: its checks raise first)
        self.tracer = None if activations is False else Tracer(parameters, activations)
        self.names: dict[int, str] = {}
        self.order: dict[int, int] = {}
        self.params: list[torch.Tensor] = []
        for i, item in enumerate(items):
            # (a tensor is no pair, though one of two rows would unpack as one)
            pair = None if isinstance(item, torch.Tensor) else item
            try:
                name, param = pair
            except (TypeError, ValueError) as e:
                raise _not_named(parameters, f" whose item {i} is {describe_argument(item)}") from e
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"watch: the parameter named {name!r} is a {type(param).__name__}, not a tensor"
                )
            self.names.setdefault(id(param), str(name))
            self.order.setdefault(id(param), i)
            self.params.append(param)
        self.log_skipped = log_skipped
        self.warned = False
        self.now: list[Table] = []
        self.last: list[Table] = []
        # scale() ran since the last update(): this iteration has begun, and until its pass the
        # tables at hand are the last iteration's (reading them then is refused).
        self.begun = False
        # Whether a pass checks that its parameters have names here (check_names): _FIRST_PASS
        # until one has, then _CHECKING for the rest of that iteration (every optimizer's pass
        # is checked), _CHECKED from its update() on, or once the warning is given.
        self.name_check = _FIRST_PASS

    def not_covered(self, path: str, caller_depth: int = 0) -> None:
        """Warns once that some gradients went through a path that records no statistics."""
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"ampfused GradScaler.watch: some gradients went through {path} (tensor "
                "subclasses other than DTensor, a device without ampfused kernels, or a "
                "subclass overriding _unscale_grads_), which records no statistics: "
                "report() and grad_norms() do not cover that optimizer's gradients",
                RuntimeWarning,
                stacklevel=4 + caller_depth,
            )

    def check_names(self, groups: Any) -> None:
        """Warns, once, when parameters with gradients in a pass have no name from watch():
        the reports would number them.  Called by the passes of the first iteration under this
        watch() only, so later steps pay nothing per parameter."""
        self.name_check = _CHECKING
        graded = [(i, p) for i, p in enumerate(flat_params(groups)) if p.grad is not None]
        unnamed = [(i, p) for i, p in graded if id(p) not in self.names]
        if not unnamed:
            return
        self.name_check = _CHECKED
        n, total = len(unnamed), len(graded)
        some = f"{n} of this optimizer's {total} parameters with gradients have no name"
        if n == total:
            some = f"none of this optimizer's {total} parameters with gradients has a name"
        listed = ", ".join(f"<param {i}> (shape {tuple(p.shape)})" for i, p in unnamed[:_LISTED])
        if n > _LISTED:
            listed += f" and {n - _LISTED} more"
        warnings.warn(
            f"ampfused GradScaler.watch: {some} from the watched module(s), so report() and "
            f"grad_norms() number them: {listed}.  Watch the module that owns the optimizer's "
            "parameters (scaler.watch(model), the model the optimizer was built from), or add "
            "them as (name, parameter) pairs.  (Given once per watch().)",
            UserWarning,
            stacklevel=_caller_stacklevel(),
        )

    def _passes(self, method: str) -> list[tuple[torch.Tensor, torch.Tensor, list]]:
        """The current iteration's tables, or else the last one's, with flat parameter lists;
        refused before any pass under watch() (there are none), and between this iteration's
        scale() and its pass, where they would be the last iteration's figures read as this
        one's."""
        if not self.now and (self.begun or not self.last):
            raise _not_read_yet(method, any_pass=bool(self.last))
        return [(t, pn, flat_params(groups)) for t, pn, groups in self.now or self.last]

    def report(self) -> StepReport:
        passes = self._passes("report")
        activations = None
        if self.tracer is not None:  # the same iteration as the parameters' tables
            activations = read_activations(self.tracer.now if self.now else self.tracer.last)
        return build_report(passes, self.names, self.order, activations)

    def report_activations(self) -> list[ActivationStats]:
        """The traced rows of the current iteration so far, or else of the last one."""
        if self.tracer is None:
            return []
        return read_activations(self.tracer.now or self.tracer.last)

    def remove(self) -> None:
        """unwatch(): the tracing hooks removed."""
        if self.tracer is not None:
            self.tracer.remove()

    def grad_norms(self, group_separator: str) -> dict[str, float]:
        passes = self._passes("grad_norms")
        return grad_norms(passes, self.names, self.order, group_separator)

    def close_iteration(self) -> None:
        """At update(): this iteration's tables become the last iteration's; a skipped step is
        reported when watch(log_skipped=...) asked for it."""
        self.last, self.now = self.now, []
        self.begun = False
        if self.name_check == _CHECKING:
            self.name_check = _CHECKED
        if self.tracer is not None:
            self.tracer.close_iteration()
        if not self.log_skipped or not self.last:
            return
        report = self.report()
        if report.skipped:
            if self.log_skipped == "warn":
                warnings.warn(str(report), RuntimeWarning, stacklevel=3)
            else:
                _LOG.warning("%s", report)
