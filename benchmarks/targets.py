"""The targets the results are checked against: CPU targets (computed from this run's
``step_cost`` records when it ran on CPU) and GPU targets (from a GPU run's records, or recorded
as not yet measured)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks import bench_clip, bench_diagnostics
from benchmarks.suite import Record


@dataclass
class TargetResult:
    name: str
    requirement: str
    value: str
    passed: bool | None  # None: not measured
    detail: str = ""

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "not yet measured"}[self.passed]


def _get(
    records: list[Record],
    question: str,
    workload: str,
    method: str,
    realloc: bool = False,
    dtype: str = "fp32",
) -> Record | None:
    for r in records:
        if (
            r.question == question
            and r.workload == workload
            and r.method == method
            and r.realloc == realloc
            and r.dtype == dtype
            and r.ok
        ):
            return r
    return None


def cpu_targets(records: list[Record]) -> list[TargetResult]:
    out: list[TargetResult] = []
    for workload, need in (("3000 x 16", 10.0), ("1000 x 1K", 5.0)):
        a = _get(records, "step_cost", workload, "ampfused")
        t = _get(records, "step_cost", workload, "torch")
        req = f">= {need:g}x lower per-step cost than torch.amp.GradScaler"
        if a is None or t is None:
            out.append(TargetResult(f"{workload} fp32", req, "-", None, "not measured in this run"))
            continue
        ratio = t.median_s / a.median_s  # type: ignore[operator]
        out.append(
            TargetResult(
                f"{workload} fp32",
                req,
                f"{ratio:.2f}x",
                ratio >= need,
                f"ampfused {a.median_s * 1e6:.0f} us, torch {t.median_s * 1e6:.0f} us",  # type: ignore[operator]
            )
        )
    for workload, torch_ref in (("gpt2-124m", 1.17), ("4 x 16M", 1.26)):
        a = _get(records, "step_cost", workload, "ampfused")
        t = _get(records, "step_cost", workload, "torch")
        req = f"<= 1.05x the in-place _foreach_mul_ floor (torch ~{torch_ref}x)"
        if a is None or a.x_floor is None:
            out.append(TargetResult(f"{workload} fp32", req, "-", None, "not measured in this run"))
            continue
        tx = f"{t.x_floor:.3f}x" if t is not None and t.x_floor is not None else "-"
        out.append(
            TargetResult(
                f"{workload} fp32",
                req,
                f"{a.x_floor:.3f}x",
                a.x_floor <= 1.05,
                f"torch here {tx} of the floor",
            )
        )
    return out


def diagnostics_targets(records: list[Record]) -> list[TargetResult]:
    """The issue's cost of the statistics, from the diagnostics question's records: the watched
    pass within 1.15x of the plain one (GPT-2 124M, 4 x 16M, fp32), torch's per-layer logging
    beside it, and no per-parameter Python work (bytecodes of a watched step flat in the count)."""
    q = bench_diagnostics.QUESTION
    bound = bench_diagnostics.RATIO_BOUND
    out: list[TargetResult] = []
    for w in bench_diagnostics.BOUND_WORKLOADS:
        a, watched, norms, tn = (
            _get(records, q, w.name, m)
            for m in ("ampfused", "ampfused-watch", "ampfused-norms", "torch-norms")
        )
        name = f"diagnostics {w.name} fp32"
        req = f"watched pass (per-gradient statistics) <= {bound:g}x the plain ampfused pass"
        if a is None or watched is None:
            out.append(TargetResult(name, req, "-", None, "not measured in this run"))
            continue
        ratio = watched.median_s / a.median_s  # type: ignore[operator]
        detail = f"ampfused {a.median_s * 1e3:.2f} ms, watched {watched.median_s * 1e3:.2f} ms"  # type: ignore[operator]
        for label, x, y in (
            ("torch + per-layer norms / watched", tn, watched),
            ("/ watched + grad_norms()", tn, norms),
        ):
            if x is not None and y is not None:
                detail += f"; {label} {x.median_s / y.median_s:.2f}x"  # type: ignore[operator]
        out.append(TargetResult(name, req, f"{ratio:.3f}x", ratio <= bound, detail))
    out.append(_flat_host_cost(records))
    return out


def clip_target(records: list[Record]) -> TargetResult:
    """The issue's fused clip: clip_grad_norm_ through the scaler at least 1.5x faster than
    torch's unscale_ + clip_grad_norm_ on GPT-2 124M fp32, the floor beside it."""
    q, w = bench_clip.QUESTION, bench_clip.TARGET.name
    clip, pair, floor = (
        _get(records, q, w, m) for m in ("ampfused-clip", "torch-clip", "floor-mul")
    )
    name = f"clip {w} fp32"
    req = f"clip_grad_norm_ >= {bench_clip.SPEEDUP_BOUND:g}x faster than torch's unscale_ + clip"
    if clip is None or pair is None:
        return TargetResult(name, req, "-", None, "not measured in this run")
    speedup = pair.median_s / clip.median_s  # type: ignore[operator]
    detail = f"fused {clip.median_s * 1e3:.2f} ms, torch's pair {pair.median_s * 1e3:.2f} ms"  # type: ignore[operator]
    if floor is not None:
        detail += f"; fused / floor {clip.median_s / floor.median_s:.2f}x (ideal 1.5x)"  # type: ignore[operator]
    return TargetResult(name, req, f"{speedup:.2f}x", speedup >= bench_clip.SPEEDUP_BOUND, detail)


def _flat_host_cost(records: list[Record]) -> TargetResult:
    """Python bytecodes per watched step at 100..3000 tensors: a per-parameter Python loop adds
    several per parameter; allowed is less than one per ten parameters added."""
    q = bench_diagnostics.QUESTION
    req = "no per-parameter host work: Python bytecodes of a watched step flat in the tensor count"
    name = "diagnostics host cost"
    rows = []
    for n in bench_diagnostics.COUNTS:
        w = bench_diagnostics.count_workload(n).name
        rows.append((n, _get(records, q, w, "ampfused-watch"), _get(records, q, w, "ampfused")))
    have = [(n, w, a) for n, w, a in rows if w is not None and w.py_bytecodes is not None]
    if len(have) < 2:
        return TargetResult(name, req, "-", None, "not measured in this run")
    (n0, w0, _), (n1, w1, _) = have[0], have[-1]
    growth = (w1.py_bytecodes - w0.py_bytecodes) / (n1 - n0)  # type: ignore[operator]
    value = " / ".join(str(w.py_bytecodes) for _, w, _ in have)
    detail = f"at {' / '.join(str(n) for n, _, _ in have)} x {bench_diagnostics.COUNT_NUMEL}"
    detail += f" ({growth:+.3f} per added tensor); watched / plain time "
    detail += " / ".join(
        f"{w.median_s / a.median_s:.2f}x" if a is not None else "-"  # type: ignore[operator]
        for _, w, a in have
    )
    return TargetResult(name, req, value, abs(growth) < 0.1, detail)


def slower_than_torch(records: list[Record]) -> list[Record]:
    """ampfused scaler records slower than torch's beyond noise (interquartile ranges apart)."""
    torch_by = {
        (r.question, r.workload, r.dtype, r.inject_inf, r.realloc): r
        for r in records
        if r.method == "torch" and r.ok
    }
    bad = []
    for r in records:
        if r.method != "ampfused" or not r.ok:
            continue
        t = torch_by.get((r.question, r.workload, r.dtype, r.inject_inf, r.realloc))
        if t is not None and r.q1_s > t.q3_s:  # type: ignore[operator]
            bad.append(r)
    return bad


def never_slower(records: list[Record]) -> TargetResult:
    compared = [
        r for r in records if r.method == "ampfused" and r.ok and r.speedup_vs_torch is not None
    ]
    bad = slower_than_torch(records)
    worst = min((r.speedup_vs_torch for r in compared), default=None)  # type: ignore[type-var]
    detail = (
        f"{len(compared)} workloads; worst median ratio {worst:.2f}x"
        if worst is not None
        else "no workload with both scalers"
    )
    if bad:
        detail += "; slower on: " + ", ".join(f"{r.question}:{r.label}" for r in bad[:6])
    return TargetResult(
        "never slower than torch",
        "on every workload, ampfused.GradScaler not slower than torch.amp.GradScaler "
        "(slower = its 25th percentile above torch's 75th)",
        f"{len(bad)} slower",
        (not bad) if compared else None,
        detail,
    )


def gpu_targets(records: list[Record], e2e: dict[str, Any] | None) -> list[TargetResult]:
    """GPU targets from a GPU run (host+device times; device time for the bandwidth target)."""
    out: list[TargetResult] = []
    big = [
        r
        for r in records
        if r.method == "ampfused"
        and r.ok
        and r.grad_bytes >= 1 << 30
        and (r.device_x_copy or r.x_copy) is not None
    ]
    req = ">= 90% of device-copy bandwidth for >= 1 GiB of gradients"
    if big:
        worst = min(big, key=lambda r: 1 / (r.device_x_copy or r.x_copy))  # type: ignore[operator]
        frac = 1 / (worst.device_x_copy or worst.x_copy)  # type: ignore[operator]
        out.append(
            TargetResult(
                "bandwidth",
                req,
                f"{frac:.0%}",
                frac >= 0.9,
                f"worst: {worst.question}:{worst.label}",
            )
        )
    else:
        out.append(TargetResult("bandwidth", req, "-", None, "no >= 1 GiB workload ran"))
    many = [
        r
        for r in records
        if r.method == "ampfused" and r.ok and r.n_tensors >= 1000 and r.speedup_vs_torch
    ]
    req = "host+device per-step cost >= 5x lower than torch for >= 1,000 tensors"
    if many:
        worst = min(many, key=lambda r: r.speedup_vs_torch)  # type: ignore[arg-type,return-value]
        out.append(
            TargetResult(
                "many tensors",
                req,
                f"{worst.speedup_vs_torch:.2f}x",
                worst.speedup_vs_torch >= 5.0,  # type: ignore[operator]
                f"worst: {worst.question}:{worst.label}",
            )
        )
    else:
        out.append(TargetResult("many tensors", req, "-", None, "no >= 1,000-tensor workload ran"))
    out.append(never_slower(records))
    out.append(e2e_target(e2e))
    return out


def e2e_target(e2e: dict[str, Any] | None) -> TargetResult:
    req = "end-to-end GPT step no slower than with torch's scaler (and identical losses)"
    if not e2e:
        return TargetResult("end-to-end", req, "-", None, "e2e not run")
    comps = e2e["comparisons"]
    ratios = {k: c["torch_over_ampfused"] for k, c in comps.items()}
    slower = [k for k, c in comps.items() if c["ampfused_slower_beyond_iqr"]]
    same = all(c["max_abs_loss_diff"] == 0 and c["weights_bitwise_equal"] for c in comps.values())
    value = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if v is not None)
    detail = "losses and weights identical" if same else "LOSSES OR WEIGHTS DIFFER"
    if slower:
        detail += "; slower beyond IQR: " + ", ".join(slower)
    return TargetResult("end-to-end", req, value, (not slower) and same, detail)


def gpu_not_measured() -> list[TargetResult]:
    return [
        TargetResult(
            "bandwidth", ">= 90% of device-copy bandwidth for >= 1 GiB of gradients", "-", None
        ),
        TargetResult(
            "many tensors",
            "host+device per-step cost >= 5x lower than torch for >= 1,000 tensors",
            "-",
            None,
        ),
        TargetResult(
            "never slower", "never slower than torch.amp.GradScaler on any workload", "-", None
        ),
        TargetResult(
            "end-to-end", "end-to-end GPT step no slower than with torch's scaler", "-", None
        ),
    ]
