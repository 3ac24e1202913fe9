"""What the scaler's pass saw, by parameter name: ``GradScaler.watch`` and the statistics its
reports read (the report itself and its advice: :mod:`ampfused.report`).

Under ``watch()`` the fused pass writes a float64 statistics table per device (``grad_stats``,
see :func:`ampfused.reference.grad_stats`): a header (scale in force, step, verdict) and, per
work item of each gradient, the sum of squares of the unscaled values, the largest finite
magnitude, and the counts of +inf, -inf, NaN, zeros and float16-subnormal values.
:class:`Watch` keeps the names given to ``watch()`` and the tables of the current and the last
iteration (and of the one before it, which the report of a backward overflow measures the scale
by).  Nothing here runs unless a report is asked for; building one copies every table to the
host (one copy per device) and reduces it there.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ampfused import _C, ops
from ampfused._arguments import describe_argument, user_stacklevel
from ampfused._grad_pass import flat_params
from ampfused.activations import Row, Tracer
from ampfused.report import LISTED as _LISTED
from ampfused.report import ActivationStats, GradStats, StepReport

__all__ = ["ActivationStats", "GradStats", "StepReport"]

_LOG = logging.getLogger("ampfused")
_FIELDS = len(ops.STAT_FIELDS)
_LOG_SKIPPED = (False, "log", "warn")

# Watch.name_check: whether a pass still checks that watch() named its parameters (see there).
_CHECKED, _FIRST_PASS, _CHECKING = 0, 1, 2

# (statistics table, [position, numel] per gradient, the param_groups the positions index)
Table = tuple[torch.Tensor, torch.Tensor, Any]


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
        rows = torch.cat(per_pass) if per_pass else torch.zeros(0, _FIELDS, dtype=torch.float64)
        # Parameter order: watched ones by their rank, then the others by position.  Permuted as
        # Python lists: a tensor indexed by the permutation (1,000 rows) goes through an
        # intra-op parallel region, whose wait for a thread the OS runs late cost 10-40 ms a
        # step with a busy process per core (a plain column's sqrt stays under the grain).
        perm = sorted(range(len(ranks)), key=ranks.__getitem__)
        self.names = [self.names[i] for i in perm]
        self.numels = [numels[i] for i in perm]
        norms = rows[:, 0].sqrt().float().tolist()
        self.norms = [norms[i] for i in perm]
        self._table, self._perm = rows, perm
        self.total_norm = _norm(total_sq)

    @property
    def rows(self) -> list[list[float]]:
        """Each gradient's row (ops.STAT_FIELDS), in report order (the report's; grad_norms()
        reads only the norms)."""
        listed = self._table.tolist()
        return [listed[i] for i in self._perm]


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
    chains: dict[str, tuple[str, ...]] | None = None,
) -> StepReport:
    """Reduces the iteration's tables into a report: one (grad_stats, [position, numel] per
    gradient, the optimizer's flat parameter list the positions index) per pass and device.
    ``names``/``order`` map id(param) to its watched name and rank; ``chains``: the traced
    model's nn.Sequential modules (StepReport.chains)."""
    r = _Reduced(passes, names, order)
    grads = [
        GradStats(name, norm, row[1], int(row[2]), int(row[3]), int(row[4]), int(row[5]), numel)
        for name, norm, row, numel in zip(r.names, r.norms, r.rows, r.numels, strict=True)
    ]
    return StepReport(
        r.step,
        r.scale,
        r.skipped,
        grads,
        r.total_norm,
        _rank(),
        activations or [],
        chains=chains or {},
    )


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
        # +inf, -inf, NaN, zeros, subnormal
        counts = items[:, 2:7].sum(dim=0).tolist() if len(items) else [0.0] * 5
        key = (name, call, direction, recompute)
        entry = merged.get(key)
        if entry is None:
            merged[key] = [abs_max, counts, numel, dtype, not inputs_bad]
        else:
            entry[0] = max(entry[0], abs_max)
            entry[1] = [a + b for a, b in zip(entry[1], counts, strict=True)]
            entry[2] += numel
            if torch.finfo(dtype).max > torch.finfo(entry[3]).max:
                entry[3] = dtype
            entry[4] = entry[4] and not inputs_bad
    out = []
    for (name, call, direction, rc), (abs_max, c, numel, dtype, inputs_ok) in merged.items():
        pos_inf, neg_inf, nan, zeros, subnormal = map(int, c)
        out.append(
            ActivationStats(
                name,
                call,
                direction,
                abs_max,
                pos_inf,
                neg_inf,
                nan,
                numel,
                dtype,
                rc,
                inputs_ok,
                zeros,
                subnormal,
            )
        )
    return out


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


def _not_named(given: Any, detail: str = "") -> TypeError:
    """watch()'s refusal of an argument that names no parameters."""
    return TypeError(
        "watch(model): expected the model whose parameters to name (a torch.nn.Module), "
        "(name, parameter) pairs such as model.named_parameters() or a dict of them, got "
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
    iteration's passes (``now``) and of the last completed iteration (``last``), and the tables
    and traced rows of the iteration before that (``before``, ``traced_before``: a few float64
    rows per gradient and per traced module call, kept one iteration longer)."""

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
        "before",
        "traced_before",
    )

    def __init__(
        self,
        parameters: torch.nn.Module
        | Mapping[str, torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]],
        log_skipped: Any,
        activations: Any = False,
    ) -> None:
        if log_skipped not in _LOG_SKIPPED:
            raise ValueError(
                f"watch: log_skipped must be False, 'log' or 'warn', got {log_skipped!r}"
            )
        if isinstance(parameters, torch.nn.Module):
            items = parameters.named_parameters()
        elif isinstance(parameters, Mapping):  # dict(model.named_parameters()): name -> tensor
            items = iter(parameters.items())
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
        # The iteration before `last` (tables, traced rows): the reference a report of `last`
        # scales its backward overflow by (StepReport.reference).
        self.before: list[Table] = []
        self.traced_before: list[Row] = []
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
            stacklevel=user_stacklevel(),
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
        if self.tracer is None:
            return build_report(passes, self.names, self.order)
        # The traced rows of the same iteration as the parameters' tables, and the iteration
        # before it (read only for a backward overflow).
        rows, before = (self.tracer.now, self.last) if self.now else (self.tracer.last, self.before)
        traced_before = self.tracer.last if self.now else self.traced_before
        chains = self.tracer.chains
        report = build_report(passes, self.names, self.order, read_activations(rows), chains)
        if not report._in_backward or not before or not traced_before:
            return report
        passes = [(t, pn, flat_params(groups)) for t, pn, groups in before]
        reference = build_report(passes, self.names, self.order, read_activations(traced_before))
        finite = not reference.skipped and not reference.offenders
        if not finite or any(a.non_finite for a in reference._rows("backward")):
            return report
        return dataclasses.replace(report, reference=reference)

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
        self.before, self.last, self.now = self.last, self.now, []
        self.begun = False
        if self.name_check == _CHECKING:
            self.name_check = _CHECKED
        if self.tracer is not None:
            self.traced_before = self.tracer.last
            self.tracer.close_iteration()
        if not self.log_skipped or not self.last:
            return
        report = self.report()
        if report.skipped:
            if self.log_skipped == "warn":
                warnings.warn(str(report), RuntimeWarning, stacklevel=3)
            else:
                _LOG.warning("%s", report)
