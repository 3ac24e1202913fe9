"""ampfused's own performance targets, checked on a run's records: the CPU targets (step_cost,
diagnostics and clip rows of a CPU run) and the GPU targets (a GPU run's records, or recorded
as not yet measured).  Development goals, not correctness checks: the console and results.md
show them last, in a section that says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks import questions as qs
from benchmarks.suite import Record

NOT_RUN = "not measured in this run"


@dataclass
class TargetResult:
    name: str
    requirement: str
    value: str
    passed: bool | None  # None: not measured
    detail: str = ""

    @property
    def verdict(self) -> str:
        return {True: "met", False: "not met", None: "not measured"}[self.passed]


def _get(records: list[Record], question: str, workload: str, method: str) -> Record | None:
    for r in records:
        if (r.question, r.workload, r.method) == (question, workload, method) and r.ok:
            if not r.realloc and r.dtype == "fp32":
                return r
    return None


def _ms(r: Record) -> str:
    return f"{r.median_s * 1e3:.2f} ms"  # type: ignore[operator]


def cpu_targets(records: list[Record], questions: list[str]) -> list[TargetResult]:
    """The targets of the questions that ran, and (for information) never slower than torch."""
    out: list[TargetResult] = []
    if "step_cost" in questions:
        for w, need in (("3000 x 16", 10.0), ("1000 x 1K", 5.0)):
            a, t = (_get(records, "step_cost", w, m) for m in ("ampfused", "torch"))
            req = f">= {need:g}x lower per-step cost than torch.amp.GradScaler"
            if a is None or t is None:
                out.append(TargetResult(f"{w} fp32", req, "-", None, NOT_RUN))
                continue
            x = t.median_s / a.median_s  # type: ignore[operator]
            detail = f"ampfused {a.median_s * 1e6:.0f} us, torch {t.median_s * 1e6:.0f} us"  # type: ignore[operator]
            out.append(TargetResult(f"{w} fp32", req, f"{x:.2f}x", x >= need, detail))
        for w, torch_ref in (("gpt2-124m", 1.17), ("4 x 16M", 1.26)):
            a, t = (_get(records, "step_cost", w, m) for m in ("ampfused", "torch"))
            req = f"<= 1.05x the in-place _foreach_mul_ floor (torch ~{torch_ref}x)"
            if a is None or a.x_floor is None:
                out.append(TargetResult(f"{w} fp32", req, "-", None, NOT_RUN))
                continue
            tx = f"{t.x_floor:.3f}x" if t is not None and t.x_floor is not None else "-"
            detail = f"torch here {tx} of the floor"
            out.append(
                TargetResult(f"{w} fp32", req, f"{a.x_floor:.3f}x", a.x_floor <= 1.05, detail)
            )
    if "diagnostics" in questions:
        out += diagnostics_targets(records)
    if "clip" in questions:
        out.append(clip_target(records))
    if out and records:
        info = never_slower(records)
        info.name = "(info) never slower than torch"
        out.append(info)
    return out


def diagnostics_targets(records: list[Record]) -> list[TargetResult]:
    """The watched pass within 1.15x of the plain one (GPT-2 124M, 4 x 16M, fp32), torch's
    per-layer logging beside it, and no per-parameter Python work."""
    q, bound, out = "diagnostics", qs.DIAG_RATIO_BOUND, []
    for w in qs.DIAG_BOUND_SETS:
        a, watched, norms, tn = (
            _get(records, q, w.name, m)
            for m in ("ampfused", "ampfused-watch", "ampfused-norms", "torch-norms")
        )
        name = f"diagnostics {w.name} fp32"
        req = f"watched pass (per-gradient statistics) <= {bound:g}x the plain ampfused pass"
        if a is None or watched is None:
            out.append(TargetResult(name, req, "-", None, NOT_RUN))
            continue
        ratio = watched.median_s / a.median_s  # type: ignore[operator]
        detail = f"ampfused {_ms(a)}, watched {_ms(watched)}"
        for label, x, y in (
            ("torch + per-layer norms / watched", tn, watched),
            ("/ watched + grad_norms()", tn, norms),
        ):
            if x is not None and y is not None:
                detail += f"; {label} {x.median_s / y.median_s:.2f}x"  # type: ignore[operator]
        out.append(TargetResult(name, req, f"{ratio:.3f}x", ratio <= bound, detail))
    # Python bytecodes per watched step at 100..3000 tensors: a per-parameter Python loop adds
    # several per parameter; allowed is less than one per ten parameters added.
    req = "no per-parameter host work: Python bytecodes of a watched step flat in the tensor count"
    have = []
    for n in qs.DIAG_COUNTS:
        w = qs.diag_count_workload(n).name
        watched, a = _get(records, q, w, "ampfused-watch"), _get(records, q, w, "ampfused")
        if watched is not None and watched.py_bytecodes is not None:
            have.append((n, watched, a))
    if len(have) < 2:
        return [*out, TargetResult("diagnostics host cost", req, "-", None, NOT_RUN)]
    (n0, w0, _), (n1, w1, _) = have[0], have[-1]
    growth = (w1.py_bytecodes - w0.py_bytecodes) / (n1 - n0)  # type: ignore[operator]
    detail = f"at {' / '.join(str(n) for n, _, _ in have)} x {qs.DIAG_COUNT_NUMEL}"
    detail += f" ({growth:+.3f} per added tensor); watched / plain time "
    detail += " / ".join(
        f"{w.median_s / a.median_s:.2f}x" if a is not None else "-"  # type: ignore[operator]
        for _, w, a in have
    )
    value = " / ".join(str(w.py_bytecodes) for _, w, _ in have)
    return [*out, TargetResult("diagnostics host cost", req, value, abs(growth) < 0.1, detail)]


def clip_target(records: list[Record]) -> TargetResult:
    """clip_grad_norm_ through the scaler at least 1.5x faster than torch's unscale_ +
    clip_grad_norm_ on GPT-2 124M fp32, the floor beside it."""
    w, bound = qs.GPT2.name, qs.CLIP_SPEEDUP_BOUND
    clip, pair, floor = (
        _get(records, "clip", w, m) for m in ("ampfused-clip", "torch-clip", "floor-mul")
    )
    name, req = (
        f"clip {w} fp32",
        f"clip_grad_norm_ >= {bound:g}x faster than torch's unscale_ + clip",
    )
    if clip is None or pair is None:
        return TargetResult(name, req, "-", None, NOT_RUN)
    x = pair.median_s / clip.median_s  # type: ignore[operator]
    detail = f"fused {_ms(clip)}, torch's pair {_ms(pair)}"
    if floor is not None:
        detail += f"; fused / floor {clip.median_s / floor.median_s:.2f}x (ideal 1.5x)"  # type: ignore[operator]
    return TargetResult(name, req, f"{x:.2f}x", x >= bound, detail)


def never_slower(records: list[Record]) -> TargetResult:
    """ampfused.GradScaler against torch.amp.GradScaler on every workload both ran: slower
    means its first quartile above torch's third."""
    torch_by = {(r.question, r.label): r for r in records if r.method == "torch" and r.ok}
    pairs = [
        (r, torch_by[(r.question, r.label)])
        for r in records
        if r.method == "ampfused" and r.ok and (r.question, r.label) in torch_by
    ]
    bad = [a for a, t in pairs if a.q1_s > t.q3_s]  # type: ignore[operator]
    worst = min((t.median_s / a.median_s for a, t in pairs), default=None)  # type: ignore[operator]
    detail = (
        f"{len(pairs)} workloads; worst median ratio {worst:.2f}x"
        if pairs
        else "no workload with both scalers"
    )
    if bad:
        detail += "; slower on: " + ", ".join(f"{r.question}:{r.label}" for r in bad[:6])
    req = (
        "on every workload, ampfused.GradScaler not slower than torch.amp.GradScaler "
        "(slower = its 25th percentile above torch's 75th)"
    )
    return TargetResult(
        "never slower than torch", req, f"{len(bad)} slower", (not bad) if pairs else None, detail
    )


BANDWIDTH = ">= 90% of device-copy bandwidth for >= 1 GiB of gradients"
MANY = "host+device per-step cost >= 5x lower than torch for >= 1,000 tensors"
E2E = "end-to-end GPT step no slower than with torch's scaler (and identical losses)"


def gpu_targets(records: list[Record], e2e: dict[str, Any] | None) -> list[TargetResult]:
    """GPU targets from a GPU run (host+device times; device time for the bandwidth target)."""
    ours = [r for r in records if r.method == "ampfused" and r.ok]
    big = [r for r in ours if r.grad_bytes >= 1 << 30 and (r.device_x_copy or r.x_copy)]
    if big:
        worst = max(big, key=lambda r: r.device_x_copy or r.x_copy)  # type: ignore[arg-type,return-value]
        frac = 1 / (worst.device_x_copy or worst.x_copy)  # type: ignore[operator]
        out = [
            TargetResult(
                "bandwidth",
                BANDWIDTH,
                f"{frac:.0%}",
                frac >= 0.9,
                f"worst: {worst.question}:{worst.label}",
            )
        ]
    else:
        out = [TargetResult("bandwidth", BANDWIDTH, "-", None, "no >= 1 GiB workload ran")]
    many = [r for r in ours if r.n_tensors >= 1000 and r.speedup_vs_torch]
    if many:
        worst = min(many, key=lambda r: r.speedup_vs_torch)  # type: ignore[arg-type,return-value]
        x = worst.speedup_vs_torch
        out.append(
            TargetResult(
                "many tensors",
                MANY,
                f"{x:.2f}x",
                x >= 5.0,
                f"worst: {worst.question}:{worst.label}",
            )
        )  # type: ignore[operator]
    else:
        out.append(TargetResult("many tensors", MANY, "-", None, "no >= 1,000-tensor workload ran"))
    out.append(never_slower(records))
    if not e2e:
        return [*out, TargetResult("end-to-end", E2E, "-", None, "e2e not run")]
    comps = e2e["comparisons"]
    slower = [k for k, c in comps.items() if c["ampfused_slower_beyond_iqr"]]
    same = all(c["max_abs_loss_diff"] == 0 and c["weights_bitwise_equal"] for c in comps.values())
    value = ", ".join(
        f"{k} {c['torch_over_ampfused']:.2f}x" for k, c in comps.items() if c["torch_over_ampfused"]
    )
    detail = ("losses and weights identical" if same else "LOSSES OR WEIGHTS DIFFER") + (
        "; slower beyond IQR: " + ", ".join(slower) if slower else ""
    )
    return [*out, TargetResult("end-to-end", E2E, value, (not slower) and same, detail)]


def gpu_not_measured() -> list[TargetResult]:
    never = "never slower than torch.amp.GradScaler on any workload"
    return [
        TargetResult(name, req, "-", None)
        for name, req in (
            ("bandwidth", BANDWIDTH),
            ("many tensors", MANY),
            ("never slower", never),
            ("end-to-end", E2E),
        )
    ]
