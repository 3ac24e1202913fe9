"""The pass: one read of every gradient per iteration, unscaling it, checking it for inf/NaN and
computing the scale update from the same read.

:func:`found_inf` decides which route an optimizer's gradients take, in one place:

* a :class:`~ampfused.MasterWeights` optimizer: its float16 gradients unscaled into the masters'
  float32 ones (``MasterWeights._grads_to_masters``);
* a scaler subclass that overrides ``_unscale_grads_`` (e.g. to all-reduce found_inf): torch's
  methods, which call it;
* factors set behind the setters' back, which torch's update() refuses: torch's methods;
* otherwise the C++ walk (csrc/grad_gather.cpp: ``optimizer.param_groups`` read in C++, one
  fused launch per device, all dtypes, any count), with DTensor gradients (FSDP2, tensor
  parallel) as their local shards, the pending scale update written beside it
  (:mod:`ampfused._scale_state`), and under ``watch()`` or a fused clip a statistics table per
  device;
* gradients the walk cannot take (sparse, tensor subclasses other than DTensor, a device without
  ampfused kernels): torch's walk (``torch.amp.GradScaler._unscale_grads_``) over the groups
  already read.

Every route ends in :func:`agree`: found_inf made the same on every rank before anything reads
it (:mod:`ampfused._dist`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ampfused import _C, _dist
from ampfused._arguments import user_stacklevel
from ampfused._scale_state import READ_ONLY_PASS, STATE_SIZE, kernel_update_args
from ampfused._torch_private import tensor_version
from ampfused.master_weights import MasterWeights

__all__ = ["found_inf", "agree", "unscale_grads", "multiply_grads", "read_param_groups"]

# Devices with ampfused kernels; others (mps, xpu, ...) use torch's implementation unchanged.
KERNEL_DEVICES = ("cpu", "cuda")

Found = dict[torch.device, torch.Tensor]


# ----------------------------------------------------------------------------- optimizers
class ParamGroups:
    """Stands in for an optimizer in torch's ``_unscale_grads_``, which reads only
    ``param_groups``: lets torch's walk reuse groups already read from a one-shot iterable."""

    __slots__ = ("param_groups",)

    def __init__(self, param_groups: list | tuple) -> None:
        self.param_groups = param_groups


def read_param_groups(optimizer: Any) -> list | tuple:
    """``optimizer.param_groups`` as a list or tuple, read once: torch's scaler walks it with a
    for loop, so any iterable works there, a generator included (read once per pass)."""
    groups = optimizer.param_groups
    if type(groups) is list or type(groups) is tuple:
        return groups
    try:
        iterator = iter(groups)
    except TypeError as e:
        raise TypeError(
            "optimizer.param_groups must be an iterable of dicts with a 'params' entry, got "
            f"{type(groups).__name__}"
        ) from e
    return list(iterator)


def flat_params(groups: Any) -> list:
    return [p for g in groups for p in g["params"]]


def group_index(groups: Any, position: int) -> tuple[int, int]:
    """(group, index in the group) of a position in flat_params(groups)."""
    for g, group in enumerate(groups):
        n = len(group["params"])
        if position < n:
            return g, position
        position -= n
    raise IndexError(position)


# ----------------------------------------------------------------------------- the pass
def found_inf(
    scaler: Any,
    optimizer: Any,
    check_only: bool,
    allow_fp16: bool,
    tables: list | None = None,
    caller_depth: int = 0,
) -> Found | None:
    """One pass over the optimizer's gradients (unscaling them unless check_only), with the
    pending update computed; found_inf per device, agreed across ranks.

    Returns None, having read nothing, when torch's method must run instead (its own
    ``unscale_`` / ``_check_inf_per_device``, which call ``_unscale_grads_``).  With ``tables``,
    the pass writes statistics and appends (table, positions, groups) per device to it (none
    where gradients took torch's walk).  caller_depth: frames between the scaler's public
    method and this call beyond the one (for the warning a watch() gives).

    A scaler subclass that overrides ``_unscale_grads_`` (``scaler._pass_base`` is the class
    whose ``_unscale_grads_`` is the fused walk) hooks the unscale: its gradients take torch's
    methods, which call the override.
    """
    scale, tracker = scaler._scale, scaler._growth_tracker
    assert scale is not None and tracker is not None
    if not (scale.is_cuda or scale.is_cpu):
        return None
    allow_fp16 = allow_fp16 or scaler._allow_fp16  # as _unscale_grads_ for torch's walk
    watch = scaler._watch
    first_table = len(watch.now) if watch is not None else 0
    hooked = type(scaler)._unscale_grads_ is not scaler._pass_base._unscale_grads_
    if isinstance(optimizer, MasterWeights):
        island_set = scaler._island_set
        islands = None if island_set is None else island_set.active("GradScaler.unscale_")
        if islands is not None and check_only and scaler._scaling:
            raise NotImplementedError(
                "scale islands: this MasterWeights optimizer unscales its gradients itself by "
                "the one global scale, but the islands' gradients carry their own factors; "
                "leave islands out with it"
            )
        if hooked:
            raise NotImplementedError(
                f"{type(scaler).__name__} overrides _unscale_grads_ (e.g. to all-reduce "
                "found_inf), which a MasterWeights optimizer's pass does not call; use "
                "ampfused.GradScaler itself with MasterWeights"
            )
        state = scaler._scale_state
        if islands is not None:
            islands.ensure_state(scale, state.pass_input(scale, tracker))
        if watch is not None:
            _masters_statistics(scaler, optimizer, watch, caller_depth, islands)
        # Low-precision gradients unscaled into the masters' float32 ones (a check-only pass
        # casts them unscaled, for an optimizer that divides by the scale itself).
        inv = torch.ones((), dtype=torch.float32, device=scale.device)
        if not check_only:
            inv = inv_scale(scaler)
        if state.headroom and not state.dtypes_seen:
            check_headroom_dtypes(scaler, [{"params": optimizer.model_params}])
        if state.headroom and watch is not None:
            # (the masters' pass measures nothing itself: the update reads the traced float16
            # activation gradients and the statistics pass's float16 parameter gradients)
            nxt = state.pending_buffer(scale.device)
            view = state.magnitude_view(nxt)
            wrote = watch.tracer is not None and activation_magnitude(
                watch.tracer.now, view, islands
            )
            state.measured = _masters_magnitude(watch.now[first_table:], scale, view, wrote)
            state.measured |= wrote
        return agree(scaler, optimizer._grads_to_masters(inv, islands), (), first_table)
    island_set = scaler._island_set
    islands = None if island_set is None else island_set.active("GradScaler.unscale_")
    if islands is not None:
        if hooked:
            raise NotImplementedError(
                f"{type(scaler).__name__} overrides _unscale_grads_, which does not unscale "
                "scale islands' gradients by their own factors; use ampfused.GradScaler "
                "itself with islands"
            )
        if check_only and scaler._scaling:
            raise NotImplementedError(
                "scale islands: this optimizer unscales its gradients itself (a fused "
                "optimizer, _step_supports_amp_scaling) by the one global scale, but the "
                "islands' gradients carry their own factors; use the optimizer without "
                "fused=True, or leave islands out"
            )
    if hooked:
        return None
    factors = (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)
    args = kernel_update_args(factors)
    if args is None:  # values set behind the setters' back: torch's update() raises
        return None
    groups = read_param_groups(optimizer)
    dev = scale.device
    state = scaler._scale_state
    unwrap = _dist.dtensor_unwrap()
    pending = state.pending
    # (an earlier pass of this iteration: its verdict and magnitude are combined with this one's;
    # state.measured also where an agreement dropped the pending record)
    accumulate = (pending is not None and bool(pending.found)) or state.measured
    nxt = state.pending_buffer(dev)
    island_of = island_inv = None
    if islands is not None:
        islands.ensure_state(scale, state.pass_input(scale, tracker))
        island_of, island_inv = islands.of_groups(flat_params(groups)), islands.inv
    if state.headroom and not accumulate and watch is not None and watch.tracer is not None:
        # The traced activation gradients' magnitude, taken into the pass's as an earlier one's
        # (an island's at the global scale: divided by its factor)
        accumulate = activation_magnitude(watch.tracer.now, state.magnitude_view(nxt), islands)
    result = _C.fused_pass(
        groups,
        state.pass_input(scale, tracker),
        nxt,
        *args,
        *state.kernel_policy,
        check_only,
        accumulate,
        allow_fp16,
        watch is not None or tables is not None,
        unwrap,
        state.headroom,
        island_of,
        island_inv,
    )
    if result is None and islands is not None:
        raise NotImplementedError(
            "scale islands: some gradient needs torch's own unscale walk (sparse, or a tensor "
            "subclass other than DTensor), which does not unscale islands' gradients by their "
            "own factors; leave islands out for this model"
        )
    if result is None:
        # A gradient needs torch's walk: run it over the groups read above, with the inputs
        # torch's methods give it.
        if watch is not None:
            watch.not_covered("torch's own unscale path", caller_depth)
        inv = torch.ones((), dtype=torch.float32, device=dev)
        if not check_only:
            inv = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        found = torch_walk(scaler, groups, inv, found_inf, allow_fp16)
        return agree(scaler, found, (), first_table)
    if watch is not None and watch.name_check:  # (the first iteration under watch() only)
        watch.check_names(groups)
    if state.headroom and not state.dtypes_seen:  # (the first pass with gradients only)
        check_headroom_dtypes(scaler, groups)
    # DTensor gradients have their found_inf reduced over their meshes; a rank with no gradient
    # joins the all-reduces the ranks with gradients run (checked only then: no cost per step).
    mesh_plan = _dist.mesh_plan(unwrap[3]) if unwrap is not None and unwrap[3] else []
    if not result:
        mesh_plan = _dist.mesh_plan(_dist.param_meshes(groups))
    pending = state.pending or state.start_pending(scale, tracker, factors)
    # The magnitude in `nxt` is this iteration's where a pass ran on the scale's device (or an
    # earlier one, or the tracer, wrote it); else prepare_next and agree() take it as none.
    state.measured = bool(state.headroom) and (accumulate or any(r[0] == dev for r in result))
    found = {}
    for device, flag, stats, positions in result:
        found[device] = flag
        if device == dev:
            pending.found[id(flag)] = (flag, tensor_version(flag))  # (Pending.note, inline)
        if stats is not None:
            if watch is not None:
                watch.now.append((stats, positions, groups))
            if tables is not None and not mesh_plan:  # (sharded: the norm needs every rank)
                tables.append((stats, positions, groups))
    return agree(scaler, found, mesh_plan, first_table)


def check_headroom_dtypes(scaler: Any, groups: Any) -> None:
    """The headroom policy keeps the largest gradient ``headroom`` times below float16's largest
    value (65,504): a rule for float16.  At the first pass that meets gradients, a UserWarning
    where they, or the traced activations, are bfloat16 and none is float16: bfloat16 has
    float32's range and wants no loss scale (``scaling=False``).  Reads the dtypes of lists and
    tuples of parameters only (a generator was read by the pass)."""
    dtypes: set[torch.dtype] = set()
    for group in groups:
        params = group.get("params") if isinstance(group, dict) else None
        if isinstance(params, (list, tuple)):
            dtypes.update(
                p.grad.dtype for p in params if isinstance(p, torch.Tensor) and p.grad is not None
            )
    watch = scaler._watch
    if watch is not None and watch.tracer is not None:
        dtypes.update(row[6] for row in watch.tracer.now)  # (the traced outputs' dtypes)
    if not dtypes:
        return  # (no gradient yet: the next pass looks)
    scaler._scale_state.dtypes_seen = True
    if torch.bfloat16 in dtypes and torch.float16 not in dtypes:
        warnings.warn(
            f"{type(scaler).__name__}(policy='headroom') meets bfloat16 gradients, but the "
            "headroom policy is a float16 rule: it moves the scale to keep the largest gradient "
            "headroom times below float16's largest value (65,504), and bfloat16, which has "
            "float32's range, overflows nowhere near it, so the scale it sets (and grows) "
            "protects nothing.  bfloat16 training needs no loss scale: use "
            f"{type(scaler).__name__}(..., scaling=False), which keeps the scale at 1.0 and "
            "still skips the steps with inf/NaN.  (Given once per scaler.)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def activation_magnitude(rows: list, into: torch.Tensor, islands: Any = None) -> bool:
    """The largest finite magnitude of this iteration's traced float16 activation gradients
    (the scaled values: what overflows in backward) written into `into` (float32, on the
    scale's device; no sync).  Returns whether any was traced.  `islands`: the scale islands
    (ampfused.scale_islands.Islands) or None; a row of a module inside one is taken at the
    global scale (times the island's inverse factor)."""
    of = islands.island_of_module if islands is not None else None
    columns = []
    for name, _, direction, _, table, _, dtype, input_rows in rows:
        if direction != "backward" or dtype != torch.float16:
            continue
        column = table[1 + input_rows :, 1].to(into.device)  # (abs_max; no inputs in backward)
        k = of(name) if of is not None else 0
        columns.append(column * islands.inv[k - 1] if k else column)
    if not columns:
        return False
    into.copy_(torch.cat(columns).max())
    return True


def _masters_statistics(
    scaler: Any, optimizer: Any, watch: Any, caller_depth: int, islands: Any = None
) -> None:
    """Under watch(), the statistics of a MasterWeights optimizer's float16 gradients, unscaled,
    by the model's parameters (the ones watch() names): a read-only pass before the masters'
    own (which casts and unscales and records nothing), writing only its table.  With scale
    islands each gradient is read with its island's inverse factor too (truly unscaled rows,
    as the fused pass's: the islands' update reads them)."""
    scale, tracker, state = scaler._scale, scaler._growth_tracker, scaler._scale_state
    groups = [{"params": optimizer.model_params}]
    scratch = torch.empty(STATE_SIZE, dtype=torch.int32, device=scale.device)  # (unused update)
    island_of = island_inv = None
    if islands is not None:
        island_of, island_inv = islands.of_groups(optimizer.model_params), islands.inv
    result = _C.fused_pass(
        groups,
        state.pass_input(scale, tracker),
        scratch,
        *READ_ONLY_PASS,
        True,  # allow_fp16: float16 gradients are what the masters' pass reads
        True,  # statistics
        _dist.dtensor_unwrap(),
        0.0,  # headroom: a read-only pass measures nothing for the rule
        island_of,
        island_inv,
    )
    if result is None:
        watch.not_covered("torch's own unscale path", caller_depth + 1)
        return
    if watch.name_check:
        watch.check_names(groups)
    for _, _, stats, positions in result:
        if stats is not None:
            watch.now.append((stats, positions, groups))


def _masters_magnitude(tables: list, scale: torch.Tensor, into: torch.Tensor, add: bool) -> bool:
    """The headroom policy's measurement of a MasterWeights optimizer's float16 gradients, from
    their statistics tables (:func:`_masters_statistics`: truly unscaled abs-max per item) at
    the global scale (times it, a float64 product rounded to float32, as the fused pass takes
    it from its rows), into `into` (max-ed with what is there where `add`: the traced
    activations' magnitude, written this iteration).  Inf/NaN counts as
    nothing here: the found_inf flag says it.  Returns whether any table was on its device."""
    tops = [t[1:, 1].max() for t, _, _ in tables if t.device == into.device and t.shape[0] > 1]
    if not tops:
        return False
    top = (torch.stack(tops).max() * scale.double()).float()
    top = torch.where(torch.isfinite(top), top, 0.0).reshape(1)
    if add:
        torch.maximum(into, top, out=into)
    else:
        into.copy_(top)
    return True


def agree(scaler: Any, found: Found, mesh_plan: Any, first_table: int, plan_done: int = 0) -> Found:
    """found_inf made the same on every rank: each flag all-reduced over the DTensors' meshes
    (MAX), then over found_inf_group (MAX; ShardedGradScaler: SUM over its process_group), in
    place, before anything reads it.  A rank without gradients joins with a zero flag on the
    scale's device, which it keeps as its result.  The pending update, computed from this
    rank's flags, is dropped (update() computes it from the agreed ones), and the verdict in
    this pass's statistics tables (the watched ones from first_table on) becomes the agreed
    one.  plan_done: how many of found_inf_group's reductions torch's own method already ran."""
    if not mesh_plan and not scaler._found_inf_plan:
        return found  # (single-process training: nothing to agree on)
    if not found:
        plan_done = 0  # torch's method had no flag to reduce: it ran none of the plan
    plan = _dist.unique([*mesh_plan, *scaler._found_inf_plan[plan_done:]])
    if not plan:
        return found
    if not found:
        dev = scaler._scale.device
        found = {dev: torch.zeros((), dtype=torch.float32, device=dev)}
    flags = list(found.values())
    state = scaler._scale_state
    if state.headroom:
        # The headroom policy: the magnitude is agreed in the same collective as the flag of
        # the scale's device (MAX: the verdict is the same as by SUM, any flag > 0), on every
        # rank alike; a rank that measured nothing joins with 0.
        dev = scaler._scale.device
        magnitude = state.magnitude_view(state.pending_buffer(dev))
        if not state.measured:
            magnitude.zero_()
        state.measured = True
        flag = found.get(dev)
        if flag is None:
            flag = found[dev] = torch.zeros((), dtype=torch.float32, device=dev)
            flags = list(found.values())
        pair = torch.stack((flag.reshape(()), magnitude[0]))
        _dist.all_reduce_flags([pair], [(group, _dist.max_op()) for group, _ in plan])
        flag.copy_(pair[0])
        magnitude.copy_(pair[1:])
        _dist.all_reduce_flags([f for f in flags if f is not flag], plan)
    else:
        _dist.all_reduce_flags(flags, plan)
    state.pending = None
    tables = scaler._watch.now[first_table:] if scaler._watch is not None else ()
    if tables:
        skipped = flags[0] > 0
        for f in flags[1:]:
            skipped = skipped | (f.to(skipped.device) > 0)
        for table, _, _ in tables:
            table[0, 2].copy_(skipped, non_blocking=True)
    return found


def agree_torch_result(scaler: Any, found: Found, plan_done: int = 0) -> Found:
    """:func:`agree` for found_inf that torch's own method computed (no statistics)."""
    first_table = len(scaler._watch.now) if scaler._watch is not None else 0
    return agree(scaler, found, (), first_table, plan_done)


# ----------------------------------------------------------------------------- walks
def unscale_grads(
    optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
) -> tuple[Found | None, Any]:
    """torch's ``_unscale_grads_`` contract, one launch per device instead of one per (device,
    dtype), and no Python loop over parameters.  Returns (None, the optimizer or its groups as
    read) where the gradients need the walk of the scaler's next class (torch's)."""
    if inv_scale.device.type not in KERNEL_DEVICES:
        return None, optimizer
    groups = read_param_groups(optimizer)
    result = _C.unscale_grads(groups, inv_scale, found_inf, allow_fp16)
    if result is not None:
        return dict(result), optimizer
    return None, ParamGroups(groups)  # (read once, reused)


def torch_walk(
    scaler: Any, groups: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
) -> Found:
    """torch's own walk (per parameter, per (device, dtype) group) over groups already read."""
    return torch.amp.GradScaler._unscale_grads_(
        scaler, ParamGroups(groups), inv_scale, found_inf, allow_fp16
    )


def multiply_grads(scaler: Any, groups: Any, factor: torch.Tensor) -> None:
    """Every gradient of the groups times factor, in place (multiply-or-pass)."""
    flag = torch.zeros((), dtype=torch.float32, device=factor.device)
    # (DTensors: their local shards, with no collective)
    if _C.unscale_grads(groups, factor, flag, True, _dist.dtensor_unwrap()) is None:
        torch_walk(scaler, groups, factor, flag, True)


def inv_scale(scaler: Any) -> torch.Tensor:
    """What the gradients are multiplied by: 1 / scale, as torch computes it (1 without
    scaling)."""
    if not scaler._scaling:
        return torch.ones((), dtype=torch.float32, device=scaler._scale.device)
    return scaler._scale.double().reciprocal().float()
