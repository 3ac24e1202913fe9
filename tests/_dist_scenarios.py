"""Scenarios run on every rank of a tests/_dist_pool.py pool: ``f(rank, world, device, **kw)``.

Each trains a small model for a few steps with one scaler, puts inf/NaN into ONE rank's
gradients at one step, and returns what the test compares across ranks, across scalers and
with a single-process reference: per step the scale, the growth tracker, whether the optimizer
stepped, the found_inf values; at the end every parameter's bytes.  Results are plain Python
values (bytes, floats, lists), so they cross the process boundary as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ampfused

INF = float("inf")
STEPS = 5
INF_STEP = 2  # the step whose gradients get inf/NaN, on one rank
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2  # so the scale grows inside STEPS as well as backing off


# ---------------------------------------------------------------------------------- pieces
def snap(t: torch.Tensor) -> bytes:
    """The tensor's bytes (a DTensor's full value: a collective, run on every rank)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    # (a clone: numpy would pin the storage, which FSDP frees by resizing it)
    return t.detach().cpu().clone().contiguous().view(torch.uint8).numpy().tobytes()


def make_scaler(kind: str, device: str) -> Any:
    dt = torch.device(device).type
    args = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    if kind == "torch":
        return torch.amp.GradScaler(dt, **args)
    if kind == "ampfused":
        return ampfused.GradScaler(dt, **args)
    if kind == "ampfused-group":
        return ampfused.GradScaler(dt, found_inf_group=dist.group.WORLD, **args)
    if kind == "torch-sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(dt, **args)
    if kind == "ampfused-sharded":
        return ampfused.ShardedGradScaler(dt, **args)
    raise ValueError(kind)


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if kind == "adam-fused":
        return torch.optim.Adam(params, lr=1e-2, fused=True)
    raise ValueError(kind)


def make_model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def batch(step: int, rank: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g).to(device)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(torch.device(x.device).type, dtype=torch.float16):
        return model(x).float().square().mean()


def scaler_state(scaler: Any) -> tuple[float, int]:
    sd = scaler.state_dict()
    return float(sd["scale"]), int(sd["_growth_tracker"])


def found_infs(scaler: Any, opt: Any) -> list[tuple[tuple[int, ...], list[float]]]:
    """(shape, values) of each found_inf the scaler recorded for opt this iteration."""
    flags = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
    return [(tuple(f.shape), f.reshape(-1).tolist()) for f in flags]


def train(
    rank: int,
    model: nn.Module,
    wrapped: nn.Module,
    opt: Any,
    scaler: Any,
    device: str,
    poison: Any,
    inf_rank: int = 1,
    clip: float | None = None,
) -> list[dict]:
    """STEPS iterations of scale(loss).backward(), step, update; at INF_STEP, on inf_rank (-1:
    every rank), poison(model) writes inf/NaN into a gradient after backward (after DDP's
    all-reduce, FSDP's reduce-scatter).  With clip, the gradients are clipped to that total
    norm: by ampfused's scaler.clip_grad_norm_, or unscale_ + torch.nn.utils.clip_grad_norm_ for
    torch's scalers; the norms are logged."""
    log = []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(wrapped, batch(step, rank, device))).backward()
        if step == INF_STEP and inf_rank in (rank, -1):
            with torch.no_grad():
                poison(model)
        entry: dict[str, Any] = {}
        if clip is not None:
            if isinstance(scaler, ampfused.GradScaler):
                norm = scaler.clip_grad_norm_(opt, clip)
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            entry["norm"] = norm.item()
        before = [snap(p) for p in model.parameters()]
        scaler.step(opt)
        flags = found_infs(scaler, opt)
        scaler.update()
        stepped = before != [snap(p) for p in model.parameters()]
        entry.update(state=scaler_state(scaler), stepped=stepped, found_inf=flags)
        log.append(entry)
    return log


def result(log: list[dict], model: nn.Module, **extra: Any) -> dict:
    return {"log": log, "params": [snap(p) for p in model.parameters()], **extra}


def poison_first_weight(value: float = INF) -> Any:
    def poison(model: nn.Module) -> None:
        grad = next(model.parameters()).grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = value

    return poison


# ---------------------------------------------------------------------------------- reference
def reference(world: int, opt_kind: str, device: str = "cpu") -> dict:
    """One process, the same data: the mean of the ranks' losses (what DDP and FSDP average),
    ampfused.GradScaler, and inf in the gradients at INF_STEP (every rank skips it)."""
    model = make_model(device)
    opt = make_opt(opt_kind, model.parameters())
    scaler = make_scaler("ampfused", device)
    log = []
    for step in range(STEPS):
        opt.zero_grad()
        losses = [loss_of(model, batch(step, r, device)) for r in range(world)]
        scaler.scale(sum(losses) / world).backward()
        if step == INF_STEP:
            with torch.no_grad():
                poison_first_weight()(model)
        scaler.step(opt)
        scaler.update()
        log.append({"state": scaler_state(scaler)})
    return {"log": log, "params": [p.detach().clone() for p in model.parameters()]}


# ---------------------------------------------------------------------------------- scenarios
def ddp(rank: int, world: int, device: str, scaler: str, opt: str, poison_value: float = INF):
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(device)
    wrapped = DistributedDataParallel(model)
    optimizer = make_opt(opt, model.parameters())
    sc = make_scaler(scaler, device)
    log = train(rank, model, wrapped, optimizer, sc, device, poison_first_weight(poison_value))
    return result(log, model)


def fsdp1(
    rank: int,
    world: int,
    device: str,
    scaler: str,
    opt: str,
    fp16_grads: bool = False,
    inf_rank: int = 1,
    cpu_offload: bool = False,
):
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision

    model = make_model(device)
    mp = None
    if fp16_grads:
        mp = MixedPrecision(
            param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True
        )
    wrapped = FullyShardedDataParallel(
        model,
        device_id=torch.device(device),
        mixed_precision=mp,
        use_orig_params=False,
        cpu_offload=CPUOffload(offload_params=cpu_offload),
    )
    optimizer = make_opt(opt, wrapped.parameters())
    sc = make_scaler(scaler, device)
    log = train(rank, wrapped, wrapped, optimizer, sc, device, poison_first_weight(), inf_rank)
    with FullyShardedDataParallel.summon_full_params(wrapped):
        params = [snap(p) for p in wrapped.parameters()]
    grad_dtypes = sorted({str(p.grad.dtype) for p in wrapped.parameters() if p.grad is not None})
    return {"log": log, "params": params, "grad_dtypes": grad_dtypes}


def _count_torch_unscale() -> list[int]:
    """Counts calls of torch's foreach check-and-unscale (what torch's scaler runs and
    ampfused's fused path does not)."""
    calls = [0]
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    torch._amp_foreach_non_finite_check_and_unscale_ = counted
    return calls


def fsdp2_model(device: str, world: int) -> nn.Module:
    """make_model's model, each Linear and the whole fully_shard-ed (FSDP2) over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world,))
    model = make_model(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2(
    rank: int,
    world: int,
    device: str,
    scaler: str,
    opt: str,
    clip: float | None = None,
    poison_value: float = INF,
):
    model = fsdp2_model(device, world)
    optimizer = make_opt(opt, model.parameters())
    sc = make_scaler(scaler, device)
    original = torch._amp_foreach_non_finite_check_and_unscale_
    calls = _count_torch_unscale()
    try:
        poison = poison_first_weight(poison_value)
        log = train(rank, model, model, optimizer, sc, device, poison, clip=clip)
    finally:
        torch._amp_foreach_non_finite_check_and_unscale_ = original
    return result(log, model, torch_unscale_calls=calls[0])


def tensor_parallel(
    rank: int, world: int, device: str, scaler: str, opt: str, shard_first: bool = False
):
    """A 2-D mesh (data x tensor parallel, 1 x world): a Replicate parameter and a Shard(0)
    one, whose gradients are set as DTensors of those placements; inf goes into rank 1's shard
    of the sharded gradient only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(torch.device(device).type, (1, world), mesh_dim_names=("dp", "tp"))
    rep, shard = [Replicate(), Replicate()], [Replicate(), Shard(0)]
    torch.manual_seed(0)
    w_rep = nn.Parameter(distribute_tensor(torch.randn(4, 4, device=device), mesh, rep))
    w_shard = nn.Parameter(distribute_tensor(torch.randn(8, 4, device=device), mesh, shard))
    params = [w_shard, w_rep] if shard_first else [w_rep, w_shard]
    optimizer = make_opt(opt, params)
    sc = make_scaler(scaler, device)
    log = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        scale = sc.scale(torch.ones((), device=device))  # (a loss, as a backward would scale)
        w_rep.grad = distribute_tensor(torch.randn(4, 4, generator=g).to(device) * scale, mesh, rep)
        w_shard.grad = distribute_tensor(
            torch.randn(8, 4, generator=g).to(device) * scale, mesh, shard
        )
        if step == INF_STEP and rank == 1:
            w_shard.grad.to_local()[0, 0] = INF
        before = [snap(p) for p in params]
        sc.step(optimizer)
        flags = found_infs(sc, optimizer)
        sc.update()
        stepped = before != [snap(p) for p in params]
        log.append({"state": scaler_state(sc), "stepped": stepped, "found_inf": flags})
    return {"log": log, "params": [snap(p) for p in params]}


def groups_without_params(rank: int, world: int, device: str, opt: str):
    """Megatron-style: found_inf reduced over a list of groups; rank 1's optimizer has no
    gradient at all (a pipeline stage without parameters of this kind); rank 0 finds inf at
    INF_STEP.  Every rank must take part in every collective and skip the same step.  The second
    group holds rank 0 only: on rank 1 dist.new_group returns NON_GROUP_MEMBER."""
    everyone = dist.new_group(list(range(world)))
    only_first = dist.new_group([0])
    sc = ampfused.GradScaler(
        torch.device(device).type,
        init_scale=INIT_SCALE,
        growth_interval=GROWTH_INTERVAL,
        found_inf_group=[everyone, only_first],
    )
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5, device=device))
    optimizer = make_opt(opt, [p])
    log = []
    for step in range(STEPS):
        optimizer.zero_grad()
        if rank == 0:
            sc.scale((p * p).sum()).backward()
            if step == INF_STEP:
                with torch.no_grad():
                    p.grad[1] = INF
        else:
            sc.scale(torch.ones((), device=device))  # the lazy init, as a forward would
        sc.step(optimizer)
        flags = found_infs(sc, optimizer)
        sc.update()
        log.append({"state": scaler_state(sc), "found_inf": flags, "counters": sc.counters()})
    return {"log": log}


def watched(rank: int, world: int, device: str):
    """watch() with found_inf_group under DDP: inf on rank 1 after the all-reduce.  Both ranks'
    reports say the step was skipped; only rank 1's names the culprit; counters agree."""
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(device)
    wrapped = DistributedDataParallel(model)
    optimizer = make_opt("sgd", model.parameters())
    sc = make_scaler("ampfused-group", device).watch(model)
    out = []
    for step in range(STEPS):
        optimizer.zero_grad()
        sc.scale(loss_of(wrapped, batch(step, rank, device))).backward()
        if step == INF_STEP and rank == 1:
            with torch.no_grad():
                model[2].bias.grad[0] = float("nan")
        sc.step(optimizer)
        report = sc.report()
        out.append(
            {
                "skipped": report.skipped,
                "offenders": [g.name for g in report.offenders],
                "step_skipped": sc.step_skipped(),
                "text": str(report),
            }
        )
        sc.update()
    return {"reports": out, "counters": sc.counters(), "state": scaler_state(sc)}


def ddp_islands(rank: int, world: int, device: str, group: bool = True):
    """Scale islands under DDP: each rank traces its own batch, so the islands' measurements
    differ per rank; with found_inf_group they are agreed and every rank holds the same factors
    (DDP's all-reduce then sums gradients at equal scales): the parameters stay equal.  Without
    it, watch() refuses (returns the error's text)."""
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(device)
    wrapped = DistributedDataParallel(model)
    optimizer = make_opt("sgd", model.parameters())
    dt = torch.device(device).type
    group_arg = dict(found_inf_group=dist.group.WORLD) if group else {}
    sc = ampfused.GradScaler(dt, policy="headroom", islands=["0"], **group_arg)
    try:
        sc.watch(model, activations=True)
    except RuntimeError as e:
        return {"error": str(e)}
    return train_islands(rank, device, model, wrapped, optimizer, sc)


def train_islands(
    rank: int, device: str, model: nn.Module, forward: nn.Module, optimizer: Any, sc: Any
) -> dict:
    """STEPS iterations, rank 1's batches 2^6 larger than rank 0's (so the ranks' measurements
    differ); each step's island factors and the final parameters."""
    factors = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x = batch(step, rank, device) * (64.0 if rank else 1.0)
        sc.scale(loss_of(forward, x)).backward()
        sc.step(optimizer)
        sc.update()
        factors.append(sc.island_factors())
    return {"factors": factors, "params": [snap(p) for p in model.parameters()]}


def fsdp2_islands(rank: int, world: int, device: str):
    """Scale islands on an FSDP2 model (each Linear and the model fully_shard-ed): the pass
    takes the islands' DTensor gradients as their local shards, each by its island's factor;
    with found_inf_group every rank holds the same factors and the same parameters."""
    model = fsdp2_model(device, world)
    optimizer = make_opt("sgd", model.parameters())
    dt = torch.device(device).type
    sc = ampfused.GradScaler(dt, policy="headroom", islands=["0"], found_inf_group=dist.group.WORLD)
    sc.watch(model, activations=True)
    return train_islands(rank, device, model, model, optimizer, sc)


def master_weights(rank: int, world: int, device: str):
    """float16 parameters with float32 masters (MasterWeights) under DDP, found_inf agreed:
    inf in rank 1's float16 model gradient after the all-reduce."""
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(device).half()
    wrapped = DistributedDataParallel(model)
    optimizer = ampfused.MasterWeights(make_opt("adam", model.parameters()))
    sc = make_scaler("ampfused-group", device)
    log = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x = batch(step, rank, device).half()
        sc.scale(wrapped(x).float().square().mean()).backward()
        if step == INF_STEP and rank == 1:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = INF
        before = [snap(p) for p in model.parameters()]
        sc.step(optimizer)
        sc.update()
        stepped = before != [snap(p) for p in model.parameters()]
        log.append({"state": scaler_state(sc), "stepped": stepped})
    return result(log, model)


def fsdp2_checkpoint(rank: int, world: int, device: str, path: str, opt: str):
    """FSDP2 resume through torch.distributed.checkpoint: train STEPS straight; train INF_STEP +
    1 steps, save model, optimizer (DCP) and scaler, build everything afresh, load (set_state_dict
    runs a dummy optimizer step to make the optimizer's state: the scaler must not notice), and
    train the rest.  Both runs must end with the same bytes and the same scaler state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world,))

    def build() -> tuple[nn.Module, Any, Any]:
        model = make_model(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, make_opt(opt, model.parameters()), make_scaler("ampfused", device)

    def run(model: nn.Module, optimizer: Any, sc: Any, steps: range) -> None:
        for step in steps:
            optimizer.zero_grad()
            sc.scale(loss_of(model, batch(step, rank, device))).backward()
            if step == INF_STEP and rank == 1:
                with torch.no_grad():
                    poison_first_weight()(model)
            sc.step(optimizer)
            sc.update()

    straight = build()
    run(*straight, range(STEPS))
    expected = ([snap(p) for p in straight[0].parameters()], straight[2].state_dict())

    first = build()
    split = INF_STEP + 1
    run(*first, range(split))
    model_sd, optim_sd = get_state_dict(first[0], first[1])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    scaler_sd = [first[2].state_dict() if rank == 0 else None]
    dist.broadcast_object_list(scaler_sd, src=0)

    model, optimizer, sc = build()
    sc.scale(torch.ones((), device=device))  # a scaler in use before loading, as in a resume
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the dummy step happens here
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    sc.load_state_dict(scaler_sd[0])
    loaded = sc.state_dict()
    run(model, optimizer, sc, range(split, STEPS))
    got = ([snap(p) for p in model.parameters()], sc.state_dict())
    return {"expected": expected, "got": got, "loaded": loaded, "saved": scaler_sd[0]}


class _HostReadsRaise:
    """While active, every Python-level way to read a tensor's value on the host raises (as
    tests/conftest.py's no_host_sync fixture, in a rank)."""

    NAMES = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__")

    def __enter__(self) -> None:
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(torch.Tensor, n, _raiser(f"Tensor.{n}"))

    def __exit__(self, *exc: Any) -> None:
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def _raiser(name: str) -> Any:
    def read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} called on a route that must not read the device")

    return read


def fused_step_reads_nothing(rank: int, world: int, device: str, engine: str) -> list[bool]:
    """Adam(fused=True) under each engine: scaler.step and update, the all-reduce included,
    read no tensor value on the host (on CUDA: no host sync)."""
    model = make_model(device)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped, params, sc = DistributedDataParallel(model), model.parameters(), "ampfused-group"
    elif engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model, device_id=torch.device(device))
        params, sc = wrapped.parameters(), "ampfused-sharded"
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model, mesh=init_device_mesh(torch.device(device).type, (world,)))
        params, sc = model.parameters(), "ampfused"
    optimizer = make_opt("adam-fused", params)
    scaler = make_scaler(sc, device)
    skipped = []
    for step in range(STEPS):
        optimizer.zero_grad()
        scaler.scale(loss_of(wrapped, batch(step, rank, device))).backward()
        if step == INF_STEP and rank == 1:
            with torch.no_grad():
                poison_first_weight()(wrapped)
        with _HostReadsRaise():
            scaler.step(optimizer)
            scaler.update()
            flag = scaler.step_skipped_tensor()
        skipped.append(bool(flag))
    return skipped


# ---------------------------------------------------------------------------------- edges
class _CountAllReduce:
    """While active, dist.all_reduce is counted and NOT run (returns at once): a scenario whose
    ranks would run different collectives reports the counts instead of hanging."""

    def __enter__(self) -> list[str]:
        self.saved = dist.all_reduce
        self.calls: list[str] = []

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            name = "world" if group is None else str(dist.get_process_group_ranks(group))
            self.calls.append(name)
            return _DoneWork() if kwargs.get("async_op") else None

        dist.all_reduce = counted
        return self.calls

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self.saved


class _DoneWork:
    def wait(self) -> bool:
        return True


def dtensor_rank_without_gradients(rank: int, world: int, device: str) -> list[str]:
    """DTensor parameters on a 1-D mesh, found_inf_group=WORLD (as for pipeline stages):
    rank 1's gradients are all None this iteration, rank 0's are DTensors.  The all-reduces
    each rank's unscale_ runs (counted, not run)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(torch.device(device).type, (world,))
    local = torch.ones(2, 4, device=device)
    p = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    optimizer = make_opt("sgd", [p])
    sc = ampfused.GradScaler(
        torch.device(device).type, init_scale=INIT_SCALE, found_inf_group=dist.group.WORLD
    )
    sc.scale(torch.ones((), device=device))
    if rank == 0:
        local = torch.ones(2, 4, device=device)
        p.grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    with _CountAllReduce() as calls:
        sc.unscale_(optimizer)
    return calls


class _HookedSharded(ampfused.ShardedGradScaler):
    """A subclass hooking _unscale_grads_: torch's ShardedGradScaler.unscale_ runs."""

    def _unscale_grads_(self, *args: Any) -> Any:
        return super()._unscale_grads_(*args)


def sharded_torch_path_rank_without_gradients(rank: int, world: int, device: str) -> list[str]:
    """ShardedGradScaler on torch's unscale_ path (a subclass hooking _unscale_grads_): rank 1
    has no gradient.  The all-reduces each rank's unscale_ runs (counted, not run)."""
    p = nn.Parameter(torch.ones(4, device=device))
    optimizer = make_opt("sgd", [p])
    sc = _HookedSharded(torch.device(device).type, init_scale=INIT_SCALE)
    sc.scale(torch.ones((), device=device))
    if rank == 0:
        p.grad = torch.ones(4, device=device)
    with _CountAllReduce() as calls:
        sc.unscale_(optimizer)
    return calls


def watch_two_optimizers(rank: int, world: int, device: str) -> dict:
    """watch() with found_inf_group: optimizer A (plain, watched) finds inf on every rank, then
    a MasterWeights optimizer B is clean.  A's step was skipped."""
    import warnings

    a = nn.Parameter(torch.ones(4, device=device))
    b = nn.Parameter(torch.ones(4, device=device, dtype=torch.float16))
    opt_a = make_opt("sgd", [a])
    opt_b = ampfused.MasterWeights(make_opt("sgd", [b]))
    sc = make_scaler("ampfused-group", device).watch([("a", a), ("b", b)])
    sc.scale(torch.ones((), device=device))
    a.grad = torch.tensor([1.0, INF, 1.0, 1.0], device=device)
    b.grad = torch.ones(4, device=device, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (B's statistics are recorded: nothing to warn of)
        sc.step(opt_a)
        sc.step(opt_b)
    report = sc.report()
    out = {"skipped": report.skipped, "offenders": [g.name for g in report.offenders]}
    sc.update()
    out["skipped_steps"] = sc.counters()["skipped_steps"]
    return out


def sharded_found_inf_shapes(rank: int, world: int, device: str) -> dict:
    """The found_inf tensors users can see, from ampfused's ShardedGradScaler and torch's: after
    unscale_, after unscale_ + clip, and step_skipped_tensor."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    dt = torch.device(device).type
    out = {}
    for name, cls in (("ampfused", ampfused.ShardedGradScaler), ("torch", ShardedGradScaler)):
        p = nn.Parameter(torch.ones(4, device=device))
        optimizer = make_opt("sgd", [p])
        sc = cls(dt, init_scale=INIT_SCALE)
        for how in ("unscale_", "clip"):
            sc.scale(torch.ones((), device=device))
            p.grad = torch.ones(4, device=device)
            sc.unscale_(optimizer)  # (ShardedGradScaler.clip_grad_norm_ refuses: FSDP clips)
            if how == "clip":
                torch.nn.utils.clip_grad_norm_([p], 1.0)
            out[f"{name} {how}"] = [shape for shape, _ in found_infs(sc, optimizer)]
            sc.step(optimizer)
            if name == "ampfused":
                out[f"{name} step_skipped_tensor after {how}"] = tuple(
                    sc.step_skipped_tensor().shape
                )
            sc.update()
    return out


def sharded_unscale_then_fused_step(rank: int, world: int, device: str) -> dict:
    """ShardedGradScaler, unscale_ (as before clipping), then Adam(fused=True), inf on rank 1 at
    INF_STEP; the same with ampfused.GradScaler(found_inf_group=WORLD), whose flags are 0-dim."""
    out = {}
    for kind in ("ampfused-sharded", "ampfused-group"):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(8, device=device))
        optimizer = make_opt("adam-fused", [p])
        sc = make_scaler(kind, device)
        log = []
        for step in range(STEPS):
            optimizer.zero_grad()
            sc.scale((p * p).sum()).backward()
            if step == INF_STEP and rank == 1:
                with torch.no_grad():
                    p.grad[0] = INF
            sc.unscale_(optimizer)
            sc.step(optimizer)
            sc.update()
            log.append(scaler_state(sc))
        out[kind] = {"log": log, "params": snap(p)}
    return out


def fsdp1_clip(rank: int, world: int, device: str) -> dict:
    """FSDP1, one step clipped to a total norm of 0.05 by FSDP's own clip (unscale_, then
    FullyShardedDataParallel.clip_grad_norm_: the norm over every rank's shards) under torch's
    and ampfused's ShardedGradScaler; ampfused's clip_grad_norm_ tried first (it must refuse,
    changing nothing).  The norms returned."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    out: dict[str, Any] = {}
    for kind in ("torch-sharded", "ampfused-sharded"):
        wrapped = FullyShardedDataParallel(make_model(device), device_id=torch.device(device))
        optimizer = make_opt("sgd", wrapped.parameters())
        sc = make_scaler(kind, device)
        sc.scale(loss_of(wrapped, batch(0, rank, device))).backward()
        if kind == "ampfused-sharded":
            before = [snap(p.grad) for p in wrapped.parameters()]
            try:
                sc.clip_grad_norm_(optimizer, 0.05)
            except NotImplementedError as e:
                out["refused"] = str(e)
            out["unchanged"] = before == [snap(p.grad) for p in wrapped.parameters()]
        sc.unscale_(optimizer)
        out[kind] = float(wrapped.clip_grad_norm_(0.05))
    return out


def headroom_traced(rank: int, world: int, device: str, group: bool) -> dict:
    """The headroom policy under DDP with traced activations, rank 1's loss 300 times larger (so
    are its activation gradients; the weight gradients are averaged): with found_inf_group the
    magnitude is agreed in the flag's all-reduce (one per step) and the ranks keep one scale;
    without, they drift apart."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    # No biases (their gradients sum over the batch), a large last layer, small inputs: the
    # float16 activation gradient between the layers is far larger than any weight gradient.
    model = nn.Sequential(nn.Linear(8, 64, bias=False), nn.ReLU(), nn.Linear(64, 4, bias=False))
    model = model.to(device)
    with torch.no_grad():
        model[2].weight.mul_(100.0)
    wrapped = DistributedDataParallel(model)
    # Two optimizers: the second pass of an iteration keeps the first's agreed magnitude.
    optimizers = [make_opt("sgd", [p]) for p in model.parameters()]
    kwargs = {"found_inf_group": dist.group.WORLD} if group else {}
    sc = ampfused.GradScaler(torch.device(device).type, policy="headroom", **kwargs)
    sc.watch(model, activations=True)
    calls = []
    real = dist.all_reduce

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    dist.all_reduce = counted
    scales = []
    try:
        for step in range(STEPS):
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss = loss_of(wrapped, batch(step, rank, device) * 1e-3)
            sc.scale(loss * (300.0 if rank == 1 else 1.0)).backward()
            for optimizer in optimizers:
                sc.step(optimizer)
            sc.update()
            scales.append(sc.get_scale())
    finally:
        dist.all_reduce = real
    params = [snap(p) for p in model.parameters()]
    return {"scales": scales, "all_reduces": len(calls), "params": params}
