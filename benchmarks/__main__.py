"""``python -m benchmarks``: the ampfused benchmark suite (see ``--help``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import compare, distributed, e2e, islands, policy, report, tracing
from benchmarks import targets as tg
from benchmarks.env import (
    REPO,
    RESULTS,
    CpuShare,
    default_device,
    device_slug,
    header,
    is_gpu,
    run_folder,
    shown,
)
from benchmarks.methods import COMPARED, METHODS, select
from benchmarks.questions import QUESTIONS, render
from benchmarks.suite import Context, Record
from benchmarks.timing import FULL_TIMING, QUICK_TIMING, TIMING_MODES, batched
from benchmarks.workloads import DTYPE_NAMES, MODELS

TITLES = {q.name: q.title for q in QUESTIONS.values()}
TITLES["distributed"] = "Distributed: a step with found_inf all-reduced across 2 CPU processes"
TITLES["e2e"] = "End-to-end: small GPT, float16 autocast, each scaler"
TITLES["instructions"] = "Host cost in instructions per call (torch on one thread)"
TITLES["tracing"] = "Activation tracing: a GPT-2 step (forward, backward, scaler) traced or not"
TITLES["policy"] = "Loss-scale policies: float16 training on CPU (skipped steps, scale, loss)"
TITLES["islands"] = "Islands: every layer's activation gradients inside float16's range (CPU)"
ORDER = ("step_cost", "diagnostics", "clip", "masters", "busy", "distributed", "models", "counts")
ORDER += ("sizes", "e2e", "tracing", "policy", "islands", "instructions")
DEFAULT = ORDER[:-1]  # instructions: minutes under callgrind, only when named

DESCRIPTION = """\
Benchmarks ampfused.GradScaler against torch.amp.GradScaler, torch's raw ops, a naive loop,
ampfused's raw op and (GPU) apex, with the memory floor in the same run: one table per question
(see benchmarks/README.md), then ampfused's own targets (development goals).  The default runs
every question but instructions (minutes under callgrind).

Each run writes results.jsonl, results.md and plots to a new folder of its own,
benchmarks/runs/<UTC date>-<time>-<device>[-quick]/ (git-ignored), or to --out DIR.  The
results committed under benchmarks/results/ are written with --out on purpose:
  python -m benchmarks --out benchmarks/results/cpu
  python -m benchmarks --quick --out benchmarks/results/cpu/quick
python -m benchmarks.compare OLD NEW lists the rows that got slower."""


# What the suite uses where it is installed and does without: what a run loses without it.
OPTIONAL = {
    "matplotlib": "no plots (the tables only)",
    "tqdm": "no progress bar (a line per question instead)",
    "transformers": "the tracing and islands questions and the policy question's GPT-2 are skipped",
}


def missing_packages(questions: list[str], plots: bool) -> dict[str, str]:
    """For each optional package this run would use and cannot import: a line saying what is
    lost without it and how to install it."""
    wanted = {
        "matplotlib": plots,
        "tqdm": True,
        "transformers": bool({"tracing", "policy", "islands"} & set(questions)),
    }
    return {
        name: f"{name} is not installed: {lost} (pip install {name})"
        for name, lost in OPTIONAL.items()
        if wanted[name] and importlib.util.find_spec(name) is None
    }


class LineProgress:
    """The progress bar without tqdm: a line on stderr as each question starts."""

    def __init__(self, total: int, disable: bool) -> None:
        self.total, self.n, self.disable = total, 0, disable

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def set_description(self, text: str) -> None:
        if not self.disable:
            print(f"{text} ({self.n} of {self.total} done)", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, disable: bool) -> Any:
    """tqdm's bar where tqdm is installed, else :class:`LineProgress`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineProgress(total, disable)
    return tqdm(total=total, unit="cfg", disable=disable, mininterval=0.5)


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
    add = p.add_argument
    add("--quick", action="store_true", help="short run, same outputs (times: docs/benchmarks.md)")
    add("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    add("--only", type=_csv(ORDER), metavar="Q[,Q]", help=f"questions: {', '.join(ORDER)}")
    add(
        "--workloads",
        type=_csv(tuple(MODELS)),
        metavar="W[,W]",
        help="models: " + ", ".join(MODELS),
    )
    add("--methods", type=_csv(COMPARED), metavar="M[,M]", help=f"of {', '.join(COMPARED)}")
    add("--dtypes", type=_csv(DTYPE_NAMES), metavar="D[,D]", help="models (all), sweeps (fp32)")
    add(
        "--out",
        type=Path,
        metavar="DIR",
        help="output folder (default: a new benchmarks/runs/<date>-<time>-<device>[-quick]/)",
    )
    add(
        "--timing", choices=TIMING_MODES, default="auto", help="auto: batched on GPU, else per-step"
    )
    add("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    add("--no-plots", action="store_true", help="skip the PNG plots")
    add("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


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
    plan: dict[str, list] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    e2e: dict[str, Any] | None = None
    policy: dict[str, Any] | None = None
    islands: dict[str, Any] | None = None
    instructions: str | None = None
    errors: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    others: dict[str, float | None] = field(default_factory=dict)  # CPU share of others
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
    run = environment(args, argv)
    if run is None:
        return 2
    run_questions(run)
    collect_notes(run)
    if run.gpu:
        run.gpu_t = tg.gpu_targets(run.records, run.e2e)
    else:
        run.cpu_t = tg.cpu_targets(run.records, run.questions) or None
    print()
    for title, body in sections(run, "simple"):
        print(f"== {title} ==\n{body}\n" if title else body)
    write_results(run)
    return 1 if run.errors else 0


def environment(args: argparse.Namespace, argv: list[str] | None) -> Run | None:
    """The device, output folder, context, header and the notes they imply (None: no GPU)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    if is_gpu(device) and not torch.cuda.is_available():
        print("error: --device cuda but no GPU is available", file=sys.stderr)
        return None
    out = args.out or run_folder(device_slug(device) + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(
        device=device,
        timing=dataclasses.replace(QUICK_TIMING if args.quick else FULL_TIMING, mode=args.timing),
        methods=select(args.methods, device),
        quick=args.quick,
    )
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    run = Run(args, device, out, args.only or list(DEFAULT), command, ctx, header(device))
    apex = "GPU only" if run.hdr["apex"] == "available" else "not importable"
    run.notes += [
        x
        for x, shown in (
            ("No GPU: device times, floor-copy, launches and syncs are GPU-only; the op columns "
             "count dispatcher ops and .item() calls (each a host sync on a GPU).", not run.gpu),
            (f"apex (amp_C.multi_tensor_scale): {apex}, column skipped",
             not METHODS["apex"].present(device)),
            ("fp16 and mixed: both scalers unscale float16 grads in place (torch's private "
             "allow_fp16 path, ampfused's allow_fp16=True); mixed = fp32, bf16 or fp16 per "
             "tensor at random (fixed seed).", True),
            ("torch's CUDA unscale kernel has no bfloat16: torch, torch-ops n/a on bf16, mixed.",
             run.gpu),
            ("Before each timed step, untimed: the gradients restored, every scale reset to 2^16 "
             "(torch-ops groups the lists by dtype once).", True),
            ("Batched timing: a sample times a loop of steps with one synchronization at the end, "
             "minus the same loop without the step ('restore (subtracted)'); a step with a host "
             "sync inside (both scalers' step(), naive, apex) drains the device every step.",
             batched(ctx.timing, device)),
        )
        if shown
    ]  # fmt: skip
    for q in run.questions:
        if q in QUESTIONS:
            run.plan[q] = QUESTIONS[q].plan(ctx, args)
            run.notes += QUESTIONS[q].notes(ctx, args)
    missing = missing_packages(run.questions, not args.no_plots)
    for line in missing.values():
        print(f"python -m benchmarks: {line}", file=sys.stderr, flush=True)
    if "matplotlib" in missing:  # (the questions note what they skip for transformers)
        args.no_plots = True
        run.notes.append(missing["matplotlib"])
    return run


def run_question(run: Run, q: str) -> None:
    if q in QUESTIONS:
        run.records += QUESTIONS[q].run(run.ctx, run.plan[q])
    elif q == "distributed":
        run.records += distributed.run(run.ctx)
    elif q == "e2e":
        run.e2e = e2e.run(run.ctx)
    elif q == "tracing":
        run.records += tracing.run(run.ctx)
    elif q == "policy":
        run.policy = policy.run(run.ctx)
        run.errors += policy.errors(run.policy)
    elif q == "islands":
        run.islands = islands.run(run.ctx)
        run.errors += islands.errors(run.islands)
    elif q == "instructions":  # a process of its own: it may re-run itself under callgrind
        cmd = [sys.executable, "-m", "benchmarks.instructions", "--out", str(run.out)]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"exit {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
        run.instructions = done.stdout.strip()
        run.ctx.tick()


def run_questions(run: Run) -> None:
    """Each question under one progress bar, timed with the CPU share others took meanwhile; a
    question that raises is reported and the next one runs."""
    sizes = {"distributed": len(distributed.WORKLOADS), "instructions": 1}
    sizes["tracing"] = len(tracing.MODELS)
    sizes["policy"] = policy.n_runs(run.args.quick)
    sizes["islands"] = islands.n_runs(run.args.quick)
    sizes["e2e"] = e2e.preset(run.device, run.args.quick).steps
    total = sum(len(run.plan[q]) if q in run.plan else sizes[q] for q in run.questions)
    h = run.hdr
    print(
        f"ampfused benchmarks on {h['device_name']} ({run.device}), torch {h['torch']}, "
        f"commit {h['git_commit']}, {h['torch_threads']} threads\noutput folder: {shown(run.out)}",
        flush=True,
    )
    t_start, run_share = time.perf_counter(), CpuShare().start()
    bar = progress_bar(total, run.args.no_progress)
    run.ctx.progress = bar
    for q in run.questions:
        bar.set_description(q)
        t0, share = time.perf_counter(), CpuShare().start()
        try:
            run_question(run, q)
        except Exception as e:  # noqa: BLE001 - one broken question must not hide the others
            bar.write(traceback.format_exc())
            run.errors.append(f"{q}: {type(e).__name__}: {e}")
        run.durations[q] = round(time.perf_counter() - t0, 1)
        run.others[q] = share.stop()
    bar.close()
    run.elapsed = time.perf_counter() - t_start
    run.total_share = run_share.stop()


def collect_notes(run: Run) -> None:
    """Other processes' CPU share, the realloc rows' note, the records that failed."""
    share, others = run.total_share, run.others
    if share is not None:
        per_question = ", ".join(f"{q} {v:.0%}" for q, v in others.items() if v is not None)
        run.hdr["cpu_used_by_others"] = (
            f"{share:.1%} of all CPU time during the run ({per_question})"
        )
        if share > 0.05 and not run.gpu:
            busy = f"Other processes (or hypervisor steal) used {share:.0%} of the CPU time"
            run.notes.insert(0, f"{busy} ({per_question}): rerun on an idle machine.")
    if any(r.realloc for r in run.records):
        realloc = "new gradient tensors every step, last layer first, as after zero_grad()"
        run.notes.append(f"realloc rows: {realloc}; the note: how often the pointers changed.")
    run.notes += run.ctx.notes
    run.errors += [
        f"{r.question}:{r.workload} {r.dtype} {r.method}: {r.note}"
        for r in run.records
        if r.status == "error"
    ]


def sections(run: Run, tablefmt: str) -> list[tuple[str, str]]:
    """What the console and results.md show, in order: how ampfused compares, a table per
    question, notes, errors, then ampfused's own targets."""
    h, md, out = run.hdr, tablefmt == "github", []
    if md:
        out.append(("", f"# ampfused benchmarks: {h['device_name']}\n"))
        out.append(
            ("", f"`{run.command}`, {run.elapsed:.0f} s. {report.method_text(run.records)}\n")
        )
    out.append(
        ("Environment", report.grid([[k, v] for k, v in h.items()], ["field", "value"], tablefmt))
    )
    lines = report.comparisons(run.records, run.e2e) + policy.comparison_lines(run.policy)
    if lines:
        out.append(("How ampfused compares", report.bullets(lines, tablefmt)))
    for q in ORDER:
        recs = [r for r in run.records if r.question == q]
        body = render(q, recs, run.gpu, tablefmt) if recs else ""
        if q == "e2e" and run.e2e:
            text = report.paragraph(report.e2e_text(run.e2e), tablefmt)
            body = text + "\n\n" + report.e2e_table(run.e2e, tablefmt)
        if q == "policy" and run.policy:
            body = policy.text(run.policy, tablefmt)
        if q == "islands" and run.islands:
            body = islands.text(run.islands, tablefmt)
        if q == "instructions" and run.instructions:
            body = f"```\n{run.instructions}\n```" if md else run.instructions
        if body:
            plot = f"![{q}]({run.plots[q].name})\n\n" if md and q in run.plots else ""
            out.append((TITLES[q], plot + body))
    if run.notes:
        out.append(("Notes", report.bullets(run.notes, tablefmt)))
    if run.errors:
        out.append(("Errors", report.bullets(run.errors, tablefmt)))
    for kind, results in (("CPU", run.cpu_t), ("GPU", run.gpu_t)):
        if results:
            met = sum(1 for t in results if t.passed)
            intro = report.paragraph(tg.TARGETS_INTRO, tablefmt)
            body = intro + "\n\n" + tg.targets_table(results, tablefmt)
            title = f"Our {kind} performance targets (development goals, not tests)"
            out.append((f"{title}: {met} of {len(results)} met", body))
    if md and not run.gpu:
        out.append(("", f"GPU targets: see {gpu_targets_link(run.out)}.\n"))
    if md:
        methods = "\n".join(f"- **{m.name}**: {m.description}" for m in METHODS.values())
        out.append(("Methods", methods))
        for q in ORDER:
            recs = [r for r in run.records if r.question == q]
            if recs:
                out.append((f"All records: {q}", report.details(recs, tablefmt)))
    return out


def gpu_targets_link(out: Path) -> str:
    """benchmarks/results/gpu-targets.md as a link from results.md in ``out``: relative inside
    the checkout, else the file's path in the repository."""
    try:
        out.resolve().relative_to(REPO)
    except ValueError:
        return "benchmarks/results/gpu-targets.md in the ampfused repository"
    link = os.path.relpath(RESULTS / "gpu-targets.md", out.resolve())
    return f"[{link}]({link})"


def write_results(run: Run) -> None:
    """Plots (unless --no-plots), results.jsonl and results.md in the run's output folder and,
    for a GPU run written inside benchmarks/results (--out), gpu-targets.md."""
    if not run.args.no_plots:
        title = f"ampfused benchmarks, {run.hdr['device_name']}, torch {run.hdr['torch']}, "
        title += run.hdr["git_commit"]
        try:
            run.plots = report.plots(run.records, run.out, title)
            if run.policy:
                run.plots["policy"] = policy.plot(run.policy, run.out, title)
            if run.islands:
                run.plots["islands"] = islands.plot(run.islands, run.out, title)
        except Exception as e:  # noqa: BLE001 - a plot that fails is an error, not the end
            run.errors.append(f"plots: {type(e).__name__}: {e}")
    targets = {
        k: [t.__dict__ for t in v] if v else None
        for k, v in (("cpu", run.cpu_t), ("gpu", run.gpu_t))
    }
    head = {
        "header": run.hdr,
        "command": run.command,
        "quick": run.args.quick,
        "elapsed_s": round(run.elapsed, 1),
        "durations_s": run.durations,
        "cpu_used_by_others": {"run": run.total_share, **run.others},
        "errors": run.errors,
        "targets": targets,
    }
    compare.write(run.out, head, run.records, run.e2e, run.policy, run.islands)
    md = "\n".join(f"## {t}\n\n{b}\n" if t else b for t, b in sections(run, "github"))
    (run.out / "results.md").write_text(md)
    write_gpu_targets(run)
    names = ["results.jsonl", "results.md", *(p.name for p in run.plots.values())]
    written = ", ".join(names[:-1]) + " and " + names[-1]
    print(f"wrote {written} to {shown(run.out)} ({run.elapsed:.0f} s)")


def write_gpu_targets(run: Run) -> None:
    """benchmarks/results/gpu-targets.md, from a GPU run whose output folder is inside
    benchmarks/results (results meant to be committed); a --quick run replaces only the
    placeholder that says "Not yet measured".  A CPU run, or one written elsewhere, leaves it."""
    if not run.gpu or run.gpu_t is None:
        return
    try:
        slug = run.out.resolve().relative_to(RESULTS.resolve()).as_posix()
    except ValueError:
        return
    path = RESULTS / "gpu-targets.md"
    measured = path.exists() and "Not yet measured" not in path.read_text()
    if run.args.quick and measured:
        return
    path.write_text(tg.gpu_targets_md(run.gpu_t, run.hdr, slug, run.command))


if __name__ == "__main__":
    sys.exit(main())
