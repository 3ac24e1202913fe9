from benchmarks.suite import Record


def rec(method: str, median_us: float, iqr_us: float = 2.0, **kw) -> Record:  # noqa: ANN003
    """A record of ``method`` (question counts, workload 10 x 16 unless given), in us."""
    r = Record(
        kw.pop("question", "counts"), kw.pop("workload", "10 x 16"), "count",
        kw.pop("dtype", "fp32"), kw.pop("inject_inf", False), 10, 160, 640, method,
        "floor" if method.startswith("floor") else "scaler", samples=11, **kw,
    )  # fmt: skip
    if r.status == "ok":
        r.median_s = median_us * 1e-6
        r.q1_s, r.q3_s = r.median_s - iqr_us / 2e6, r.median_s + iqr_us / 2e6
        r.bytes_moved, r.gbps = 1280, 1280 / r.median_s / 1e9
    return r
