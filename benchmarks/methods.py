"""The methods compared, side by side, on one :class:`~benchmarks.workloads.GradSet`.

A runner's ``run()`` is the timed work of one optimizer step; ``reset()`` (untimed) puts its
scale back to 2^16 so nothing drifts however many steps are timed.  Runners keep the GradSet's
own gradient lists: a realloc workload refills them at every restore.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ampfused
from benchmarks.env import amp_C, is_gpu, multi_tensor_applier
from benchmarks.workloads import INIT_SCALE, GradSet, NoOpOptimizer, Workload

GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 2000
CLIP_MAX_NORM = 1e-3  # small enough that every set is clipped


class Runner:
    def run(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        pass

    def bytes_moved(self, gs: GradSet) -> int:
        return gs.workload.unscale_bytes


# --------------------------------------------------------------------------- scalers
class _TorchScalerAllowFP16(torch.amp.GradScaler):
    """torch's scaler taking float16 grads through its private ``allow_fp16`` path (the one
    ShardedGradScaler and fused optimizers use); its public ``unscale_`` raises ValueError."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # noqa: ANN001
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def _ampfused_cls(gs: GradSet) -> Callable[..., torch.amp.GradScaler]:
    fp16 = gs.workload.has(torch.float16)
    return functools.partial(ampfused.GradScaler, allow_fp16=True) if fp16 else ampfused.GradScaler


def _torch_cls(gs: GradSet) -> type[torch.amp.GradScaler]:
    return _TorchScalerAllowFP16 if gs.workload.has(torch.float16) else torch.amp.GradScaler


class ScalerRunner(Runner):
    """``unscale_(opt); step(opt); update()``; subclasses change the unscale part."""

    def __init__(self, cls: Callable[..., torch.amp.GradScaler], gs: GradSet) -> None:
        self.scaler = cls(gs.device.type, init_scale=INIT_SCALE)
        self.scaler.scale(torch.ones((), device=gs.device))  # creates the scale on the device
        self.optimizer = gs.optimizer

    def reset(self) -> None:
        self.scaler._scale.fill_(INIT_SCALE)
        self.scaler._growth_tracker.zero_()

    def unscale(self) -> None:
        self.scaler.unscale_(self.optimizer)

    def run(self) -> None:
        self.unscale()
        self.scaler.step(self.optimizer)
        self.scaler.update()


class ForkJoinRunner(ScalerRunner):
    """ampfused's step with every CPU pass over 256 KB split across the intra-op threads, as
    before csrc/cpu/parallel.h decided from what splits cost (two mode switches, ~2 us each,
    are timed with it)."""

    def __init__(self, gs: GradSet) -> None:
        super().__init__(_ampfused_cls(gs), gs)

    def run(self) -> None:
        torch.ops.ampfused._cpu_split_config("always", 0, False)
        try:
            super().run()
        finally:
            torch.ops.ampfused._cpu_split_config("auto", 0, False)


def has_split_ops() -> bool:
    """Whether the build has the CPU split's private ops (csrc/cpu/parallel.cpp)."""
    return hasattr(torch.ops.ampfused, "_cpu_split_config")


def _names(gs: GradSet) -> list[str]:
    return [f"param{i}" for i in range(len(gs.params))]


class WatchRunner(ScalerRunner):
    """After ``watch()`` of every parameter; with ``read_norms``, ``grad_norms()`` after
    ``unscale_``, as a logging hook calls it."""

    def __init__(self, gs: GradSet, read_norms: bool = False) -> None:
        super().__init__(_ampfused_cls(gs), gs)
        self.scaler.watch(list(zip(_names(gs), gs.params, strict=True)))
        self.read_norms = read_norms
        self.logged: dict[str, float] = {}

    def unscale(self) -> None:
        super().unscale()
        if self.read_norms:
            self.logged = self.scaler.grad_norms()


class TorchNormsRunner(ScalerRunner):
    """What users log today (Lightning's ``grad_norm``): per-layer norms by ``_foreach_norm``,
    the total, one ``.item()`` each, into the dict ``grad_norms()`` returns."""

    def __init__(self, gs: GradSet) -> None:
        super().__init__(_torch_cls(gs), gs)
        self.grads = gs.grads
        self.keys = [f"grad_2.0_norm/{n}" for n in _names(gs)]
        self.logged: dict[str, float] = {}

    def unscale(self) -> None:
        super().unscale()
        norms = torch._foreach_norm(self.grads, 2, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms))
        self.logged = {k: n.item() for k, n in zip(self.keys, norms, strict=True)}
        self.logged["grad_2.0_norm_total"] = total.item()


class ClipRunner(ScalerRunner):
    """Fused: ampfused's ``clip_grad_norm_`` (12 B per fp32 element); else torch's ``unscale_``
    then ``torch.nn.utils.clip_grad_norm_`` (foreach: 8 + 4 + 8 = 20 B)."""

    def __init__(self, gs: GradSet, fused: bool) -> None:
        super().__init__(_ampfused_cls(gs) if fused else _torch_cls(gs), gs)
        self.fused, self.params = fused, gs.params

    def unscale(self) -> None:
        if self.fused:
            self.scaler.clip_grad_norm_(self.optimizer, CLIP_MAX_NORM)
        else:
            super().unscale()
            torch.nn.utils.clip_grad_norm_(self.params, CLIP_MAX_NORM, foreach=True)

    def bytes_moved(self, gs: GradSet) -> int:
        return gs.workload.unscale_bytes * (12 if self.fused else 20) // 8


class MastersRunner(ScalerRunner):
    """float16 parameters stepped through float32 masters.  Fused: ``MasterWeights`` +
    ``GradScaler`` (12 B per element).  Else torch's scaler by hand: ``_foreach_copy_`` of the
    gradients into the masters', ``unscale_``, copy back (20 B)."""

    def __init__(self, gs: GradSet, fused: bool) -> None:
        super().__init__(ampfused.GradScaler if fused else torch.amp.GradScaler, gs)
        self.fused, self.grads = fused, gs.grads
        # Parameters of its own: the GradSet's share one buffer whose version counter the other
        # runner's copy back would bump.
        self.params = [torch.nn.Parameter(p.detach().clone()) for p in gs.params]
        for p, g in zip(self.params, gs.grads, strict=True):
            p.grad = g
        if fused:
            self.optimizer = ampfused.MasterWeights(NoOpOptimizer(self.params))
            return
        self.masters = [p.detach().float() for p in self.params]
        self.master_grads = [torch.empty_like(m) for m in self.masters]
        for m, g in zip(self.masters, self.master_grads, strict=True):
            m.grad = g
        self.optimizer = NoOpOptimizer(self.masters)

    @torch.no_grad()
    def run(self) -> None:
        if not self.fused:
            torch._foreach_copy_(self.master_grads, self.grads)
        super().run()
        if not self.fused:
            torch._foreach_copy_(self.params, self.masters)

    def bytes_moved(self, gs: GradSet) -> int:
        return gs.workload.unscale_bytes * (12 if self.fused else 20) // 4  # 4 B per element


# --------------------------------------------------------------------------- distributed
def _torch_sharded(gs: GradSet) -> Runner:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ScalerRunner(ShardedGradScaler, gs)


def _ampfused_group(gs: GradSet) -> Runner:
    # dist.group.WORLD is None until init_process_group(): read when the runner is made.
    return ScalerRunner(functools.partial(_ampfused_cls(gs), found_inf_group=dist.group.WORLD), gs)


class DTensorScalerRunner(ScalerRunner):
    """A scaler over DTensor gradients as FSDP2 hands them over: each gradient is this rank's
    ``Shard(0)`` (on a 1-D mesh of the world) of a DTensor gradient of a DTensor parameter."""

    def __init__(self, cls: Callable[..., torch.amp.GradScaler], gs: GradSet) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh(gs.device.type, (dist.get_world_size(),))
        params = []
        local = functools.partial(DTensor.from_local, device_mesh=mesh, run_check=False)
        with torch.no_grad():
            for p in gs.params:
                dp = torch.nn.Parameter(local(p.detach(), placements=[Shard(0)]))
                dp.grad = local(p.grad, placements=[Shard(0)])
                params.append(dp)
        super().__init__(cls, gs)
        self.optimizer = NoOpOptimizer(params)


class AllReduceFloor(Runner):
    """One ``dist.all_reduce`` of a one-element float32 tensor over the world group."""

    def __init__(self, gs: GradSet) -> None:
        self.flag = torch.zeros(1, dtype=torch.float32, device=gs.device)

    def reset(self) -> None:
        self.flag.zero_()

    def run(self) -> None:
        dist.all_reduce(self.flag)

    def bytes_moved(self, gs: GradSet) -> int:
        return 0


# --------------------------------------------------------------------------- raw ops
class TorchOpsRunner(Runner):
    """torch's ops as its scaler calls them, the lists grouped by dtype once up front."""

    def __init__(self, gs: GradSet) -> None:
        self.groups = list(gs.groups.values())
        self.scale = torch.full((), INIT_SCALE, device=gs.device)
        self.tracker = torch.zeros((), dtype=torch.int32, device=gs.device)

    def reset(self) -> None:
        self.scale.fill_(INIT_SCALE)
        self.tracker.zero_()

    def run(self) -> None:
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, device=self.scale.device)
        for grads in self.groups:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        torch._amp_update_scale_(self.scale, self.tracker, found_inf, GROWTH, BACKOFF, INTERVAL)


class AmpfusedOpRunner(Runner):
    def __init__(self, gs: GradSet) -> None:
        dev, i32 = gs.device, torch.int32
        self.args = (
            gs.grads,
            torch.zeros((), device=dev),  # found_inf
            torch.full((), INIT_SCALE, device=dev),
            torch.zeros((), dtype=i32, device=dev),
            torch.zeros((), device=dev),  # next scale and tracker
            torch.zeros((), dtype=i32, device=dev),
        )

    def run(self) -> None:
        ampfused.ops.unscale_update_scale_(*self.args, GROWTH, BACKOFF, INTERVAL)


class _HostScaleRunner(Runner):
    """A scale kept as a Python float (hand-written loops, apex): torch's update rule."""

    def __init__(self, gs: GradSet) -> None:
        self.grads, self.groups = gs.grads, list(gs.groups.values())
        self.overflow = torch.zeros(1, dtype=torch.int32, device=gs.device)
        self.reset()

    def reset(self) -> None:
        self.scale, self.tracker = INIT_SCALE, 0

    def update(self, found_inf: bool) -> None:
        self.tracker = 0 if found_inf else self.tracker + 1
        if found_inf or self.tracker == INTERVAL:
            self.scale *= BACKOFF if found_inf else GROWTH
            self.tracker = 0


class NaiveRunner(_HostScaleRunner):
    def run(self) -> None:
        inv = 1.0 / self.scale
        finite = []
        for g in self.grads:
            finite.append(torch.isfinite(g).all())
            g.mul_(inv)
        self.update(not bool(torch.stack(finite).all()))


class ApexRunner(_HostScaleRunner):
    def run(self) -> None:
        self.overflow.zero_()
        for grads in self.groups:
            multi_tensor_applier(
                amp_C.multi_tensor_scale, self.overflow, [grads, grads], 1.0 / self.scale
            )
        self.update(bool(self.overflow.item()))


# --------------------------------------------------------------------------- floors
class ForeachMulFloor(Runner):
    def __init__(self, gs: GradSet) -> None:
        self.groups = list(gs.groups.values())

    def run(self) -> None:
        for grads in self.groups:
            torch._foreach_mul_(grads, 1.0 / INIT_SCALE)


class CopyFloor(Runner):
    """``copy_`` per dtype pair: (flat, pristine) for the copy floor; for the masters floor,
    float16 -> float32 and back (12 B per element)."""

    def __init__(self, gs: GradSet, masters: bool = False) -> None:
        if masters:
            low = gs.flats[torch.float16]
            high = torch.empty_like(low, dtype=torch.float32)
            self.pairs = [(high, low), (low, high)]
        else:
            self.pairs = [(gs.flats[dt], gs.pristine[dt]) for dt in gs.flats]

    def run(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)

    def bytes_moved(self, gs: GradSet) -> int:
        return sum(
            d.numel() * d.element_size() + s.numel() * s.element_size() for d, s in self.pairs
        )


# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # scaler | op | floor
    description: str
    factory: Callable[[GradSet], Runner]
    # Why the method cannot run this workload on this device (None: it can).
    unavailable: Callable[[Workload, torch.device], str | None] = lambda w, d: None
    # Not listed at all on this machine (apex not importable, GPU-only on CPU).
    present: Callable[[torch.device], bool] = lambda d: True
    # On CPU, skipped for larger gradient sets (a quarter of this with --quick): time budget.
    max_cpu_bytes: int | None = None
    # False: runs in its own question (diagnostics, clip, masters, distributed) or via --methods.
    default: bool = True


def _torch_na(w: Workload, d: torch.device) -> str | None:
    if is_gpu(d) and w.has(torch.bfloat16):
        return "torch's CUDA unscale kernel has no bfloat16"
    return None


def _copy_na(w: Workload, d: torch.device) -> str | None:
    return "the copy floor does not depend on how gradients are allocated" if w.realloc else None


def _float16_only_na(w: Workload, d: torch.device) -> str | None:
    if set(w.dtypes()) != {torch.float16} or w.realloc:
        return "master weights are measured on float16 gradient sets (same gradients)"
    return None


def _dist_na(w: Workload, d: torch.device) -> str | None:
    if not dist.is_available() or not dist.is_initialized():
        return "needs a torch.distributed process group (the distributed question has one)"
    return None


_na16, _GLOO = _float16_only_na, "; 2 processes, gloo"
_A, _T = "ampfused.GradScaler", "torch.amp.GradScaler"
# The full descriptions are benchmarks/README.md's "What is compared".
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ampfused", "scaler", f"{_A}: unscale_ + step + update, no-op optimizer",
           lambda gs: ScalerRunner(_ampfused_cls(gs), gs)),
    Method("torch", "scaler", f"{_T}: the same calls", lambda gs: ScalerRunner(_torch_cls(gs), gs),
           _torch_na),
    Method("ampfused-forkjoin", "scaler", f"{_A}, every CPU pass split across threads (before)",
           ForkJoinRunner, present=lambda d: d.type == "cpu" and has_split_ops(),
           default=False),
    Method("ampfused-headroom", "scaler", f"{_A}(policy='headroom'): the magnitude measured too",
           lambda gs: ScalerRunner(functools.partial(_ampfused_cls(gs), policy="headroom"), gs),
           default=False),
    Method("ampfused-watch", "scaler", f"{_A} after watch(): per-gradient statistics in the pass",
           WatchRunner, default=False),
    Method("ampfused-norms", "scaler", "ampfused-watch plus grad_norms() after unscale_",
           lambda gs: WatchRunner(gs, read_norms=True), default=False),
    Method("torch-norms", "scaler", f"{_T} + _foreach_norm, .item() per layer and for the total",
           TorchNormsRunner, _torch_na, default=False),
    Method("ampfused-clip", "scaler", f"{_A}: clip_grad_norm_(opt, max_norm), 12 B per element",
           lambda gs: ClipRunner(gs, fused=True), default=False),
    Method("torch-clip", "scaler", f"{_T}: unscale_ + torch.nn.utils.clip_grad_norm_, 20 B",
           lambda gs: ClipRunner(gs, fused=False), _torch_na, default=False),
    Method("ampfused-masters", "scaler", f"ampfused.MasterWeights + {_A}: float16 model, 12 B",
           lambda gs: MastersRunner(gs, fused=True), _na16, default=False),
    Method("torch-masters", "scaler", f"float32 masters by hand with {_T}: 20 B",
           lambda gs: MastersRunner(gs, fused=False), _na16, default=False),
    Method("ampfused-dist", "scaler", f"ampfused.ShardedGradScaler: found_inf SUM{_GLOO}",
           lambda gs: ScalerRunner(ampfused.ShardedGradScaler, gs), _dist_na, default=False),
    Method("torch-dist", "scaler", f"torch's FSDP1 ShardedGradScaler: found_inf SUM{_GLOO}",
           _torch_sharded, _dist_na, default=False),
    Method("ampfused-group", "scaler", f"{_A}(found_inf_group=WORLD): one MAX all-reduce{_GLOO}",
           _ampfused_group, _dist_na, default=False),
    Method("ampfused-fsdp2", "scaler", f"{_A} over DTensor (FSDP2) gradients{_GLOO}",
           lambda gs: DTensorScalerRunner(_ampfused_cls(gs), gs), _dist_na, default=False),
    Method("torch-fsdp2", "scaler", f"{_T} over the same DTensor gradients{_GLOO}",
           lambda gs: DTensorScalerRunner(_torch_cls(gs), gs), _dist_na, default=False),
    Method("ampfused-op", "op", "ampfused.ops.unscale_update_scale_ on the whole list",
           AmpfusedOpRunner),
    Method("torch-ops", "op", "torch._amp_foreach_non_finite_check_and_unscale_ per dtype + "
           "_amp_update_scale_", TorchOpsRunner, _torch_na),
    # Three passes and a bool temporary per tensor: seconds a step for 100 M parameters.
    Method("naive", "op", "per tensor isfinite(g).all() and g.mul_(inv), one host sync",
           NaiveRunner, max_cpu_bytes=128 << 20),
    Method("apex", "op", "apex amp_C.multi_tensor_scale per dtype + overflow .item()",
           ApexRunner, present=lambda d: amp_C is not None and is_gpu(d)),
    Method("floor-mul", "floor", "memory floor: in-place torch._foreach_mul_", ForeachMulFloor),
    Method("floor-masters", "floor", "float16 -> float32 copy and back over flat buffers, 12 B",
           lambda gs: CopyFloor(gs, masters=True), _na16, default=False),
    Method("floor-allreduce", "floor", f"one dist.all_reduce of one float32 flag{_GLOO}",
           AllReduceFloor, _dist_na, default=False),
    Method("floor-copy", "floor", "bandwidth ceiling: device-to-device copy (GPU)", CopyFloor,
           _copy_na, present=is_gpu),
)}  # fmt: skip
COMPARED = tuple(n for n, m in METHODS.items() if m.kind != "floor")
FLOORS = tuple(n for n, m in METHODS.items() if m.kind == "floor")


def select(names: list[str] | None, device: torch.device) -> list[Method]:
    """``names`` (or the default compared methods) plus every default floor, present ones only."""
    wanted = list(names) if names else [n for n in COMPARED if METHODS[n].default]
    wanted += [f for f in FLOORS if f not in wanted and METHODS[f].default]
    return [METHODS[n] for n in wanted if METHODS[n].present(device)]
