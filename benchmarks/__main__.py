"""``python -m benchmarks``: the ampfused benchmark suite (see ``--help``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks import bench_counts, bench_e2e, bench_models, bench_sizes, report, step_cost
from benchmarks import targets as tg
from benchmarks.env import RESULTS, CpuShare, default_device, device_slug, header, is_gpu
from benchmarks.methods import COMPARED, METHODS, select
from benchmarks.suite import Context, Record
from benchmarks.timing import FULL_TIMING, QUICK_TIMING, TIMING_MODES, batched
from benchmarks.workloads import DTYPE_NAMES, MODELS

QUESTIONS = ("step_cost", "models", "counts", "sizes", "e2e")

DESCRIPTION = """\
Benchmarks ampfused.GradScaler against torch.amp.GradScaler, torch's raw ops, a naive Python
loop, ampfused's raw op and (when importable, on GPU) apex, with the memory floor measured in
the same run.  Questions:
  step_cost  per-step cost on the four gradient sets of the CPU targets (3000 x 16, 1000 x 1K,
             GPT-2 124M, 4 x 16M fp32), checked against the targets
  models     GPT-2 124M, Llama-style 1B (7B on GPU), ResNet-50, BERT-base, ViT-B/16 gradient
             sets x dtypes (fp32, fp16, bf16, mixed) x with/without an injected inf
  counts     1 to 10,000 tensors of 16 and 1024 elements
  sizes      8 tensors of 16 to 2^28 elements (capped on CPU)
  e2e        a small GPT trained with float16 autocast under each scaler: step time, loss curves
Writes a console table, results.json, results.md and PNG plots to benchmarks/results/<device>/
(<device>/quick/ with --quick).  A full run takes under 10 minutes on a 2-core CPU, --quick
under a minute."""


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
        print(f"  {m.name:12s} [{m.kind}] {m.description}")
    print("dtypes:", ", ".join(DTYPE_NAMES))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_everything()
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    if is_gpu(device) and not torch.cuda.is_available():
        print("error: --device cuda but no GPU is available", file=sys.stderr)
        return 2
    gpu = is_gpu(device)
    slug = device_slug(device)
    out = args.out or (RESULTS / slug / ("quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    questions = args.only or list(QUESTIONS)
    command = "python -m benchmarks" + ("" if argv is None and len(sys.argv) < 2 else " ")
    command += " ".join(argv if argv is not None else sys.argv[1:])
    command = command.strip()

    ctx = Context(
        device=device,
        timing=dataclasses.replace(QUICK_TIMING if args.quick else FULL_TIMING, mode=args.timing),
        methods=select(args.methods, device),
        quick=args.quick,
        profile=not args.no_profile,
    )
    hdr = header(device)
    notes: list[str] = []
    if not gpu:
        notes.append(
            "No GPU: device time (CUDA events), the device-copy floor, kernel launches and host "
            "syncs are GPU-only and skipped; the op columns report dispatcher ops and .item() "
            "calls per step from torch.profiler (each .item() is a blocking host sync on a GPU). "
            "GPU targets: benchmarks/results/gpu-targets.md (not yet measured)."
        )
    if METHODS["apex"].present(device) is False:
        notes.append(
            "apex (amp_C.multi_tensor_scale): "
            + (
                "not importable, column skipped"
                if hdr["apex"] != "available"
                else "GPU only, skipped"
            )
        )
    notes.append(
        "float16 and mixed workloads: both scalers run with allow_fp16=True through their "
        "private hooks (torch's _unscale_grads_, ampfused's _fused_found_inf); the public "
        "unscale_ raises ValueError for float16 grads, as in torch. mixed = each tensor fp32, bf16 "
        "or fp16 at random (fixed seed)."
    )
    if gpu:
        notes.append(
            "torch's CUDA unscale kernel has no bfloat16: torch and torch-ops are n/a on "
            "bf16 and mixed workloads."
        )
    notes.append(
        "Gradients are restored from a pristine copy and every scale reset to 2^16 before each "
        "timed step (untimed). torch-ops groups the lists by dtype once, outside the timing."
    )
    if batched(ctx.timing, device):
        notes.append(
            "Batched timing: each sample times a loop of consecutive steps (restore, reset, "
            "step) with one synchronization at the end, minus the same loop without the step; "
            "the restores run on the device's stream like the rest, and their cost per step is "
            "reported as 'restore (subtracted)'. A step with a host sync inside it (both "
            "scalers' step(), naive, apex) drains the device every step, as in training."
        )

    # Plan: configs per question, for the progress bar's total.
    plan: dict[str, Any] = {}
    if "step_cost" in questions:
        plan["step_cost"] = len(step_cost.WORKLOADS)
    if "models" in questions:
        infs = {None: None, "both": [False, True], "no": [False], "yes": [True]}[args.inf]
        cfgs, n = bench_models.configs(ctx, args.workloads, args.dtypes, infs)
        plan["models"] = cfgs
        notes += n
    if "counts" in questions:
        plan["counts"] = bench_counts.configs(ctx, args.dtypes)
    if "sizes" in questions:
        cfgs, n = bench_sizes.configs(ctx, args.dtypes)
        plan["sizes"] = cfgs
        notes += n
    total = sum(v if isinstance(v, int) else len(v) for v in plan.values())
    if "e2e" in questions:
        total += bench_e2e.steps_total(ctx)

    print(
        f"ampfused benchmarks on {hdr['device_name']} ({device}), torch {hdr['torch']}, "
        f"commit {hdr['git_commit']}, {hdr['torch_threads']} threads -> {out}",
        flush=True,
    )
    t_start = time.perf_counter()
    records: list[Record] = []
    e2e: dict[str, Any] | None = None
    errors: list[str] = []
    durations: dict[str, float] = {}
    others: dict[str, float | None] = {}
    run_share = CpuShare().start()
    bar = tqdm(total=total, unit="cfg", disable=args.no_progress, mininterval=0.5, file=sys.stderr)
    ctx.progress = bar
    for q in questions:
        bar.set_description(q)
        t0 = time.perf_counter()
        share = CpuShare().start()
        try:
            if q == "step_cost":
                sc_ctx = Context(
                    device=device,
                    timing=dataclasses.replace(
                        step_cost.QUICK_TIMING if args.quick else step_cost.TIMING,
                        mode=args.timing,
                    ),
                    methods=ctx.methods,
                    quick=args.quick,
                    profile=ctx.profile,
                    progress=bar,
                )
                records += step_cost.measure(sc_ctx)
            elif q == "models":
                records += bench_models.run(ctx, plan["models"])
            elif q == "counts":
                records += bench_counts.run(ctx, plan["counts"])
            elif q == "sizes":
                records += bench_sizes.run(ctx, plan["sizes"])
            elif q == "e2e":
                res = bench_e2e.run(ctx)
                e2e = {
                    "config": res.config,
                    "n_params": res.n_params,
                    "n_param_tensors": res.n_param_tensors,
                    "runs": res.runs,
                    "comparisons": res.comparisons,
                }
        except Exception as e:  # noqa: BLE001 - one broken question must not hide the others
            bar.write(traceback.format_exc())
            errors.append(f"{q}: {type(e).__name__}: {e}")
        durations[q] = round(time.perf_counter() - t0, 1)
        others[q] = share.stop()
    bar.close()
    elapsed = time.perf_counter() - t_start
    total_share = run_share.stop()
    if total_share is not None:
        hdr["cpu_used_by_others"] = f"{total_share:.1%} of all CPU time during the run" + (
            " (" + ", ".join(f"{q} {v:.0%}" for q, v in others.items() if v is not None) + ")"
        )
        if total_share > 0.05 and not gpu:
            notes.insert(
                0,
                f"Other processes (or hypervisor steal) used {total_share:.0%} of the CPU time "
                "during this run: CPU timings are disturbed (per question: "
                + ", ".join(f"{q} {v:.0%}" for q, v in others.items() if v is not None)
                + "). Rerun on an idle machine for clean numbers.",
            )

    if any(r.realloc for r in records):
        notes.append(
            "realloc rows: every restore replaces each gradient by a new tensor (zero_grad"
            "(set_to_none=True), then one allocation per parameter, last layer first, as "
            "backward does); the note gives how often the allocator returned a different "
            "pointer list (ampfused's CUDA metadata table is cached by pointer list)."
        )
    notes += ctx.notes
    for r in records:
        if r.status == "error":
            errors.append(f"{r.question}:{r.workload} {r.dtype} {r.method}: {r.note}")

    cpu_t = tg.cpu_targets(records) if not gpu and "step_cost" in questions else None
    cpu_info = tg.never_slower(records) if not gpu and records else None
    if cpu_t is not None and cpu_info is not None:
        cpu_info.name = "(info) never slower than torch"
        cpu_t = [*cpu_t, cpu_info]
    gpu_t = tg.gpu_targets(records, e2e) if gpu else None

    # Console.
    print()
    print(report.header_table(hdr, "simple"))
    for q in ("step_cost", "models", "counts", "sizes"):
        recs = [r for r in records if r.question == q]
        if recs:
            print(f"\n== {report.QUESTION_TITLES[q]} ==")
            if q == "step_cost":
                print(step_cost.table(recs))
            else:
                print(report.pivot(recs, gpu, "simple"))
    if e2e:
        print("\n== End-to-end small GPT, float16 autocast ==")
        print(report.e2e_table(e2e, "simple"))
    if notes:
        print("\nNotes:")
        for n in notes:
            print(" -", n)
    if cpu_t:
        print(f"\n== CPU targets: {sum(1 for t in cpu_t if t.passed)}/{len(cpu_t)} pass ==")
        print(report.targets_table(cpu_t, "simple"))
    if gpu_t:
        print("\n== GPU targets ==")
        print(report.targets_table(gpu_t, "simple"))
    if errors:
        print("\nErrors:")
        for e in errors:
            print(" -", e)

    # Files.
    plots: dict[str, Path] = {}
    if not args.no_plots:
        title = (
            f"ampfused benchmarks, {hdr['device_name']}, torch {hdr['torch']}, {hdr['git_commit']}"
        )
        for key, fn, data in (
            ("counts", report.plot_counts, records),
            ("sizes", report.plot_sizes, records),
            ("models", report.plot_models, records),
            ("e2e", report.plot_e2e, e2e),
        ):
            try:
                path = fn(data, out / f"{key}.png", title)  # type: ignore[operator]
            except Exception as e:  # noqa: BLE001
                errors.append(f"plot {key}: {type(e).__name__}: {e}")
                continue
            if path is not None:
                plots[key] = path
    payload = {
        "header": hdr,
        "command": command,
        "quick": args.quick,
        "elapsed_s": round(elapsed, 1),
        "durations_s": durations,
        "cpu_used_by_others": {"run": total_share, **others},
        "notes": notes,
        "errors": errors,
        "methods": {
            m.name: {"label": m.label, "kind": m.kind, "description": m.description}
            for m in METHODS.values()
        },
        "targets": {
            "cpu": [t.__dict__ for t in cpu_t] if cpu_t else None,
            "gpu": [t.__dict__ for t in gpu_t] if gpu_t else None,
        },
        "records": [r.to_json() for r in records],
        "e2e": e2e,
    }
    report.write_json(out / "results.json", payload)
    (out / "results.md").write_text(
        report.markdown(
            header=hdr,
            command=command,
            elapsed_s=elapsed,
            notes=notes,
            records=records,
            cpu_targets=cpu_t,
            gpu_targets=gpu_t,
            e2e=e2e,
            plots=plots,
            gpu=gpu,
            errors=errors,
            gpu_targets_link=os.path.relpath(RESULTS / "gpu-targets.md", out),
        )
    )
    _write_gpu_targets(out, gpu, args.quick, gpu_t, hdr, slug)
    print(
        f"\nwrote {out}/results.json, results.md"
        + (f", {len(plots)} plots" if plots else "")
        + f" in {elapsed:.0f} s"
    )
    return 1 if errors else 0


def _write_gpu_targets(
    out: Path, gpu: bool, quick: bool, gpu_t: list[tg.TargetResult] | None, hdr: dict, slug: str
) -> None:
    """benchmarks/results/gpu-targets.md: measured by a GPU run, else 'not yet measured'.  Only
    for output folders inside benchmarks/results; a quick or CPU run never replaces a
    measurement."""
    try:
        out.resolve().relative_to(RESULTS.resolve())
    except ValueError:
        return
    path = RESULTS / "gpu-targets.md"
    existing = path.read_text() if path.exists() else ""
    measured = existing and "Not yet measured" not in existing
    if gpu and gpu_t is not None:
        if quick and measured:
            return
        path.write_text(report.gpu_targets_md(gpu_t, hdr, slug + ("/quick" if quick else "")))
    elif not measured:
        path.write_text(report.gpu_targets_md(tg.gpu_not_measured(), None, None))


if __name__ == "__main__":
    sys.exit(main())
