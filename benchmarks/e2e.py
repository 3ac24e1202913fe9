"""Does swapping the scaler change an end-to-end float16 training step, in time or in
results?  A small nanoGPT-style model trained under each scaler from the same weights on the
same batches, in lockstep (benchmarks/README.md); losses and final weights must be identical.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampfused
from benchmarks.suite import Context
from benchmarks.timing import Stats, batched, device_clock

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
    """(steps, grad_accum, batch, block_size + 1) tokens of a fixed random Markov chain (four
    likely successors a token): something to learn."""
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


def chunks(cfg: E2EConfig) -> list[list[int]]:
    """Steps grouped into samples of ``steps_per_sample``, the untimed ``timed_from`` apart."""
    n = max(1, cfg.steps_per_sample)
    out: list[list[int]] = []
    for lo, hi in (
        (0, min(cfg.timed_from, cfg.steps)),
        (min(cfg.timed_from, cfg.steps), cfg.steps),
    ):
        out += [list(range(a, min(a + n, hi))) for a in range(lo, hi, n)]
    return out


def run(ctx: Context, cfg: E2EConfig | None = None) -> dict[str, Any]:
    """The config, the model's size, per run its step times, losses and scales, and per
    optimizer how ampfused's run compares with torch's."""
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
            opt = make_optimizer(model, cfg, fused=opt_name == "adamw-fused")
            runs.append(Run(scaler_name, opt_name, model, opt, cls(device.type)))
    clock = device_clock(device)

    def now() -> float:
        clock.synchronize()
        return clock.now()

    for i, chunk in enumerate(chunks(cfg)):
        k = i % len(runs)
        for r in runs[k:] + runs[:k]:
            # In a chunk of several steps (GPU) the scales are read back after the chunk.
            pending = []
            t0 = now()
            for step in chunk:
                loss = train_step(r, batches[step], cfg, device.type)
                pending.append((loss, r.scaler._scale.detach().clone() if len(chunk) > 1 else None))
            t1 = now()
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
        st = Stats(r.step_s)
        result_runs[r.key] = {
            "scaler": r.scaler_name,
            "optimizer": r.optimizer_name,
            "median_step_s": st.median if st.n else None,
            "q1_s": st.q1 if st.n else None,
            "q3_s": st.q3 if st.n else None,
            "timed_steps": r.timed_steps,
            "steps_per_sample": cfg.steps_per_sample,
            "samples": st.n,
            "losses": r.losses,
            "scales": r.scales,
            "skipped_steps": sum(
                b < a for a, b in zip([65536.0, *r.scales], r.scales, strict=False)
            ),
        }
    comparisons: dict[str, dict[str, Any]] = {}
    for opt_name in OPTIMIZERS:
        rt, ra = (
            r for s in SCALERS for r in runs if (r.optimizer_name, r.scaler_name) == (opt_name, s)
        )
        t, a = result_runs[rt.key], result_runs[ra.key]
        pt, pa = dict(rt.model.named_parameters()), dict(ra.model.named_parameters())
        comparisons[opt_name] = {
            "max_abs_loss_diff": max(abs(x - y) for x, y in zip(rt.losses, ra.losses, strict=True)),
            "scales_equal": rt.scales == ra.scales,
            "weights_bitwise_equal": all(torch.equal(pt[n], pa[n]) for n in pt),
            "torch_over_ampfused": t["median_step_s"] / a["median_step_s"]
            if t["median_step_s"] and a["median_step_s"]
            else None,
            "ampfused_slower_beyond_iqr": bool(a["q1_s"] > t["q3_s"]),
        }
    return {
        "config": asdict(cfg),
        "n_params": sum(p.numel() for p in base.parameters()),
        "n_param_tensors": len(list(base.parameters())),
        "runs": result_runs,
        "comparisons": comparisons,
    }
