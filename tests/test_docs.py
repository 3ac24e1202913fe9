"""Every ```python block of README.md and docs/*.md, run as written on the CPU.

Each block runs in the test process (torch and ampfused are imported once), in a namespace of its
own, in a temporary working folder.  An HTML comment on the line just before a block says more
(docs/testing.md, "The documentation's examples"); directives are separated by ";":

- ``cpu``: run with every ``"cuda"`` written ``"cpu"``;
- ``after NAME``: run in the namespace left by the block with ``id=NAME`` on the same page (run
  first), or by the set-up NAME in SETUPS below;
- ``id=NAME``: names the block; CHECKS[NAME], where there is one, checks what it printed;
- ``accelerate``: reset Accelerate's process-wide state before and after;
- ``skip (reason)``: not run; the skip prints the reason (which may hold ";").

A block that does not run fails its test with the page and line in the traceback.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import ampfused
from ampfused import reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HALF_MAX = torch.finfo(torch.float16).max

BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
DIRECTIVES = re.compile(r"<!--\s*test:(.*?)-->\s*\n$", re.S)


@dataclass
class Example:
    page: Path
    line: int
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples(page: Path) -> list[Example]:
    text = page.read_text()
    found = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()]
        last_line = before[before.rstrip("\n").rfind("\n") + 1 :]
        directives: dict[str, str] = {}
        comment = DIRECTIVES.search(last_line)
        if comment:
            for part in re.split(r";(?![^()]*\))", comment.group(1)):  # not in (...)
                key, _, value = part.strip().partition(" ")
                if key.startswith("id="):
                    key, value = "id", key[3:]
                directives[key] = value.strip()
        line = before.count("\n") + 2  # the block's first line of code
        found.append(Example(page, line, match.group(1), directives))
    return found


ALL = [ex for page in PAGES for ex in examples(page)]


# ------------------------------------------------------------------------------- set-ups
# The names a snippet takes from the text around it ("continue a training loop ...").
SETUPS: dict[str, str] = {
    "loop": """
import torch
import ampfused

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
loss_fn = torch.nn.functional.cross_entropy
loader = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(4)]
x, y = loader[0]
device = "cpu"
scaler = ampfused.GradScaler(device)
with torch.autocast(device, dtype=torch.float16):
    loss = loss_fn(model(x), y)
""",
    "lightning": """
import torch
import lightning.pytorch as pl

torch.manual_seed(0)
device = "cpu"


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_epoch_end(self):
        self.trainer.should_stop = True  # one epoch is enough here


model = Model()
data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8)
""",
    "hf": """
import torch

torch.manual_seed(0)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def forward(self, x, labels):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(16, generator=g), "labels": torch.randn(1, generator=g)}


model, ds = Model(), Data()
""",
}


# ------------------------------------------------------------------------------- checks
def check_gpt2_mlp(ns: dict[str, Any], out: str) -> None:
    """The headline report: an overflow that starts in block 1's MLP, found with the defaults."""
    assert ns["model"].config._attn_implementation == "sdpa"  # transformers' default attention
    assert "overflow started in forward: transformer.h.1.mlp.c_proj output" in out, out
    assert "ampfused.keep_float32(model, ['transformer.h.1.mlp.c_proj'])" in out, out


def check_gpt2_island(ns: dict[str, Any], out: str) -> None:
    assert out.split() == ["False"], out


def check_gpt2_attention(ns: dict[str, Any], out: str) -> None:
    assert "it started in code of transformer.h.1.attn that no traced module covers" in out, out


def check_convnet_backward(ns: dict[str, Any], out: str) -> None:
    """A backward overflow in the first step: no island shown, the reason the model's own."""
    assert "overflow started in backward: 1 output gradient" in out, out
    assert "computed in the backward of 2" in out, out
    assert "at least 1 and 2, consecutive children of the nn.Sequential <model>" in out, out
    assert "nothing runs between them but autocast's casts" in out, out
    assert "keep_float32" not in out and ns["scaler"].report().suggested_islands == [], out


def check_convnet_no_island(ns: dict[str, Any], out: str) -> None:
    assert out.split() == ["[]", "['1',", "'2']"], out


def check_convnet_policies(ns: dict[str, Any], out: str) -> None:
    """The skipped steps and scales the page quotes."""
    assert out.split() == ["torch", "13", "8.0", "headroom", "0", "2.0"], out


def check_headroom(ns: dict[str, Any], out: str) -> None:
    """The scale moved off its start of 1.0, the magnitude keeps the learned margin's least
    headroom (sqrt 2), nothing skipped (was tests/test_headroom_policy.py's README test)."""
    scale, magnitude, skipped = out.split()
    least = HALF_MAX / reference.MARGIN_LEAST
    assert float(scale) > 1.0 and 0 < float(magnitude) <= least and skipped == "0", out


def check_islands(ns: dict[str, Any], out: str) -> None:
    """The island got a power-of-two factor of its own (moved off 1), no step was skipped, and
    the gradients the optimizer stepped with were unscaled by it (finite, not scaled up)."""
    scaler, model = ns["scaler"], ns["model"]
    factor = scaler.island_factors()["0"]
    assert factor != 1.0 and math.log2(factor) == round(math.log2(factor)), out
    assert scaler.counters()["skipped_steps"] == 0, out
    assert str(factor) in out, out
    assert all(p.grad.abs().max() < 100 for p in model.parameters()), out


def check_islands_readme(ns: dict[str, Any], out: str) -> None:
    """ "auto" chose the quiet branch (and only it) and lifted it by a power of two above 1,
    with no skipped step."""
    factors = ns["scaler"].island_factors()
    assert list(factors) == ["branch"] and factors["branch"] > 1.0, out
    assert math.log2(factors["branch"]) == round(math.log2(factors["branch"])), out
    assert ns["scaler"].counters()["skipped_steps"] == 0, out


def check_underflow(ns: dict[str, Any], out: str) -> None:
    """The report's underflow lines and the rows the example prints agree, worst first, and the
    too-low scale leaves most of the first layer's output gradients subnormal."""
    report = ns["report"]
    assert "float16 activation gradients below 2**-14 (subnormal)" in out, out
    printed = [line.split() for line in out.splitlines() if line.endswith("%") and " " in line]
    rows = [r for r in printed if len(r) == 4]
    assert [r[0] for r in rows] == [a.module for a in report.underflow] and rows, out
    assert all(int(r[1]) <= int(r[2]) for r in rows) and report.underflow[0].subnormal_share > 0.5
    # (the page's "as a scale island at 2^k ...: none of them": the example's k is 10 or more)
    assert "as a scale island at 2^" in out and "below 65,504): none of them" in out, out


def check_ops(ns: dict[str, Any], out: str) -> None:
    assert out.split() == ["0.0", "65536.0", "1"], out
    assert ns["tracker"].dtype == torch.int32 and ns["next_tracker"].dtype == torch.int32


def check_swap_cpu(ns: dict[str, Any], out: str) -> None:
    loss, scale = map(float, out.split())
    assert math.isfinite(loss) and scale > 0 and ns["scaler"].counters()["steps"] == 20


def check_lightning_norms(ns: dict[str, Any], out: str) -> None:
    """The keys the example's comment shows are keys the scaler returned in Lightning."""
    (ex,) = [e for e in ALL if e.directives.get("id") == "lightning-norms"]
    quoted = re.findall(r'"(grad_2\.0_norm[^"]*)"', ex.code)
    keys = ns["scaler"].grad_norms()
    assert quoted and all(k in keys for k in quoted), (quoted, sorted(keys))


CHECKS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "convnet-backward": check_convnet_backward,
    "convnet-no-island": check_convnet_no_island,
    "convnet-policies": check_convnet_policies,
    "gpt2-mlp": check_gpt2_mlp,
    "gpt2-island": check_gpt2_island,
    "gpt2-attention": check_gpt2_attention,
    "headroom": check_headroom,
    "islands": check_islands,
    "islands-readme": check_islands_readme,
    "lightning-norms": check_lightning_norms,
    "ops": check_ops,
    "swap-cpu": check_swap_cpu,
    "underflow": check_underflow,
}


# ------------------------------------------------------------------------------- running
@contextlib.contextmanager
def accelerate_state(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    state = pytest.importorskip("accelerate.state")

    def reset() -> None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()

    reset()
    try:
        yield
    finally:
        reset()


def source(ex: Example) -> str:
    code = ex.code.replace('"cuda"', '"cpu"') if "cpu" in ex.directives else ex.code
    return "\n" * (ex.line - 1) + code  # line numbers in tracebacks are the page's


def run(ex: Example, cache: dict[tuple[Path, str], tuple[dict[str, Any], str]]) -> tuple:
    """Run `ex` (after the block or set-up it continues); its namespace and what it printed."""
    after = ex.directives.get("after")
    if after is None:
        ns: dict[str, Any] = {"__name__": "__docs__"}
    elif after in SETUPS:
        ns = {"__name__": "__docs__"}
        exec(compile(SETUPS[after], f"<set-up {after}>", "exec"), ns)
    else:
        (parent,) = [e for e in ALL if e.page == ex.page and e.directives.get("id") == after]
        key = (parent.page, after)
        if key not in cache:
            cache[key] = run(parent, cache)
        ns = dict(cache[key][0])
    out = io.StringIO()
    with accelerate_state("accelerate" in ex.directives), contextlib.redirect_stdout(out):
        exec(compile(source(ex), str(ex.page), "exec"), ns)
    return ns, out.getvalue()


@pytest.fixture(scope="module")
def namespaces() -> dict[tuple[Path, str], tuple[dict[str, Any], str]]:
    return {}


@pytest.mark.parametrize("ex", ALL, ids=[ex.name for ex in ALL])
def test_example_runs(
    ex: Example, namespaces: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "skip" in ex.directives:
        pytest.skip(f"{ex.name}: {ex.directives['skip'].strip('()')}")
    setup = SETUPS.get(ex.directives.get("after", ""), "")
    for module in ("lightning.pytorch", "transformers", "accelerate"):
        if module in ex.code or module in setup:  # the frameworks are optional test deps
            pytest.importorskip(module)
    if not ampfused.KERNELS:
        pytest.skip("ampfused's kernels are not built")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    ns, out = run(ex, namespaces)
    name = ex.directives.get("id")
    if name is not None:
        namespaces[(ex.page, name)] = (ns, out)
        if name in CHECKS:
            CHECKS[name](ns, out)


def test_every_page_has_examples_and_ids_are_unique() -> None:
    """The extractor finds the blocks (a changed fence would silently test nothing), every
    ``after`` names something that exists, and every check belongs to a block."""
    assert len(ALL) >= 25
    ids = [(ex.page, ex.directives["id"]) for ex in ALL if "id" in ex.directives]
    assert len(ids) == len(set(ids)), ids
    for ex in ALL:
        after = ex.directives.get("after")
        assert after is None or after in SETUPS or (ex.page, after) in ids, ex.name
        unknown = set(ex.directives) - {"cpu", "after", "id", "accelerate", "skip"}
        assert not unknown, (ex.name, unknown)
    assert set(CHECKS) <= {name for _, name in ids}


def test_moved_sections_are_linked_from_the_readme() -> None:
    """Each docs page is linked from the README, and every relative link of every page
    (README and docs) points to a file that exists, with an anchor that is a heading there."""
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(\s*([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: {target}"
            if anchor:
                assert anchor in anchors(dest), f"{page.name}: {target}"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"^#+ (.*)$", page.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_fused_clip_is_not_promised_bit_for_bit() -> None:
    """scaler.clip_grad_norm_ sums the norm in float64 in its own order and multiplies once, so
    it can differ from torch's unscale_ + clip_grad_norm_ in the last bits
    (tests/test_clip.py::test_op_order_shows_in_the_float32_total): the README's "Identical
    results" names it as the exception, and its clipping section says so."""
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    identical = readme[readme.index("**Identical results.**") :].split("**", 3)[2]
    assert "torch's `clip_grad_norm_` after `unscale_`" in identical, identical
    assert "Not bit for bit: the fused `scaler.clip_grad_norm_`" in identical, identical
    section = readme[readme.index("### Clipping in the same pass") :].split("###")[1]
    assert "not the same bits" in section and "in the last bits" in section, section
