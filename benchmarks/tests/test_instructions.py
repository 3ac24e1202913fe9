"""benchmarks/instructions.py's bookkeeping: a callgrind dump by object file, layers, targets
(the counters themselves need a CPU counter or valgrind)."""

from __future__ import annotations

from benchmarks import instructions as ins

# Compressed names ("(id) name" once, then "(id)"); a cost line after calls= is the callee's.
DUMP = """\
version: 1
creator: callgrind-3.19.0
events: Ir
ob=(1) /usr/lib/libpython3.11.so.1.0
fl=(1) ceval.c
fn=(1) _PyEval_EvalFrameDefault
10 500
cob=(2) /site-packages/torch/lib/libtorch_cpu.so
cfi=(2) ops.cpp
cfn=(2) at::mul_
calls=2 20
11 9000
+1 25
ob=(2)
fl=(2)
fn=(2)
20 4000
cob=(3) /work/ampfused/_C.cpython-311-x86_64-linux-gnu.so
calls=1 5
21 777
ob=(3)
fn=(3) launch_pass_cpu
5 700
-2 77
ob=(4) /lib/x86_64-linux-gnu/libc.so.6
fn=(4) memcpy
1 30
totals: 5332
"""


def test_self_cost_by_object_skips_call_lines_and_resolves_names(tmp_path):
    path = tmp_path / "callgrind.out.1"
    path.write_text(DUMP)
    by = ins._self_cost_by_object(str(path))
    assert by == {
        "/usr/lib/libpython3.11.so.1.0": 525,
        "/site-packages/torch/lib/libtorch_cpu.so": 4000,
        "/work/ampfused/_C.cpython-311-x86_64-linux-gnu.so": 777,
        "/lib/x86_64-linux-gnu/libc.so.6": 30,
    }
    assert sum(by.values()) == 5332  # the dump's own total


def test_layers():
    assert ins._layer("/usr/lib/libpython3.11.so.1.0") == "Python"
    assert ins._layer("/root/.pyenv/versions/3.11.7/bin/python3.11") == "Python"
    assert ins._layer("/x/site-packages/torch/lib/libc10.so") == "torch"
    assert ins._layer("/x/site-packages/torch/_C.cpython-311-x86_64-linux-gnu.so") == "torch"
    assert ins._layer("/work/ampfused/_C.cpython-311-x86_64-linux-gnu.so") == "ampfused _C"
    assert ins._layer("/lib/x86_64-linux-gnu/libc.so.6") == "C/C++ runtime"


def test_targets():
    def row(workload, tensors, method, total):
        return ins.Row(workload, tensors, method, {"unscale_": total, "step": 0, "update": 0})

    rows = [row("1 x 16", 1, "ampfused", 90), row("1 x 16", 1, "torch", 300)]
    rows += [row("3000 x 16", 3000, "ampfused", 51), row("3000 x 16", 3000, "torch", 1000)]
    assert [t[1:] for t in ins.targets(rows)] == [("0.300", True), ("0.051", False)]
    text = ins.table(rows, 7.0)
    assert text.splitlines()[2].split("|")[-2].strip() == "0.300"
    assert text.splitlines()[0].split("|")[-2].strip() == "ampfused / torch"
    lines = ins.targets_text(ins.targets(rows)).splitlines()
    assert "development goals" in lines[0]
    assert lines[1].startswith("  met: 1 x 16") and lines[2].startswith("  not met: 3000 x 16")
