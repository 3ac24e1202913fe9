"""What the scaler needs from torch.distributed: the groups found_inf is agreed over, DTensor
gradients handed to the fused pass as their local shards, and the all-reduce itself.

Every rank of a data-, tensor- or pipeline-parallel job must make the same skip decision and keep
the same scale; otherwise replicas diverge, or hang in the next collective.  ampfused makes the
decision agree by all-reducing each found_inf flag before anything reads it (the optimizer's
step, ``update()``), on the device, with no host sync where the backend has none (NCCL).

torch.distributed is imported only when a group is given or a gradient is a DTensor: a
single-process user pays nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from ampfused._torch_private import DTENSOR_LOCAL_ATTR, DTENSOR_SPEC_ATTR

# (group, op): one all-reduce of the flag.  group None is torch's default (world) group.
Reduction = tuple[Any, Any]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class _NoGroup:
    """found_inf_group's default: no reduction.  (None is refused, not taken for it:
    ``dist.group.WORLD`` is None until ``init_process_group()`` has run, and a scaler made
    before then would silently never reduce.)"""

    def __repr__(self) -> str:
        return "ampfused.NO_GROUP"


NO_GROUP = _NoGroup()


def check_found_inf_group(where: str, value: Any, name: str = "found_inf_group") -> tuple[Any, ...]:
    """The found_inf_group argument (or another one, named ``name``) as a tuple of process
    groups (empty: no reduction).

    Accepts a ``torch.distributed.ProcessGroup`` (``dist.group.WORLD`` once the default group is
    initialized, ``dist.new_group(...)``, a ``DeviceMesh``'s ``get_group(dim)``), or a list or
    tuple of them.  On a rank outside a group, ``dist.new_group`` returns
    ``GroupMember.NON_GROUP_MEMBER``: accepted, and no collective is run over that group there.
    """
    if value is NO_GROUP:
        return ()
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    dist = _dist()
    if not dist.is_available():
        raise RuntimeError(
            f"{where}: {name} needs torch.distributed, which this build of torch does not have"
        )
    from torch.distributed.distributed_c10d import GroupMember

    groups = []
    for i, group in enumerate(items):
        if group is GroupMember.NON_GROUP_MEMBER:
            continue
        if not isinstance(group, dist.ProcessGroup):
            what = name if len(items) == 1 else f"{name}[{i}]"
            hint = (
                " (torch.distributed.group.WORLD is None until init_process_group() has run: "
                "make the scaler after it)"
                if group is None
                else ""
            )
            raise TypeError(
                f"{where}: {what} must be a torch.distributed.ProcessGroup (such as "
                "torch.distributed.group.WORLD, a dist.new_group(...) or a DeviceMesh's "
                f"get_group(dim)) or a list of them, got {type(group).__name__}{hint}"
            )
        if all(group is not g for g in groups):
            groups.append(group)
    return tuple(groups)


def max_op() -> Any:
    """torch.distributed's MAX reduction."""
    return _dist().ReduceOp.MAX


def reductions(groups: Sequence[Any], op_name: str) -> list[Reduction]:
    """(group, op) for each group: op_name "max" or "sum"."""
    if not groups:
        return []
    dist = _dist()
    op = dist.ReduceOp.MAX if op_name == "max" else dist.ReduceOp.SUM
    return [(g, op) for g in groups]


def dtensor_unwrap() -> tuple | None:
    """What the fused pass (``_C.fused_pass``/``_C.unscale_grads``'s ``unwrap``) needs to take
    DTensor gradients as their local shards: (DTensor, the local shard's attribute, the spec's
    attribute, a list the pass fills with each distinct (mesh, placements)); None when
    torch.distributed.tensor was never imported, so no gradient can be a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return None
    return (module.DTensor, DTENSOR_LOCAL_ATTR, DTENSOR_SPEC_ATTR, [])


def mesh_plan(seen: Sequence[tuple[Any, tuple]]) -> list[Reduction]:
    """The all-reduces (MAX) that make found_inf agree across the DTensor gradients' meshes,
    from the distinct (mesh, placements) the pass met.

    found_inf is reduced over every mesh dimension on which ANY gradient's placement is not
    Replicate (Shard or Partial): local shards there hold different values, so a rank may see
    an inf the others do not.  torch's DTensor handler looks at the first gradient's placements
    only, so with tensor parallelism (a Replicate gradient first, an inf in a Shard one) its
    ranks can disagree.  A mesh reduced over all its dimensions that spans the world takes one
    all-reduce over the world group; otherwise one per dimension, in dimension order.  Empty
    when every gradient is replicated (each rank then holds the whole gradient).
    """
    meshes: list[tuple[Any, set[int]]] = []  # (mesh, dims to reduce), in first-seen order
    for mesh, placements in seen:
        for entry in meshes:
            if entry[0] is mesh or entry[0] == mesh:
                dims = entry[1]
                break
        else:
            dims = set()
            meshes.append((mesh, dims))
        dims.update(d for d, placement in enumerate(placements) if not placement.is_replicate())
    dist = _dist()
    found: list[Reduction] = []
    for mesh, dims in meshes:
        if not dims:
            continue
        if len(dims) == mesh.ndim and mesh.size() == dist.get_world_size():
            found.append((None, dist.ReduceOp.MAX))
        else:
            found += [(mesh.get_group(dim), dist.ReduceOp.MAX) for dim in sorted(dims)]
    return found


def param_meshes(groups: Sequence[Any]) -> list[tuple[Any, tuple]]:
    """(mesh, placements) of each DTensor parameter of the groups, for :func:`mesh_plan` on a
    rank that holds no gradient: it must join the mesh all-reduces that the ranks whose
    gradients are DTensors run (FSDP2 and tensor-parallel gradients take their parameters'
    meshes and, but for Partial, their placements).  Empty when torch.distributed.tensor was
    never imported."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return []
    dtensor = module.DTensor
    return [
        (p.device_mesh, p.placements)
        for group in groups
        for p in group["params"]
        if isinstance(p, dtensor)
    ]


def unique(plan: list[Reduction]) -> list[Reduction]:
    """The plan without repeats of a (group, op): the default group given as None (a mesh that
    spans the world) and as the group object (found_inf_group=dist.group.WORLD) are one."""
    if len(plan) < 2:
        return plan
    world = _dist().group.WORLD
    out: list[Reduction] = []
    seen: list[Reduction] = []
    for group, op in plan:
        key = (world if group is None else group, op)
        if not any(key[0] is g and key[1] == o for g, o in seen):
            seen.append(key)
            out.append((group, op))
    return out


def all_reduce_flags(flags: Sequence[torch.Tensor], plan: Sequence[Reduction]) -> None:
    """Each flag all-reduced, in place, by each (group, op) of the plan, in order (every rank runs
    the same plan).  A CPU flag over an NCCL group (gradients offloaded to the CPU) is reduced
    through a copy on the current CUDA device, as NCCL takes no CPU tensors."""
    dist = _dist()
    for flag in flags:
        for group, op in plan:
            if flag.device.type == "cpu" and dist.get_backend(group) == "nccl":
                on_device = flag.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(on_device, op=op, group=group)
                flag.copy_(on_device)
            else:
                dist.all_reduce(flag, op=op, group=group)
