"""Question: what does a scaler step cost on real models' gradient sets, per dtype, with and
without an inf?  Configs are the product of models x dtypes x inf, minus the combinations the
device cannot afford (see :func:`configs`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from benchmarks.suite import Context, Record, run_workload
from benchmarks.workloads import DTYPE_NAMES, MODELS, Workload

QUESTION = "models"

# vit-b16 is left to --workloads: BERT-base stands for the 100M-parameter encoders (time budget).
DEFAULT_MODELS = ("gpt2-124m", "llama-1b", "llama-7b", "resnet50", "bert-base")
# An injected inf only changes the flag and the scale update, not the passes: by default it is
# measured on fp32 and mixed only.
DEFAULT_INF_DTYPES = ("fp32", "mixed")
QUICK_MODELS = ("gpt2-124m", "resnet50")
# --quick, unless models/dtypes/inf are chosen: fp32 of both, and mixed with an inf of ResNet-50.
QUICK_CONFIGS = (
    ("gpt2-124m", "fp32", False),
    ("resnet50", "fp32", False),
    ("resnet50", "mixed", True),
)
# On CPU, gradient sets above this size run fp32 without inf only (a step of the 4.4 GB fp32
# Llama-1B set takes about a second per method there).
CPU_HEAVY_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str
    inject_inf: bool
    realloc: bool = False

    def workload(self) -> Workload:
        shapes = tuple(MODELS[self.model].shapes())
        return Workload(self.model, shapes, self.dtype, self.inject_inf, "model", self.realloc)


def configs(
    ctx: Context,
    models: list[str] | None,
    dtypes: list[str] | None,
    infs: list[bool] | None,
) -> tuple[list[ModelConfig], list[str]]:
    """The configs to run and notes about those left out.  On a GPU every model's fp32 set
    without inf also runs with gradients reallocated every step, as after
    zero_grad(set_to_none=True); on CPU that case is in the step_cost question."""
    gpu = ctx.device.type == "cuda"
    if ctx.quick and models is None and dtypes is None and infs is None:
        quick = [ModelConfig(*c) for c in QUICK_CONFIGS]
        return quick + ([ModelConfig(*QUICK_CONFIGS[0], realloc=True)] if gpu else []), []
    models = models or list(QUICK_MODELS if ctx.quick else DEFAULT_MODELS)
    dtypes = dtypes or (["fp32", "mixed"] if ctx.quick else list(DTYPE_NAMES))
    inf_default = infs is None
    infs = infs if infs is not None else [False, True]
    notes: list[str] = []
    if inf_default:
        notes.append("models: the injected-inf variant runs on fp32 and mixed (--inf yes for all)")
    out: list[ModelConfig] = []
    for model, dtype, inf in itertools.product(models, dtypes, infs):
        spec = MODELS[model]
        if spec.gpu_only and not gpu:
            note = f"{spec.title}: GPU only (skipped on CPU)"
            if note not in notes:
                notes.append(note)
            continue
        if inf and inf_default and dtype not in DEFAULT_INF_DTYPES:
            continue
        cfg = ModelConfig(model, dtype, inf)
        if not gpu and cfg.workload().grad_bytes > CPU_HEAVY_BYTES:
            if dtype != "fp32" or inf:
                note = f"{spec.title}: on CPU only fp32 without inf (time budget)"
                if note not in notes:
                    notes.append(note)
                continue
        out.append(cfg)
        if gpu and dtype == "fp32" and not inf:
            out.append(ModelConfig(model, dtype, inf, realloc=True))
    return out, notes


def run(ctx: Context, cfgs: list[ModelConfig]) -> list[Record]:
    records: list[Record] = []
    for cfg in cfgs:
        records += run_workload(ctx, QUESTION, cfg.workload())
        ctx.tick()
    return records
