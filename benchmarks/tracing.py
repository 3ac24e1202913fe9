"""The tracing question: what ``watch(model, activations=True)`` costs a training step.

A transformers GPT-2 (a tiny one, and one of GPT-2 small's shapes) in float16 autocast, one
step = forward + backward + ``scaler.step`` + ``update`` with ampfused's scaler, three ways:
untraced, traced, and traced the way users do it by hand (forward hooks and tensor hooks that
call ``.item()`` on ``isinf``/``isnan`` per module: a host sync each).  Methods interleave by
round; the median step of each is reported with the ratios to the untraced step.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import ampfused
from benchmarks.report import table as report_table
from benchmarks.suite import Context, Record

METHODS = ("untraced", "traced", "item-hooks")
# (name, GPT2Config overrides, batch, sequence, timed steps per round, rounds, in --quick).
# GPT-2 small's shapes take ~4 s a step on a 2-core CPU (float16 matmuls are emulated there).
MODELS = (
    ("gpt2-tiny", {"vocab_size": 64, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 2},
     2, 12, 20, 5, True),
    ("gpt2-small shapes", {}, 1, 16, 1, 3, False),
)  # fmt: skip


def _model(config: dict, device: torch.device) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(device)


def _item_hooks(model: torch.nn.Module) -> None:
    """What users write by hand: every leaf module's outputs and output gradients checked with
    .item() (a host sync per check)."""

    def check(t: torch.Tensor) -> None:
        if torch.isinf(t).any().item() or torch.isnan(t).any().item():
            pass

    def hook(module: Any, args: Any, output: Any) -> None:
        for t in output if isinstance(output, tuple) else (output,):
            if torch.is_tensor(t) and t.is_floating_point():
                check(t)
                if t.requires_grad:
                    t.register_hook(check)

    for m in model.modules():
        if next(m.children(), None) is None:
            m.register_forward_hook(hook)


def _stepper(name: str, config: dict, batch: int, seq: int, method: str, device: torch.device):  # noqa: ANN202
    model = _model(config, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ampfused.GradScaler(device.type, init_scale=2.0**10)
    if method == "traced":
        scaler.watch(model, activations=True)
    elif method == "item-hooks":
        _item_hooks(model)
    ids = torch.randint(0, config.get("vocab_size", 50257), (batch, seq), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    step.params = list(model.parameters())  # type: ignore[attr-defined]  (the table's sizes)
    return step


def _time(step: Callable[[], None], n: int, device: torch.device) -> float:
    """Seconds per step over n steps (one synchronize at each end on a GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / n


def run(ctx: Context, question: str = "tracing", models: tuple = MODELS) -> list[Record]:
    """The tracing question's records (``question`` names them; ``models``: of MODELS)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        ctx.notes.append(f"{question}: tracing skipped (transformers is not installed)")
        return []
    records = []
    for name, config, batch, seq, n, rounds, in_quick in models:
        if ctx.quick and not in_quick:
            ctx.tick()
            continue
        ctx.describe(f"tracing {name}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steppers = {m: _stepper(name, config, batch, seq, m, ctx.device) for m in METHODS}
            for step in steppers.values():
                step()  # (warm-up: allocations, first-call costs)
            samples: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(rounds):
                for method, step in steppers.items():
                    samples[method].append(_time(step, n, ctx.device))
        params = steppers["untraced"].params
        numel = sum(p.numel() for p in params)
        for method, times in samples.items():
            q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
            records.append(
                Record(
                    question,
                    name,
                    "model",
                    "fp16 autocast",
                    False,
                    len(params),
                    numel,
                    4 * numel,  # (float32 parameters' gradients)
                    method,
                    "step",
                    median_s=statistics.median(times),
                    q1_s=q[0],
                    q3_s=q[2],
                    samples=len(times),
                )  # fmt: skip
            )
        ctx.tick()
    return records


def table(records: list[Record], tablefmt: str) -> str:
    ratios = [("traced / untraced", "traced", "untraced")]
    ratios.append(("item-hooks / untraced", "item-hooks", "untraced"))
    return report_table(records, METHODS, ratios, tablefmt=tablefmt)
