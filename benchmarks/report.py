"""What a run shows: number formats, the tables (console and results.md), the plots."""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.suite import Record


# --------------------------------------------------------------------------- tables
TABLE_FORMATS = ("github", "simple")


def tabulate(
    rows: Sequence[Sequence[Any]], headers: Sequence[str], tablefmt: str = "simple"
) -> str:
    """A table as the tabulate package draws it with ``disable_numparse=True`` (cells
    ``str()``-ed, stripped and left-aligned, None empty), in its "github" (results.md) or
    "simple" (console) format: the suite needs no package for its tables, and a run's tables
    are the same text whether tabulate is installed or not (benchmarks/tests/test_tables.py
    holds the two to it).  Columns are as wide as their widest line, and at least their
    header's plus 2; a newline in any cell or header makes the table multiline: each row as
    many lines as its tallest cell, an all-empty row none."""
    if tablefmt not in TABLE_FORMATS:
        raise ValueError(f"tablefmt={tablefmt!r}: the suite draws {' or '.join(TABLE_FORMATS)}")
    heads = [str(h) for h in headers]
    body = [["" if c is None else str(c).strip() for c in row] for row in rows]
    multiline = any("\n" in c for c in [*heads, *(c for row in body for c in row)])

    def lines(cell: str) -> list[str]:
        return cell.splitlines() if multiline else [cell]

    def width(cell: str) -> int:
        return max((len(x) for x in lines(cell)), default=0)

    widths = [max([width(h) + 2, *(width(row[j]) for row in body)]) for j, h in enumerate(heads)]

    def draw(row: list[str]) -> list[str]:
        split = [lines(c) for c in row]
        height = max(len(x) for x in split)
        out = []
        for k in range(height):
            cells = [
                (x[k] if k < len(x) else "").ljust(w) for x, w in zip(split, widths, strict=True)
            ]
            out.append(
                "| " + " | ".join(cells) + " |"
                if tablefmt == "github"
                else "  ".join(cells).rstrip()
            )
        return out

    rule = (
        "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        if tablefmt == "github"
        else "  ".join("-" * w for w in widths)
    )
    text = [*draw(heads), rule]
    for row in body:
        text += draw(row)
    return "\n".join(text)


# --------------------------------------------------------------------------- formats
def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us" if s < 1e-5 else f"{s * 1e6:.0f} us"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def fmt_x(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def fmt_gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def _cell(r: Record | None, iqr: bool = False) -> str:
    if r is None:
        return "-"
    if not r.ok:
        return r.status
    return fmt_time(r.median_s) + (f" ±{fmt_time(r.iqr_s)}" if iqr else "")


def _ratio(x: Record | None, y: Record | None) -> str:
    return "-" if x is None or y is None else f"{x.median_s / y.median_s:.2f}x"


# A console table fits a terminal this wide; results.md's ("github") are rendered and scroll.
CONSOLE_WIDTH = 100
HEADER_WRAP, CELL_WRAP = 12, 40  # console: longer headers and cells go on more lines


def _wrap(text: str, width: int) -> str:
    lines = textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines) or text


def _width(text: str) -> int:
    return max(map(len, text.split("\n")))


def _parts(widths: list[int], limit: int) -> list[list[int]]:
    """Column indices in groups, each led by column 0, no wider than ``limit`` (but for a
    column too wide on its own)."""
    parts, part = [], [0]
    for i in range(1, len(widths)):
        if part != [0] and sum(widths[j] + 2 for j in [*part, i]) - 2 > limit:
            parts.append(part)
            part = [0]
        part.append(i)
    return [*parts, part]


def _even_parts(widths: list[int]) -> list[list[int]]:
    """As few groups as fit CONSOLE_WIDTH, as even as the column order allows: those of the
    narrowest limit that needs no more of them."""
    fewest, limit = len(_parts(widths, CONSOLE_WIDTH)), CONSOLE_WIDTH
    while limit > widths[0] and len(_parts(widths, limit - 1)) == fewest:
        limit -= 1
    return _parts(widths, limit)


def _head_wrap(header: str, width: int) -> int:
    """How wide a header may be: its cells' width, at least HEADER_WRAP, and no word split."""
    return max(HEADER_WRAP, width, *map(len, header.split()))


def grid(rows: list[list[Any]], headers: list[str], tablefmt: str) -> str:
    """A table: one for results.md ("github"); for the console, headers and cells wrapped and
    the columns split into tables no wider than CONSOLE_WIDTH, each repeating the first column
    (rows then apart by a blank line where a cell took more than one line)."""
    if tablefmt == "github":
        return tabulate(rows, headers=headers, tablefmt=tablefmt)
    text = [[str(c) for c in r] for r in rows]
    columns = list(zip(*text, strict=True)) if text else [()] * len(headers)
    natural = [max(map(len, c), default=0) for c in columns]
    cells = [max((_width(_wrap(x, CELL_WRAP)) for x in c), default=0) for c in columns]
    # A header wraps no narrower than its cells; tabulate pads it by 2.
    widths = [
        max(w, _width(_wrap(h, _head_wrap(h, w))) + 2) for h, w in zip(headers, cells, strict=True)
    ]
    tables = []
    for part in _even_parts(widths):
        room = CONSOLE_WIDTH - sum(widths[j] + 2 for j in part) + 2
        wrap = {}
        for j in part:  # the room left goes to the columns whose cells were wrapped
            grow = max(0, min(room, natural[j] - cells[j]))
            wrap[j], room = cells[j] + grow, room - grow
        heads = [_wrap(headers[j], _head_wrap(headers[j], wrap[j])) for j in part]
        body = [[_wrap(r[j], wrap[j]) for j in part] for r in text]
        out = tabulate(body, headers=heads, tablefmt=tablefmt)
        tables.append(_space_rows(out.split("\n"), heads, body))
    return "\n\n".join(tables)


def _space_rows(lines: list[str], heads: list[str], body: list[list[str]]) -> str:
    """A blank line between rows where more than one row took more than one line (tabulate
    drops empty rows, so it goes into the text it renders)."""
    heights = [1 + max(c.count("\n") for c in r) for r in body]
    top = 2 + max(h.count("\n") for h in heads)  # the header's lines and its rule
    if sum(h > 1 for h in heights) < 2 or len(lines) != top + sum(heights):
        return "\n".join(lines)
    out, i = lines[:top], top
    for k, h in enumerate(heights):
        out += [""] * (k > 0) + lines[i : i + h]
        i += h
    return "\n".join(out)


def by_workload(records: Sequence[Record]) -> list[dict[str, Record]]:
    groups: dict[tuple, dict[str, Record]] = {}
    for r in records:
        groups.setdefault((r.workload, r.dtype, r.inject_inf, r.realloc), {})[r.method] = r
    return list(groups.values())


# --------------------------------------------------------------------------- tables
Extra = tuple[str, Callable[[dict[str, "Record"]], str]]


def joined(
    head: str, attr: str, methods: Sequence[str], fmt: Callable[[Any], str] = str, sep: str = " / "
) -> Extra:
    """A column of ``attr`` of each of ``methods`` that ran, joined by ``sep``."""

    def cell(ok: dict[str, Record]) -> str:
        vals = (getattr(ok[m], attr) if m in ok else None for m in methods)
        return sep.join("-" if v is None else fmt(v) for v in vals)

    return (head, cell)


def host_device(records: Sequence[Record]) -> list[Extra]:
    """ampfused's and torch's host and device medians, where measured (batched, GPU)."""
    return [
        joined(f"{kind}: {m}", f"{kind}_median_s", (m,), fmt_time)
        for kind in ("host", "device")
        if any(getattr(r, f"{kind}_median_s") is not None for r in records)
        for m in ("ampfused", "torch")
    ]


def table(
    records: Sequence[Record],
    names: Sequence[str],
    ratios: Sequence[tuple[str, str, str]],
    extra: Sequence[Extra] = (),
    tablefmt: str = "simple",
    iqr: bool = False,
) -> str:
    """One row per workload: each named method's median step, the ratios (header, x, y: x's
    median over y's), then the ``extra`` columns, each computed from the records that ran."""
    rows = []
    for by in by_workload(records):
        r = next(iter(by.values()))
        ok = {m: x for m, x in by.items() if x.ok}
        rows.append(
            [r.label, r.n_tensors, f"{r.grad_bytes / 1e6:.1f}"]
            + [_cell(by.get(m), iqr) for m in names]
            + [_ratio(ok.get(x), ok.get(y)) for _, x, y in ratios]
            + [fn(ok) for _, fn in extra]
        )
    headers = ["gradients", "tensors", "MB", *names, *(h for h, _, _ in ratios)]
    return grid(rows, headers + [h for h, _ in extra], tablefmt)


def pivot(records: Sequence[Record], gpu: bool, tablefmt: str) -> str:
    """Every method's median per workload, then ampfused's GB/s, ratios to the floor, host and
    device times, op counts (ampfused's/torch's) and ampfused's speedup over torch."""
    from benchmarks.methods import METHODS

    names = [m for m in METHODS if any(r.method == m for r in records)]
    a_t = ("ampfused", "torch")
    extra = [joined("ampfused GB/s", "gbps", ("ampfused",), fmt_gbps)]
    extra += [joined(f"{m} / floor", "x_floor", (m,), fmt_x) for m in a_t]
    if gpu:
        extra += [joined("ampfused / floor-copy", "x_copy", ("ampfused",), fmt_x)]
    extra += host_device(records)
    counts = (
        (("launches", "launches"), ("syncs", "syncs"))
        if gpu
        else (("ops", "ops"), ("item()", "items"))
    )
    extra += [joined(f"{h} ampfused / torch", attr, a_t, sep="/") for h, attr in counts]
    extra += [joined("speedup vs torch", "speedup_vs_torch", ("ampfused",), lambda x: fmt_x(x, 1))]
    return table(records, names, [], extra, tablefmt)


DETAIL_FIELDS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("IQR", "iqr_s", fmt_time),
    ("samples", "samples", str),
    ("GB/s", "gbps", fmt_gbps),
    ("time / floor", "x_floor", fmt_x),
    ("steps/sample", "steps_per_sample", str),
    ("host median", "host_median_s", fmt_time),
    ("restore (subtracted)", "restore_median_s", fmt_time),
    ("time / floor-copy", "x_copy", fmt_x),
    ("device median", "device_median_s", fmt_time),
    ("device GB/s", "device_gbps", fmt_gbps),
    ("restore device", "restore_device_median_s", fmt_time),
    ("spin overruns", "spin_overruns", str),
    ("ops", "ops", str),
    ("item()", "items", str),
    ("launches", "launches", str),
    ("syncs", "syncs", str),
    ("Python bytecodes", "py_bytecodes", str),
    ("speedup vs torch", "speedup_vs_torch", lambda x: fmt_x(x, 1)),
)


def details(records: Sequence[Record], tablefmt: str) -> str:
    """Every record, with each field that any of them measured."""
    fields = [f for f in DETAIL_FIELDS if any(getattr(r, f[1]) is not None for r in records)]
    rows = [
        [r.label, r.method, _cell(r)]
        + ["-" if getattr(r, a) is None else fmt(getattr(r, a)) for _, a, fmt in fields]
        + [r.note]
        for r in records
    ]
    return grid(
        rows, ["workload", "method", "median", *(h for h, _, _ in fields), "note"], tablefmt
    )


def e2e_table(e2e: dict[str, Any], tablefmt: str) -> str:
    rows = []
    for key, r in e2e["runs"].items():
        comp = e2e["comparisons"][r["optimizer"]]
        rows.append(
            [key, fmt_time(r["median_step_s"]), fmt_time((r["q3_s"] or 0) - (r["q1_s"] or 0))]
            + [r["timed_steps"], f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"]
            + [r["skipped_steps"], f"{comp['max_abs_loss_diff']:g}"]
            + ["yes" if comp["weights_bitwise_equal"] else "NO"]
        )
    headers = ["scaler/optimizer", "median step", "IQR", "timed steps", "loss first -> last"]
    headers += ["skipped steps", "max |loss diff| (same optimizer)", "final weights bit-equal"]
    return grid(rows, headers, tablefmt)


# Ours against torch's way, per question: the pairs a summary line compares.
PAIRS = (
    ("ampfused", "torch"),
    ("ampfused-norms", "torch-norms"),
    ("ampfused-clip", "torch-clip"),
    ("ampfused-masters", "torch-masters"),
    ("ampfused-dist", "torch-dist"),
    ("ampfused-fsdp2", "torch-fsdp2"),
    ("traced", "item-hooks"),
)


def _times(x: float) -> str:
    """A ratio to 2 decimals, or 3 where 2 would round a ratio other than 1 to 1.00x."""
    return f"{x:.3f}x" if f"{x:.2f}" == "1.00" and x != 1 else f"{x:.2f}x"


def comparisons(records: Sequence[Record], e2e: dict[str, Any] | None) -> list[str]:
    """Per question and pair: on how many gradient sets ours is faster (by the medians), on how
    many slower and how many of those beyond noise (IQRs apart), and the range of the time
    theirs takes over ours."""
    lines = []
    for q in dict.fromkeys(r.question for r in records):
        groups = by_workload([r for r in records if r.question == q and r.ok])
        for ours, theirs in PAIRS:
            pairs = [(g[ours], g[theirs]) for g in groups if ours in g and theirs in g]
            if not pairs:
                continue
            x = [t.median_s / a.median_s for a, t in pairs]
            faster, slower = sum(v > 1 for v in x), sum(v < 1 for v in x)
            line = f"{q}: {ours} faster than {theirs} on {faster} of {len(x)} gradient set"
            line += "s" if len(x) > 1 else ""
            if slower:
                beyond = sum(a.q1_s > t.q3_s for a, t in pairs)
                line += f", slower on {slower} ({beyond} of them beyond noise)"
            if len(x) > faster + slower:
                line += f", as fast on {len(x) - faster - slower}"
            span = _times(x[0]) if len(x) == 1 else f"{_times(min(x))} to {_times(max(x))}"
            median = "" if len(x) == 1 else f" (median {_times(statistics.median(x))})"
            lines.append(f"{line}; {theirs} takes {span} the time of {ours}{median}")
    for opt, c in ((e2e or {}).get("comparisons") or {}).items():
        same = c["max_abs_loss_diff"] == 0 and c["weights_bitwise_equal"]
        lines.append(
            f"e2e {opt}: a step with torch's scaler takes {fmt_x(c['torch_over_ampfused'])} the "
            "time of one with ampfused's; losses and "
            + ("weights identical" if same else "weights DIFFER")
        )
    return lines


def paragraph(text: str, tablefmt: str) -> str:
    """``text`` as results.md has it ("github"), else wrapped to CONSOLE_WIDTH."""
    if tablefmt == "github":
        return text
    return textwrap.fill(text, CONSOLE_WIDTH, break_long_words=False, break_on_hyphens=False)


def bullets(items: Sequence[str], tablefmt: str) -> str:
    """A markdown list; for the console each line wrapped to CONSOLE_WIDTH under its dash."""
    if tablefmt == "github":
        return "\n".join(f"- {x}" for x in items)
    wrap = textwrap.TextWrapper(
        CONSOLE_WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
    )
    out = []
    for item in items:
        for k, line in enumerate(item.split("\n")):  # a traceback in a note keeps its lines
            wrap.initial_indent = "  " if k else "- "
            out += wrap.wrap(line) or [wrap.initial_indent]
    return "\n".join(out)


# --------------------------------------------------------------------------- plots
def plots(records: Sequence[Record], out: Path, title: str) -> dict[str, Path]:
    """counts.png, sizes.png, models.png: those whose question ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.methods import METHODS

    def series(recs: list[Record], panels: Callable[[Record], str], x: Callable, y: Callable):  # noqa: ANN202
        keys = list(dict.fromkeys(panels(r) for r in recs))
        fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.8), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            for m in METHODS:
                pts = sorted((x(r), y(r)) for r in recs if r.method == m and panels(r) == key)
                if pts:
                    style = "o--" if METHODS[m].kind == "floor" else "o-"
                    ax.plot(*zip(*pts, strict=True), style, ms=3, label=m)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(key)
            ax.grid(True, which="both", alpha=0.3)
        return fig, axes[0]

    done: dict[str, Path] = {}
    ok = [r for r in records if r.ok]
    counts = [r for r in ok if r.question == "counts"]
    if counts:
        fig, axes = series(
            counts,
            lambda r: f"{r.numel // r.n_tensors} elements per tensor, {r.dtype}",
            lambda r: r.n_tensors,
            lambda r: r.median_s * 1e6,
        )
        axes[0].set(xlabel="gradient tensors", ylabel="time per step (us), median")
        done["counts"] = fig
    sizes = [r for r in ok if r.question == "sizes"]
    if sizes:
        fig, axes = series(
            sizes, lambda r: r.dtype, lambda r: r.numel // r.n_tensors, lambda r: r.gbps
        )
        axes[0].set(xlabel="elements per tensor (8 tensors)", ylabel="GB/s (bytes / median)")
        done["sizes"] = fig
    models = [r for r in ok if r.question == "models" and not r.inject_inf and r.speedup_vs_torch]
    if models:
        labels = list(dict.fromkeys(f"{r.workload}\n{r.dtype}{r.variant}" for r in models))
        names = [m for m in METHODS if m != "torch" and any(r.method == m for r in models)]
        fig, ax = plt.subplots(figsize=(max(10, 0.75 * len(labels) + 5), 4.8))
        width = 0.8 / len(names)
        for i, m in enumerate(names):
            by = {
                f"{r.workload}\n{r.dtype}{r.variant}": r.speedup_vs_torch
                for r in models
                if r.method == m
            }
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, [by.get(lab, float("nan")) for lab in labels], width=width, label=m)
        ax.axhline(1.0, color="tab:red", lw=1, ls="--", label="torch.amp.GradScaler")
        ax.set_yscale("log")
        ax.set_ylabel("speedup over torch.amp.GradScaler\n(median per-step time)")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        done["models"] = fig
    paths = {}
    for key, fig in done.items():
        fig.axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        paths[key] = out / f"{key}.png"
        fig.savefig(paths[key], dpi=110)
        plt.close(fig)
    return paths


# --------------------------------------------------------------------------- results.md
def method_text(records: Sequence[Record]) -> str:
    batched = any(r.timing == "batched" for r in records)
    how = (
        'timed as a training loop runs (benchmarks/README.md, "Method"): a sample is a batch of '
        "consecutive steps (*steps/sample*) with one device synchronization at the end, minus the "
        "same batch of untimed gradient restores; *host* = CPU time to queue one step; *device* "
        "= device time of one step from CUDA events"
        if batched
        else "host wall time including device completion"
    )
    return (
        f"Times are per optimizer step, {how}; median over interleaved rounds (IQR = "
        "interquartile range). GB/s = bytes read + written (8 B per fp32 element for an "
        "unscale) / median time; */ floor* = time / time of an in-place `torch._foreach_mul_` "
        "over the same gradients in the same run (*floor-mul*; */ floor-copy*: a device-to-device "
        "copy of the same bytes); *speedup* = torch.amp.GradScaler time / this "
        "time. *realloc* rows: new gradient tensors every step, as after "
        "`zero_grad(set_to_none=True)`."
    )


def e2e_text(e2e: dict[str, Any]) -> str:
    cfg, g = e2e["config"], e2e["config"]["gpt"]
    chunk = cfg.get("steps_per_sample", 1)
    return (
        f"nanoGPT-style model ({g['n_layer']} layers, {g['n_head']} heads, {g['n_embd']} "
        f"embedding, block {g['block_size']}, vocab {g['vocab_size']}: {e2e['n_params']:,} "
        f"parameters in {e2e['n_param_tensors']} tensors), batch {cfg['batch_size']} x "
        f"{cfg['grad_accum']} accumulation steps, unscale_ + clip_grad_norm_({cfg['grad_clip']}), "
        f"AdamW; {cfg['steps']} steps per run, the first {cfg['timed_from']} untimed; runs "
        + (
            "interleaved step by step."
            if chunk == 1
            else f"interleaved in chunks of {chunk} consecutive steps, one synchronization "
            "per chunk (median step = median over chunks of chunk time / steps)."
        )
    )
