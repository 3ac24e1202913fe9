"""What the scaler's pass saw, by parameter name: the reports behind ``GradScaler.watch``.

The fused pass writes a float64 statistics table per device (``grad_stats``, see
:func:`ampfused.reference.grad_stats`): a header (scale in force, step, verdict) and, per work
item of each gradient, the sum of squares of the unscaled values, the largest finite magnitude,
and the counts of +inf, -inf, NaN and zeros.  Nothing here runs unless a report is asked for;
building one copies every table to the host (one copy per device) and reduces it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ampfused import _C

__all__ = ["GradStats", "StepReport"]


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
        grads: every parameter that had a gradient, in parameter order (the order given to
            ``watch``, then parameters it was not given).
        total_norm: L2 norm over all those gradients, float32.
    """

    step: int
    scale: float
    skipped: bool
    grads: list[GradStats] = field(repr=False)
    total_norm: float

    @property
    def offenders(self) -> list[GradStats]:
        """The gradients that held inf/NaN, first offender first."""
        return [g for g in self.grads if g.non_finite]

    def __str__(self) -> str:
        head = (
            f"ampfused step {self.step}: scale {self.scale:g}, "
            f"total grad norm {self.total_norm:.4g}"
        )
        bad = self.offenders
        if not bad:
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
    if not math.isfinite(sum_squares):
        return sum_squares
    return float(torch.tensor(math.sqrt(sum_squares), dtype=torch.float32))


def build_report(
    passes: list[tuple[torch.Tensor, torch.Tensor, list]],
    names: dict[int, str],
    order: dict[int, int],
) -> StepReport:
    """Reduces the iteration's tables into a report: one (grad_stats, [position, numel] per
    gradient, the optimizer's flat parameter list the positions index) per pass and device.
    ``names``/``order`` map id(param) to its watched name and rank."""
    # One device-to-host copy per device: the tables of a device are concatenated there first.
    by_device: dict[torch.device, list[int]] = {}
    for i, (table, _, _) in enumerate(passes):
        by_device.setdefault(table.device, []).append(i)
    host: list[torch.Tensor | None] = [None] * len(passes)
    for idx in by_device.values():
        joined = torch.cat([passes[i][0] for i in idx]).cpu() if len(idx) > 1 else None
        offset = 0
        for i in idx:
            table = passes[i][0]
            if joined is None:
                host[i] = table.cpu()
            else:
                host[i] = joined[offset : offset + table.shape[0]]
                offset += table.shape[0]
    entries = []
    scale, step, skipped = 1.0, 0, False
    total_sq = 0.0
    for (_, pos_numel, params), table in zip(passes, host, strict=True):
        assert table is not None
        scale, step = float(table[0, 0]), int(table[0, 1])
        skipped = skipped or bool(table[0, 2])
        per_grad, total = _C.reduce_grad_stats(table[1:], pos_numel[:, 1])
        total_sq += total
        for (position, numel), row in zip(pos_numel.tolist(), per_grad.tolist(), strict=True):
            p = params[position] if position < len(params) else None
            key = id(p)
            name = names.get(key, f"<param {position}>")
            rank = order.get(key, len(order) + position)
            entries.append(
                (
                    rank,
                    GradStats(
                        name=name,
                        norm=_norm(row[0]),
                        abs_max=row[1],
                        pos_inf=int(row[2]),
                        neg_inf=int(row[3]),
                        nan=int(row[4]),
                        zeros=int(row[5]),
                        numel=numel,
                    ),
                )
            )
    entries.sort(key=lambda e: e[0])
    return StepReport(
        step=step,
        scale=scale,
        skipped=skipped,
        grads=[g for _, g in entries],
        total_norm=_norm(total_sq),
    )
