"""The policy question (issue 30 §2): which loss-scale policy trains a float16-autocast model
with the fewest skipped steps, the highest scale and the loss of torch's?

Real training on the CPU: float32 parameters, ``torch.autocast("cpu", dtype=torch.float16)``,
AdamW at a fixed learning rate, the same initial weights and the same batches (fixed seeds)
for every policy, on two tasks (:data:`TASKS`):

- ``gpt2-tiny``: a transformers GPT-2 (2 layers, 64 wide, 4 heads, eager attention) trained as
  a byte-level language model (vocabulary 256, no tokenizer) on the standard library's own
  source files (``sysconfig.get_paths()["stdlib"]``, its ``*.py`` files sorted by name),
  batches of 4 windows of 32 bytes at seeded random offsets.  The loss is summed over the
  batch's tokens and the gradients divided by their count after ``unscale_``, as
  fairseq/metaseq train (their ``multiply_grads``): the float16 gradients are then ~2^7 times
  a mean loss's, and 65,536 overflows at the start under torch's rule, as on real models.  (With
  a mean loss this tiny model never reaches float16's ceiling at 65,536 and the scale would not
  matter; that is why.)
- ``mlp-teacher``: an MLP (32 -> 128 -> 128 -> 8, GELU) regressing the outputs of a fixed random
  teacher network (32 -> 64 -> 8, tanh) on 65,536 fixed random inputs, targets not normalized
  (standard deviation 20), MSE loss, batches of 128; with **planted spikes**: every
  ``spike_every`` steps (from that step on, none in the last ``last`` steps) one batch's loss is
  multiplied by :data:`SPIKE` (10^3) before scaling; their indices are in the results.

Policies (:data:`POLICIES`), each a scaler class, its keyword arguments and whether activations
are traced (``scaler.watch(model, activations=True)``): torch's default
(``torch.amp.GradScaler("cpu")``, torch's own class), ampfused's default (torch's rule: it must
train bit for bit alike, every step's loss and scale), torch's class with
``growth_interval=256`` (metaseq's), ampfused's ``hysteresis=2`` (DeepSpeed's / Megatron's), and
ampfused's ``policy="headroom"`` untraced and traced (its margin learned) and with the margin
fixed at 4 (``headroom=4.0``).  A policy whose constructor refuses its
arguments (``policy="headroom"`` before it exists) is "not available" in the table.  One more
run per task trains in float32 (no autocast, no scaler; it skips the planted-spike steps, as
every scaler is expected to), the reference for the loss.

Per run:

- **skipped steps**: a step is skipped when its pass found inf/NaN (the optimizer step did not
  happen): ampfused's ``scaler.step_skipped()``, torch's ``_found_inf_per_device(optimizer)``,
  read after ``step()`` (a host sync, cheap on a CPU).  Split into the first ``first`` steps,
  at the planted spikes (the spike's step and the :data:`SPIKE_WINDOW` - 1 after it) and later
  (the rest).
- **scale**: the scale each step ran with (``get_scale()`` before ``scale()``), as log2: every
  step's (the plot), the median and the lowest.
- **activation gradients underflowed**: every ``sample_every``-th step (planted spikes left
  out), tensor hooks on the outputs of the model's leaf modules with a weight of two or more
  dimensions (Linear, transformers' Conv1D) capture their gradients in the autocast backward
  where the output is float16, scaled as the scaler makes them.  A float32 twin of the model
  (a second instance of the same architecture, loaded with the same weights, so that no hook of
  the scaler's tracing comes along and the training state is untouched) recomputes the same
  step on the same batch without autocast, its loss multiplied by the same scale (and spike
  factor), and the same outputs' gradients are captured.  An element **underflowed** when it is
  zero or subnormal in float16 (|x| < 2^-14) where the same element in float32 is a normal
  float16-representable magnitude or larger (|x| >= 2^-14): float16 lost a value it could have
  held.  The share of the sampled elements, over all sampled steps.  Also recorded:
  ``subnormal``, the share zero or subnormal in float16 where float32 is not zero (values that
  float16 holds with fewer than 11 significant bits or not at all: what a too-low scale costs).
- **final loss**: the mean training loss of the last ``last`` steps (the loss before any spike
  factor; the language model's per token), its difference from torch's default and from the
  float32 run's on the same task.
- **wall time**: the run's training steps (the underflow sampling's float32 recompute left out).

Run-to-run noise: torch's default trains again with the batches of all but the last ``last``
steps drawn from other seeds (:attr:`Form.noise_seeds`; the last ``last`` batches, those the
final loss averages, stay the same): the spread (largest minus smallest) of torch's final loss
over those runs and the main one is the noise.  ``--quick`` runs none (the loss target is then
not judged).

Targets (the headroom policy's, judged for every policy): no skipped step outside the planted
spikes, at most one per spike (within its window); a median scale at least torch's default's;
a final loss within run-to-run noise of torch's default's, judged one way: a loss above torch's
by more than the noise is not met, a lower one is (it trained better, usually because it
skipped fewer steps).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import math
import os
import statistics
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampfused
from benchmarks.report import bullets, grid, paragraph
from benchmarks.suite import Context

QUESTION = "policy"
SPIKE = 1e3  # a planted spike multiplies one batch's loss by this before scaling
SPIKE_WINDOW = 10  # skips at a spike's step and the 9 after it are the spike's
TINY = 2.0**-14  # float16's smallest normal magnitude
INIT_SEED = 0  # the weights
DATA_SEED = 1  # the batches of the main runs
TAIL_SEED = 10_000  # the batches of the last `last` steps, the same in every run


# --------------------------------------------------------------------------- forms
@dataclass(frozen=True)
class Form:
    """How long: steps per task, the spike period, the sampling period, the windows."""

    steps: dict[str, int]
    spike_every: int
    sample_every: int = 50
    first: int = 50  # "skipped in the first N steps"
    last: int = 50  # the final loss: mean over the last N steps
    noise_seeds: tuple[int, ...] = ()  # torch's default again on other batches: the noise

    def spikes(self, task: Task) -> list[int]:
        """The planted spikes' steps: every spike_every-th step, none in the last ``last``."""
        if not task.spiked:
            return []
        return list(range(self.spike_every, self.steps[task.name] - self.last, self.spike_every))


FULL = Form({"gpt2-tiny": 1000, "mlp-teacher": 2000}, spike_every=300, noise_seeds=(2, 3))
QUICK = Form({"gpt2-tiny": 100, "mlp-teacher": 400}, spike_every=150, sample_every=40)


# --------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class Policy:
    name: str
    scaler: str  # "torch" (torch.amp.GradScaler), "ampfused", or "float32" (no scaler)
    kwargs: tuple[tuple[str, Any], ...] = ()
    trace: bool = False  # scaler.watch(model, activations=True)
    about: str = ""

    def make(self) -> Any:
        """The scaler (None for float32); raises what its constructor raises."""
        if self.scaler == "float32":
            return None
        cls = torch.amp.GradScaler if self.scaler == "torch" else ampfused.GradScaler
        return cls("cpu", **dict(self.kwargs))

    def call(self) -> str:
        cls = "torch.amp.GradScaler" if self.scaler == "torch" else "ampfused.GradScaler"
        args = ", ".join(['"cpu"', *(f"{k}={v!r}" for k, v in self.kwargs)])
        watch = " + watch(model, activations=True)" if self.trace else ""
        return f"{cls}({args}){watch}"


TORCH = "torch default"
AMPFUSED = "ampfused default"
HEADROOM, HEADROOM_TRACED = "headroom", "headroom traced"
HEADROOM_FIXED = "headroom, fixed 4"
FLOAT32 = Policy("float32", "float32", about="no autocast, no scaler")
POLICIES = (
    Policy(TORCH, "torch", about="torch's class and rule"),
    Policy(AMPFUSED, "ampfused", about="torch's rule, fused: must train bit for bit alike"),
    Policy("growth interval 256", "torch", (("growth_interval", 256),), about="metaseq's"),
    Policy("hysteresis 2", "ampfused", (("hysteresis", 2),), about="DeepSpeed's / Megatron's"),
    Policy(HEADROOM, "ampfused", (("policy", "headroom"),),
           about="parameter gradients only, the margin learned"),
    Policy(HEADROOM_TRACED, "ampfused", (("policy", "headroom"),), trace=True,
           about="parameter and traced float16 activation gradients"),
    Policy(HEADROOM_FIXED, "ampfused", (("policy", "headroom"), ("headroom", 4.0)),
           about="the margin fixed at 4, the learned margin's most"),
)  # fmt: skip


def availability(policies: Sequence[Policy] = POLICIES) -> dict[str, str | None]:
    """Per policy: None where its scaler can be made, else why not (its constructor's error)."""
    out: dict[str, str | None] = {}
    for p in policies:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p.make()
            out[p.name] = None
        except (TypeError, ValueError) as e:
            out[p.name] = f"not available: {type(e).__name__}: {e}"[:160]
    return out


# --------------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class Task:
    """A model, its data and its loss.  ``loss`` returns (the loss to backward, the loss to
    report as a float tensor); ``divisor`` divides the gradients after ``unscale_``."""

    name: str
    about: str
    lr: float
    spiked: bool
    model: Callable[[], nn.Module]
    data: Callable[[], Any]
    draw: Callable[[Any, torch.Generator], Any]  # one batch's indices
    batch: Callable[[Any, Any], Any]  # (data, indices) -> batch
    loss: Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]
    divisor: float = 1.0
    requires: str | None = None  # a package the model needs: without it the task is skipped


# The language model
LM_BATCH, LM_BLOCK, LM_WIDTH, LM_LAYERS, LM_HEADS = 4, 32, 64, 2, 4


@functools.lru_cache(maxsize=1)
def stdlib_bytes() -> torch.Tensor:
    """The standard library's own *.py files (sorted by name), concatenated, as int64 bytes."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    blob = b"".join(Path(f).read_bytes() for f in files)
    if len(blob) < 1 << 16:
        raise RuntimeError(f"{root}: only {len(blob)} bytes of Python source found")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def transformers_model(model: str, config: str, **settings: Any) -> nn.Module:
    """transformers' ``model`` class built from its ``config`` class with ``settings``, eager
    attention, the weights drawn from INIT_SEED (the same in every run)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = getattr(transformers, config)(**settings)
    cfg._attn_implementation = "eager"
    torch.manual_seed(INIT_SEED)
    return getattr(transformers, model)(cfg)


def _gpt2() -> nn.Module:
    return transformers_model(
        "GPT2LMHeadModel", "GPT2Config",
        vocab_size=256, n_positions=LM_BLOCK, n_embd=LM_WIDTH, n_layer=LM_LAYERS,
        n_head=LM_HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def _lm_draw(data: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, len(data) - LM_BLOCK - 1, (LM_BATCH,), generator=g)


def _lm_batch(data: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch.stack([data[o : o + LM_BLOCK + 1] for o in offsets.tolist()])


def _lm_loss(model: nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=x).logits
    total = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
    return total, total.detach() / y.numel()


# The MLP and its teacher
MLP_IN, MLP_HIDDEN, MLP_OUT, MLP_BATCH, MLP_ITEMS, MLP_TARGET_STD = 32, 128, 8, 128, 1 << 16, 20.0


@functools.lru_cache(maxsize=1)
def teacher_data() -> tuple[torch.Tensor, torch.Tensor]:
    """65,536 random inputs and a fixed random teacher's outputs for them, scaled to a standard
    deviation of MLP_TARGET_STD (regression targets nobody normalized)."""
    g = torch.Generator().manual_seed(12345)
    w1 = torch.randn(64, MLP_IN, generator=g) * 1.5 / math.sqrt(MLP_IN)
    w2 = torch.randn(MLP_OUT, 64, generator=g) * 1.5 / math.sqrt(64)
    b1 = torch.randn(64, generator=g) * 0.1
    x = torch.randn(MLP_ITEMS, MLP_IN, generator=g)
    y = torch.tanh(x @ w1.T + b1) @ w2.T
    return x, y / y.std() * MLP_TARGET_STD


def _mlp() -> nn.Module:
    torch.manual_seed(INIT_SEED)
    return nn.Sequential(
        nn.Linear(MLP_IN, MLP_HIDDEN), nn.GELU(), nn.Linear(MLP_HIDDEN, MLP_HIDDEN), nn.GELU(),
        nn.Linear(MLP_HIDDEN, MLP_OUT),
    )  # fmt: skip


def _mlp_draw(data: tuple[torch.Tensor, torch.Tensor], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, len(data[0]), (MLP_BATCH,), generator=g)


def _mlp_batch(data: tuple[torch.Tensor, torch.Tensor], ix: torch.Tensor) -> tuple:
    return data[0][ix], data[1][ix]


def _mlp_loss(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    loss = F.mse_loss(model(x).float(), y)
    return loss, loss.detach()


TASKS = (
    Task(
        "gpt2-tiny",
        f"transformers GPT-2 ({LM_LAYERS} layers, width {LM_WIDTH}, {LM_HEADS} heads, eager "
        f"attention), byte-level language model on the standard library's *.py files, batch "
        f"{LM_BATCH} x {LM_BLOCK} bytes, loss summed over tokens and gradients divided by their "
        "count after unscale_ (fairseq/metaseq), AdamW lr 2e-3",
        2e-3, False, _gpt2, stdlib_bytes, _lm_draw, _lm_batch, _lm_loss,
        divisor=LM_BATCH * LM_BLOCK, requires="transformers",
    ),
    Task(
        "mlp-teacher",
        f"MLP {MLP_IN}-{MLP_HIDDEN}-{MLP_HIDDEN}-{MLP_OUT} (GELU) regressing a fixed random "
        f"teacher's outputs (standard deviation {MLP_TARGET_STD:g}, not normalized), MSE, batch "
        f"{MLP_BATCH}, AdamW lr 3e-3, planted spikes (loss x {SPIKE:g})",
        3e-3, True, _mlp, teacher_data, _mlp_draw, _mlp_batch, _mlp_loss,
    ),
)  # fmt: skip


def batch_indices(task: Task, data: Any, steps: int, seed: int, last: int) -> list:
    """Each step's batch indices: the first ``steps - last`` from ``seed``, the last ``last``
    from TAIL_SEED (the same in every run: the final loss averages the same batches)."""
    head = torch.Generator().manual_seed(seed)
    tail = torch.Generator().manual_seed(TAIL_SEED)
    return [task.draw(data, head if i < steps - last else tail) for i in range(steps)]


# --------------------------------------------------------------------------- underflow
def _targets(model: nn.Module) -> dict[str, nn.Module]:
    """Leaf modules with a weight of 2+ dimensions (Linear, Conv1D, Conv), by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if next(m.children(), None) is None
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() >= 2
        and not isinstance(m, nn.Embedding)
    }


class Capture:
    """Forward hooks that put a tensor hook on each target module's output (float16 outputs
    only with ``half_only``), keeping its gradient; ``close()`` removes the hooks."""

    def __init__(self, model: nn.Module, half_only: bool) -> None:
        self.grads: dict[str, list[torch.Tensor]] = {}
        self.half_only = half_only
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in _targets(model).items()]

    def _hook(self, name: str) -> Callable:
        def keep(grad: torch.Tensor) -> None:
            self.grads.setdefault(name, []).append(grad.detach().clone())

        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not (torch.is_tensor(out) and out.requires_grad):
                return
            if self.half_only and out.dtype != torch.float16:
                return
            out.register_hook(keep)

        return hook

    def close(self) -> dict[str, list[torch.Tensor]]:
        for h in self.handles:
            h.remove()
        return self.grads


def underflow_counts(half: dict[str, list], full: dict[str, list]) -> tuple[int, int, int]:
    """(underflowed, subnormal, elements) over the outputs both captured: underflowed = zero or
    subnormal in float16 (|x| < 2^-14) where float32 is a normal float16 magnitude or larger
    (|x| >= 2^-14); subnormal = zero or subnormal in float16 where float32 is not zero."""
    lost = sub = n = 0
    for name, hs in half.items():
        for h, f in zip(hs, full.get(name, []), strict=False):
            tiny = h.float().abs() < TINY  # (inf and NaN compare False: not counted)
            a = f.abs()
            lost += int((tiny & (a >= TINY)).sum())
            sub += int((tiny & (a > 0)).sum())
            n += h.numel()
    return lost, sub, n


def float32_grads(
    task: Task, twin: nn.Module, model: nn.Module, batch: Any, factor: float
) -> dict[str, list]:
    """The target outputs' gradients of the same step in float32, the loss times ``factor``."""
    twin.load_state_dict(model.state_dict())
    cap = Capture(twin, half_only=False)
    try:
        loss, _ = task.loss(twin, batch)
        (loss * factor).backward()
    finally:
        grads = cap.close()
    twin.zero_grad(set_to_none=True)
    return grads


# --------------------------------------------------------------------------- one run
def _skipped(scaler: Any, opt: torch.optim.Optimizer) -> bool:
    """Whether this iteration's step was skipped (after step(), before update())."""
    if isinstance(scaler, ampfused.GradScaler):
        return scaler.step_skipped()
    return any(bool(f.item()) for f in scaler._found_inf_per_device(opt).values())


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _divide(params: list[torch.Tensor], divisor: float) -> None:
    if divisor != 1:
        torch._foreach_div_(_grads(params), divisor)


def _largest(tensors: Any) -> float:
    """The largest magnitude over ``tensors`` (inf where one holds inf/NaN)."""
    out = 0.0
    for t in tensors:
        m = float(t.float().abs().max()) if t.numel() else 0.0
        out = max(out, m) if m == m else math.inf
    return out


def _log2(x: float) -> float:
    return math.log2(x) if x > 0 else float("-inf")


@dataclass
class Trace:
    """What one run measured, step by step."""

    losses: list[float] = field(default_factory=list)
    log2_scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    # step, underflowed, subnormal, elements, largest activation and parameter gradient (scaled)
    samples: list[tuple[int, int, int, int, float, float]] = field(default_factory=list)
    measured: list[tuple[int, Any]] = field(default_factory=list)  # step, train()'s measure
    # the headroom policy's measured magnitude of each step (scaled, at the step's scale; +inf:
    # it found inf/NaN; 0: nothing measured): scaler.magnitude() after its update
    magnitudes: list[float] = field(default_factory=list)
    wall_s: float = 0.0


def forward_backward(
    task: Task, scaler: Any, model: nn.Module, batch: Any, spike: bool = False
) -> torch.Tensor:
    """The step's forward in float16 autocast and its scaled backward (the loss times SPIKE at a
    planted spike); returns the loss to report."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss, shown = task.loss(model, batch)
    if spike:
        loss = loss * SPIKE
    scaler.scale(loss).backward()
    return shown


def optimizer_step(
    task: Task, scaler: Any, params: list[torch.Tensor], opt: torch.optim.Optimizer
) -> bool:
    """The rest of the step after the backward: unscale_ and the gradients divided (where the
    task divides them), the scaler's step and update, the gradients cleared; whether the step
    was skipped."""
    if task.divisor != 1:
        scaler.unscale_(opt)
        _divide(params, task.divisor)
    scaler.step(opt)
    skipped = _skipped(scaler, opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return skipped


def train(
    task: Task,
    policy: Policy,
    form: Form,
    seed: int = DATA_SEED,
    measure: Callable[[dict, dict], Any] | None = None,
) -> Trace:
    """One run of ``task`` under ``policy`` (float32: no autocast, no scaler).  ``measure``, if
    given, is called at each sampled step with the captured float16 and float32 activation
    gradients (name -> list of tensors); what it returns goes to ``Trace.measured``."""
    steps = form.steps[task.name]
    spikes = set(form.spikes(task))
    data = task.data()
    indices = batch_indices(task, data, steps, seed, form.last)
    model = task.model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=task.lr)
    scaler = policy.make()
    if policy.trace:
        scaler.watch(model, activations=True)
    twin = task.model() if scaler is not None else None
    out = Trace()
    for i in range(steps):
        batch = task.batch(data, indices[i])
        spike = i in spikes
        t0 = time.perf_counter()
        if scaler is None:  # float32: the reference; a planted spike's step is skipped
            loss, shown = task.loss(model, batch)
            if not spike:
                loss.backward()
                _divide(params, task.divisor)
                opt.step()
            opt.zero_grad(set_to_none=True)
            out.losses.append(float(shown))
            out.wall_s += time.perf_counter() - t0
            continue
        scale = scaler.get_scale()
        sample = i % form.sample_every == 0 and not spike
        cap = Capture(model, half_only=True) if sample else None
        shown = forward_backward(task, scaler, model, batch, spike)
        if cap is not None:
            half = cap.close()
            t1 = time.perf_counter()
            full = float32_grads(task, twin, model, batch, scale * (SPIKE if spike else 1.0))
            largest = (_largest(g for gs in half.values() for g in gs), _largest(_grads(params)))
            out.samples.append((i, *underflow_counts(half, full), *largest))
            if measure is not None:
                out.measured.append((i, measure(half, full)))
            t0 += time.perf_counter() - t1  # (the float32 recompute is not the run's time)
        if optimizer_step(task, scaler, params, opt):
            out.skipped.append(i)
        if getattr(scaler, "policy", None) == "headroom":
            out.magnitudes.append(scaler.magnitude())  # (a sync, outside the timed part below)
        out.losses.append(float(shown))
        out.log2_scales.append(_log2(scale))
        out.wall_s += time.perf_counter() - t0
    if policy.trace:
        scaler.unwatch()
    return out


# --------------------------------------------------------------------------- summaries
def split_skips(skipped: Sequence[int], spikes: Sequence[int], first: int) -> dict[str, Any]:
    """Skipped steps in the first ``first`` steps, at planted spikes (a spike's step and the
    SPIKE_WINDOW - 1 after it) and later; the most at any one spike."""
    per_spike = {s: 0 for s in spikes}
    early = later = 0
    for t in skipped:
        owner = next((s for s in spikes if s <= t < s + SPIKE_WINDOW), None)
        if owner is not None:
            per_spike[owner] += 1
        elif t < first:
            early += 1
        else:
            later += 1
    return {
        "first": early,
        "later": later,
        "spikes": sum(per_spike.values()),
        "most_at_one_spike": max(per_spike.values(), default=0),
    }


def summary(trace: Trace, task: Task, form: Form) -> dict[str, Any]:
    """The run's record, without the comparisons to torch's and float32's runs."""
    steps = len(trace.losses)
    r: dict[str, Any] = {
        "steps": steps,
        "final_loss": statistics.fmean(trace.losses[-form.last :]),
        "wall_s": trace.wall_s,
        "ms_per_step": 1e3 * trace.wall_s / max(steps, 1),
    }
    if trace.log2_scales:
        finite = [x for x in trace.log2_scales if math.isfinite(x)] or [float("nan")]
        r["skipped"] = split_skips(trace.skipped, form.spikes(task), form.first)
        r["skipped_steps"] = trace.skipped
        r["log2_scale_median"] = statistics.median(finite)
        r["log2_scale_lowest"] = min(finite)
        r["log2_scales"] = [int(x) if x == int(x) else x for x in trace.log2_scales]
        if trace.magnitudes:
            r["magnitudes"] = trace.magnitudes
        lost, sub, n = (sum(s[k] for s in trace.samples) for k in (1, 2, 3))
        ratios = [a / p for *_, a, p in trace.samples if 0 < p < math.inf and a < math.inf]
        r["underflow"] = {
            "underflowed": lost / n if n else None,
            "subnormal": sub / n if n else None,
            "elements": n,
            # the largest float16 activation gradient over the largest parameter gradient (the
            # pass's measurement without tracing), median over the sampled steps without inf
            "activation_over_parameter_max": statistics.median(ratios) if ratios else None,
            "samples": [list(s) for s in trace.samples],
        }
    return r


def at_scale(run: dict[str, Any], log2_scale: float, spikes: Sequence[int]) -> dict[str, Any]:
    """What a headroom run's measured magnitudes say of a higher global scale (issue 36 §3):
    each step's largest scaled gradient moved to 2^log2_scale (and to half a binade below it),
    and the steps where it would pass float16's largest value, 65,504 (an overflow: a skipped
    step), leaving out the steps that found inf/NaN or measured nothing, and the planted spikes'
    windows."""
    window = {t for s in spikes for t in range(s, s + SPIKE_WINDOW)}
    over: dict[str, list[int]] = {"at": [], "half_binade_below": []}
    for t, (m, s) in enumerate(zip(run["magnitudes"], run["log2_scales"], strict=True)):
        if t in window or not (0 < m < math.inf) or not math.isfinite(s):
            continue
        for key, shift in (("at", 0.0), ("half_binade_below", -0.5)):
            if m * 2.0 ** (log2_scale + shift - s) > 65504.0:
                over[key].append(t)
    return {"log2_scale": log2_scale, **{k: v for k, v in over.items()}}


def verdict(run: dict[str, Any], torch_run: dict[str, Any] | None, noise: float | None) -> dict:
    """The targets for one run: no skip outside the spikes, at most one per spike, a median
    scale at least torch's, a final loss not above torch's by more than the noise (None: not
    judged)."""
    s = run["skipped"]
    parts: dict[str, bool | None] = {
        "no skip outside spikes": s["first"] == 0 and s["later"] == 0,
        "at most one skip per spike": s["most_at_one_spike"] <= 1,
        "median scale at least torch's": None,
        "loss at most torch's plus noise": None,
    }
    if torch_run is not None and torch_run.get("status") == "ok":
        parts["median scale at least torch's"] = (
            run["log2_scale_median"] >= torch_run["log2_scale_median"]
        )
        if noise is not None:
            parts["loss at most torch's plus noise"] = run["loss_minus_torch"] <= noise
    failed = [k for k in ("first", "later") if s[k]]
    failed = [("skips at start", "later skips")[k == "later"] for k in failed]
    if parts["at most one skip per spike"] is False:
        failed.append("2+ skips at a spike")
    if parts["median scale at least torch's"] is False:
        failed.append("median scale below torch's")
    if parts["loss at most torch's plus noise"] is False:
        failed.append("loss above torch's beyond noise")
    unjudged = [("scale", "loss")[k.startswith("loss")] for k, ok in parts.items() if ok is None]
    met: bool | None = None if unjudged else True
    if failed:
        met, text = False, "not met: " + ", ".join(failed)
    else:
        text = "met" + (f" ({' and '.join(unjudged)} not judged)" if unjudged else "")
    return {"met": met, "text": text, "parts": parts}


# --------------------------------------------------------------------------- the question
def n_runs(quick: bool, tasks: Sequence[Task] = TASKS, policies: Sequence = POLICIES) -> int:
    form = QUICK if quick else FULL
    return len(tasks) * (len(policies) + 1 + len(form.noise_seeds))


def run(
    ctx: Context,
    form: Form | None = None,
    tasks: Sequence[Task] = TASKS,
    policies: Sequence[Policy] = POLICIES,
) -> dict[str, Any]:
    """Every task under every available policy, float32 and the noise runs: the question's
    results (results.jsonl's ``{"policy": ...}`` line)."""
    form = form or (QUICK if ctx.quick else FULL)
    with one_thread():
        return _run(ctx, form, tasks, policies)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the block: the same bits on any machine (tiny models gain
    nothing from two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run(ctx: Context, form: Form, tasks: Sequence[Task], policies: Sequence[Policy]) -> dict:
    available = availability(policies)
    result = head(ctx, form, policies, available)
    for task in tasks:
        if skip(ctx, QUESTION, task, len(policies) + 1 + len(form.noise_seeds)):
            continue
        result["tasks"][task.name] = run_task(ctx, task, form, policies, available, result["runs"])
    return result


def skip(ctx: Context, question: str, task: Task, runs: int) -> bool:
    """Whether ``task`` cannot run here (the package it requires is not installed): if so a
    note of ``question``'s says so and its ``runs`` are ticked off."""
    if task.requires is None or importlib.util.find_spec(task.requires) is not None:
        return False
    ctx.notes.append(f"{question}: {task.name} skipped ({task.requires} is not installed)")
    ctx.tick(runs)
    return True


def head(
    ctx: Context, form: Form, policies: Sequence[Policy], available: dict[str, str | None]
) -> dict[str, Any]:
    """A training question's results before its runs: the form, the policies (their call and
    why one is not available), no task and no run yet."""
    return {
        "form": {
            "quick": ctx.quick,
            "spike_factor": SPIKE,
            "spike_window": SPIKE_WINDOW,
            "sample_every": form.sample_every,
            "first": form.first,
            "last": form.last,
            "noise_seeds": list(form.noise_seeds),
            "torch_threads": 1,
        },
        "policies": {
            p.name: {"call": p.call(), "about": p.about, "trace": p.trace, "why": available[p.name]}
            for p in policies
        },
        "tasks": {},
        "runs": [],
    }


def _record(task: Task, policy: Policy, seed: int) -> dict[str, Any]:
    return {"task": task.name, "policy": policy.name, "seed": seed, "status": "ok", "note": ""}


def run_task(
    ctx: Context,
    task: Task,
    form: Form,
    policies: Sequence[Policy],
    available: dict[str, str | None],
    runs: list[dict[str, Any]],
    measure: Callable[[dict, dict], Any] | None = None,
    extra: Callable[[Trace], dict[str, Any]] | None = None,
    question: str = QUESTION,
) -> dict[str, Any]:
    """One task's runs appended to ``runs``; the task's entry (spikes, noise, equality).
    Another training question passes its own ``measure`` (to :func:`train`), ``extra`` (the
    figures it adds to a scaled run's record, from its trace) and name (the progress line's)."""
    traces: dict[str, Trace] = {}
    mine: list[dict[str, Any]] = []
    plan = [(p, DATA_SEED) for p in (*policies, FLOAT32)]
    plan += [(policies[0], s) for s in form.noise_seeds if policies and policies[0].name == TORCH]
    t_task = time.perf_counter()
    for policy, seed in plan:
        rec = _record(task, policy, seed)
        why = available.get(policy.name) if policy is not FLOAT32 else None
        other = f" batch seed {seed}" if seed != DATA_SEED else ""
        ctx.describe(f"{question} {task.name} {policy.name}{other}")
        if why:
            rec["status"], rec["note"] = "n/a", why
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trace = train(task, policy, form, seed, measure)
                rec.update(summary(trace, task, form))
                if extra is not None and trace.log2_scales:
                    rec.update(extra(trace))
                if seed == DATA_SEED:
                    traces[policy.name] = trace
            except Exception as e:  # noqa: BLE001 - one broken policy must not hide the others
                rec["status"] = "error"
                rec["note"] = f"{type(e).__name__}: {e}".split("\n")[0][:200]
        mine.append(rec)
        ctx.tick()
    main = {r["policy"]: r for r in mine if r["seed"] == DATA_SEED}
    ref, f32 = main.get(TORCH), main.get(FLOAT32.name)
    # torch's default on every batch order it ran (the main one and the noise seeds')
    noise_losses = [r["final_loss"] for r in mine if r["policy"] == TORCH and r["status"] == "ok"]
    noise = max(noise_losses) - min(noise_losses) if len(noise_losses) > 1 else None
    for r in mine:
        if r["status"] != "ok":
            continue
        for key, other in (("loss_minus_torch", ref), ("loss_minus_float32", f32)):
            if other is not None and other["status"] == "ok":
                r[key] = r["final_loss"] - other["final_loss"]
        if "skipped" in r and r["seed"] == DATA_SEED:
            r["target"] = verdict(r, ref, noise)
        if "magnitudes" in r and ref is not None and ref.get("status") == "ok":
            r["at_torch_median"] = at_scale(r, ref["log2_scale_median"], form.spikes(task))
    runs += mine

    def alike(x: str, y: str) -> bool | None:
        """Whether the runs of policies x and y trained bit for bit alike (None: one is missing)."""
        if x not in traces or y not in traces:
            return None
        a, b = traces[x], traces[y]
        return (a.losses, a.log2_scales, a.skipped) == (b.losses, b.log2_scales, b.skipped)

    return {
        "about": task.about,
        "steps": form.steps[task.name],
        "spikes": form.spikes(task),
        "parameters": sum(p.numel() for p in task.model().parameters()),
        "noise": {"final_losses": noise_losses, "spread": noise},
        "ampfused_equals_torch": alike(TORCH, AMPFUSED),
        "traced_equals_untraced": alike(HEADROOM, HEADROOM_TRACED),
        "wall_s": time.perf_counter() - t_task,
    }


# --------------------------------------------------------------------------- output
HEADERS = [
    "policy",
    "skipped steps: first 50 / later / at spikes",
    "log2 scale: median / lowest",
    "activation gradients underflowed / subnormal",
    "final loss (minus torch default's / float32's)",
]


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{100 * x:.2g}%" if x < 0.01 else f"{100 * x:.1f}%"


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}"


def _log2_cell(x: float) -> str:
    return f"{x:g}" if x == int(x) else f"{x:.1f}"


def _main_runs(result: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return [r for r in result["runs"] if r["task"] == task and r["seed"] == DATA_SEED]


def table(result: dict[str, Any], task: str, tablefmt: str) -> str:
    """One task's runs (the main batch order), one row per policy, float32 last."""
    rows = []
    headers = [h.replace("first 50", f"first {result['form']['first']}") for h in HEADERS]
    for r in _main_runs(result, task):
        row = [r["policy"]]
        if r["status"] != "ok":
            rows.append(row + ["not available" if r["status"] == "n/a" else "error"] + ["-"] * 3)
            continue
        if "skipped" in r:
            s, u = r["skipped"], r["underflow"]
            spikes = str(s["spikes"]) if result["tasks"][task]["spikes"] else "-"
            row += [
                f"{s['first']} / {s['later']} / {spikes}",
                f"{_log2_cell(r['log2_scale_median'])} / {_log2_cell(r['log2_scale_lowest'])}",
                f"{_pct(u['underflowed'])} / {_pct(u['subnormal'])}",
            ]
        else:
            row += ["-", "-", "-"]
        diffs = (r.get("loss_minus_torch"), r.get("loss_minus_float32"))
        rows.append(row + [f"{r['final_loss']:.4f} ({' / '.join(_signed(d) for d in diffs)})"])
    return grid(rows, headers, tablefmt)


def _status(r: dict[str, Any] | None) -> str:
    return "-" if r is None else {"n/a": "not available"}.get(r["status"], r["status"])


def targets_table(result: dict[str, Any], tablefmt: str) -> str:
    """Per policy: the targets on each model, met or not in words, and each run's seconds."""
    tasks = list(result["tasks"])
    rows = []
    for name in (*result["policies"], FLOAT32.name):
        runs = [
            next((x for x in _main_runs(result, t) if x["policy"] == name), None) for t in tasks
        ]
        ok = [r if r is not None and r["status"] == "ok" else None for r in runs]
        cells = [
            (r["target"]["text"] if "target" in r else "-") if r else _status(x)
            for r, x in zip(ok, runs, strict=True)
        ]
        seconds = " / ".join(f"{r['wall_s']:.1f}" if r else "-" for r in ok)
        rows.append([name, *cells, seconds])
    headers = ["policy", *(f"targets on {t}" for t in tasks)]
    return grid(rows, [*headers, f"seconds per run: {' / '.join(tasks)}"], tablefmt)


def intro(result: dict[str, Any]) -> str:
    f = result["form"]
    return (
        "Training on the CPU in float16 autocast (float32 parameters, AdamW, fixed seeds: the "
        "same weights and batches for every policy); a step is skipped when its pass found "
        f"inf/NaN; planted spikes: one batch's loss times {f['spike_factor']:g} (a spike owns "
        f"the skips of its step and the {f['spike_window'] - 1} after it). log2 scale: of the "
        "scale each step ran with. Activation gradients (outputs of Linear/Conv1D layers, "
        f"every {f['sample_every']}th step) underflowed: zero or subnormal in float16 where the "
        "same step in float32 (same weights, batch and scale) gives a normal float16 magnitude "
        "or larger; subnormal: zero or subnormal in float16 where float32 is not zero. Final "
        f"loss: mean of the last {f['last']} steps. Targets (the headroom policy's): no skipped "
        "step outside the planted spikes and at most one per spike, a median scale at least "
        "torch default's, a final loss not above torch default's by more than run-to-run "
        "noise (a lower one meets it)."
    )


def finding(result: dict[str, Any], name: str) -> str:
    """One task in words: what it is, torch's behavior, the noise, ampfused = torch."""
    t = result["tasks"][name]
    runs = {r["policy"]: r for r in _main_runs(result, name)}
    spikes = f", planted spikes at steps {', '.join(map(str, t['spikes']))}" if t["spikes"] else ""
    line = f"{name}: {t['about']}; {t['parameters']:,} parameters, {t['steps']} steps{spikes}. "
    ref = runs.get(TORCH)
    if ref and ref["status"] == "ok":
        s, low = ref["skipped"], _log2_cell(ref["log2_scale_lowest"])
        start = "2^16 overflowed; " if s["first"] else ""
        line += (
            f"torch's default skipped {s['first']} steps in the first {result['form']['first']} "
            f"({start}lowest scale 2^{low}), {s['later']} later"
            + (f" and {s['spikes']} at the spikes" if t["spikes"] else "")
            + f"; median scale 2^{_log2_cell(ref['log2_scale_median'])}. "
        )
    line += noise_text(t["noise"]) + " "
    ratio = (runs.get(TORCH) or {}).get("underflow", {}).get("activation_over_parameter_max")
    if ratio is not None:
        line += (
            f"The largest float16 activation gradient is {ratio:.3g} times the largest "
            "parameter gradient (torch's default, median over the sampled steps). "
        )
    for r in runs.values():
        at = r.get("at_torch_median")
        if at is None or r["log2_scale_median"] >= at["log2_scale"] - 0.5:
            continue
        line += (
            f"{r['policy']} (median 2^{_log2_cell(r['log2_scale_median'])}): at torch's median "
            f"scale its measured magnitudes pass 65,504 at {_steps(at['at'])} outside the "
            f"spikes, at half a binade below it at {_steps(at['half_binade_below'])}. "
        )
    traced = t.get("traced_equals_untraced")
    if traced is not None:
        line += (
            "headroom traced and untraced trained bit for bit alike. "
            if traced
            else "headroom traced and untraced differ. "
        )
    same = t["ampfused_equals_torch"]
    line += (
        "ampfused's default trained as torch's did, bit for bit (every step's loss, scale and "
        "skip equal)."
        if same
        else "ampfused's default and torch's DIFFER (losses, scales or skips)."
        if same is False
        else "ampfused's default not compared with torch's (a run did not finish)."
    )
    return line


def _steps(steps: list[int]) -> str:
    """'no step', 'one step (step a)' or 'N steps (steps a, b, c, d, ...)'."""
    if not steps:
        return "no step"
    if len(steps) == 1:
        return f"one step (step {steps[0]})"
    more = ", ..." if len(steps) > 4 else ""
    return f"{len(steps)} steps (steps {', '.join(map(str, steps[:4]))}{more})"


def noise_text(noise: dict[str, Any]) -> str:
    """A task's run-to-run noise in words (its entry's ``noise``)."""
    if noise["spread"] is None:
        return "Run-to-run noise not estimated (--quick): the loss target is not judged."
    losses = ", ".join(f"{x:.4f}" for x in noise["final_losses"])
    return (
        f"Run-to-run noise {noise['spread']:.4f}: the spread of torch default's final loss over "
        f"{len(noise['final_losses'])} batch orders ({losses})."
    )


def unavailable(result: dict[str, Any]) -> list[str]:
    missing = {n: p["why"] for n, p in result["policies"].items() if p["why"]}
    if not missing:
        return []
    why = next(iter(missing.values()))
    return [f"Not available in this build: {', '.join(missing)} ({why})."]


def errors(result: dict[str, Any] | None, question: str = QUESTION) -> list[str]:
    """The runs that failed, as the suite's error lines."""
    return [
        f"{question}:{r['task']} {r['policy']} (batch seed {r['seed']}): {r['note']}"
        for r in (result or {}).get("runs", [])
        if r["status"] == "error"
    ]


def text(result: dict[str, Any], tablefmt: str) -> str:
    """The question's section: what it measures, a table per model with its findings, the
    targets per policy."""
    return section(result, tablefmt, intro(result), finding, table)


def section(
    result: dict[str, Any],
    tablefmt: str,
    about: str,
    finding: Callable[[dict[str, Any], str], str],
    table: Callable[[dict[str, Any], str, str], str],
) -> str:
    """A training question's section: ``about`` (what it measures), the policies not
    available, per task its ``finding`` in words and its ``table``, the targets per policy."""
    md = tablefmt == "github"
    parts = [paragraph(about, tablefmt)]
    parts += [bullets(unavailable(result), tablefmt)] if unavailable(result) else []
    for name in result["tasks"]:
        parts.append(paragraph(finding(result, name), tablefmt))
        parts.append(table(result, name, tablefmt))
    head = "Per policy: the targets on each model, and the time of each run:"
    parts.append(f"**{head}**" if md else head)
    parts.append(targets_table(result, tablefmt))
    return "\n\n".join(parts)


def comparison_lines(result: dict[str, Any] | None) -> list[str]:
    """For "How ampfused compares": whether ampfused's default trained as torch's did."""
    if not result:
        return []
    same = [t["ampfused_equals_torch"] for t in result["tasks"].values()]
    judged = [s for s in same if s is not None]
    if not judged:
        return []
    return [
        f"policy: ampfused's default trained as torch's default did, bit for bit, on "
        f"{sum(judged)} of {len(judged)} models (every step's loss, scale and skip)"
    ]


def plot(result: dict[str, Any], out: Path, title: str) -> Path:
    """policy.png: the log2 scale each step ran with, one panel per model, one line per
    policy; planted spikes marked."""

    def draw(ax: Any, name: str) -> None:
        runs = [r for r in _main_runs(result, name) if "log2_scales" in r]
        for k, r in enumerate(runs):  # each line thinner than the last: equal ones stay seen
            style = "--" if r["policy"] in (AMPFUSED, HEADROOM_TRACED) else "-"
            lw = 3.0 - 2.0 * k / max(len(runs) - 1, 1)
            ax.plot(r["log2_scales"], style, lw=lw, label=r["policy"])
        for k, s in enumerate(result["tasks"][name]["spikes"]):
            ax.axvline(s, color="grey", lw=0.8, ls=":", label="planted spike" if k == 0 else None)
        ax.set(title=name, xlabel="step", ylabel="log2 of the loss scale")

    return panels(result, out / "policy.png", title, draw)


def panels(
    result: dict[str, Any], path: Path, title: str, draw: Callable[[Any, str], None]
) -> Path:
    """A training question's plot at ``path``: one panel per task, drawn by ``draw(axes,
    task)``, a grid, the legend of the last panel beside it, ``title`` above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["tasks"])
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        draw(ax, name)
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
