"""Gradient sets: model shape lists written out here (no downloads) and synthetic sweeps, made
into gradients of a no-op optimizer's parameters.  A :class:`GradSet` keeps them as views into
one flat buffer per dtype with a pristine copy, so a restore is one copy per dtype (a
``realloc`` workload instead gives every parameter a new gradient tensor at each restore)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Shape = tuple[int, ...]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
# "mixed": each tensor one of these at random (fixed seed; a round robin would follow the
# period of the shape list).
MIXED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIXED_SEED = 0
DTYPE_NAMES = (*DTYPES, "mixed")
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default
# Scaled gradients ~ N(0, 1e-3) * INIT_SCALE: far below float16's maximum, normal once unscaled.
GRAD_STD = 2.0**-10
ALIGN_BYTES = 64  # each tensor starts on a 64-byte boundary of its flat buffer


# --------------------------------------------------------------------------- shape lists
def gpt2_124m() -> list[Shape]:
    """Hugging Face ``GPT2LMHeadModel`` (lm_head tied): 148 tensors, 124,439,808 parameters."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: list[Shape] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,)]  # ln_1 weight, bias
        shapes += [(d, 3 * d), (3 * d,)]  # attn.c_attn
        shapes += [(d, d), (d,)]  # attn.c_proj
        shapes += [(d,), (d,)]  # ln_2
        shapes += [(d, 4 * d), (4 * d,)]  # mlp.c_fc
        shapes += [(4 * d, d), (d,)]  # mlp.c_proj
    shapes += [(d,), (d,)]  # ln_f
    return shapes


def llama(
    layers: int, hidden: int, intermediate: int, vocab: int, heads: int, kv_heads: int
) -> list[Shape]:
    """RMSNorm, SwiGLU MLP, grouped-query attention, untied lm_head, no biases."""
    kv = hidden // heads * kv_heads
    shapes: list[Shape] = [(vocab, hidden)]  # embed_tokens
    for _ in range(layers):
        shapes += [(hidden,)]  # input_layernorm
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]  # q, k, v, o
        shapes += [(hidden,)]  # post_attention_layernorm
        shapes += [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    shapes += [(hidden,), (vocab, hidden)]  # norm, lm_head
    return shapes


def llama_1b() -> list[Shape]:
    """147 tensors, 1,104,218,112 parameters."""
    return llama(16, 2048, 8192, 32000, 32, 8)


def llama_7b() -> list[Shape]:
    """Llama-2-7B: 291 tensors, 6,738,415,616 parameters."""
    return llama(32, 4096, 11008, 32000, 32, 32)


def resnet50() -> list[Shape]:
    """torchvision ``resnet50`` (BatchNorm weight and bias): 161 tensors, 25,557,032."""
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
        for b in range(blocks):
            out = width * 4
            shapes += [(width, inplanes, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if b == 0:  # downsample: 1x1 conv + BatchNorm
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


def bert_base() -> list[Shape]:
    """``bert-base-uncased`` with pooler: 199 tensors, 109,482,240 parameters."""
    d, ff, vocab = 768, 3072, 30522
    shapes: list[Shape] = [(vocab, d), (512, d), (2, d), (d,), (d,)]
    for _ in range(12):
        shapes += [(d, d), (d,)] * 3  # query, key, value
        shapes += [(d, d), (d,), (d,), (d,)]  # attention.output dense + LayerNorm
        shapes += [(ff, d), (ff,)]  # intermediate.dense
        shapes += [(d, ff), (d,), (d,), (d,)]  # output dense + LayerNorm
    shapes += [(d, d), (d,)]  # pooler
    return shapes


def vit_b16() -> list[Shape]:
    """timm ``vit_base_patch16_224``: 152 tensors, 86,567,656 parameters."""
    d, ff = 768, 3072
    shapes: list[Shape] = [(1, 1, d), (1, 197, d), (d, 3, 16, 16), (d,)]
    for _ in range(12):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # norm1, attn.qkv, attn.proj
        shapes += [(d,), (d,), (ff, d), (ff,), (d, ff), (d,)]  # norm2, mlp.fc1, mlp.fc2
    shapes += [(d,), (d,), (1000, d), (1000,)]
    return shapes


@dataclass(frozen=True)
class Model:
    name: str
    title: str
    shapes: Callable[[], list[Shape]]
    gpu_only: bool = False


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        Model("gpt2-124m", "GPT-2 124M", gpt2_124m),
        Model("llama-1b", "Llama-style 1B", llama_1b),
        Model("llama-7b", "Llama-2 7B", llama_7b, gpu_only=True),
        Model("resnet50", "ResNet-50", resnet50),
        Model("bert-base", "BERT-base", bert_base),
        Model("vit-b16", "ViT-B/16", vit_b16),
    )
}


def uniform(count: int, numel: int) -> list[Shape]:
    return [(numel,)] * count


def numel_of(shapes: Sequence[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)


# --------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    name: str
    shapes: tuple[Shape, ...]
    dtype: str = "fp32"  # fp32 | fp16 | bf16 | mixed
    inject_inf: bool = False  # one element inf
    family: str = "model"  # model | count | size | target
    realloc: bool = False  # new gradient tensors every step (zero_grad(set_to_none=True))

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    @property
    def numel(self) -> int:
        return numel_of(self.shapes)

    def dtypes(self) -> list[torch.dtype]:
        if self.dtype == "mixed":
            rng = random.Random(MIXED_SEED)
            return [MIXED_DTYPES[rng.randrange(len(MIXED_DTYPES))] for _ in self.shapes]
        return [DTYPES[self.dtype]] * len(self.shapes)

    @property
    def grad_bytes(self) -> int:
        return sum(
            math.prod(s) * torch.empty((), dtype=dt).element_size()
            for s, dt in zip(self.shapes, self.dtypes(), strict=True)
        )

    @property
    def unscale_bytes(self) -> int:
        """Every element read and written (8 B per fp32)."""
        return 2 * self.grad_bytes

    def has(self, dtype: torch.dtype) -> bool:
        return dtype in self.dtypes()

    @property
    def label(self) -> str:
        return (
            f"{self.name} {self.dtype}"
            + (" +inf" if self.inject_inf else "")
            + (" realloc" if self.realloc else "")
        )


class NoOpOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step`` does nothing: what remains of ``scaler.step`` is the scaler."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        return None


@dataclass
class GradSet:
    """Gradients attached as ``.grad`` of parameters; :meth:`restore` refills ``grads`` and
    ``groups`` in place, so runners may hold on to these lists."""

    workload: Workload
    device: torch.device
    grads: list[torch.Tensor]
    params: list[torch.nn.Parameter]
    optimizer: NoOpOptimizer
    flats: dict[torch.dtype, torch.Tensor]
    pristine: dict[torch.dtype, torch.Tensor]
    groups: dict[torch.dtype, list[torch.Tensor]] = field(default_factory=dict)
    # realloc: pristine views per dtype, and each gradient's (dtype, index in its group)
    pristine_groups: dict[torch.dtype, list[torch.Tensor]] = field(default_factory=dict)
    grad_slots: list[tuple[torch.dtype, int]] = field(default_factory=list)
    reallocs: int = 0  # realloc restores so far
    pointer_changes: int = 0  # of those after the first, how many changed the pointer list
    _last_pointers: tuple[int, ...] | None = None
    # The restore on the calling thread alone (the busy question): a copy that splits across the
    # pool would start its threads for the timed step, which a training step's own parallel
    # regions do not always do.
    restore_on_one_thread: bool = False

    def restore(self) -> None:
        """The pristine scaled gradients back, untimed (realloc: in new tensors)."""
        threads = torch.get_num_threads()
        if self.restore_on_one_thread and threads > 1:
            torch.set_num_threads(1)
        try:
            if self.workload.realloc:
                self._realloc()
                return
            for dt, flat in self.flats.items():
                flat.copy_(self.pristine[dt])
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _realloc(self) -> None:
        # zero_grad(set_to_none=True): the old gradients are released first ...
        for p in self.params:
            p.grad = None
        self.grads.clear()
        for lst in self.groups.values():
            lst.clear()
        # ... then backward() allocates one per parameter, last layers first (a foreach multiply
        # by 1, exact in every dtype, allocates and fills them in a few calls).
        for dt, src in self.pristine_groups.items():
            self.groups[dt].extend(torch._foreach_mul(src[::-1], 1.0)[::-1])
        for p, (dt, k) in zip(self.params, self.grad_slots, strict=True):
            g = self.groups[dt][k]
            p.grad = g
            self.grads.append(g)
        pointers = tuple(g.data_ptr() for g in self.grads)
        if self._last_pointers is not None and pointers != self._last_pointers:
            self.pointer_changes += 1
        self._last_pointers = pointers
        self.reallocs += 1

    @property
    def pointer_change_rate(self) -> float | None:
        """realloc: the share of restores that changed the gradient pointer list."""
        if not self.workload.realloc or self.reallocs < 2:
            return None
        return self.pointer_changes / (self.reallocs - 1)

    def release(self) -> None:
        for p in self.params:
            p.grad = None
        for c in (self.grads, self.params, self.groups, self.pristine_groups, self.grad_slots):
            c.clear()
        for c in (self.flats, self.pristine, self.optimizer.param_groups):
            c.clear()


def build(workload: Workload, device: torch.device, seed: int = 0) -> GradSet:
    """Allocate the gradients of ``workload`` on ``device`` (2x its gradient bytes in all)."""
    dtypes = workload.dtypes()
    offsets: list[int] = []
    used: dict[torch.dtype, int] = {}
    for shape, dt in zip(workload.shapes, dtypes, strict=True):
        align = ALIGN_BYTES // torch.empty((), dtype=dt).element_size()
        start = -(-used.get(dt, 0) // align) * align
        offsets.append(start)
        used[dt] = start + math.prod(shape)
    gen = torch.Generator().manual_seed(seed)
    flats: dict[torch.dtype, torch.Tensor] = {}
    for dt, n in used.items():  # a random block tiled over each buffer: cheap for billions
        base = (torch.randn(1 << 20, generator=gen) * (GRAD_STD * INIT_SCALE)).to(device)
        flats[dt] = flat = torch.empty(n, dtype=dt, device=device)
        for start in range(0, n, 1 << 20):
            flat[start : start + (1 << 20)].copy_(base[: min(n - start, 1 << 20)])
    grads = [
        flats[dt][off : off + math.prod(shape)].view(shape)
        for shape, dt, off in zip(workload.shapes, dtypes, offsets, strict=True)
    ]
    if workload.inject_inf and grads:
        g = grads[len(grads) // 2].view(-1)
        g[g.numel() // 2] = float("inf")
    pristine = {dt: f.clone() for dt, f in flats.items()}
    # Parameters are views of the pristine buffers (no extra memory; never written).
    params = []
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    pristine_groups: dict[torch.dtype, list[torch.Tensor]] = {}
    slots: list[tuple[torch.dtype, int]] = []
    for shape, g, off in zip(workload.shapes, grads, offsets, strict=True):
        p = torch.nn.Parameter(pristine[g.dtype][off : off + math.prod(shape)].view(shape))
        p.grad = g
        params.append(p)
        slots.append((g.dtype, len(groups.get(g.dtype, []))))
        groups.setdefault(g.dtype, []).append(g)
        pristine_groups.setdefault(g.dtype, []).append(p.detach())
    r = workload.realloc
    gs = GradSet(workload, device, grads, params, NoOpOptimizer(params), flats, pristine, groups,
                 pristine_groups if r else {}, slots if r else [])  # fmt: skip
    if workload.realloc:
        # Separate allocations from here on; no local view may keep a flat buffer alive.
        g = p = flat = None
        flats.clear()
        gs.restore()
    return gs
