"""The single-process questions: their gradient sets, methods, timing and tables
(benchmarks/README.md); ``distributed``, ``e2e`` and ``instructions`` have modules of their own."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks import distributed, tracing
from benchmarks.env import busy_cores
from benchmarks.methods import METHODS, has_split_ops
from benchmarks.report import fmt_time, fmt_x, grid, host_device, joined, pivot, table
from benchmarks.suite import Context, Record, run_workload
from benchmarks.timing import TimingConfig
from benchmarks.workloads import DTYPE_NAMES, MODELS, Workload, gpt2_124m, uniform

# The targets' questions take more samples: their figures are ratios a few percent apart.
TARGET_TIMING = TimingConfig(3, 15, 61, min_time_s=0.5, max_wall_s=20.0)
QUICK_TARGET_TIMING = TimingConfig(2, 5, 11, min_time_s=0.1, max_wall_s=2.5, batch_s=0.02)
# Under load a torch step can take a second (busy): rounds end on wall time.  Batched, so that
# each step's parallel regions follow the restore's as a training step's follow backward's: a
# pool thread still spinning from the last region is the one the OS preempts (benchmarks/README).
BUSY_TIMING = TimingConfig(1, 7, 41, min_time_s=0.5, max_wall_s=10.0, mode="batched")
QUICK_BUSY_TIMING = TimingConfig(1, 5, 11, min_time_s=0.1, max_wall_s=3.0, mode="batched")


def _w(name: str, shapes: Sequence, dtype: str = "fp32", family: str = "target") -> Workload:
    return Workload(name, tuple(shapes), dtype, family=family)


GPT2 = _w("gpt2-124m", gpt2_124m())
X4_16M = _w("4 x 16M", uniform(4, 1 << 24))
X1000_1K = _w("1000 x 1K", uniform(1000, 1024), family="count")
GPT2_MIXED = _w("gpt2-124m", gpt2_124m(), "mixed", "model")


@dataclass(frozen=True)
class Question:
    """``plan``: (workload, method names or None for the context's) in run order; ``table``
    renders its records (None: the generic pivot)."""

    name: str
    title: str
    plan: Callable[[Context, argparse.Namespace], list[tuple[Workload, tuple[str, ...] | None]]]
    table: Callable[[list[Record], str], str] | None = None
    target_timing: bool = False  # the targets' sample counts (TARGET_TIMING)
    python_cost: bool = False  # count the Python bytecodes of one step
    notes: Callable[[Context, argparse.Namespace], list[str]] = lambda ctx, args: []
    # Run with a busy process per core (BUSY_TIMING, no op counts), then also(ctx)'s records.
    busy: bool = False
    also: Callable[[Context], list[Record]] | None = None

    def run(self, ctx: Context, plan: list[tuple[Workload, tuple[str, ...] | None]]) -> list:
        timing = None
        if self.target_timing:
            timing = QUICK_TARGET_TIMING if ctx.quick else TARGET_TIMING
        if self.busy:
            timing = QUICK_BUSY_TIMING if ctx.quick else BUSY_TIMING
        if timing is not None and (ctx.timing.mode != "auto" or not self.busy):
            timing = dataclasses.replace(timing, mode=ctx.timing.mode)
        if timing is not None:
            ctx = dataclasses.replace(ctx, timing=timing, profile=ctx.profile and not self.busy)
        if self.busy:
            ctx = dataclasses.replace(ctx, restore_on_one_thread=True)
        records: list[Record] = []
        with _busy(ctx, self.name) if self.busy else contextlib.nullcontext():
            for w, names in plan:
                methods = None
                if names is not None:
                    methods = [METHODS[n] for n in names if METHODS[n].present(ctx.device)]
                records += run_workload(ctx, self.name, w, methods, self.python_cost)
                ctx.tick()
            if self.also is not None and plan:
                records += self.also(dataclasses.replace(ctx, progress=None))  # (untracked)
        return records


# --------------------------------------------------------------------------- step_cost
STEP_COST_SETS = (
    _w("3000 x 16", uniform(3000, 16)),
    X1000_1K,
    GPT2,
    X4_16M,
    # the 16-bit rows: the headroom policy's measurement in the 16-bit loops
    *(_w("gpt2-124m", gpt2_124m(), d) for d in ("fp16", "bf16")),
)
STEP_COST_METHODS = ("ampfused", "ampfused-headroom", "torch", "floor-mul")


def _step_cost_plan(ctx: Context, args: argparse.Namespace) -> list:
    sets = [dataclasses.replace(w, family="target") for w in STEP_COST_SETS]
    sets += [dataclasses.replace(w, realloc=True) for w in sets]
    return [(w, STEP_COST_METHODS) for w in sets]


def _step_cost_table(records: list[Record], tablefmt: str = "simple") -> str:
    ratios = [
        ("torch / ampfused", "torch", "ampfused"),
        ("headroom / ampfused", "ampfused-headroom", "ampfused"),
        ("ampfused / floor", "ampfused", "floor-mul"),
        ("torch / floor", "torch", "floor-mul"),
    ]
    return table(records, STEP_COST_METHODS, ratios, host_device(records), tablefmt, iqr=True)


# --------------------------------------------------------------------------- diagnostics
DIAG_METHODS = ("ampfused", "ampfused-watch", "ampfused-norms", "torch", "torch-norms", "floor-mul")
# Also the order of the bytecode column.
DIAG_COUNT_METHODS = ("ampfused", "ampfused-watch", "ampfused-norms", "torch-norms")
DIAG_BOUND_SETS = (GPT2, X4_16M)  # the 1.15x target is stated on these (fp32)
# ... and on GPT-2's shapes in each 16-bit format (the watched pass against the plain one only)
DIAG_16BIT_SETS = tuple(_w("gpt2-124m", gpt2_124m(), d, "model") for d in ("bf16", "fp16"))
DIAG_16BIT_METHODS = ("ampfused", "ampfused-watch")
DIAG_COUNTS = (100, 1000, 3000)
DIAG_COUNT_NUMEL = 16
DIAG_RATIO_BOUND = 1.15


def diag_count_workload(n: int) -> Workload:
    return _w(f"{n} x {DIAG_COUNT_NUMEL}", uniform(n, DIAG_COUNT_NUMEL), family="count")


def _diagnostics_plan(ctx: Context, args: argparse.Namespace) -> list:
    out: list = [(w, DIAG_METHODS) for w in DIAG_BOUND_SETS]
    if not ctx.quick:
        out.append((GPT2_MIXED, DIAG_METHODS))
        out += [(w, DIAG_16BIT_METHODS) for w in DIAG_16BIT_SETS]
    return out + [(diag_count_workload(n), DIAG_COUNT_METHODS) for n in DIAG_COUNTS]


def _diagnostics_table(records: list[Record], tablefmt: str = "simple") -> str:
    ratios = [
        ("watch / ampfused", "ampfused-watch", "ampfused"),
        ("norms / ampfused", "ampfused-norms", "ampfused"),
        ("torch-norms / watch", "torch-norms", "ampfused-watch"),
        ("torch-norms / norms", "torch-norms", "ampfused-norms"),
    ]
    head = "Python bytecodes ampfused / watch / norms / torch-norms"
    extra = [joined(head, "py_bytecodes", DIAG_COUNT_METHODS)]
    return table(records, DIAG_METHODS, ratios, extra, tablefmt)


# --------------------------------------------------------------------------- clip, masters
CLIP_METHODS = ("ampfused-clip", "torch-clip", "ampfused", "floor-mul")
CLIP_SPEEDUP_BOUND = 1.5  # on GPT-2 124M fp32, the CPU target
MASTERS_METHODS = ("ampfused-masters", "torch-masters", "ampfused", "floor-masters")
MASTERS_SETS = tuple(
    dataclasses.replace(w, dtype="fp16") for w in (GPT2, X4_16M, X1000_1K)
)  # float16 models


def _fused_table(names: tuple[str, ...]) -> Callable[[list[Record], str], str]:
    """A fused method against torch's way, the plain step and the floor (names in that order)."""
    fused, theirs, plain, floor = names

    def render(records: list[Record], tablefmt: str = "simple") -> str:
        ratios = [
            (f"{theirs} / {fused}", theirs, fused),
            (f"{fused} / floor", fused, floor),
            (f"{fused} / {plain}", fused, plain),
        ]
        gbps = joined(f"GB/s {fused} / {theirs}", "gbps", (fused, theirs), lambda x: f"{x:.1f}")
        return table(records, names, ratios, [gbps], tablefmt)

    return render


# --------------------------------------------------------------------------- sweeps
# vit-b16 is left to --workloads: BERT-base stands for the 100M-parameter encoders (time budget).
DEFAULT_MODELS = ("gpt2-124m", "llama-1b", "llama-7b", "resnet50", "bert-base")
QUICK_MODELS = ("gpt2-124m", "resnet50")
# --quick, unless models or dtypes are chosen: fp32 of both, and mixed with an inf of ResNet-50.
QUICK_MODEL_CONFIGS = (("gpt2-124m", "fp32", False), ("resnet50", "fp32", False))
QUICK_MODEL_CONFIGS += (("resnet50", "mixed", True),)
# An injected inf only changes the flag and the scale update: fp32 and mixed only.
INF_DTYPES = ("fp32", "mixed")
# On CPU, sets above this run fp32 without inf only (Llama-1B fp32: a second a step).
CPU_HEAVY_BYTES = 1 << 30
COUNTS = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)
QUICK_COUNTS = (1, 10, 100, 1000)
COUNT_NUMELS = (16, 1024)
LOG2_SIZES = tuple(range(4, 29, 2))  # 16 ... 2^28 elements, 8 tensors each
CPU_MAX_LOG2, QUICK_MAX_LOG2 = 24, 20  # 8 x 2^24 fp32 = 512 MiB: tens of ms a step on 2 cores


def _model(name: str, dtype: str, inf: bool, realloc: bool = False) -> Workload:
    return Workload(name, tuple(MODELS[name].shapes()), dtype, inf, "model", realloc)


def _models(ctx: Context, args: argparse.Namespace) -> tuple[list[Workload], list[str]]:
    """The model configs to run and notes on those left out.  On a GPU each fp32 set without
    inf also runs realloc; on CPU that case is in step_cost."""
    gpu = ctx.device.type == "cuda"
    if ctx.quick and args.workloads is None and args.dtypes is None:
        out = [_model(*c) for c in QUICK_MODEL_CONFIGS]
        return out + ([_model(*QUICK_MODEL_CONFIGS[0], realloc=True)] if gpu else []), []
    models = args.workloads or list(QUICK_MODELS if ctx.quick else DEFAULT_MODELS)
    dtypes = args.dtypes or (["fp32", "mixed"] if ctx.quick else list(DTYPE_NAMES))
    notes, out = ["models: an injected inf runs on fp32 and mixed"], []
    for name, dtype, inf in itertools.product(models, dtypes, [False, True]):
        spec, w = MODELS[name], _model(name, dtype, inf)
        if spec.gpu_only and not gpu:
            notes.append(f"{spec.title}: GPU only (skipped on CPU)")
        elif inf and dtype not in INF_DTYPES:
            continue
        elif not gpu and w.grad_bytes > CPU_HEAVY_BYTES and (dtype != "fp32" or inf):
            notes.append(f"{spec.title}: on CPU only fp32 without inf (time budget)")
        else:
            out.append(w)
            if gpu and dtype == "fp32" and not inf:
                out.append(_model(name, dtype, inf, realloc=True))
    return out, list(dict.fromkeys(notes))


def _sizes(ctx: Context) -> list[int]:
    gpu = ctx.device.type == "cuda"
    cap = QUICK_MAX_LOG2 if ctx.quick else (LOG2_SIZES[-1] if gpu else CPU_MAX_LOG2)
    sizes = [s for s in LOG2_SIZES if s <= cap]
    return sorted(set(sizes[::2] + sizes[-1:])) if ctx.quick else sizes


def _counts_plan(ctx: Context, args: argparse.Namespace) -> list:
    counts = QUICK_COUNTS if ctx.quick else COUNTS
    dtypes = args.dtypes or ["fp32"]
    return [
        (Workload(f"{c} x {n}", tuple(uniform(c, n)), d, family="count"), None)
        for n, d, c in itertools.product(COUNT_NUMELS, dtypes, counts)
    ]


def _sizes_plan(ctx: Context, args: argparse.Namespace) -> list:
    return [
        (Workload(f"8 x 2^{s}", tuple(uniform(8, 1 << s)), d, family="size"), None)
        for d, s in itertools.product(args.dtypes or ["fp32"], _sizes(ctx))
    ]


def _sizes_notes(ctx: Context, args: argparse.Namespace) -> list[str]:
    cap = _sizes(ctx)[-1]
    return [] if cap == LOG2_SIZES[-1] else [f"sizes capped at 2^{cap} elements (time budget)"]


def _clip_plan(ctx: Context, args: argparse.Namespace) -> list:
    sets = (GPT2, X4_16M, X1000_1K) + (() if ctx.quick else (GPT2_MIXED,))
    return [(w, CLIP_METHODS) for w in sets]


# --------------------------------------------------------------------------- busy
# (what is compared, ampfused's method, torch's way): the passes whose CPU path splits work
# across threads, each against what a torch user runs instead.
BUSY_PAIRS = (
    ("unscale", "ampfused", "torch"),
    ("layer norms", "ampfused-norms", "torch-norms"),
    ("clip", "ampfused-clip", "torch-clip"),
    ("masters", "ampfused-masters", "torch-masters"),
    ("tracing", "traced", "item-hooks"),
)
X3000_16 = STEP_COST_SETS[0]


def _busy_plan(ctx: Context, args: argparse.Namespace) -> list:
    if ctx.device.type != "cpu":
        return []  # (a notes entry says so)
    plain = (X1000_1K, GPT2) if ctx.quick else (X3000_16, X1000_1K, GPT2, X4_16M)
    out: list = [(w, ("ampfused", "ampfused-forkjoin", "torch")) for w in plain]
    fused = ("ampfused-norms", "torch-norms", "ampfused-clip", "torch-clip")
    out += [(w, fused) for w in (X1000_1K, GPT2)]
    masters = ("ampfused-masters", "torch-masters")
    return out + [(dataclasses.replace(w, dtype="fp16"), masters) for w in (X1000_1K, GPT2)]


def _busy_tracing(ctx: Context) -> list[Record]:
    return tracing.run(ctx, "busy", tracing.MODELS[:1])


@contextlib.contextmanager
def _busy(ctx: Context, question: str):  # noqa: ANN202
    """A busy process per core for the block; a note says how many, the load they made and
    how ampfused's CPU passes ran meanwhile."""
    before = torch.ops.ampfused._cpu_split_stats() if has_split_ops() else None
    with busy_cores() as n:
        yield
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    note = f"{question}: {n} busy processes (one per core) ran beside every step"
    if load is not None:
        note += f"; 1-minute load average at the end {load:.1f}"
    if before is not None:
        after = torch.ops.ampfused._cpu_split_stats()
        split, kept = after[0] - before[0], after[1] - before[1]
        note += (
            f"; ampfused's CPU passes over 256 KB: {split} split across threads, {kept} kept on "
            "the calling thread (csrc/cpu/parallel.h)"
        )
    ctx.notes.append(note)


def busy_pairs(records: list[Record]) -> list[tuple[str, str, Record | None, Record | None]]:
    """(pass, gradient set, ampfused's record, torch's way's record) of every BUSY_PAIRS pair
    that ran on a set, in BUSY_PAIRS order."""
    out = []
    for what, ours, theirs in BUSY_PAIRS:
        by: dict[str, dict[str, Record]] = {}
        for r in records:
            if r.question == "busy" and r.method in (ours, theirs) and r.ok:
                by.setdefault(r.label, {})[r.method] = r
        out += [(what, label, got.get(ours), got.get(theirs)) for label, got in by.items()]
    return out


def _busy_table(records: list[Record], tablefmt: str = "simple") -> str:
    """One row per (compared pass, gradient set): ampfused's median step, torch's way's (the
    pairs of BUSY_PAIRS), the ratio, and for the plain step ampfused splitting every pass."""
    forks = {r.label: r for r in records if r.method == "ampfused-forkjoin" and r.ok}
    rows = []
    for what, label, a, t in busy_pairs(records):
        ratio = fmt_x(t.median_s / a.median_s) if a is not None and t is not None else "-"
        fork = forks.get(label) if what == BUSY_PAIRS[0][0] else None
        rows.append(
            [what, label, fmt_time(a.median_s if a else None),
             fmt_time(t.median_s if t else None), ratio,
             fmt_time(fork.median_s if fork else None)]
        )  # fmt: skip
    headers = ["pass", "gradients", "ampfused", "torch's way", "torch's way / ampfused"]
    headers.append("ampfused, every pass split (before)")
    return grid(rows, headers, tablefmt)


def _models_plan(ctx: Context, args: argparse.Namespace) -> list:
    return [(w, None) for w in _models(ctx, args)[0]]


QUESTIONS: dict[str, Question] = {q.name: q for q in (
    Question("step_cost", "Per-step scaler cost on the target gradient sets", _step_cost_plan,
             _step_cost_table, target_timing=True),
    Question("diagnostics", "Diagnostics: the pass with per-gradient statistics vs per-layer "
             "norms by hand", _diagnostics_plan, _diagnostics_table, True, python_cost=True),
    Question("clip", "Unscale + clip: scaler.clip_grad_norm_ vs torch's unscale_ + "
             "clip_grad_norm_", _clip_plan, _fused_table(CLIP_METHODS), target_timing=True),
    Question("masters", "float16 model, float32 masters: MasterWeights vs the recipe by hand",
             lambda ctx, args: [(w, MASTERS_METHODS) for w in MASTERS_SETS],
             _fused_table(MASTERS_METHODS), target_timing=True),
    Question("busy", "Under load: a busy process per core, as dataloader workers are",
             _busy_plan, _busy_table, busy=True, also=_busy_tracing,
             notes=lambda ctx, args: [] if ctx.device.type == "cpu" else ["busy: CPU only"]),
    Question("models", "Model gradient sets", _models_plan,
             notes=lambda ctx, args: _models(ctx, args)[1]),
    Question("counts", "Tensor-count sweep", _counts_plan),
    Question("sizes", "Tensor-size sweep (8 tensors per size)", _sizes_plan, notes=_sizes_notes),
)}  # fmt: skip


def render(q: str, records: list[Record], gpu: bool, tablefmt: str = "simple") -> str:
    question = QUESTIONS.get(q)
    if question is not None and question.table is not None:
        return question.table(records, tablefmt)
    if q == "distributed":
        return distributed.table(records, tablefmt)
    if q == "tracing":
        return tracing.table(records, tablefmt)
    return pivot(records, gpu, tablefmt)
