"""Console tables, JSON, markdown summary and PNG plots of one suite run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tabulate import tabulate  # noqa: E402

from benchmarks import (  # noqa: E402
    bench_clip,
    bench_diagnostics,
    bench_distributed,
    bench_masters,
)
from benchmarks.fmt import fmt_bytes, fmt_gbps, fmt_time, fmt_x  # noqa: E402
from benchmarks.methods import METHODS  # noqa: E402
from benchmarks.suite import Record  # noqa: E402
from benchmarks.targets import TargetResult  # noqa: E402

COLORS = {
    "ampfused": "tab:blue",
    "torch": "tab:red",
    "ampfused-watch": "tab:olive",
    "ampfused-norms": "tab:brown",
    "torch-norms": "tab:pink",
    "ampfused-op": "tab:cyan",
    "torch-ops": "tab:orange",
    "naive": "tab:gray",
    "apex": "tab:green",
    "floor-mul": "black",
    "floor-copy": "tab:purple",
}
QUESTION_TITLES = {
    "step_cost": "Per-step scaler cost on the target gradient sets",
    "diagnostics": "Diagnostics: the pass with per-gradient statistics vs per-layer norms by hand",
    "clip": "Unscale + clip: scaler.clip_grad_norm_ vs torch's unscale_ + clip_grad_norm_",
    "masters": "float16 model, float32 masters: MasterWeights vs the recipe by hand",
    "distributed": "Distributed: a step with found_inf all-reduced across 2 CPU processes (gloo)",
    "models": "Model gradient sets",
    "counts": "Tensor-count sweep",
    "sizes": "Tensor-size sweep (8 tensors per size)",
}


def _workload_key(r: Record) -> tuple:
    return (r.workload, r.dtype, r.inject_inf, r.realloc)


def _batched(records: Sequence[Record]) -> bool:
    return any(r.timing == "batched" for r in records)


def _cell(r: Record | None) -> str:
    if r is None:
        return "-"
    if r.status != "ok":
        return r.status
    return fmt_time(r.median_s)


def _grouped(records: Sequence[Record]) -> dict[tuple, dict[str, Record]]:
    groups: dict[tuple, dict[str, Record]] = {}
    for r in records:
        groups.setdefault(_workload_key(r), {})[r.method] = r
    return groups


def _pair(a: Record | None, t: Record | None, attr: str) -> str:
    va = getattr(a, attr) if a is not None and a.ok else None
    vt = getattr(t, attr) if t is not None and t.ok else None
    return f"{'-' if va is None else va}/{'-' if vt is None else vt}"


def pivot(records: Sequence[Record], gpu: bool, tablefmt: str) -> str:
    """One row per workload: each method's median step time, then ampfused's GB/s, its and
    torch's ratio to the floor(s), ampfused's speedup over torch, and op counts."""
    if not records:
        return ""
    methods = [m for m in METHODS if any(r.method == m for r in records)]
    headers = ["workload", "tensors", "grad bytes"] + [METHODS[m].name for m in methods]
    headers += ["ampfused GB/s", "ampfused x floor", "torch x floor"]
    batched = _batched(records)
    if gpu:
        headers += ["ampfused x copy"]
        if batched:
            headers += ["host: ampfused", "host: torch"]
        headers += ["device: ampfused", "device: torch", "launches a/t", "syncs a/t"]
    else:
        if batched:
            headers += ["host: ampfused", "host: torch"]
        headers += ["ops a/t", "item() a/t"]
    headers += ["speedup vs torch"]
    rows = []
    for by in _grouped(records).values():
        any_r = next(iter(by.values()))
        a, t = by.get("ampfused"), by.get("torch")
        row: list[Any] = [any_r.label, any_r.n_tensors, fmt_bytes(any_r.grad_bytes)]
        row += [_cell(by.get(m)) for m in methods]
        row += [
            fmt_gbps(a.gbps) if a and a.ok else "-",
            fmt_x(a.x_floor) if a and a.ok else "-",
            fmt_x(t.x_floor) if t and t.ok else "-",
        ]

        hosts = [
            fmt_time(a.host_median_s) if a and a.ok else "-",
            fmt_time(t.host_median_s) if t and t.ok else "-",
        ]
        if gpu:
            row += [fmt_x(a.x_copy) if a and a.ok else "-"]
            if batched:
                row += hosts
            row += [
                fmt_time(a.device_median_s) if a and a.ok else "-",
                fmt_time(t.device_median_s) if t and t.ok else "-",
                _pair(a, t, "launches"),
                _pair(a, t, "syncs"),
            ]
        else:
            if batched:
                row += hosts
            row += [_pair(a, t, "ops"), _pair(a, t, "items")]
        row += [fmt_x(a.speedup_vs_torch, 1) if a and a.ok and a.speedup_vs_torch else "-"]
        rows.append(row)
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def details(records: Sequence[Record], gpu: bool, tablefmt: str) -> str:
    """Every record: median, IQR, samples, GB/s, ratios, counts, status."""
    batched = _batched(records)
    headers = ["workload", "method", "median", "IQR", "n", "GB/s", "x floor"]
    if batched:
        headers += ["steps/sample", "host median", "restore (subtracted)"]
    if gpu:
        headers += ["x copy", "device median", "device GB/s", "launches", "syncs"]
        if batched:
            headers += ["restore device", "spin overruns"]
    else:
        headers += ["ops", "item()"]
    code = any(r.py_bytecodes is not None for r in records)
    if code:
        headers += ["Python bytecodes"]
    headers += ["speedup vs torch", "note"]
    rows = []
    for r in records:
        row: list[Any] = [
            r.label,
            r.method,
            fmt_time(r.median_s) if r.ok else r.status,
            fmt_time(r.iqr_s),
            r.samples or "-",
            fmt_gbps(r.gbps),
            fmt_x(r.x_floor),
        ]
        if batched:
            row += [
                r.steps_per_sample or "-",
                fmt_time(r.host_median_s),
                fmt_time(r.restore_median_s),
            ]
        if gpu:
            row += [
                fmt_x(r.x_copy),
                fmt_time(r.device_median_s),
                fmt_gbps(r.device_gbps),
                "-" if r.launches is None else r.launches,
                "-" if r.syncs is None else r.syncs,
            ]
            if batched:
                row += [
                    fmt_time(r.restore_device_median_s),
                    "-" if r.spin_overruns is None else f"{r.spin_overruns}/{r.samples}",
                ]
        else:
            row += ["-" if r.ops is None else r.ops, "-" if r.items is None else r.items]
        if code:
            row += ["-" if r.py_bytecodes is None else r.py_bytecodes]
        row += [fmt_x(r.speedup_vs_torch, 1), r.note]
        rows.append(row)
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def targets_table(results: Sequence[TargetResult], tablefmt: str) -> str:
    rows = [[t.name, t.requirement, t.value, t.verdict, t.detail] for t in results]
    return tabulate(
        rows,
        headers=["target", "requirement", "measured", "verdict", "detail"],
        tablefmt=tablefmt,
        disable_numparse=True,
    )


def e2e_table(e2e: dict[str, Any], tablefmt: str) -> str:
    rows = []
    for key, r in e2e["runs"].items():
        comp = e2e["comparisons"][r["optimizer"]]
        rows.append(
            [
                key,
                fmt_time(r["median_step_s"]),
                fmt_time((r["q3_s"] or 0) - (r["q1_s"] or 0)),
                r["timed_steps"],
                f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                r["skipped_steps"],
                f"{comp['max_abs_loss_diff']:g}",
                "yes" if comp["weights_bitwise_equal"] else "NO",
            ]
        )
    headers = [
        "scaler/optimizer",
        "median step",
        "IQR",
        "timed steps",
        "loss first -> last",
        "skipped steps",
        "max |loss diff| (same optimizer)",
        "final weights bit-equal",
    ]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


# --------------------------------------------------------------------------- plots
def _method_series(records: Sequence[Record], method: str) -> list[Record]:
    return [r for r in records if r.method == method and r.ok]


def plot_counts(records: Sequence[Record], path: Path, title: str) -> Path | None:
    recs = [r for r in records if r.question == "counts"]
    if not recs:
        return None
    numels = sorted({r.numel // r.n_tensors for r in recs if r.n_tensors})
    dtypes = sorted({r.dtype for r in recs})
    panels = [(n, d) for n in numels for d in dtypes]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (numel, dtype) in zip(axes[0], panels, strict=True):
        sub = [r for r in recs if r.numel // r.n_tensors == numel and r.dtype == dtype]
        for m in METHODS:
            series = sorted(_method_series(sub, m), key=lambda r: r.n_tensors)
            if not series:
                continue
            xs = [r.n_tensors for r in series]
            ys = [r.median_s * 1e6 for r in series]  # type: ignore[operator]
            lo = [(r.median_s - r.q1_s) * 1e6 for r in series]  # type: ignore[operator]
            hi = [(r.q3_s - r.median_s) * 1e6 for r in series]  # type: ignore[operator]
            style = "--" if METHODS[m].kind == "floor" else "-"
            ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                fmt="o" + style,
                ms=3,
                capsize=2,
                color=COLORS[m],
                label=METHODS[m].label,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("gradient tensors")
        ax.set_ylabel("time per step (us), median and IQR")
        ax.set_title(f"{numel} elements per tensor, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sizes(records: Sequence[Record], path: Path, title: str) -> Path | None:
    recs = [r for r in records if r.question == "sizes"]
    if not recs:
        return None
    dtypes = sorted({r.dtype for r in recs})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        sub = [r for r in recs if r.dtype == dtype]
        for m in METHODS:
            series = sorted(_method_series(sub, m), key=lambda r: r.numel)
            if not series:
                continue
            xs = [r.numel // r.n_tensors for r in series]
            ys = [r.gbps for r in series]
            style = "--" if METHODS[m].kind == "floor" else "-"
            ax.plot(xs, ys, "o" + style, ms=3, color=COLORS[m], label=METHODS[m].label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("elements per tensor (8 tensors)")
        ax.set_ylabel("GB/s (bytes read + written / median step time)")
        ax.set_title(dtype)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_label(r: Record) -> str:
    return f"{r.workload}\n{r.dtype}" + (" realloc" if r.realloc else "")


def plot_models(records: Sequence[Record], path: Path, title: str) -> Path | None:
    recs = [r for r in records if r.question == "models" and not r.inject_inf]
    if not recs:
        return None
    labels = []
    for r in recs:
        lab = _plot_label(r)
        if lab not in labels:
            labels.append(lab)
    methods = [m for m in METHODS if METHODS[m].kind != "floor" and m != "torch"]
    methods = [m for m in methods if any(r.method == m and r.ok for r in recs)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10, 0.75 * len(labels) + 5), 8.5))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        ys = []
        for lab in labels:
            r = next((r for r in recs if _plot_label(r) == lab and r.method == m), None)
            ys.append(r.speedup_vs_torch if r is not None and r.speedup_vs_torch else math.nan)
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(labels))]
        ax1.bar(xs, ys, width=width, color=COLORS[m], label=METHODS[m].label)
    ax1.axhline(1.0, color="tab:red", lw=1, ls="--", label="torch.amp.GradScaler")
    ax1.set_yscale("log")
    ax1.set_ylabel("speedup over torch.amp.GradScaler\n(median per-step time)")
    ax1.set_xticks(range(len(labels)), labels, fontsize=7)
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax1.grid(True, axis="y", which="both", alpha=0.3)
    floor_methods = [m for m in ("ampfused", "torch", "ampfused-op", "torch-ops") if m in METHODS]
    width2 = 0.8 / len(floor_methods)
    for i, m in enumerate(floor_methods):
        ys = []
        for lab in labels:
            r = next((r for r in recs if _plot_label(r) == lab and r.method == m), None)
            ys.append(r.x_floor if r is not None and r.x_floor else math.nan)
        xs = [j + (i - (len(floor_methods) - 1) / 2) * width2 for j in range(len(labels))]
        ax2.bar(xs, ys, width=width2, color=COLORS[m], label=METHODS[m].label)
    ax2.axhline(1.0, color="black", lw=1, ls="--", label="in-place _foreach_mul_ floor")
    ax2.set_yscale("log")
    ax2.set_ylabel("time / floor time")
    ax2.set_xticks(range(len(labels)), labels, fontsize=7)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_e2e(e2e: dict[str, Any] | None, path: Path, title: str) -> Path | None:
    if not e2e:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"torch": dict(ls="-", lw=3.5, alpha=0.35), "ampfused": dict(ls="--", lw=1.3)}
    colors = {"adamw": "tab:blue", "adamw-fused": "tab:green"}
    for key, r in e2e["runs"].items():
        ax1.plot(
            range(1, len(r["losses"]) + 1),
            r["losses"],
            color=colors.get(r["optimizer"], "k"),
            label=key,
            **styles[r["scaler"]],
        )
    diffs = ", ".join(f"{k}: {c['max_abs_loss_diff']:g}" for k, c in e2e["comparisons"].items())
    ax1.set_title(f"loss per step (max |torch - ampfused|: {diffs})", fontsize=9)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("training loss")
    ax1.legend(fontsize=8)
    ax1.grid(True, alpha=0.3)
    keys = list(e2e["runs"])
    meds = [e2e["runs"][k]["median_step_s"] * 1e3 for k in keys]
    errs = [
        (
            (e2e["runs"][k]["median_step_s"] - e2e["runs"][k]["q1_s"]) * 1e3,
            (e2e["runs"][k]["q3_s"] - e2e["runs"][k]["median_step_s"]) * 1e3,
        )
        for k in keys
    ]
    ax2.bar(
        range(len(keys)),
        meds,
        yerr=list(zip(*errs, strict=True)),
        capsize=4,
        color=[COLORS[e2e["runs"][k]["scaler"]] for k in keys],
    )
    ax2.set_xticks(range(len(keys)), keys, fontsize=8)
    ax2.set_ylabel("training step (ms), median and IQR")
    ax2.set_title("end-to-end step time", fontsize=9)
    ax2.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- files
def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=1, sort_keys=False, default=str) + "\n")


def header_table(header: dict[str, Any], tablefmt: str) -> str:
    return tabulate(
        [[k, v] for k, v in header.items()],
        headers=["", ""],
        tablefmt=tablefmt,
        disable_numparse=True,
    )


def method_text(records: Sequence[Record]) -> str:
    """How the tables' times were taken, for the top of results.md."""
    common = (
        "GB/s = bytes read + written (8 B per fp32 element for an unscale) / median time; "
        "*x floor* = time / time of an in-place `torch._foreach_mul_` over the same gradients "
        "in the same run; *speedup* = torch.amp.GradScaler time / this time. *realloc* rows: "
        "new gradient tensors every step, as after `zero_grad(set_to_none=True)`."
    )
    if not _batched(records):
        return (
            "Times are per optimizer step, host wall time including device completion, median "
            "over interleaved rounds (IQR = interquartile range); " + common
        )
    return (
        "Times are per optimizer step, timed as a training loop runs: each sample is a batch "
        "of consecutive steps (*steps/sample*) with one device synchronization at the end, "
        "minus a batch of the same untimed gradient restores without the steps; median over "
        "interleaved rounds (IQR = interquartile range). *host* = CPU time to queue one step "
        "(launches, Python, host syncs inside the step); *device* = device time of one step "
        "from CUDA events, the batch queued behind a device spin (a step with a host sync "
        "inside also pays the device's idle time while the host turns around). " + common
    )


def markdown(
    *,
    header: dict[str, Any],
    command: str,
    elapsed_s: float,
    notes: list[str],
    records: list[Record],
    cpu_targets: list[TargetResult] | None,
    gpu_targets: list[TargetResult] | None,
    e2e: dict[str, Any] | None,
    plots: dict[str, Path],
    gpu: bool,
    errors: list[str],
    gpu_targets_link: str = "../gpu-targets.md",
) -> str:
    md: list[str] = []
    md.append(f"# ampfused benchmarks: {header['device_name']}\n")
    md.append(f"`{command}`, {elapsed_s:.0f} s. " + method_text(records) + "\n")
    md.append("## Environment\n")
    md.append(header_table(header, "github") + "\n")
    if errors:
        md.append("## Errors\n")
        md += [f"- {e}" for e in errors]
        md.append("")
    if notes:
        md.append("## Notes\n")
        md += [f"- {n}" for n in notes]
        md.append("")
    if cpu_targets:
        n_pass = sum(1 for t in cpu_targets if t.passed)
        md.append(f"## CPU targets: {n_pass}/{len(cpu_targets)} pass\n")
        md.append(targets_table(cpu_targets, "github") + "\n")
    if gpu_targets:
        md.append("## GPU targets\n")
        md.append(targets_table(gpu_targets, "github") + "\n")
    elif not gpu:
        md.append(f"GPU targets: see [{gpu_targets_link}]({gpu_targets_link}).\n")
    for q in QUESTION_TITLES:
        recs = [r for r in records if r.question == q]
        if not recs:
            continue
        md.append(f"## {QUESTION_TITLES[q]}\n")
        if q in plots:
            md.append(f"![{q}]({plots[q].name})\n")
        if q == "diagnostics":
            md.append(bench_diagnostics.table(recs, "github") + "\n")
        elif q == "clip":
            md.append(bench_clip.table(recs, "github") + "\n")
        elif q == "masters":
            md.append(bench_masters.table(recs, "github") + "\n")
        elif q == "distributed":
            md.append(bench_distributed.table(recs, "github") + "\n")
        else:
            md.append(pivot(recs, gpu, "github") + "\n")
    if e2e:
        md.append("## End-to-end: small GPT, float16 autocast, each scaler\n")
        cfg = e2e["config"]
        g = cfg["gpt"]
        md.append(
            f"nanoGPT-style model ({g['n_layer']} layers, {g['n_head']} heads, {g['n_embd']} "
            f"embedding, block {g['block_size']}, vocab {g['vocab_size']}: "
            f"{e2e['n_params']:,} parameters in {e2e['n_param_tensors']} tensors), batch "
            f"{cfg['batch_size']} x {cfg['grad_accum']} accumulation steps, unscale_ + "
            f"clip_grad_norm_({cfg['grad_clip']}), AdamW; {cfg['steps']} steps per run, the first "
            f"{cfg['timed_from']} untimed; "
            + (
                "runs interleaved step by step.\n"
                if cfg.get("steps_per_sample", 1) == 1
                else f"runs interleaved in chunks of {cfg['steps_per_sample']} consecutive steps, "
                "one synchronization per chunk (median step = median over chunks of chunk "
                "time / steps).\n"
            )
        )
        if "e2e" in plots:
            md.append(f"![e2e]({plots['e2e'].name})\n")
        md.append(e2e_table(e2e, "github") + "\n")
    md.append("## Methods\n")
    md += [f"- **{m.name}** ({m.label}): {m.description}" for m in METHODS.values()]
    md.append("")
    md.append("## All records\n")
    for q in QUESTION_TITLES:
        recs = [r for r in records if r.question == q]
        if recs:
            md.append(f"### {q}\n")
            md.append(details(recs, gpu, "github") + "\n")
    return "\n".join(md)


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
    results: list[TargetResult], header: dict[str, Any] | None, slug: str | None
) -> str:
    md = ["# GPU targets\n"]
    if header is None:
        md.append(
            "Not yet measured: no GPU was available to the runs so far. `python -m benchmarks` "
            "on a GPU machine measures them and rewrites this file.\n"
        )
        md.append(GPU_METHOD_MD)
    else:
        md.append(
            f"Measured on {header['device_name']} (torch {header['torch']}, CUDA "
            f"{header['cuda_runtime']}, commit {header['git_commit']}, {header['date']}); "
            f"details in [{slug}/results.md]({slug}/results.md).\n"
        )
    md.append(targets_table(results, "github") + "\n")
    return "\n".join(md)
