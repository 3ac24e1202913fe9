"""Question: does swapping the scaler change an end-to-end float16 training step, in time or in
results?  A small GPT trained nanoGPT-style (autocast float16, gradient accumulation,
``unscale_`` then ``clip_grad_norm_``, AdamW plain and fused, decay/no-decay parameter groups)
with each scaler from the same initial weights on the same batches.  Runs advance in lockstep
in rotated order.  On CPU each step is one sample (timed like the other questions).  On a GPU a
sample is a chunk of consecutive steps with one synchronization at the end, as training runs
(``steps_per_sample``; losses and scales are read back after the chunk): a synchronization per
step would add its own cost to every sample.  The loss curves of the two scalers must coincide
exactly (max abs difference 0) and so must the final weights.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampfused
from benchmarks.suite import Context
from benchmarks.timing import batched, synced_clock

QUESTION = "e2e"
SCALERS = {"torch": torch.amp.GradScaler, "ampfused": ampfused.GradScaler}
OPTIMIZERS = ("adamw", "adamw-fused")


# --------------------------------------------------------------------------- model
@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: learned positions, pre-LN blocks, lm_head tied to wte."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class E2EConfig:
    gpt: GPTConfig = GPTConfig()
    batch_size: int = 8
    grad_accum: int = 2
    steps: int = 24
    timed_from: int = 2  # the first steps (allocator, autotuning) are not timed
    lr: float = 1e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1337
    steps_per_sample: int = 1  # steps timed together between two synchronizations


CPU_FULL = E2EConfig(steps=30)
CPU_QUICK = E2EConfig(GPTConfig(block_size=32, n_layer=1, n_embd=32), batch_size=4, steps=6)
GPU_FULL = E2EConfig(
    GPTConfig(block_size=256, vocab_size=4096, n_layer=6, n_head=6, n_embd=384),
    batch_size=32,
    grad_accum=4,
    steps=60,
    timed_from=5,
    steps_per_sample=5,
)
GPU_QUICK = E2EConfig(
    GPU_FULL.gpt, batch_size=16, grad_accum=2, steps=15, timed_from=3, steps_per_sample=3
)


def preset(device: torch.device, quick: bool) -> E2EConfig:
    if device.type == "cuda":
        return GPU_QUICK if quick else GPU_FULL
    return CPU_QUICK if quick else CPU_FULL


def make_batches(cfg: E2EConfig, device: torch.device) -> torch.Tensor:
    """Token sequences from a fixed random Markov chain (each token has four likely successors),
    so there is something to learn: shape (steps, grad_accum, batch, block_size + 1)."""
    g = torch.Generator().manual_seed(cfg.seed)
    v, t = cfg.gpt.vocab_size, cfg.gpt.block_size
    n = cfg.steps * cfg.grad_accum * cfg.batch_size
    succ = torch.randint(v, (v, 4), generator=g)
    seq = torch.empty(n, t + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(v, (n,), generator=g)
    for i in range(t):
        follow = succ[seq[:, i], torch.randint(4, (n,), generator=g)]
        noise = torch.randint(v, (n,), generator=g)
        seq[:, i + 1] = torch.where(torch.rand(n, generator=g) < 0.9, follow, noise)
    return seq.view(cfg.steps, cfg.grad_accum, cfg.batch_size, t + 1).to(device)


def make_optimizer(model: nn.Module, cfg: E2EConfig, fused: bool) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


# --------------------------------------------------------------------------- runs
@dataclass
class Run:
    scaler_name: str
    optimizer_name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    step_s: list[float] = field(default_factory=list)  # one per sample: seconds per step
    timed_steps: int = 0
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.scaler_name}/{self.optimizer_name}"


def train_step(run: Run, batch: torch.Tensor, cfg: E2EConfig, device_type: str) -> torch.Tensor:
    total = torch.zeros((), device=batch.device)
    for micro in range(cfg.grad_accum):
        xb, yb = batch[micro, :, :-1], batch[micro, :, 1:]
        with torch.autocast(device_type, dtype=torch.float16):
            loss = run.model(xb, yb) / cfg.grad_accum
        run.scaler.scale(loss).backward()
        total += loss.detach()
    run.scaler.unscale_(run.optimizer)
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return total


@dataclass
class E2EResult:
    config: dict[str, Any]
    n_params: int
    n_param_tensors: int
    runs: dict[str, dict[str, Any]]
    comparisons: dict[str, dict[str, Any]]


def chunks(cfg: E2EConfig) -> list[list[int]]:
    """Steps grouped into timing samples: the untimed first ``timed_from`` steps in chunks of
    their own, then ``steps_per_sample`` consecutive steps per chunk (the last may be shorter)."""
    n = max(1, cfg.steps_per_sample)
    out: list[list[int]] = []
    for lo, hi in (
        (0, min(cfg.timed_from, cfg.steps)),
        (min(cfg.timed_from, cfg.steps), cfg.steps),
    ):
        out += [list(range(a, min(a + n, hi))) for a in range(lo, hi, n)]
    return out


def run(ctx: Context, cfg: E2EConfig | None = None) -> E2EResult:
    device = ctx.device
    cfg = cfg or preset(device, ctx.quick)
    if ctx.timing is not None and not batched(ctx.timing, device):
        cfg = dataclasses.replace(cfg, steps_per_sample=1)  # --timing per-step: one step a sample
    torch.manual_seed(cfg.seed)
    base = GPT(cfg.gpt).to(device)
    batches = make_batches(cfg, device)
    runs: list[Run] = []
    for opt_name in OPTIMIZERS:
        for scaler_name, cls in SCALERS.items():
            model = copy.deepcopy(base)
            runs.append(
                Run(
                    scaler_name,
                    opt_name,
                    model,
                    make_optimizer(model, cfg, fused=opt_name == "adamw-fused"),
                    cls(device.type),
                )
            )
    clock = synced_clock(device)
    for i, chunk in enumerate(chunks(cfg)):
        k = i % len(runs)
        for r in runs[k:] + runs[:k]:
            if len(chunk) == 1:  # CPU: as before, nothing is read back inside the timing
                t0 = clock()
                loss = train_step(r, batches[chunk[0]], cfg, device.type)
                t1 = clock()
                pending = [(loss, None)]
            else:  # GPU: no sync between the steps; the scale is read back after the chunk
                t0 = clock()
                pending = []
                for step in chunk:
                    loss = train_step(r, batches[step], cfg, device.type)
                    pending.append((loss, r.scaler._scale.detach().clone()))
                t1 = clock()
            if chunk[0] >= cfg.timed_from:
                r.step_s.append((t1 - t0) / len(chunk))
                r.timed_steps += len(chunk)
            for loss, scale in pending:
                r.losses.append(loss.item())
                r.scales.append(r.scaler.get_scale() if scale is None else scale.item())
        ctx.describe(f"e2e step {chunk[-1] + 1}/{cfg.steps}")
        ctx.tick(len(chunk))
    result_runs: dict[str, dict[str, Any]] = {}
    for r in runs:
        q = statistics.quantiles(r.step_s, n=4, method="inclusive") if len(r.step_s) > 1 else None
        med = statistics.median(r.step_s) if r.step_s else None
        result_runs[r.key] = {
            "scaler": r.scaler_name,
            "optimizer": r.optimizer_name,
            "median_step_s": med,
            "q1_s": q[0] if q else med,
            "q3_s": q[2] if q else med,
            "timed_steps": r.timed_steps,
            "steps_per_sample": cfg.steps_per_sample,
            "samples": len(r.step_s),
            "losses": r.losses,
            "scales": r.scales,
            "skipped_steps": sum(
                1 for a, b in zip([65536.0, *r.scales], r.scales, strict=False) if b < a
            ),
        }
    comparisons: dict[str, dict[str, Any]] = {}
    for opt_name in OPTIMIZERS:
        rt = next(r for r in runs if r.optimizer_name == opt_name and r.scaler_name == "torch")
        ra = next(r for r in runs if r.optimizer_name == opt_name and r.scaler_name == "ampfused")
        pt, pa = dict(rt.model.named_parameters()), dict(ra.model.named_parameters())
        t_med = result_runs[rt.key]["median_step_s"]
        a_med = result_runs[ra.key]["median_step_s"]
        comparisons[opt_name] = {
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(rt.losses, ra.losses, strict=True)),
            "scales_equal": rt.scales == ra.scales,
            "weights_bitwise_equal": all(torch.equal(pt[n], pa[n]) for n in pt),
            "torch_over_ampfused": (t_med / a_med) if t_med and a_med else None,
            "ampfused_slower_beyond_iqr": bool(
                result_runs[ra.key]["q1_s"] > result_runs[rt.key]["q3_s"]
            ),
        }
    n_params = sum(p.numel() for p in base.parameters())
    return E2EResult(
        config=asdict(cfg),
        n_params=n_params,
        n_param_tensors=len(list(base.parameters())),
        runs=result_runs,
        comparisons=comparisons,
    )


def steps_total(ctx: Context) -> int:
    return preset(ctx.device, ctx.quick).steps
