"""ampfused's own performance targets, checked on a run's records: development goals, not
correctness checks (the output shows them last, under a heading that says so), and their table
and gpu-targets.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import questions as qs
from benchmarks.report import grid
from benchmarks.suite import Record

NOT_RUN = "not measured in this run"


@dataclass
class TargetResult:
    name: str
    requirement: str
    value: str = "-"
    passed: bool | None = None  # None: not measured
    detail: str = NOT_RUN

    @property
    def verdict(self) -> str:
        return {True: "met", False: "not met", None: "not measured"}[self.passed]


def _get(
    records: list[Record], question: str, workload: str, method: str, dtype: str = "fp32"
) -> Record | None:
    for r in records:
        if (r.question, r.workload, r.method) == (question, workload, method) and r.ok:
            if not r.realloc and r.dtype == dtype:
                return r
    return None


def _ms(r: Record) -> str:
    return f"{r.median_s * 1e3:.2f} ms"


def _x(a: Record, b: Record) -> float:
    return a.median_s / b.median_s


def cpu_targets(records: list[Record], questions: list[str]) -> list[TargetResult]:
    """The targets of the questions that ran, and (for information) never slower than torch."""
    out: list[TargetResult] = []
    if "step_cost" in questions:
        for w, need in (("3000 x 16", 10.0), ("1000 x 1K", 5.0)):
            a, t = (_get(records, "step_cost", w, m) for m in ("ampfused", "torch"))
            res = TargetResult(
                f"{w} fp32", f">= {need:g}x lower per-step cost than torch.amp.GradScaler"
            )
            if a is not None and t is not None:
                res.value, res.passed = f"{_x(t, a):.2f}x", _x(t, a) >= need
                res.detail = f"ampfused {a.median_s * 1e6:.0f} us, torch {t.median_s * 1e6:.0f} us"
            out.append(res)
        for w, torch_ref in (("gpt2-124m", 1.17), ("4 x 16M", 1.26)):
            a, t = (_get(records, "step_cost", w, m) for m in ("ampfused", "torch"))
            res = TargetResult(
                f"{w} fp32", f"<= 1.05x the in-place _foreach_mul_ floor (torch ~{torch_ref}x)"
            )
            if a is not None and a.x_floor is not None:
                res.value, res.passed = f"{a.x_floor:.3f}x", a.x_floor <= 1.05
                tx = f"{t.x_floor:.3f}x" if t is not None and t.x_floor is not None else "-"
                res.detail = f"torch here {tx} of the floor"
            out.append(res)
    if "diagnostics" in questions:
        out += diagnostics_targets(records)
    if "clip" in questions:
        out.append(clip_target(records))
    if "busy" in questions:
        out.append(busy_target(records))
    if out and records:
        out.append(never_slower(records, "(info) never slower than torch"))
    return out


def diagnostics_targets(records: list[Record]) -> list[TargetResult]:
    """The watched pass within 1.15x of the plain one (GPT-2 124M, 4 x 16M, fp32; GPT-2 124M in
    bfloat16 and float16 when measured), torch's per-layer logging beside it, and no
    per-parameter Python work."""
    q, bound, out = "diagnostics", qs.DIAG_RATIO_BOUND, []
    for w in qs.DIAG_BOUND_SETS:
        a, watched, norms, tn = (
            _get(records, q, w.name, m)
            for m in ("ampfused", "ampfused-watch", "ampfused-norms", "torch-norms")
        )
        req = f"watched pass (per-gradient statistics) <= {bound:g}x the plain ampfused pass"
        res = TargetResult(f"diagnostics {w.name} fp32", req)
        if a is not None and watched is not None:
            res.value, res.passed = f"{_x(watched, a):.3f}x", _x(watched, a) <= bound
            res.detail = f"ampfused {_ms(a)}, watched {_ms(watched)}"
            for label, x, y in (
                ("torch + per-layer norms / watched", tn, watched),
                ("/ watched + grad_norms()", tn, norms),
            ):
                if x is not None and y is not None:
                    res.detail += f"; {label} {_x(x, y):.2f}x"
        out.append(res)
    for w in qs.DIAG_16BIT_SETS:  # (where measured: not with --quick)
        a, watched = (_get(records, q, w.name, m, w.dtype) for m in qs.DIAG_16BIT_METHODS)
        if a is None or watched is None:
            continue
        req = f"watched pass on 16-bit gradients <= {bound:g}x the plain ampfused pass"
        res = TargetResult(f"diagnostics {w.name} {w.dtype}", req)
        res.value, res.passed = f"{_x(watched, a):.3f}x", _x(watched, a) <= bound
        res.detail = f"ampfused {_ms(a)}, watched {_ms(watched)}"
        out.append(res)
    # A per-parameter Python loop adds several bytecodes a parameter; allowed: under one per ten.
    req = "no per-parameter host work: Python bytecodes of a watched step flat in the tensor count"
    res = TargetResult("diagnostics host cost", req)
    have = []
    for n in qs.DIAG_COUNTS:
        w = qs.diag_count_workload(n).name
        watched, a = _get(records, q, w, "ampfused-watch"), _get(records, q, w, "ampfused")
        if watched is not None and watched.py_bytecodes is not None:
            have.append((n, watched, a))
    if len(have) >= 2:
        (n0, w0, _), (n1, w1, _) = have[0], have[-1]
        growth = (w1.py_bytecodes - w0.py_bytecodes) / (n1 - n0)
        res.value = " / ".join(str(w.py_bytecodes) for _, w, _ in have)
        res.passed = abs(growth) < 0.1
        res.detail = f"at {' / '.join(str(n) for n, _, _ in have)} x {qs.DIAG_COUNT_NUMEL}"
        res.detail += f" ({growth:+.3f} per added tensor); watched / plain time "
        res.detail += " / ".join(f"{_x(w, a):.2f}x" if a else "-" for _, w, a in have)
    return [*out, res]


def clip_target(records: list[Record]) -> TargetResult:
    """clip_grad_norm_ through the scaler >= 1.5x faster than torch's pair on GPT-2 124M fp32."""
    w, bound = qs.GPT2.name, qs.CLIP_SPEEDUP_BOUND
    clip, pair, floor = (
        _get(records, "clip", w, m) for m in ("ampfused-clip", "torch-clip", "floor-mul")
    )
    req = f"clip_grad_norm_ >= {bound:g}x faster than torch's unscale_ + clip"
    res = TargetResult(f"clip {w} fp32", req)
    if clip is not None and pair is not None:
        res.value, res.passed = f"{_x(pair, clip):.2f}x", _x(pair, clip) >= bound
        res.detail = f"fused {_ms(clip)}, torch's pair {_ms(pair)}"
        if floor is not None:
            res.detail += f"; fused / floor {_x(clip, floor):.2f}x (ideal 1.5x)"
    return res


def busy_target(records: list[Record]) -> TargetResult:
    """Under load (a busy process per core), each pass not slower than torch's way on any
    gradient set: slower means its first quartile above the other's third."""
    req = (
        "with a busy process per core, every pass (unscale, per-layer norms, clip, masters, "
        "traced activations) not slower than torch's way"
    )
    res = TargetResult("under load", req, detail="no pair ran")
    pairs = [(w, k, a, t) for w, k, a, t in qs.busy_pairs(records) if a and t]
    if not pairs:
        return res
    bad = [f"{what} {label}" for what, label, a, t in pairs if a.q1_s > t.q3_s]
    worst = min(_x(t, a) for _, _, a, t in pairs)
    res.value, res.passed = f"{len(bad)} slower", not bad
    res.detail = f"{len(pairs)} pass x gradient pairs; lowest torch's way / ampfused {worst:.2f}x"
    if bad:
        res.detail += "; slower on: " + ", ".join(bad[:6])
    return res


def never_slower(records: list[Record], name: str = "never slower than torch") -> TargetResult:
    """ampfused.GradScaler against torch.amp.GradScaler on every workload both ran: slower
    means its first quartile above torch's third."""
    torch_by = {(r.question, r.label): r for r in records if r.method == "torch" and r.ok}
    pairs = [
        (r, torch_by[(r.question, r.label)])
        for r in records
        if r.method == "ampfused" and r.ok and (r.question, r.label) in torch_by
    ]
    bad = [a for a, t in pairs if a.q1_s > t.q3_s]
    req = (
        "on every workload, ampfused.GradScaler not slower than torch.amp.GradScaler "
        "(slower = its 25th percentile above torch's 75th)"
    )
    if not pairs:
        return TargetResult(name, req, "0 slower", None, "no workload with both scalers")
    worst = min(_x(t, a) for a, t in pairs)
    detail = f"{len(pairs)} workloads; worst median ratio {worst:.2f}x"
    if bad:
        detail += "; slower on: " + ", ".join(f"{r.question}:{r.label}" for r in bad[:6])
    return TargetResult(name, req, f"{len(bad)} slower", not bad, detail)


BANDWIDTH = ">= 90% of device-copy bandwidth for >= 1 GiB of gradients"
MANY = "host+device per-step cost >= 5x lower than torch for >= 1,000 tensors"
E2E = "end-to-end GPT step no slower than with torch's scaler (and identical losses)"


def gpu_targets(records: list[Record], e2e: dict[str, Any] | None) -> list[TargetResult]:
    """From a GPU run: host+device times; device time for the bandwidth target."""
    ours = [r for r in records if r.method == "ampfused" and r.ok]
    out = [
        TargetResult("bandwidth", BANDWIDTH, detail="no >= 1 GiB workload ran"),
        TargetResult("many tensors", MANY, detail="no >= 1,000-tensor workload ran"),
    ]
    big = [r for r in ours if r.grad_bytes >= 1 << 30 and (r.device_x_copy or r.x_copy)]
    if big:
        worst = max(big, key=lambda r: r.device_x_copy or r.x_copy)
        frac = 1 / (worst.device_x_copy or worst.x_copy)
        out[0].value, out[0].passed = f"{frac:.0%}", frac >= 0.9
        out[0].detail = f"worst: {worst.question}:{worst.label}"
    many = [r for r in ours if r.n_tensors >= 1000 and r.speedup_vs_torch]
    if many:
        worst = min(many, key=lambda r: r.speedup_vs_torch)
        out[1].value, out[1].passed = (
            f"{worst.speedup_vs_torch:.2f}x",
            worst.speedup_vs_torch >= 5.0,
        )
        out[1].detail = f"worst: {worst.question}:{worst.label}"
    out.append(never_slower(records))
    if not e2e:
        return [*out, TargetResult("end-to-end", E2E, detail="e2e not run")]
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


# --------------------------------------------------------------------------- report
def targets_table(results: Sequence[TargetResult], tablefmt: str) -> str:
    rows = [[t.name, t.verdict, t.value, t.requirement, t.detail] for t in results]
    return grid(rows, ["target", "verdict", "measured", "requirement", "detail"], tablefmt)


TARGETS_INTRO = (
    "These are ampfused's own performance targets: goals its development is measured against, "
    "set for this class of machine, not tests. A target not met is a speed gap we track, not an "
    "error in the run or in ampfused's results."
)


GPU_METHOD_MD = """\
How a GPU run measures them (benchmarks/README.md, "Method"): steps are timed as a training loop
runs them, a batch of consecutive steps with one device synchronization at the end, minus the
same batch of untimed gradient restores without the steps: the only synchronizations counted
are those inside a step (both scalers' step() reads found_inf back). *many tensors* and *never
slower* compare that per-step cost (host and device together) and include the rows whose
gradients are new tensors every step (realloc, as after `zero_grad(set_to_none=True)`);
*bandwidth* uses device time from CUDA events; *end-to-end* times chunks of consecutive
training steps.
"""


def gpu_targets_md(
    results: list[TargetResult], header: dict[str, Any], slug: str, command: str
) -> str:
    """benchmarks/results/gpu-targets.md: a GPU run's targets, to be read on its own; ``slug``:
    the run's folder relative to benchmarks/results, whose results.md holds every figure."""
    met = sum(1 for t in results if t.passed)
    return "\n".join(
        [
            "# GPU targets\n",
            TARGETS_INTRO + "\n",
            f"{met} of {len(results)} met on {header['device_name']} (torch {header['torch']}, "
            f"CUDA {header['cuda_runtime']}, commit {header['git_commit']}, {header['date']}), "
            f"by `{command}`; the tables they are drawn from are in "
            f"[{slug}/results.md]({slug}/results.md).\n",
            GPU_METHOD_MD,
            targets_table(results, "github") + "\n",
        ]
    )
