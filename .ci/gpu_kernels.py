"""Every CUDA kernel of ampfused once over a handful of hard cases, compared with the CPU kernels.

Part of .ci/gpu: a short program for compute-sanitizer (memcheck, racecheck, synccheck), where
the test suite under the sanitizer would take many minutes, and a first look at what a broken
kernel does (one line per case, bytes compared, the first mismatches named).

    python3 .ci/gpu_kernels.py        # exits 1 if any case differs from the CPU kernels
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ampfused  # noqa: E402  (registers the ops)
from ampfused import ops  # noqa: E402

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
CHUNK = ops.CHUNK_SIZE
FAILURES: list[str] = []


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.view(view)


def same(name: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit equality, where a NaN matches any NaN: a GPU's arithmetic returns the canonical NaN
    (0x7fffffff) where x86 keeps the input's payload and sign (seen on an H100: every NaN that
    a kernel multiplied differed from the CPU kernel's in its bits)."""
    got = got.detach().cpu()
    if got.shape != want.shape:
        FAILURES.append(f"{name}: shape {tuple(got.shape)} on cuda, {tuple(want.shape)} on cpu")
        return False
    a, b = bits(got).flatten(), bits(want).flatten()
    if got.is_floating_point():
        both = (got.isnan() & want.isnan()).flatten()
        a, b = a.masked_fill(both, 0), b.masked_fill(both, 0)
    if torch.equal(a, b):
        return True
    at = (a != b).nonzero().flatten()[:5].tolist()
    g, w = got.flatten(), want.flatten()
    FAILURES.append(
        f"{name}: {got.dtype} differs at {at}: cuda={[g[i].item() for i in at]} "
        f"cpu={[w[i].item() for i in at]}"
    )
    return False


def grads_case(kind: str) -> list[torch.Tensor]:
    """CPU gradients (scaled values, some specials), views included."""
    g = torch.Generator().manual_seed(hash(kind) % 2**31)

    def r(n: int, dtype: torch.dtype) -> torch.Tensor:
        return (torch.randn(n, generator=g) * 1000).to(dtype)

    if kind == "mixed":
        big = r(3 * CHUNK + 5, F16)
        out = [r(1000, F32), big[1:], r(CHUNK, BF16), r(77, F64), r(0, F32)]
        strided = r(2 * 300, F32).view(300, 2)[:, 0]
        out.append(strided)
    elif kind == "float32":
        out = [r(n, F32) for n in (1, 3, 4, 17, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3)]
        out.append(r(CHUNK + 9, F32)[3:])  # misaligned
    elif kind == "many":  # several launches of both capacities
        out = [r(16 + i % 5, (F32, F16, BF16)[i % 3]) for i in range(2600)]
        out += [r(CHUNK * 3 + 1, F32)]
    elif kind == "many-float32":
        out = [r(16 + i % 7, F32) for i in range(4500)]
    else:
        raise ValueError(kind)
    return out


def with_specials(gs: list[torch.Tensor]) -> list[torch.Tensor]:
    gs = [x.clone() for x in gs]
    for i, x in enumerate(gs):
        if x.numel() > 2 and i % 2 == 1:
            x.view(-1)[-1] = float("inf")
            x.view(-1)[x.numel() // 2] = float("nan") if i % 4 == 1 else -float("inf")
    return gs


def to_cuda(gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same values and strides on the GPU (a view stays a view of a like base)."""
    out = []
    for x in gs:
        base = torch.empty(
            x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype, device="cuda"
        )
        base.copy_(torch.empty(0, dtype=x.dtype).set_(x.untyped_storage()).view(-1))
        out.append(base.as_strided(x.shape, x.stride(), x.storage_offset()))
    return out


def state(scale: float = 2.0**16, device: str = "cpu") -> torch.Tensor:
    s = torch.zeros(ops.STATE_SIZE, dtype=torch.int32, device=device)
    s[0:1].view(F32).fill_(scale)
    s[2] = 1
    return s


def run(name: str, fn) -> None:  # noqa: ANN001
    try:
        fn(name)
        print(f"ok    {name}", flush=True)
    except Exception:
        FAILURES.append(f"{name}: raised\n{traceback.format_exc()}")
    if FAILURES and FAILURES[-1].startswith(name + ":"):
        print(f"FAIL  {name}", flush=True)


def unscale_family(kind: str, specials: bool, check_only: bool, stats: bool):  # noqa: ANN201
    def case(name: str) -> None:
        cpu = grads_case(kind)
        if specials:
            cpu = with_specials(cpu)
        gpu = to_cuda(cpu)
        outs = {}
        for dev, gs in (("cpu", cpu), ("cuda", gpu)):
            found = torch.full((1,), 0.0, device=dev)
            st, nxt = state(device=dev), torch.zeros(ops.STATE_SIZE, dtype=torch.int32, device=dev)
            table = (
                torch.full(
                    (ops.grad_stats_rows(gs), len(ops.STAT_FIELDS)), -7.0, dtype=F64, device=dev
                )
                if stats
                else None
            )
            ops.scaler_pass_(gs, found, st, nxt, table, 2.0, 0.5, 3, check_only=check_only)
            outs[dev] = (gs, found, nxt, table)
        torch.cuda.synchronize()
        (cg, cf, cn, ct), (gg, gf, gn, gt) = outs["cpu"], outs["cuda"]
        for i, (a, b) in enumerate(zip(gg, cg, strict=True)):
            same(f"{name} grads[{i}] ({b.dtype}, {b.numel()})", a, b)
        same(f"{name} found_inf", gf, cf)
        same(f"{name} next_state", gn, cn)
        if stats:
            same(f"{name} grad_stats", gt, ct)
            total, factor = (torch.zeros(1, device="cuda") for _ in range(2))
            total_c, factor_c = torch.zeros(1), torch.zeros(1)
            for norm_type in (2.0, float("inf")):
                ops.clip_factor_(gt, gn, total, factor, 1.0, norm_type)
                ops.clip_factor_(ct, cn, total_c, factor_c, 1.0, norm_type)
                same(f"{name} clip_factor_ total (p={norm_type})", total, total_c)
                same(f"{name} clip_factor_ factor (p={norm_type})", factor, factor_c)

    return case


def plain_ops(name: str) -> None:
    cpu = with_specials(grads_case("mixed"))
    gpu = to_cuda(cpu)
    for dev, gs in (("cpu", cpu), ("cuda", gpu)):
        found = torch.zeros(1, device=dev)
        ops.non_finite_check_and_unscale_(gs, found, torch.full((1,), 0.25, device=dev))
        ops.non_finite_check_(gs, found)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(gpu, cpu, strict=True)):
        same(f"{name} grads[{i}]", a, b)


def unscale_into(name: str) -> None:
    cpu = [x for x in with_specials(grads_case("mixed")) if x.dtype != F64 and x.numel()]
    cpu = [x.contiguous() for x in cpu] + [torch.randn(CHUNK * 2 + 3).half()]
    gpu = to_cuda(cpu)
    res = {}
    for dev, gs in (("cpu", cpu), ("cuda", gpu)):
        out = [torch.full_like(x, -5.0, dtype=F32) for x in gs]
        found = torch.zeros(1, device=dev)
        ops.unscale_into_(gs, out, found, torch.full((1,), 2.0**-10, device=dev))
        res[dev] = (out, found)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(res["cuda"][0], res["cpu"][0], strict=True)):
        same(f"{name} out[{i}]", a, b)
    same(f"{name} found_inf", res["cuda"][1], res["cpu"][1])


def scaler_update(name: str) -> None:
    for found_v in (0.0, 1.0, 3.0):
        for tracker in (0, 1, 2):
            res = {}
            for dev in ("cpu", "cuda"):
                st = state(device=dev)
                st[1] = tracker
                nxt = torch.zeros_like(st)
                ops.scaler_update_(torch.full((1,), found_v, device=dev), st, nxt, 2.0, 0.5, 3)
                res[dev] = nxt
            same(f"{name} found={found_v} tracker={tracker}", res["cuda"], res["cpu"])


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_kernels.py: no CUDA GPU visible", file=sys.stderr)
        return 2
    if not ampfused.WITH_CUDA:
        print("gpu_kernels.py: ampfused was built without its CUDA kernels", file=sys.stderr)
        return 2
    run("non_finite_check_and_unscale_ + non_finite_check_", plain_ops)
    for kind in ("mixed", "float32", "many", "many-float32"):
        for specials in (False, True):
            for check_only in (False, True):
                for stats in (False, True):
                    name = (
                        f"scaler_pass_ {kind} specials={specials} check_only={check_only} "
                        f"stats={stats}"
                    )
                    run(name, unscale_family(kind, specials, check_only, stats))
    run("unscale_into_", unscale_into)
    run("scaler_update_", scaler_update)
    torch.cuda.synchronize()
    for f in FAILURES:
        print(f)
    print(f"gpu_kernels.py: {len(FAILURES)} mismatches or errors")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
