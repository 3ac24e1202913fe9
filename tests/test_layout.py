"""The package's layers, as its docstring lists them: a module imports only modules below it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ampfused

PACKAGE = Path(ampfused.__file__).parent


def _layers() -> dict[str, int]:
    """Module name -> its row in the docstring's table (0 at the top)."""
    rows = re.findall(r"^    (\w+(?:, \w+)*)  +\S", ampfused.__doc__, flags=re.MULTILINE)
    assert len(rows) >= 10, rows
    layers = {name: i for i, row in enumerate(rows) for name in row.split(", ")}
    extension = layers["_extension"]  # the row names the build modules it holds
    layers.update(_build_config=extension + 1, _build_check=extension + 1)
    return layers


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ampfused"):
            if node.module == "ampfused":
                names |= {a.name for a in node.names}
            else:
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("ampfused.")}
    return names - {"_C"}  # the compiled extension, below everything


def test_every_module_is_in_the_table():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert modules == set(_layers())


def test_no_module_imports_one_above_it():
    layers = _layers()
    upward = [
        f"{path.stem} imports {name}"
        for path in PACKAGE.glob("*.py")
        if path.stem in layers
        for name in _imports(path)
        if layers[name] <= layers[path.stem] and name != path.stem
    ]
    assert not upward, upward
