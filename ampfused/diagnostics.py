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
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampfused import _C
from ampfused._grad_pass import flat_params

__all__ = ["GradStats", "StepReport"]

_LOG = logging.getLogger("ampfused")
_LOG_SKIPPED = (False, "log", "warn")

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
    """

    step: int
    scale: float
    skipped: bool
    grads: list[GradStats] = field(repr=False)
    total_norm: float
    rank: int | None = None

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
        bad = self.offenders
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
) -> StepReport:
    """Reduces the iteration's tables into a report: one (grad_stats, [position, numel] per
    gradient, the optimizer's flat parameter list the positions index) per pass and device.
    ``names``/``order`` map id(param) to its watched name and rank."""
    r = _Reduced(passes, names, order)
    grads = [
        GradStats(name, norm, row[1], int(row[2]), int(row[3]), int(row[4]), int(row[5]), numel)
        for name, norm, row, numel in zip(r.names, r.norms, r.rows.tolist(), r.numels, strict=True)
    ]
    return StepReport(r.step, r.scale, r.skipped, grads, r.total_norm, _rank())


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


class Watch:
    """What ``watch()`` was given (names and ranks by parameter identity; the parameters are
    kept, so an identity is never reused while watched) and the statistics tables of this
    iteration's passes (``now``) and of the last completed iteration (``last``)."""

    __slots__ = ("names", "order", "params", "log_skipped", "warned", "now", "last")

    def __init__(
        self, parameters: torch.nn.Module | Iterable[tuple[str, torch.Tensor]], log_skipped: Any
    ) -> None:
        if log_skipped not in _LOG_SKIPPED:
            raise ValueError(
                f"watch: log_skipped must be False, 'log' or 'warn', got {log_skipped!r}"
            )
        if isinstance(parameters, torch.nn.Module):
            parameters = parameters.named_parameters()
        self.names: dict[int, str] = {}
        self.order: dict[int, int] = {}
        self.params: list[torch.Tensor] = []
        for i, item in enumerate(parameters):
            try:
                name, param = item
            except (TypeError, ValueError) as e:
                raise TypeError(
                    "watch: parameters must be a torch.nn.Module or (name, parameter) pairs such "
                    f"as model.named_parameters(); item {i} is {type(item).__name__}"
                ) from e
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

    def not_covered(self, path: str, caller_depth: int = 0) -> None:
        """Warns once that some gradients went through a path that records no statistics."""
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"ampfused GradScaler.watch: some gradients went through {path} (tensor "
                "subclasses other than DTensor, a device without ampfused kernels, a subclass "
                "overriding _unscale_grads_, or MasterWeights), which records no statistics: "
                "report() and grad_norms() do not cover that optimizer's gradients",
                RuntimeWarning,
                stacklevel=4 + caller_depth,
            )

    def _passes(self) -> list[tuple[torch.Tensor, torch.Tensor, list]]:
        """The current iteration's tables, or else the last one's, with flat parameter lists."""
        return [(t, pn, flat_params(groups)) for t, pn, groups in self.now or self.last]

    def report(self) -> StepReport | None:
        passes = self._passes()
        return build_report(passes, self.names, self.order) if passes else None

    def grad_norms(self, group_separator: str) -> dict[str, float]:
        passes = self._passes()
        if not passes:
            return {}
        return grad_norms(passes, self.names, self.order, group_separator)

    def close_iteration(self) -> None:
        """At update(): this iteration's tables become the last iteration's; a skipped step is
        reported when watch(log_skipped=...) asked for it."""
        self.last, self.now = self.now, []
        if not self.log_skipped or not self.last:
            return
        report = self.report()
        if report is not None and report.skipped:
            if self.log_skipped == "warn":
                warnings.warn(str(report), RuntimeWarning, stacklevel=3)
            else:
                _LOG.warning("%s", report)
