"""The islands question (issue 36 §4): does every layer's activation gradient stay inside
float16's normal range, and at what cost in skipped steps, loss and step time?

A single loss scale serves the whole model; a layer whose gradients are 2^10 smaller than the
rest's then holds them as float16 subnormals (fewer than 11 significant bits) or zeros.  The
headroom policy with islands (a loss scale per island of layers) is meant to fix that.  This
question measures it beside the policies that exist, on real float16 training on the CPU, with
the machinery of the policy question (benchmarks/policy.py: its tasks, training loop, float32
twin, skipped-step split, planted spikes and run-to-run noise):

- ``bert-tiny``: a transformers BertForMaskedLM (2 layers, 64 wide, 4 heads, eager attention)
  trained as a byte-level masked language model (vocabulary: the 256 bytes and a mask token) on
  the standard library's *.py files: batches of 4 windows of 32 bytes, 15% of the positions
  (drawn with the batch) replaced by the mask token, the model's own loss (the mean over the
  masked positions).
- ``llama-tiny``: a transformers LlamaForCausalLM (2 layers, 64 wide, 4 heads) trained as the
  policy question's gpt2-tiny is: byte-level next-byte prediction, the loss summed over tokens
  and the gradients divided by their count after ``unscale_``.

Both with planted spikes (one batch's loss times policy.SPIKE every ``spike_every`` steps).
Policies (:data:`POLICIES`): torch's default (``torch.amp.GradScaler("cpu")``, no tracing: the
untraced step), ampfused's global headroom policy with traced activations (``policy="headroom"``
and ``scaler.watch(model, activations=True)``: the traced step), and the headroom policy with
scale islands (``islands="auto"``, traced too: :mod:`ampfused.scale_islands`; the islands are
chosen after the first step, which runs without them).
A float32 run (no autocast, no scaler) is the loss's reference, and torch's default trains
again on other batches (:attr:`policy.Form.noise_seeds`) for the run-to-run noise.

Per run, beside the policy question's figures (skipped steps split into the first steps, the
planted spikes and later; the scale each step ran with, its median as log2; the final loss):

- **activation gradients**: every ``sample_every``-th step (spikes left out), the gradients at
  the outputs of every Linear layer, captured in the float16 backward as the scaler made them
  and in a float32 recompute of the same step (same weights and batch, the loss times the
  scale in force; policy.float32_grads).  Of the elements nonzero in float32, the share
  **subnormal** (zero or subnormal in float16: |x| < 2^-14, held with fewer than 11 significant
  bits or not at all) and the share **zero** (flushed to zero): the whole model's at step 0,
  and over the sampled steps after it the whole model's and the worst module's (named).  Step 0
  runs before anything is measured (the headroom policies at their starting scale of 1.0,
  islands not yet chosen): averaged in, that one step would weigh as ``sample_every`` steps
  (the figures over every sampled step are in the records too, ``activations``).  The float16
  side is read as the backward made it, at whatever scale each island ran; float32 only says
  which elements are not zero, so the measure holds for a scale per island as for one scale.
- **step time**: the policies' steps timed interleaved (each round runs one step of every
  available policy on the same batch, in a shuffled order, on models of their own, after a
  warm-up), the median per policy, over torch's default's (the untraced step) and over the
  global headroom's (the traced one).  The training runs' own times are in the records too
  (``ms_per_step``) but they ran one after the other, under whatever load came and went.

Targets (issue 36 §4: the islands policy's, judged for every policy): subnormal activation
gradients at most 0.05% of nonzero in every module where the global scale leaves more than 5%
(after step 0);
no skipped step outside the planted spikes; a final loss at least as close to float32's as the
global scale's ("too short to tell" where the two distances differ by less than the run-to-run
noise; not judged without noise runs, as in --quick); a step at most 1.25x the untraced step and
1.1x the traced one.
"""

from __future__ import annotations

import random
import re
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import policy
from benchmarks.policy import FLOAT32, TINY, Form, Policy, Task, Trace
from benchmarks.report import grid
from benchmarks.suite import Context

QUESTION = "islands"
TORCH, GLOBAL, ISLANDS = policy.TORCH, "global headroom", "headroom with islands"
# The islands policy's constructor keywords.
ISLANDS_KWARGS = (("policy", "headroom"), ("islands", "auto"))
POLICIES = (
    Policy(TORCH, "torch", about="torch's class and rule, no tracing: the untraced step"),
    Policy(GLOBAL, "ampfused", (("policy", "headroom"),), trace=True,
           about="one scale from parameter and traced activation gradients: the traced step"),
    Policy(ISLANDS, "ampfused", ISLANDS_KWARGS, trace=True,
           about="a scale per island of layers, from the traced activation gradients"),
)  # fmt: skip
UNTRACED, TRACED = TORCH, GLOBAL  # the steps each policy's step time is compared with

SUBNORMAL_MAX = 5e-4  # the target: at most 0.05% of nonzero activation gradients subnormal ...
GLOBAL_LEAVES = 0.05  # ... in every module where the global scale leaves more than 5%
# A module's own scale (the per-module ideal): its largest float32 gradient of the step
# at float16's largest over 4 (the headroom rule's fixed factor).  What is still below 2^-14
# there spans more binades than float16 holds: no loss scale of the module's holds it.
OWN_EDGE = 65504.0 / 4
STEP_VS_UNTRACED, STEP_VS_TRACED = 1.25, 1.1  # the step time's targets

FULL = Form({"bert-tiny": 1000, "llama-tiny": 1000}, spike_every=300, noise_seeds=(2, 3))
QUICK = Form({"bert-tiny": 100, "llama-tiny": 100}, spike_every=60, sample_every=20, first=20,
             last=20)  # fmt: skip
# step timing: (warm-up steps, rounds) per form; the warm-up covers torch's first overflows
TIMING = {False: (12, 60), True: (12, 15)}


# --------------------------------------------------------------------------- tasks
MASK_ID, MASK_SHARE = 256, 0.15  # the mask token (after the 256 bytes), the share masked


def _bert() -> nn.Module:
    return policy.transformers_model(
        "BertForMaskedLM", "BertConfig",
        vocab_size=MASK_ID + 1, hidden_size=policy.LM_WIDTH, num_hidden_layers=policy.LM_LAYERS,
        num_attention_heads=policy.LM_HEADS, intermediate_size=4 * policy.LM_WIDTH,
        max_position_embeddings=policy.LM_BLOCK, type_vocab_size=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def _llama() -> nn.Module:
    return policy.transformers_model(
        "LlamaForCausalLM", "LlamaConfig",
        vocab_size=256, hidden_size=policy.LM_WIDTH, intermediate_size=176,
        num_hidden_layers=policy.LM_LAYERS, num_attention_heads=policy.LM_HEADS,
        num_key_value_heads=policy.LM_HEADS, max_position_embeddings=policy.LM_BLOCK,
    )  # fmt: skip


def _mlm_draw(data: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's window offsets and the positions masked (at least one per window)."""
    offsets = policy._lm_draw(data, g)
    masked = torch.rand(len(offsets), policy.LM_BLOCK, generator=g) < MASK_SHARE
    masked[:, 0] |= ~masked.any(dim=1)
    return offsets, masked


def _mlm_batch(data: torch.Tensor, drawn: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids with the masked positions' bytes replaced by MASK_ID, labels: the bytes
    there, -100 elsewhere)."""
    offsets, masked = drawn
    x = torch.stack([data[o : o + policy.LM_BLOCK] for o in offsets.tolist()])
    return x.masked_fill(masked, MASK_ID), torch.where(masked, x, -100)


def _mlm_loss(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    x, labels = batch
    loss = model(input_ids=x, labels=labels).loss  # its own: the mean over masked positions
    return loss, loss.detach().float()


SIZE = (
    f"({policy.LM_LAYERS} layers, width {policy.LM_WIDTH}, {policy.LM_HEADS} heads, eager "
    "attention)"
)
LM_ABOUT = (
    f"on the standard library's *.py files, batch {policy.LM_BATCH} x {policy.LM_BLOCK} bytes"
)
SPIKES = f"planted spikes (loss x {policy.SPIKE:g})"
TASKS = (
    Task(
        "bert-tiny",
        f"transformers BertForMaskedLM {SIZE}, a byte-level masked language model {LM_ABOUT}, "
        f"{MASK_SHARE:.0%} of positions masked, its own mean loss, AdamW lr 1e-3, {SPIKES}",
        1e-3, True, _bert, policy.stdlib_bytes, _mlm_draw, _mlm_batch, _mlm_loss,
        requires="transformers",
    ),
    Task(
        "llama-tiny",
        f"transformers LlamaForCausalLM {SIZE}, a byte-level language model {LM_ABOUT}, loss "
        "summed over tokens and gradients divided by their count after unscale_, AdamW lr "
        f"2e-3, {SPIKES}",
        2e-3, True, _llama, policy.stdlib_bytes, policy._lm_draw, policy._lm_batch,
        policy._lm_loss, divisor=policy.LM_BATCH * policy.LM_BLOCK, requires="transformers",
    ),
)  # fmt: skip


# --------------------------------------------------------------------------- measures
def module_counts(half: dict[str, list], full: dict[str, list]) -> dict[str, list[int]]:
    """Per module that both captured: [elements, nonzero in float32, of those zero or subnormal
    in float16 (|x| < 2^-14), of those zero in float16, of those below 2^-14 at the module's
    own scale (float32's, times OWN_EDGE over its largest magnitude in any of the module's
    calls of the step)].  inf and NaN in float16 count as neither (an overflowed step's)."""
    out = {}
    for name, hs in half.items():
        counts = [0, 0, 0, 0, 0]
        fs = full.get(name, [])[: len(hs)]
        largest = max((float(f.abs().max()) for f in fs if f.numel()), default=0.0)
        own = OWN_EDGE / largest if largest > 0 else 1.0
        for h, f in zip(hs, fs, strict=False):
            nonzero, mag = f != 0, h.float().abs()
            counts[0] += h.numel()
            counts[1] += int(nonzero.sum())
            counts[2] += int((nonzero & (mag < TINY)).sum())
            counts[3] += int((nonzero & (mag == 0)).sum())
            counts[4] += int((nonzero & (f.abs() * own < TINY)).sum())
        out[name] = counts
    return out


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _worst(modules: dict[str, list[int]], k: int) -> dict[str, Any]:
    """The module with the largest share of count ``k`` (2: subnormal, 3: zero, 4: subnormal at
    its own scale) in its nonzero elements; the first in forward order on a tie."""
    shares = {n: c[k] / c[1] for n, c in modules.items() if c[1]}
    if not shares:
        return {"module": None, "share": None}
    name = max(shares, key=shares.__getitem__)
    return {"module": name, "share": shares[name]}


def _figures(measured: list[tuple[int, Any]]) -> dict[str, Any]:
    """The shares over these sampled steps: the whole model's subnormal and zero shares, the
    worst modules, per-module counts, each step's whole-model shares."""
    modules: dict[str, list[int]] = {}
    series = []
    for step, counts in measured:
        total = [0] * 5
        for name, c in counts.items():
            acc = modules.setdefault(name, [0] * 5)
            for k in range(5):
                acc[k] += c[k]
                total[k] += c[k]
        series.append([step, _share(total[2], total[1]), _share(total[3], total[1])])
    whole = [sum(c[k] for c in modules.values()) for k in range(5)]
    return {
        "subnormal": _share(whole[2], whole[1]),
        "zero": _share(whole[3], whole[1]),
        "own_scale": _share(whole[4], whole[1]),
        "worst_subnormal": _worst(modules, 2),
        "worst_zero": _worst(modules, 3),
        "worst_own_scale": _worst(modules, 4),
        "elements": whole[0],
        "nonzero": whole[1],
        "modules": modules,  # name: [elements, nonzero, subnormal, zero, at its own scale]
        "series": series,  # [step, subnormal share, zero share]
    }


def activation_figures(trace: Trace) -> dict[str, Any]:
    """The run's activation-gradient figures from its sampled steps' module counts: over every
    sampled step (``activations``), and over those after the first (``after_start``: step 0
    runs before anything is measured, at the headroom policy's starting scale of 1.0 and before
    islands are chosen; averaged in, that one step would weigh as sample_every steps)."""
    return {
        "activations": _figures(trace.measured),
        "after_start": _figures(trace.measured[1:]),
    }


def module_shares(run: dict[str, Any]) -> dict[str, float]:
    """The run's subnormal share per module after the start (modules with a nonzero
    element)."""
    modules = run["after_start"]["modules"]
    return {n: c[2] / c[1] for n, c in modules.items() if c[1]}


# --------------------------------------------------------------------------- step time
def step_times(
    task: Task, policies: Sequence[Policy], available: dict[str, str | None], form: tuple
) -> dict[str, dict[str, float]]:
    """Each available policy's training step timed interleaved: models, optimizers and scalers
    of their own, the same batch in every round, the policies in a shuffled order (seeded);
    ``form`` = (warm-up steps, timed rounds).  Per policy: the median, quartiles and count of
    the timed steps' wall times, in ms."""
    warmup, rounds = form
    data = task.data()
    drawn = policy.batch_indices(task, data, warmup + rounds, policy.DATA_SEED, 0)
    runs = []
    for p in policies:
        if available.get(p.name):
            continue
        model = task.model()
        params = [x for x in model.parameters() if x.requires_grad]
        scaler = p.make()
        if p.trace:
            scaler.watch(model, activations=True)
        runs.append((p, model, params, torch.optim.AdamW(params, lr=task.lr), scaler))
    times: dict[str, list[float]] = {p.name: [] for p, *_ in runs}
    order = random.Random(0)
    try:
        for i in range(warmup + rounds):
            batch = task.batch(data, drawn[i])
            for p, model, params, opt, scaler in order.sample(runs, len(runs)):
                t0 = time.perf_counter()
                policy.forward_backward(task, scaler, model, batch)
                policy.optimizer_step(task, scaler, params, opt)
                if i >= warmup:
                    times[p.name].append(1e3 * (time.perf_counter() - t0))
    finally:
        for p, *_, scaler in runs:
            if p.trace:
                scaler.unwatch()
    out = {}
    for name, t in times.items():
        q1, _, q3 = statistics.quantiles(t, n=4) if len(t) > 1 else (t[0], t[0], t[0])
        out[name] = {"median_ms": statistics.median(t), "q1_ms": q1, "q3_ms": q3, "steps": len(t)}
    return out


# --------------------------------------------------------------------------- targets
def verdict(
    run: dict[str, Any], main: dict[str, dict[str, Any]], noise: float | None
) -> dict[str, Any]:
    """The islands policy's targets for one run (``main``: the task's runs by policy, the main
    batch order).  Each part True, False or None (not judged), with the reason in the text."""
    ok = {n: r for n, r in main.items() if r.get("status") == "ok"}
    glob, f32 = ok.get(GLOBAL), ok.get(FLOAT32.name)
    parts: dict[str, bool | None] = {}
    failed, unjudged = [], []
    # subnormal: the modules the global scale leaves above 5%, each at most 0.05% here
    over = {n for n, s in module_shares(glob).items() if s > GLOBAL_LEAVES} if glob else set()
    mine = module_shares(run)
    bad = sorted(n for n in over if mine.get(n, 0.0) > SUBNORMAL_MAX)
    parts["subnormal"] = None if not over else not bad
    if bad:
        failed.append(f"subnormal above 0.05% in {len(bad)} of {len(over)} modules")
    elif not over:
        unjudged.append("subnormal: no module above 5% under the global scale")
    s = run["skipped"]
    parts["no skip outside spikes"] = s["first"] == 0 and s["later"] == 0
    if not parts["no skip outside spikes"]:
        n = s["first"] + s["later"]
        failed.append(f"{n} skip{'s' * (n > 1)} outside spikes")
    # the final loss: as close to float32's as the global scale's, beyond the noise
    parts["loss"] = None
    if glob and f32 and noise is not None:
        mine_d = abs(run["final_loss"] - f32["final_loss"])
        glob_d = abs(glob["final_loss"] - f32["final_loss"])
        if run is glob or mine_d <= glob_d:
            parts["loss"] = True
        elif mine_d - glob_d > noise:
            parts["loss"] = False
            failed.append("loss further from float32's than the global scale's")
        else:
            unjudged.append("loss: too short to tell")
    else:
        unjudged.append("loss not judged")
    # the step time over the untraced and the traced step
    ratios = (run.get("step_vs_untraced"), run.get("step_vs_traced"))
    if None in ratios:
        parts["step time"] = None
        unjudged.append("step time not judged")
    else:
        parts["step time"] = ratios[0] <= STEP_VS_UNTRACED and ratios[1] <= STEP_VS_TRACED
        if not parts["step time"]:
            failed.append(f"step {ratios[0]:.2f}x untraced, {ratios[1]:.2f}x traced")
    if failed:
        met, text = False, "not met: " + ", ".join(failed)
    else:
        met = None if unjudged else True
        text = "met" + (f" ({'; '.join(unjudged)})" if unjudged else "")
    return {"met": met, "text": text, "parts": parts}


# --------------------------------------------------------------------------- the question
def n_runs(
    quick: bool,
    tasks: Sequence[Task] = TASKS,
    policies: Sequence = POLICIES,
    form: Form | None = None,
) -> int:
    """The progress bar's ticks: per task, every policy, float32, the noise runs and the
    step timing."""
    form = form or (QUICK if quick else FULL)
    return len(tasks) * (len(policies) + 2 + len(form.noise_seeds))


def run(
    ctx: Context,
    form: Form | None = None,
    tasks: Sequence[Task] = TASKS,
    policies: Sequence[Policy] = POLICIES,
    timing: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Every task under every available policy, float32, the noise runs and the step timing:
    the question's results (results.jsonl's ``{"islands": ...}`` line).  ``policies[0]`` must
    be torch's default (the noise runs')."""
    form = form or (QUICK if ctx.quick else FULL)
    timing = timing or TIMING[ctx.quick]
    available = policy.availability(policies)
    result = policy.head(ctx, form, policies, available)
    result["form"]["timing"] = {"warmup": timing[0], "rounds": timing[1]}
    with policy.one_thread():
        for task in tasks:
            if policy.skip(ctx, QUESTION, task, n_runs(ctx.quick, [task], policies, form)):
                continue
            entry = policy.run_task(
                ctx, task, form, policies, available, result["runs"],
                measure=module_counts, extra=activation_figures, question=QUESTION,
            )  # fmt: skip
            for key in ("ampfused_equals_torch", "traced_equals_untraced"):
                entry.pop(key)  # (the policy question's pairs: not run here)
            ctx.describe(f"{QUESTION} {task.name} step time")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    entry["step_ms"] = step_times(task, policies, available, timing)
            except Exception as e:  # noqa: BLE001 - the training figures stand without it
                entry["step_ms"] = {}
                entry["step_error"] = f"{type(e).__name__}: {e}".split("\n")[0][:200]
            ctx.tick()
            judge(result, task.name, entry)
            result["tasks"][task.name] = entry
    return result


def judge(result: dict[str, Any], task: str, entry: dict[str, Any]) -> None:
    """The task's step-time ratios and targets, in its main runs' records (replacing the
    policy question's targets)."""
    main = {r["policy"]: r for r in policy._main_runs(result, task)}
    times = {n: t["median_ms"] for n, t in entry["step_ms"].items()}
    for r in main.values():
        if r["status"] != "ok" or "skipped" not in r:
            continue
        mine = times.get(r["policy"])
        for key, base in (("step_vs_untraced", UNTRACED), ("step_vs_traced", TRACED)):
            r[key] = mine / times[base] if mine and times.get(base) else None
        r["target"] = verdict(r, main, entry["noise"]["spread"])


def errors(result: dict[str, Any] | None) -> list[str]:
    """The runs and step timings that failed, as the suite's error lines."""
    out = policy.errors(result, QUESTION)
    for name, t in (result or {}).get("tasks", {}).items():
        if "step_error" in t:
            out.append(f"{QUESTION}:{name} step time: {t['step_error']}")
    return out


# --------------------------------------------------------------------------- output
def _ms(t: dict[str, float] | None) -> str:
    return f"{t['median_ms']:.1f}" if t else "-"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def short(module: str) -> str:
    """A module's name from its layer index on (``bert.encoder.layer.0.attention.self.query``:
    ``layer.0.attention.self.query``); a name without one as it is."""
    return re.sub(r"^.*?\.(?=layers?\.\d)", "", module)


def _worst_cell(whole: float | None, worst: dict[str, Any]) -> str:
    if worst["module"] is None:
        return policy._pct(whole)
    return f"{policy._pct(whole)} / {policy._pct(worst['share'])} ({short(worst['module'])})"


def table(result: dict[str, Any], task: str, tablefmt: str) -> str:
    """One task's main runs, one row per policy, float32 last."""
    first = result["form"]["first"]
    entry = result["tasks"][task]
    headers = [
        "policy",
        f"skipped steps: first {first} / later / at spikes",
        "log2 scale: median",
        "step 0: subnormal",
        "after step 0: subnormal, whole model / worst module",
        "after step 0: zero, whole model / worst module",
        "after step 0: subnormal at each module's own scale, whole model / worst module",
        "final loss (minus float32's)",
        "step ms (/ untraced, / traced)",
    ]
    rows = []
    for r in policy._main_runs(result, task):
        row = [r["policy"]]
        if r["status"] != "ok":
            status = "not available" if r["status"] == "n/a" else "error"
            rows.append(row + [status] + ["-"] * (len(headers) - 2))
            continue
        diff = r.get("loss_minus_float32")
        loss = f"{r['final_loss']:.4f} ({policy._signed(diff)})"
        if "skipped" not in r:  # float32
            rows.append(row + ["-"] * 6 + [loss, "-"])
            continue
        s, a = r["skipped"], r["after_start"]
        start = r["activations"]["series"][:1]
        spikes = str(s["spikes"]) if entry["spikes"] else "-"
        step = entry["step_ms"].get(r["policy"])
        ratios = f"{_x(r.get('step_vs_untraced'))}, {_x(r.get('step_vs_traced'))}"
        rows.append(
            row
            + [
                f"{s['first']} / {s['later']} / {spikes}",
                policy._log2_cell(r["log2_scale_median"]),
                policy._pct(start[0][1]) if start and start[0][0] == 0 else "-",
                _worst_cell(a["subnormal"], a["worst_subnormal"]),
                _worst_cell(a["zero"], a["worst_zero"]),
                _worst_cell(a["own_scale"], a["worst_own_scale"]),
                loss,
                f"{_ms(step)} ({ratios})",
            ]
        )
    return grid(rows, headers, tablefmt)


def intro(result: dict[str, Any]) -> str:
    f = result["form"]
    return (
        "Training on the CPU in float16 autocast (float32 parameters, AdamW, fixed seeds: the "
        "same weights and batches for every policy), as the policy question does; planted "
        f"spikes: one batch's loss times {f['spike_factor']:g} (a spike owns the skips of its "
        f"step and the {f['spike_window'] - 1} after it). Activation gradients: at the outputs "
        f"of the Linear layers, every {f['sample_every']}th step, captured in the float16 "
        "backward and in a float32 recompute of the same step (same weights, batch and scale); "
        "subnormal: zero or subnormal in float16 (below 2^-14) where float32 is not zero, as a "
        "share of the elements float32 holds nonzero, at step 0 and over the sampled steps "
        "after it (step 0 runs before anything is measured: the headroom policies' at their "
        "starting scale of 1.0, before islands are chosen); zero: of those, zero in float16; "
        "worst module: the largest share (named from its layer index on); at each module's "
        "own scale: below 2^-14 were the module's gradients scaled on their own, their largest "
        "(float32's, of the step) at 65,504 / 4 (issue 36's per-module ideal): what spans more "
        "binades than float16 holds, which no loss scale of the module's can hold. "
        "Step ms: the median step, each "
        f"policy's steps timed interleaved with the others' ({f['timing']['rounds']} rounds "
        f"after {f['timing']['warmup']} warm-up steps), over torch default's (the untraced "
        "step) and the global headroom's (traced). Final loss: mean of the last "
        f"{f['last']} steps. Targets (the islands policy's, judged for every policy): "
        "subnormal at most 0.05% in every module where the global headroom leaves more than 5% "
        "(after step 0); "
        "no skipped step outside the planted spikes; a final loss at least as close to "
        "float32's as the global headroom's (too short to tell where the two differ by less "
        "than the run-to-run noise); a step at most 1.25x the untraced one and 1.1x the traced "
        "one."
    )


def finding(result: dict[str, Any], name: str) -> str:
    """One task in words: the model, what torch's default leaves subnormal, where the global
    headroom's scale sits, the noise."""
    t = result["tasks"][name]
    runs = {r["policy"]: r for r in policy._main_runs(result, name) if r["status"] == "ok"}
    spikes = f", planted spikes at steps {', '.join(map(str, t['spikes']))}" if t["spikes"] else ""
    line = f"{name}: {t['about']}; {t['parameters']:,} parameters, {t['steps']} steps{spikes}. "
    for pname in (TORCH, GLOBAL):
        r = runs.get(pname)
        if r is None or "activations" not in r:
            continue
        a, worst = r["after_start"], r["after_start"]["worst_subnormal"]
        line += (
            f"{pname}: median scale 2^{policy._log2_cell(r['log2_scale_median'])}, "
            f"{policy._pct(a['subnormal'])} of nonzero activation gradients subnormal after "
            "step 0"
        )
        if worst["module"] is not None:
            line += f" (worst {short(worst['module'])}, {policy._pct(worst['share'])})"
        line += ". "
    return line + policy.noise_text(t["noise"])


def text(result: dict[str, Any], tablefmt: str) -> str:
    """The question's section: what it measures, a table per model with its findings, the
    targets per policy."""
    return policy.section(result, tablefmt, intro(result), finding, table)


def plot(result: dict[str, Any], out: Path, title: str) -> Path:
    """islands.png: the whole model's subnormal share of activation gradients at each sampled
    step, one panel per model, one line per policy; the target (0.05%), the 5% line and the
    planted spikes (not sampled) marked."""

    def draw(ax: Any, name: str) -> None:
        for r in policy._main_runs(result, name):
            series = r.get("activations", {}).get("series", [])
            points = [(s, 100 * x) for s, x, _ in series if x is not None]
            if points:
                ax.plot(*zip(*points, strict=True), "o-", ms=3, label=r["policy"])
        ax.axhline(100 * SUBNORMAL_MAX, color="green", lw=0.8, ls=":", label="target 0.05%")
        ax.axhline(100 * GLOBAL_LEAVES, color="grey", lw=0.8, ls=":", label="5%: judged above")
        for k, s in enumerate(result["tasks"][name]["spikes"]):
            ax.axvline(s, color="grey", lw=0.8, ls="--", label="planted spike" if k == 0 else None)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(0, 100)
        ax.set(title=name, xlabel="step", ylabel="subnormal activation gradients, % of nonzero")

    return policy.panels(result, out / "islands.png", title, draw)
