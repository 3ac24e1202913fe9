"""The methods compared, side by side, on one :class:`~benchmarks.workloads.GradSet`.

Each method is a runner with ``run()`` (the timed work of one optimizer step) and ``reset()``
(untimed: puts its loss-scale state back to the default 2^16, so the scale never drifts however
many steps are timed; the gradients are restored by the GradSet).  Runners keep the GradSet's own
gradient lists (not copies): a realloc workload refills them with new tensors at every restore.

scaler kind: ``unscale_(opt); step(opt); update()`` with a no-op optimizer (the diagnostics
             methods add per-gradient statistics: in the pass, or by hand as users log norms).
             The distributed methods (``*-dist``, ``ampfused-group``) are the same calls with a
             found_inf all-reduce over the world group; they run inside the 2-process
             ``distributed`` question (:mod:`benchmarks.bench_distributed`), which initializes
             the process group.
op kind:     the raw unscale + check + scale-update ops a hand-written scaler would call.
floor kind:  the memory floor over the same bytes (an in-place multiply; a device copy on GPU).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ampfused
from benchmarks.env import amp_C, is_gpu, multi_tensor_applier
from benchmarks.workloads import INIT_SCALE, GradSet, NoOpOptimizer, Workload

GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 2000


class Runner:
    """One method bound to one gradient set."""

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


# ampfused's scaler with float16 grads allowed (its public ``allow_fp16``), as for torch.
_ampfused_allow_fp16 = functools.partial(ampfused.GradScaler, allow_fp16=True)


class ScalerRunner(Runner):
    def __init__(self, cls: Callable[..., torch.amp.GradScaler], gs: GradSet) -> None:
        self.scaler = cls(gs.device.type, init_scale=INIT_SCALE)
        # scale() creates _scale and _growth_tracker on the device, as in training.
        self.scaler.scale(torch.ones((), device=gs.device))
        self.optimizer = gs.optimizer

    def reset(self) -> None:
        assert self.scaler._scale is not None and self.scaler._growth_tracker is not None
        self.scaler._scale.fill_(INIT_SCALE)
        self.scaler._growth_tracker.zero_()

    def run(self) -> None:
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()


def _ampfused_cls(gs: GradSet) -> Callable[..., torch.amp.GradScaler]:
    return _ampfused_allow_fp16 if gs.workload.has(torch.float16) else ampfused.GradScaler


def _torch_cls(gs: GradSet) -> type[torch.amp.GradScaler]:
    return _TorchScalerAllowFP16 if gs.workload.has(torch.float16) else torch.amp.GradScaler


def _ampfused_scaler(gs: GradSet) -> Runner:
    return ScalerRunner(_ampfused_cls(gs), gs)


def _torch_scaler(gs: GradSet) -> Runner:
    return ScalerRunner(_torch_cls(gs), gs)


# --------------------------------------------------------------------------- diagnostics
def _names(gs: GradSet) -> list[str]:
    return [f"param{i}" for i in range(len(gs.params))]


class WatchRunner(ScalerRunner):
    """ampfused.GradScaler after ``watch()`` of every parameter: the same three calls, the pass
    also recording each gradient's norm, abs-max and inf/NaN/zero counts on the device.  With
    ``read_norms``, ``grad_norms()`` after ``unscale_`` as a logging hook calls it (one
    device-to-host copy and the dict of floats built on the host)."""

    def __init__(self, gs: GradSet, read_norms: bool = False) -> None:
        super().__init__(_ampfused_cls(gs), gs)
        self.scaler.watch(list(zip(_names(gs), gs.params, strict=True)))
        self.read_norms = read_norms
        self.logged: dict[str, float] = {}

    def run(self) -> None:
        self.scaler.unscale_(self.optimizer)
        if self.read_norms:
            self.logged = self.scaler.grad_norms()
        self.scaler.step(self.optimizer)
        self.scaler.update()


class TorchNormsRunner(ScalerRunner):
    """What users log today (Lightning's ``grad_norm``, the usual per-layer loop): after torch's
    ``unscale_``, one ``torch._foreach_norm`` pass (fp32 results, as ampfused's), the total norm,
    and a ``.item()`` per layer and one for the total, into the same dict ``grad_norms()``
    returns."""

    def __init__(self, gs: GradSet) -> None:
        super().__init__(_torch_cls(gs), gs)
        self.grads = gs.grads
        self.keys = [f"grad_2.0_norm/{n}" for n in _names(gs)]
        self.logged: dict[str, float] = {}

    def run(self) -> None:
        self.scaler.unscale_(self.optimizer)
        norms = torch._foreach_norm(self.grads, 2, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms))
        logged = {k: n.item() for k, n in zip(self.keys, norms, strict=True)}
        logged["grad_2.0_norm_total"] = total.item()
        self.logged = logged
        self.scaler.step(self.optimizer)
        self.scaler.update()


# --------------------------------------------------------------------------- clipping
# Small enough that every set is clipped (the coefficient is applied either way, as in torch).
CLIP_MAX_NORM = 1e-3


class ClipRunner(ScalerRunner):
    """``unscale_`` + clip by the total L2 norm + ``step`` + ``update``: with ``fused``,
    ampfused's ``clip_grad_norm_(opt, max_norm)`` (a read pass for inf/NaN and the norm, one
    multiply pass: 12 B per fp32 element); else torch's pair, ``unscale_`` then
    ``torch.nn.utils.clip_grad_norm_`` (foreach: 8 + 4 + 8 = 20 B)."""

    def __init__(self, gs: GradSet, fused: bool) -> None:
        super().__init__(_ampfused_cls(gs) if fused else _torch_cls(gs), gs)
        self.fused = fused
        self.params = gs.params

    def run(self) -> None:
        if self.fused:
            self.scaler.clip_grad_norm_(self.optimizer, CLIP_MAX_NORM)
        else:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, CLIP_MAX_NORM, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def bytes_moved(self, gs: GradSet) -> int:
        per_fp32_element = 12 if self.fused else 20
        return gs.workload.unscale_bytes * per_fp32_element // 8


# --------------------------------------------------------------------------- master weights
class MastersRunner(ScalerRunner):
    """float16 parameters stepped through float32 masters: ``unscale_`` + ``step`` + ``update``
    with a no-op inner optimizer.  With ``fused``, ``ampfused.MasterWeights`` and
    ``ampfused.GradScaler``: one pass reads each float16 gradient and writes its master's float32
    gradient unscaled (2 + 4 B per element), the step copies the masters back (4 + 2 B): 12 B.
    Else the recipe with torch's scaler: cast the gradients (``_foreach_copy_``, 6 B), torch's
    ``unscale_`` of the masters' gradients (8 B), copy back (6 B): 20 B."""

    def __init__(self, gs: GradSet, fused: bool) -> None:
        super().__init__(ampfused.GradScaler if fused else torch.amp.GradScaler, gs)
        self.fused = fused
        # Parameters of its own (the GradSet's are views of one shared buffer, whose version
        # counter the other runner's copy back would bump), holding the GradSet's gradients.
        self.params = [torch.nn.Parameter(p.detach().clone()) for p in gs.params]
        for p, g in zip(self.params, gs.grads, strict=True):
            p.grad = g
        self.grads = gs.grads
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
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if not self.fused:
            torch._foreach_copy_(self.params, self.masters)

    def bytes_moved(self, gs: GradSet) -> int:
        # unscale_bytes is 4 B per float16 element (read + write)
        return gs.workload.unscale_bytes * (12 if self.fused else 20) // 4


# --------------------------------------------------------------------------- distributed
def _torch_sharded_cls() -> Callable[..., torch.amp.GradScaler]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler


def _ampfused_group_cls(gs: GradSet) -> Callable[..., torch.amp.GradScaler]:
    # dist.group.WORLD is None until init_process_group(): read when the runner is made.
    return functools.partial(_ampfused_cls(gs), found_inf_group=dist.group.WORLD)


class DTensorScalerRunner(ScalerRunner):
    """A scaler over DTensor gradients, as FSDP2 (``fully_shard``) hands them over: each of the
    GradSet's gradients is this rank's local shard (``Shard(0)`` on a 1-D mesh of the world) of
    a DTensor gradient of a DTensor parameter.  The shards are the GradSet's tensors themselves,
    so its restore refills them."""

    def __init__(self, cls: Callable[..., torch.amp.GradScaler], gs: GradSet) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh(gs.device.type, (dist.get_world_size(),))
        params = []
        with torch.no_grad():
            for p in gs.params:
                shard = [Shard(0)]
                dp = torch.nn.Parameter(
                    DTensor.from_local(p.detach(), mesh, shard, run_check=False)
                )
                dp.grad = DTensor.from_local(p.grad, mesh, shard, run_check=False)
                params.append(dp)
        self.params = params
        super().__init__(cls, gs)
        self.optimizer = NoOpOptimizer(params)


class AllReduceFloor(Runner):
    """One ``dist.all_reduce`` (SUM) of a one-element float32 tensor over the world group: the
    least a step that agrees on found_inf across ranks adds to the single-process step."""

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
    """torch's ops as its scaler calls them, minus the Python walk over parameters: per-dtype
    lists grouped once up front, one ``_amp_foreach_non_finite_check_and_unscale_`` per dtype,
    then ``_amp_update_scale_``."""

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
    """``ampfused.ops.unscale_update_scale_`` on the whole list (all dtypes in one call)."""

    def __init__(self, gs: GradSet) -> None:
        dev = gs.device
        self.grads = gs.grads
        self.found_inf = torch.zeros((), device=dev)
        self.scale = torch.full((), INIT_SCALE, device=dev)
        self.tracker = torch.zeros((), dtype=torch.int32, device=dev)
        self.next_scale = torch.zeros((), device=dev)
        self.next_tracker = torch.zeros((), dtype=torch.int32, device=dev)

    def run(self) -> None:
        ampfused.ops.unscale_update_scale_(
            self.grads,
            self.found_inf,
            self.scale,
            self.tracker,
            self.next_scale,
            self.next_tracker,
            GROWTH,
            BACKOFF,
            INTERVAL,
        )


class _HostScaleRunner(Runner):
    """A scaler whose scale is a Python float (hand-written loops, apex): torch's update rule
    applied on the host after one sync per step."""

    def reset(self) -> None:
        self.scale = INIT_SCALE
        self.tracker = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= BACKOFF
            self.tracker = 0
            return
        self.tracker += 1
        if self.tracker == INTERVAL:
            self.scale *= GROWTH
            self.tracker = 0


class NaiveRunner(_HostScaleRunner):
    """What one writes by hand: per tensor an isfinite check and a ``mul_``, the scale a Python
    float, one host sync to decide the skip."""

    def __init__(self, gs: GradSet) -> None:
        self.grads = gs.grads
        self.reset()

    def run(self) -> None:
        inv = 1.0 / self.scale
        finite = []
        for g in self.grads:
            finite.append(torch.isfinite(g).all())
            g.mul_(inv)
        self.update(not bool(torch.stack(finite).all()))


class ApexRunner(_HostScaleRunner):
    """NVIDIA apex's ``amp_C.multi_tensor_scale`` per dtype (scale passed as a host float, as
    apex's loss scaler does), then its overflow check: one ``.item()`` per step."""

    def __init__(self, gs: GradSet) -> None:
        self.groups = list(gs.groups.values())
        self.overflow = torch.zeros(1, dtype=torch.int32, device=gs.device)
        self.reset()

    def run(self) -> None:
        self.overflow.zero_()
        inv = 1.0 / self.scale
        for grads in self.groups:
            multi_tensor_applier(amp_C.multi_tensor_scale, self.overflow, [grads, grads], inv)
        self.update(bool(self.overflow.item()))


# --------------------------------------------------------------------------- floors
class ForeachMulFloor(Runner):
    """One in-place ``torch._foreach_mul_`` pass per dtype: the same bytes read and written as an
    unscale, with no finiteness check and no scale logic."""

    def __init__(self, gs: GradSet) -> None:
        self.groups = list(gs.groups.values())

    def run(self) -> None:
        for grads in self.groups:
            torch._foreach_mul_(grads, 1.0 / INIT_SCALE)


class MastersFloor(Runner):
    """The bytes a master-weights step cannot avoid: every float16 gradient read and written
    as float32 (the cast in), every float32 master read and written as float16 (the copy back);
    two ``copy_`` over flat buffers, 12 B per element."""

    def __init__(self, gs: GradSet) -> None:
        self.low = gs.flats[torch.float16]
        self.high = torch.empty_like(self.low, dtype=torch.float32)

    def run(self) -> None:
        self.high.copy_(self.low)
        self.low.copy_(self.high)

    def bytes_moved(self, gs: GradSet) -> int:
        return 6 * (self.low.numel() + self.high.numel())


class CopyFloor(Runner):
    """A device-to-device copy of the gradient buffers (one ``copy_`` per dtype): the bandwidth
    ceiling of any read+write pass."""

    def __init__(self, gs: GradSet) -> None:
        self.pairs = [(gs.flats[dt], gs.pristine[dt]) for dt in gs.flats]

    def run(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)

    def bytes_moved(self, gs: GradSet) -> int:
        return 2 * sum(dst.numel() * dst.element_size() for dst, _ in self.pairs)


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
    # Run when no --methods is given; the others run in their own question (diagnostics, clip,
    # masters, distributed) or when --methods names them.
    default: bool = True


def _torch_na(w: Workload, d: torch.device) -> str | None:
    if is_gpu(d) and w.has(torch.bfloat16):
        return "torch's CUDA unscale kernel has no bfloat16"
    return None


def _copy_na(w: Workload, d: torch.device) -> str | None:
    if w.realloc:
        return "the copy floor does not depend on how gradients are allocated (see same-grads)"
    return None


def _float16_only_na(w: Workload, d: torch.device) -> str | None:
    if set(w.dtypes()) != {torch.float16} or w.realloc:
        return "master weights are measured on float16 gradient sets (same gradients)"
    return None


def _dist_na(w: Workload, d: torch.device) -> str | None:
    if not dist.is_available() or not dist.is_initialized():
        return "needs a torch.distributed process group (the distributed question has one)"
    return None


def _ampfused_na(w: Workload, d: torch.device) -> str | None:
    params = inspect.signature(ampfused.GradScaler).parameters
    if w.has(torch.float16) and "allow_fp16" not in params:
        return "float16 grads: the scaler raises ValueError (no allow_fp16 option)"
    return None


def _ampfused_dist_na(w: Workload, d: torch.device) -> str | None:
    if not hasattr(ampfused, "ShardedGradScaler"):
        return "this ampfused has no ShardedGradScaler"
    return _dist_na(w, d)


def _ampfused_group_na(w: Workload, d: torch.device) -> str | None:
    if "found_inf_group" not in inspect.signature(ampfused.GradScaler).parameters:
        return "this ampfused.GradScaler has no found_inf_group option"
    return _ampfused_na(w, d) or _dist_na(w, d)


_STEP = "+ step + update, no-op optimizer"
_GLOO = "; 2 processes, gloo"
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ampfused", "scaler", f"ampfused.GradScaler: unscale_ {_STEP}", _ampfused_scaler,
               _ampfused_na),
        Method("torch", "scaler", f"torch.amp.GradScaler: unscale_ {_STEP}", _torch_scaler,
               _torch_na),
        Method("ampfused-watch", "scaler", "ampfused.GradScaler after watch(parameters): the "
               "pass also records each gradient's norm, abs-max, inf/NaN/zero counts",
               WatchRunner, _ampfused_na, default=False),
        Method("ampfused-norms", "scaler", "ampfused-watch plus grad_norms() after unscale_ (one "
               "sync, a dict of floats)", lambda gs: WatchRunner(gs, read_norms=True),
               _ampfused_na, default=False),
        Method("torch-norms", "scaler", "torch.amp.GradScaler: unscale_, torch._foreach_norm, "
               ".item() per layer and for the total, step + update", TorchNormsRunner, _torch_na,
               default=False),
        Method("ampfused-clip", "scaler", f"ampfused.GradScaler: clip_grad_norm_(opt, max_norm) "
               f"(unscale + clip, two passes, 12 B per fp32 element) {_STEP}",
               lambda gs: ClipRunner(gs, fused=True), _ampfused_na, default=False),
        Method("torch-clip", "scaler", "torch.amp.GradScaler: unscale_, torch.nn.utils."
               f"clip_grad_norm_ (foreach; 20 B) {_STEP}", lambda gs: ClipRunner(gs, fused=False),
               _torch_na, default=False),
        Method("ampfused-masters", "scaler", "ampfused.MasterWeights + ampfused.GradScaler: "
               "float16 gradients into float32 master gradients in one pass, the masters copied "
               "back by step (12 B per element)", lambda gs: MastersRunner(gs, fused=True),
               _float16_only_na, default=False),
        Method("torch-masters", "scaler", "float32 masters by hand: _foreach_copy_ of the "
               "gradients, torch.amp.GradScaler unscale_ + step + update, _foreach_copy_ back "
               "(20 B)", lambda gs: MastersRunner(gs, fused=False), _float16_only_na,
               default=False),
        Method("ampfused-dist", "scaler", "ampfused.ShardedGradScaler (world group): found_inf "
               f"all-reduced with SUM in unscale_ {_STEP}{_GLOO}",
               lambda gs: ScalerRunner(ampfused.ShardedGradScaler, gs), _ampfused_dist_na,
               default=False),
        Method("torch-dist", "scaler", "torch's FSDP1 ShardedGradScaler (world group): found_inf "
               f"all-reduced with SUM {_STEP}{_GLOO}",
               lambda gs: ScalerRunner(_torch_sharded_cls(), gs), _dist_na, default=False),
        Method("ampfused-group", "scaler", "ampfused.GradScaler(found_inf_group=WORLD): one MAX "
               f"all-reduce of found_inf per pass {_STEP}{_GLOO}",
               lambda gs: ScalerRunner(_ampfused_group_cls(gs), gs), _ampfused_group_na,
               default=False),
        Method("ampfused-fsdp2", "scaler", "ampfused.GradScaler over DTensor gradients (Shard(0) "
               "on a 1-D mesh, as FSDP2's): one pass over the local shards, one all-reduce "
               f"{_STEP}{_GLOO}", lambda gs: DTensorScalerRunner(_ampfused_cls(gs), gs),
               _ampfused_group_na, default=False),
        Method("torch-fsdp2", "scaler", "torch.amp.GradScaler over the same DTensor gradients "
               f"(through DTensor dispatch) {_STEP}{_GLOO}",
               lambda gs: DTensorScalerRunner(_torch_cls(gs), gs), _dist_na, default=False),
        Method("ampfused-op", "op", "ampfused.ops.unscale_update_scale_: unscale + check + "
               "pending scale update, one call", AmpfusedOpRunner),
        Method("torch-ops", "op", "torch._amp_foreach_non_finite_check_and_unscale_ per dtype + "
               "_amp_update_scale_", TorchOpsRunner, _torch_na),
        # Three passes and a bool temporary per tensor: seconds a step for 100 M parameters.
        Method("naive", "op", "Python loop: isfinite(g).all() + g.mul_(inv) per tensor, one sync",
               NaiveRunner, max_cpu_bytes=128 << 20),
        Method("apex", "op", "apex amp_C.multi_tensor_scale per dtype + overflow .item()",
               ApexRunner, present=lambda d: amp_C is not None and is_gpu(d)),
        Method("floor-mul", "floor", "memory floor: in-place torch._foreach_mul_ over the same "
               "gradients", ForeachMulFloor),
        Method("floor-masters", "floor", "memory floor of a master-weights step: float16 -> "
               "float32 copy and back over flat buffers (12 B per element)", MastersFloor,
               _float16_only_na, default=False),
        Method("floor-allreduce", "floor", "the collective alone: dist.all_reduce of one float32 "
               "flag over the world group" + _GLOO, AllReduceFloor, _dist_na, default=False),
        Method("floor-copy", "floor", "bandwidth ceiling: device-to-device copy of the gradient "
               "buffers (GPU only)", CopyFloor, _copy_na, present=is_gpu),
    )
}  # fmt: skip
COMPARED = tuple(n for n, m in METHODS.items() if m.kind != "floor")
FLOORS = tuple(n for n, m in METHODS.items() if m.kind == "floor")


def select(names: list[str] | None, device: torch.device) -> list[Method]:
    """The methods to run: ``names`` (or the default compared ones), plus every default floor,
    present ones only (a question's own floor, such as floor-masters, runs when named)."""
    wanted = list(names) if names else [n for n in COMPARED if METHODS[n].default]
    wanted += [f for f in FLOORS if f not in wanted and METHODS[f].default]
    return [METHODS[n] for n in wanted if METHODS[n].present(device)]
