"""``python -m benchmarks``: the ampfused benchmark suite (see ``--help``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks import (
    bench_clip,
    bench_counts,
    bench_diagnostics,
    bench_distributed,
    bench_e2e,
    bench_masters,
    bench_models,
    bench_sizes,
    report,
    results_io,
    step_cost,
)
from benchmarks import targets as tg
from benchmarks.env import RESULTS, CpuShare, default_device, device_slug, header, is_gpu
from benchmarks.methods import COMPARED, METHODS, select
from benchmarks.suite import Context, Record
from benchmarks.timing import FULL_TIMING, QUICK_TIMING, TIMING_MODES, batched
from benchmarks.workloads import DTYPE_NAMES, MODELS

QUESTIONS = (
    "step_cost",
    "diagnostics",
    "clip",
    "masters",
    "distributed",
    "models",
    "counts",
    "sizes",
    "e2e",
)

DESCRIPTION = """\
Benchmarks ampfused.GradScaler against torch.amp.GradScaler, torch's raw ops, a naive Python
loop, ampfused's raw op and (when importable, on GPU) apex, with the memory floor measured in
the same run.  Questions:
  step_cost  per-step cost on the four gradient sets of the CPU targets (3000 x 16, 1000 x 1K,
             GPT-2 124M, 4 x 16M fp32), checked against the targets
  diagnostics  the scaler's pass with per-gradient statistics (watch, grad_norms()) vs the
             plain pass and vs torch's scaler + per-layer norms by hand (GPT-2 124M, 4 x 16M;
             100 to 3000 tiny tensors for the host cost), checked against the targets
  clip       GradScaler.clip_grad_norm_ (unscale + clip, two passes) vs torch's unscale_ +
             clip_grad_norm_ (GPT-2 124M, 4 x 16M, 1000 x 1K), checked against the target
  masters    float16 parameters with float32 masters: MasterWeights + GradScaler vs the recipe
             by hand with torch's scaler (GPT-2 124M, 4 x 16M, 1000 x 1K, float16)
  distributed  2 CPU processes (gloo, 1 thread each): a step with found_inf all-reduced over
             the world group, torch's ShardedGradScaler vs ampfused.ShardedGradScaler and
             ampfused.GradScaler(found_inf_group=WORLD), beside both scalers without the
             collective, the all-reduce alone and the floor (4 x 4M, 300 x 16K, 1000 x 16)
  models     GPT-2 124M, Llama-style 1B (7B on GPU), ResNet-50, BERT-base, ViT-B/16 gradient
             sets x dtypes (fp32, fp16, bf16, mixed) x with/without an injected inf
  counts     1 to 10,000 tensors of 16 and 1024 elements
  sizes      8 tensors of 16 to 2^28 elements (capped on CPU)
  e2e        a small GPT trained with float16 autocast under each scaler: step time, loss curves
Writes a console table, results.jsonl (one line per record, committed), results.json (every
field, git-ignored), results.md and PNG plots to benchmarks/results/<device>/ (<device>/quick/
with --quick).  A full run takes under 10 minutes on a 2-core CPU, --quick under a minute.
python -m benchmarks.compare OLD NEW lists the rows that got slower between two runs."""


def _csv(choices: tuple[str, ...] | list[str]):  # noqa: ANN202
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short run (< 1 min on CPU), same outputs")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument(
        "--only",
        type=_csv(QUESTIONS),
        metavar="Q[,Q]",
        help=f"questions to run (default: all): {', '.join(QUESTIONS)}",
    )
    p.add_argument(
        "--workloads",
        type=_csv(tuple(MODELS)),
        metavar="W[,W]",
        help=f"model gradient sets for the models question: {', '.join(MODELS)}",
    )
    p.add_argument(
        "--methods",
        type=_csv(COMPARED),
        metavar="M[,M]",
        help=f"methods to compare (floors always run): {', '.join(COMPARED)}",
    )
    p.add_argument(
        "--dtypes",
        type=_csv(DTYPE_NAMES),
        metavar="D[,D]",
        help="gradient dtypes for models (default all) and the sweeps (default fp32): "
        + ", ".join(DTYPE_NAMES),
    )
    p.add_argument(
        "--inf",
        choices=("both", "no", "yes"),
        help="models question: with and/or without one injected inf (default: both)",
    )
    p.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<device>)")
    p.add_argument(
        "--timing",
        choices=TIMING_MODES,
        default="auto",
        help="per-step: one synchronized sample per step; batched: loops of steps with one "
        "sync at the end, restores subtracted (default auto: batched on GPU, per-step on CPU)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler op counts")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list questions, workloads, methods; exit")
    return p.parse_args(argv)


def list_everything() -> None:
    print("questions:", ", ".join(QUESTIONS))
    print("model workloads:")
    for m in MODELS.values():
        shapes = m.shapes()
        n = sum(torch.Size(s).numel() for s in shapes)
        print(
            f"  {m.name:10s} {m.title:16s} {len(shapes):4d} tensors {n:>14,d} parameters"
            + ("  (GPU only)" if m.gpu_only else "")
        )
    print("methods:")
    for m in METHODS.values():
        print(f"  {m.name:14s} [{m.kind}] {m.description}")
    print("dtypes:", ", ".join(DTYPE_NAMES))


@dataclass
class Run:
    """What the steps of one suite run hand each other."""

    args: argparse.Namespace
    device: torch.device
    out: Path
    questions: list[str]
    command: str
    ctx: Context
    hdr: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    e2e: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    others: dict[str, float | None] = field(default_factory=dict)  # CPU share of other processes
    total_share: float | None = None
    elapsed: float = 0.0
    cpu_t: list[tg.TargetResult] | None = None
    gpu_t: list[tg.TargetResult] | None = None
    plots: dict[str, Path] = field(default_factory=dict)

    @property
    def gpu(self) -> bool:
        return is_gpu(self.device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_everything()
        return 0
    run = environment(args, argv)
    if run is None:
        return 2
    plan_questions(run)
    run_questions(run)
    collect_notes(run)
    judge_targets(run)
    print_console(run)
    write_plots(run)
    write_results(run)
    return 1 if run.errors else 0


def environment(args: argparse.Namespace, argv: list[str] | None) -> Run | None:
    """The device, output folder, timing context, environment header and the notes they imply;
    None (after an error message) when the device asked for is not there."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    if is_gpu(device) and not torch.cuda.is_available():
        print("error: --device cuda but no GPU is available", file=sys.stderr)
        return None
    out = args.out or (RESULTS / device_slug(device) / ("quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks" + ("" if argv is None and len(sys.argv) < 2 else " ")
    command += " ".join(argv if argv is not None else sys.argv[1:])
    ctx = Context(
        device=device,
        timing=dataclasses.replace(QUICK_TIMING if args.quick else FULL_TIMING, mode=args.timing),
        methods=select(args.methods, device),
        quick=args.quick,
        profile=not args.no_profile,
    )
    run = Run(args, device, out, args.only or list(QUESTIONS), command.strip(), ctx, header(device))
    if not run.gpu:
        run.notes.append(
            "No GPU: device time (CUDA events), the device-copy floor, kernel launches and host "
            "syncs are GPU-only and skipped; the op columns report dispatcher ops and .item() "
            "calls per step from torch.profiler (each .item() is a blocking host sync on a GPU). "
            "GPU targets: benchmarks/results/gpu-targets.md (not yet measured)."
        )
    if METHODS["apex"].present(device) is False:
        run.notes.append(
            "apex (amp_C.multi_tensor_scale): "
            + (
                "not importable, column skipped"
                if run.hdr["apex"] != "available"
                else "GPU only, skipped"
            )
        )
    run.notes.append(
        "float16 and mixed workloads: both scalers unscale float16 grads in place, torch's "
        "through its private _unscale_grads_(allow_fp16=True), ampfused's with "
        "GradScaler(allow_fp16=True); by default unscale_ raises ValueError for float16 grads, "
        "as in torch. mixed = each tensor fp32, bf16 or fp16 at random (fixed seed)."
    )
    if run.gpu:
        run.notes.append(
            "torch's CUDA unscale kernel has no bfloat16: torch and torch-ops are n/a on "
            "bf16 and mixed workloads."
        )
    run.notes.append(
        "Gradients are restored from a pristine copy and every scale reset to 2^16 before each "
        "timed step (untimed). torch-ops groups the lists by dtype once, outside the timing."
    )
    if batched(ctx.timing, device):
        run.notes.append(
            "Batched timing: each sample times a loop of consecutive steps (restore, reset, "
            "step) with one synchronization at the end, minus the same loop without the step; "
            "the restores run on the device's stream like the rest, and their cost per step is "
            "reported as 'restore (subtracted)'. A step with a host sync inside it (both "
            "scalers' step(), naive, apex) drains the device every step, as in training."
        )
    return run


def plan_questions(run: Run) -> None:
    """Each question's configurations, planned before any runs so the progress bar has a total."""
    args, ctx = run.args, run.ctx
    if "step_cost" in run.questions:
        run.plan["step_cost"] = len(step_cost.WORKLOADS)
    if "diagnostics" in run.questions:
        run.plan["diagnostics"] = len(bench_diagnostics.workloads(ctx))
    if "clip" in run.questions:
        run.plan["clip"] = len(bench_clip.workloads(ctx))
    if "masters" in run.questions:
        run.plan["masters"] = len(bench_masters.workloads(ctx))
    if "distributed" in run.questions:
        run.plan["distributed"] = len(bench_distributed.workloads(ctx))
    if "models" in run.questions:
        infs = {None: None, "both": [False, True], "no": [False], "yes": [True]}[args.inf]
        run.plan["models"], notes = bench_models.configs(ctx, args.workloads, args.dtypes, infs)
        run.notes += notes
    if "counts" in run.questions:
        run.plan["counts"] = bench_counts.configs(ctx, args.dtypes)
    if "sizes" in run.questions:
        run.plan["sizes"], notes = bench_sizes.configs(ctx, args.dtypes)
        run.notes += notes


def _target_ctx(run: Run) -> Context:
    # More samples than the sweeps (step_cost.TIMING): targets are stated on these rows.
    timing = step_cost.QUICK_TIMING if run.args.quick else step_cost.TIMING
    return dataclasses.replace(run.ctx, timing=dataclasses.replace(timing, mode=run.args.timing))


def run_step_cost(run: Run) -> None:
    run.records += step_cost.measure(_target_ctx(run))


def run_diagnostics(run: Run) -> None:
    run.records += bench_diagnostics.run(_target_ctx(run))


def run_clip(run: Run) -> None:
    run.records += bench_clip.run(_target_ctx(run))


def run_masters(run: Run) -> None:
    run.records += bench_masters.run(_target_ctx(run))


def run_distributed(run: Run) -> None:
    # Its own timing (lock-step rounds in two processes; bench_distributed.TIMING).
    run.records += bench_distributed.run(run.ctx)


def run_models(run: Run) -> None:
    run.records += bench_models.run(run.ctx, run.plan["models"])


def run_counts(run: Run) -> None:
    run.records += bench_counts.run(run.ctx, run.plan["counts"])


def run_sizes(run: Run) -> None:
    run.records += bench_sizes.run(run.ctx, run.plan["sizes"])


def run_e2e(run: Run) -> None:
    res = bench_e2e.run(run.ctx)
    run.e2e = {
        "config": res.config,
        "n_params": res.n_params,
        "n_param_tensors": res.n_param_tensors,
        "runs": res.runs,
        "comparisons": res.comparisons,
    }


QUESTION_STEPS = {
    "step_cost": run_step_cost,
    "diagnostics": run_diagnostics,
    "clip": run_clip,
    "masters": run_masters,
    "distributed": run_distributed,
    "models": run_models,
    "counts": run_counts,
    "sizes": run_sizes,
    "e2e": run_e2e,
}


def run_questions(run: Run) -> None:
    """Each question in turn under one progress bar, timing it and the CPU share other
    processes took meanwhile; a question that raises is reported and the next one runs."""
    total = sum(v if isinstance(v, int) else len(v) for v in run.plan.values())
    if "e2e" in run.questions:
        total += bench_e2e.steps_total(run.ctx)
    hdr = run.hdr
    print(
        f"ampfused benchmarks on {hdr['device_name']} ({run.device}), torch {hdr['torch']}, "
        f"commit {hdr['git_commit']}, {hdr['torch_threads']} threads -> {run.out}",
        flush=True,
    )
    t_start = time.perf_counter()
    run_share = CpuShare().start()
    bar = tqdm(
        total=total, unit="cfg", disable=run.args.no_progress, mininterval=0.5, file=sys.stderr
    )
    run.ctx.progress = bar
    for q in run.questions:
        bar.set_description(q)
        t0 = time.perf_counter()
        share = CpuShare().start()
        try:
            QUESTION_STEPS[q](run)
        except Exception as e:  # noqa: BLE001 - one broken question must not hide the others
            bar.write(traceback.format_exc())
            run.errors.append(f"{q}: {type(e).__name__}: {e}")
        run.durations[q] = round(time.perf_counter() - t0, 1)
        run.others[q] = share.stop()
    bar.close()
    run.elapsed = time.perf_counter() - t_start
    run.total_share = run_share.stop()


def collect_notes(run: Run) -> None:
    """Notes and errors the runs produced: other processes' CPU share, realloc rows, records
    that failed."""
    share, others = run.total_share, run.others
    if share is not None:
        per_question = ", ".join(f"{q} {v:.0%}" for q, v in others.items() if v is not None)
        run.hdr["cpu_used_by_others"] = (
            f"{share:.1%} of all CPU time during the run ({per_question})"
        )
        if share > 0.05 and not run.gpu:
            run.notes.insert(
                0,
                f"Other processes (or hypervisor steal) used {share:.0%} of the CPU time "
                f"during this run: CPU timings are disturbed (per question: {per_question}). "
                "Rerun on an idle machine for clean numbers.",
            )
    if any(r.realloc for r in run.records):
        run.notes.append(
            "realloc rows: every restore replaces each gradient by a new tensor (zero_grad"
            "(set_to_none=True), then one allocation per parameter, last layer first, as "
            "backward does); the note gives how often the allocator returned a different "
            "pointer list (before ampfused passed its CUDA work list in the kernel parameters, a "
            "changed list cost it a table rebuild)."
        )
    run.notes += run.ctx.notes
    for r in run.records:
        if r.status == "error":
            run.errors.append(f"{r.question}:{r.workload} {r.dtype} {r.method}: {r.note}")


def judge_targets(run: Run) -> None:
    """CPU targets from a CPU run's step_cost and diagnostics records (plus the never-slower
    check), GPU targets from a GPU run."""
    if run.gpu:
        run.gpu_t = tg.gpu_targets(run.records, run.e2e)
        return
    cpu_t = tg.cpu_targets(run.records) if "step_cost" in run.questions else None
    if "diagnostics" in run.questions:
        cpu_t = (cpu_t or []) + tg.diagnostics_targets(run.records)
    if "clip" in run.questions:
        cpu_t = (cpu_t or []) + [tg.clip_target(run.records)]
    cpu_info = tg.never_slower(run.records) if run.records else None
    if cpu_t is not None and cpu_info is not None:
        cpu_info.name = "(info) never slower than torch"
        cpu_t = [*cpu_t, cpu_info]
    run.cpu_t = cpu_t


def print_console(run: Run) -> None:
    print()
    print(report.header_table(run.hdr, "simple"))
    for q in report.QUESTION_TITLES:
        recs = [r for r in run.records if r.question == q]
        if recs:
            print(f"\n== {report.QUESTION_TITLES[q]} ==")
            if q == "step_cost":
                print(step_cost.table(recs))
            elif q == "diagnostics":
                print(bench_diagnostics.table(recs))
            elif q == "clip":
                print(bench_clip.table(recs))
            elif q == "masters":
                print(bench_masters.table(recs))
            elif q == "distributed":
                print(bench_distributed.table(recs))
            else:
                print(report.pivot(recs, run.gpu, "simple"))
    if run.e2e:
        print("\n== End-to-end small GPT, float16 autocast ==")
        print(report.e2e_table(run.e2e, "simple"))
    if run.notes:
        print("\nNotes:")
        for n in run.notes:
            print(" -", n)
    if run.cpu_t:
        n_pass = sum(1 for t in run.cpu_t if t.passed)
        print(f"\n== CPU targets: {n_pass}/{len(run.cpu_t)} pass ==")
        print(report.targets_table(run.cpu_t, "simple"))
    if run.gpu_t:
        print("\n== GPU targets ==")
        print(report.targets_table(run.gpu_t, "simple"))
    if run.errors:
        print("\nErrors:")
        for e in run.errors:
            print(" -", e)


def write_plots(run: Run) -> None:
    """The PNG plots (unless --no-plots); a plot that fails is an error, not the end."""
    if run.args.no_plots:
        return
    hdr = run.hdr
    title = f"ampfused benchmarks, {hdr['device_name']}, torch {hdr['torch']}, {hdr['git_commit']}"
    for key, fn, data in (
        ("counts", report.plot_counts, run.records),
        ("sizes", report.plot_sizes, run.records),
        ("models", report.plot_models, run.records),
        ("e2e", report.plot_e2e, run.e2e),
    ):
        try:
            path = fn(data, run.out / f"{key}.png", title)  # type: ignore[operator]
        except Exception as e:  # noqa: BLE001
            run.errors.append(f"plot {key}: {type(e).__name__}: {e}")
            continue
        if path is not None:
            run.plots[key] = path


def payload(run: Run) -> dict[str, Any]:
    """Everything the run measured, as results.json holds it."""
    return {
        "header": run.hdr,
        "command": run.command,
        "quick": run.args.quick,
        "elapsed_s": round(run.elapsed, 1),
        "durations_s": run.durations,
        "cpu_used_by_others": {"run": run.total_share, **run.others},
        "notes": run.notes,
        "errors": run.errors,
        "methods": {
            m.name: {"label": m.label, "kind": m.kind, "description": m.description}
            for m in METHODS.values()
        },
        "targets": {
            "cpu": [t.__dict__ for t in run.cpu_t] if run.cpu_t else None,
            "gpu": [t.__dict__ for t in run.gpu_t] if run.gpu_t else None,
        },
        "records": [r.to_json() for r in run.records],
        "e2e": run.e2e,
    }


def write_results(run: Run) -> None:
    """results.json (full, git-ignored), results.jsonl (compact, committed), results.md and,
    inside benchmarks/results, gpu-targets.md."""
    written = results_io.write(run.out, payload(run))
    (run.out / "results.md").write_text(
        report.markdown(
            header=run.hdr,
            command=run.command,
            elapsed_s=run.elapsed,
            notes=run.notes,
            records=run.records,
            cpu_targets=run.cpu_t,
            gpu_targets=run.gpu_t,
            e2e=run.e2e,
            plots=run.plots,
            gpu=run.gpu,
            errors=run.errors,
            gpu_targets_link=os.path.relpath(RESULTS / "gpu-targets.md", run.out),
        )
    )
    write_gpu_targets(run)
    print(
        f"\nwrote {run.out}/"
        + ", ".join(p.name for p in written)
        + ", results.md"
        + (f", {len(run.plots)} plots" if run.plots else "")
        + f" in {run.elapsed:.0f} s"
    )


def write_gpu_targets(run: Run) -> None:
    """benchmarks/results/gpu-targets.md: measured by a GPU run, else 'not yet measured'.  Only
    for output folders inside benchmarks/results; a quick or CPU run never replaces a
    measurement."""
    try:
        run.out.resolve().relative_to(RESULTS.resolve())
    except ValueError:
        return
    path = RESULTS / "gpu-targets.md"
    existing = path.read_text() if path.exists() else ""
    measured = existing and "Not yet measured" not in existing
    if run.gpu and run.gpu_t is not None:
        if run.args.quick and measured:
            return
        slug = device_slug(run.device) + ("/quick" if run.args.quick else "")
        path.write_text(report.gpu_targets_md(run.gpu_t, run.hdr, slug))
    elif not measured:
        path.write_text(report.gpu_targets_md(tg.gpu_not_measured(), None, None))


if __name__ == "__main__":
    sys.exit(main())
