"""What the package ships beside its code: one version, and its license.

The version is written once, as ``ampfused.__version__``; ``pyproject.toml`` declares it dynamic
and setuptools reads it from the package's source without importing it (an isolated build has no
torch).  An sdist and a wheel of this tree, built here with ``AMPFUSED_BUILD=off`` (no compiler
runs), carry that version, the LICENSE and the changelog.  The installs themselves
(``pip install .``, ``-e``, ``--no-build-isolation``) are .ci/install-forms.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import ampfused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_version_is_written_once():
    project = _pyproject()
    assert "version" not in project["project"], "pyproject.toml repeats the version"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ampfused.__version__"}
    # What setuptools makes of it, as a build does: read from the source, not imported.
    expand = pytest.importorskip("setuptools.config.expand")
    assert expand.read_attr("ampfused.__version__", root_dir=ROOT) == ampfused.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", ampfused.__version__)
    # No other file of the package or its build states a version of its own.
    sources = [os.path.join(ROOT, "setup.py")]
    sources += [
        os.path.join(ROOT, "ampfused", n)
        for n in os.listdir(os.path.join(ROOT, "ampfused"))
        if n.endswith(".py") and n != "__init__.py"
    ]
    for path in sources:
        with open(path) as f:
            text = f.read()
        assert not re.search(r"""version\s*=\s*["']\d""", text), path
        assert ampfused.__version__ not in text, path


def test_the_changelog_has_the_version_and_unreleased_on_top():
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        headings = re.findall(r"^## (.+)$", f.read(), flags=re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert ampfused.__version__ in headings


def test_license_is_bsd_3_clause():
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("BSD 3-Clause License\n\nCopyright (c) 2026, the ampfused authors\n")
    assert "Neither the name of the copyright holder" in text


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> str:
    """What an sdist is made from, copied (the build writes egg-info and build/ into it)."""
    dest = tmp_path_factory.mktemp("tree")
    for name in (
        "setup.py",
        "pyproject.toml",
        "MANIFEST.in",
        "README.md",
        "LICENSE",
        "CHANGELOG.md",
    ):
        shutil.copy(os.path.join(ROOT, name), dest)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "_C.build.json", "*.o")
    shutil.copytree(os.path.join(ROOT, "ampfused"), dest / "ampfused", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "csrc"), dest / "csrc", ignore=ignore)
    return str(dest)


def _build(tree: str, *args: str) -> None:
    env = dict(os.environ, AMPFUSED_BUILD="off")  # (the C++ sources only travel)
    proc = subprocess.run(
        [sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_sdist_carries_the_version_license_and_changelog(tree, tmp_path):
    pytest.importorskip("setuptools")
    _build(tree, "setup.py", "-q", "sdist", "-d", str(tmp_path))
    (sdist,) = os.listdir(tmp_path)
    assert sdist == f"ampfused-{ampfused.__version__}.tar.gz"
    with tarfile.open(tmp_path / sdist) as tar:
        top = f"ampfused-{ampfused.__version__}/"
        names = {n.removeprefix(top) for n in tar.getnames()}
        info = tar.extractfile(top + "PKG-INFO").read().decode()
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= names
    assert email.parser.Parser().parsestr(info)["Version"] == ampfused.__version__


def test_wheel_carries_the_version_and_license(tree, tmp_path):
    pytest.importorskip("wheel")
    pip = ("-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation")
    _build(tree, *pip, "-w", str(tmp_path), ".")
    (name,) = os.listdir(tmp_path)
    assert name.startswith(f"ampfused-{ampfused.__version__}-")
    with zipfile.ZipFile(tmp_path / name) as whl:
        dist_info = f"ampfused-{ampfused.__version__}.dist-info/"
        meta = email.parser.Parser().parsestr(whl.read(dist_info + "METADATA").decode())
        licenses = [n for n in whl.namelist() if n.startswith(dist_info) and "LICENSE" in n]
    assert meta["Version"] == ampfused.__version__
    assert "LICENSE" in meta.get_all("License-File", [])
    assert licenses, "the wheel carries no LICENSE"
