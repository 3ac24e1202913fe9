"""The built extension shares torch's libstdc++ (contract: ``ampfused/_build_check.py``).

A toolchain whose library path holds only a static ``libstdc++.a`` links a private C++ runtime
into ``_C``; with torch's shared one in the same process, every error message that formats an
integer crashes or is cut short.  setup.py links torch's libstdc++ and refuses an extension that
still carries its own copy.  Here: the installed extension passes that check, and the check
itself tells good shared objects from bad ones, built in a temporary folder from a tiny C++
source the way the ordinary, the ``-static-libstdc++`` and the static-only toolchain link it.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys

import pytest

import ampfused
from ampfused import _build_check

LINUX = sys.platform.startswith("linux")
CXX = shutil.which("g++") or shutil.which("c++")

PROBE_SOURCE = r"""
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

// Formats an integer into an exception message and catches it: the path TORCH_CHECK takes.
extern "C" int probe_message(int n, char* out, int size) {
  try {
    std::ostringstream s;
    s << "value " << n << " rejected";
    throw std::runtime_error(s.str());
  } catch (const std::exception& e) {
    std::strncpy(out, e.what(), size - 1);
    out[size - 1] = '\0';
    return static_cast<int>(std::strlen(out));
  }
}
"""


def run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stderr}"


def extension_path() -> str:
    return ampfused._C.__file__


# --------------------------------------------------------------------------------------------
# The extension under test


@pytest.mark.skipif(not LINUX, reason="checks ELF shared objects and /proc/self/maps (Linux only)")
def test_built_extension_uses_torchs_shared_libstdcxx():
    problems = _build_check.libstdcxx_problems(extension_path(), _build_check.loaded_libstdcxx())
    assert problems == [], (
        f"{extension_path()} carries its own libstdc++: {problems}. Rebuild it with the "
        'system compilers: CC=gcc CXX=g++ LDSHARED="gcc -shared" pip install '
        "--no-build-isolation ."
    )


@pytest.mark.skipif(shutil.which("readelf") is None, reason="cross-check needs binutils' readelf")
def test_elf_reader_agrees_with_readelf():
    path = extension_path()
    out = subprocess.run(["readelf", "-dW", path], capture_output=True, text=True).stdout
    assert _build_check.read_elf(path).needed == re.findall(r"\(NEEDED\).*\[(.+)\]", out)


# --------------------------------------------------------------------------------------------
# The check itself, on shared objects linked three ways


@pytest.fixture(scope="module")
def probe_object(tmp_path_factory: pytest.TempPathFactory) -> str:
    if CXX is None:
        pytest.skip("no C++ compiler (g++ or c++ on PATH) to build the probe shared objects")
    d = tmp_path_factory.mktemp("probe")
    (d / "probe.cpp").write_text(PROBE_SOURCE)
    run(CXX, "-O1", "-fPIC", "-c", str(d / "probe.cpp"), "-o", str(d / "probe.o"))
    return str(d / "probe.o")


@pytest.fixture(scope="module")
def static_only_dir(tmp_path_factory: pytest.TempPathFactory, probe_object: str) -> str:
    """A folder holding only libstdc++.a: what the GPU image's compiler wrappers pass as -B."""
    archive = subprocess.run(
        [CXX, "-print-file-name=libstdc++.a"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(archive):
        pytest.skip(f"{CXX} has no static libstdc++.a (install the libstdc++ static package)")
    d = tmp_path_factory.mktemp("static-only")
    os.symlink(archive, d / "libstdc++.a")
    return str(d)


def link(probe_object: str, name: str, *flags: str, after: tuple[str, ...] = ()) -> str:
    """Link the probe as setuptools does: flags, objects, then extra_link_args (``after``)."""
    out = os.path.join(os.path.dirname(probe_object), name)
    run(CXX, "-shared", *flags, probe_object, "-o", out, *after)
    return out


def message_from(path: str) -> str:
    lib = ctypes.CDLL(path)
    buf = ctypes.create_string_buffer(128)
    lib.probe_message(42, buf, len(buf))
    return buf.value.decode()


@pytest.mark.skipif(not LINUX, reason="links and reads ELF shared objects (Linux only)")
def test_ordinary_link_passes(probe_object):
    path = link(probe_object, "ordinary.so")
    assert _build_check.libstdcxx_problems(path, _build_check.loaded_libstdcxx()) == []
    assert message_from(path) == "value 42 rejected"


@pytest.mark.skipif(not LINUX, reason="links and reads ELF shared objects (Linux only)")
def test_static_libstdcxx_fails_both_ways(probe_object):
    path = link(probe_object, "static.so", "-static-libstdc++")
    problems = _build_check.libstdcxx_problems(path)
    assert len(problems) == 2, problems
    assert "NEEDED libstdc++.so.6" in problems[0]
    assert "__cxa_throw" in _build_check.private_runtime_symbols(_build_check.read_elf(path))


@pytest.mark.skipif(not LINUX, reason="links and reads ELF shared objects (Linux only)")
def test_static_only_toolchain_fails_without_the_fix(probe_object, static_only_dir):
    path = link(probe_object, "static_only.so", f"-B{static_only_dir}/")
    assert len(_build_check.libstdcxx_problems(path)) == 2


@pytest.mark.skipif(not LINUX, reason="links and reads ELF shared objects (Linux only)")
def test_static_only_toolchain_passes_with_torchs_libstdcxx_on_the_link_line(
    probe_object, static_only_dir
):
    # What setup.py does: name the libstdc++ torch loaded after the objects (an extra link
    # argument), so the driver's -lstdc++ finds nothing left to pull from the static archive.
    torch_libstdcxx = _build_check.loaded_libstdcxx()
    assert torch_libstdcxx is not None
    path = link(probe_object, "fixed.so", f"-B{static_only_dir}/", after=(torch_libstdcxx,))
    assert _build_check.libstdcxx_problems(path, torch_libstdcxx) == []
    assert message_from(path) == "value 42 rejected"


@pytest.mark.skipif(not LINUX, reason="reads torch's libstdc++ (Linux only)")
def test_a_partial_copy_is_caught_by_comparing_with_torchs_libstdcxx():
    # A compiler newer than the shared libstdc++ can pull just the few members the older one
    # lacks from a static archive: no marker name need be among them.
    runtime = _build_check.read_elf(_build_check.loaded_libstdcxx())
    ctor = "_ZNSt13runtime_errorC1EPKc"  # std::runtime_error::runtime_error(const char*)
    assert ctor in runtime.strong
    ext = _build_check.ElfSymbols()
    ext.strong = {ctor}
    assert _build_check.private_runtime_symbols(ext) == []
    assert _build_check.private_runtime_symbols(ext, runtime) == [ctor]
    ext.strong, ext.weak = set(), {ctor}  # a weak definition is an inline copy, not the runtime
    assert _build_check.private_runtime_symbols(ext, runtime) == []


def test_failure_message_names_cause_and_fix():
    env = {"CC": "/opt/gcc13/gcc", "CXX": "/opt/gcc13/g++", "LDSHARED": "/opt/gcc13/gcc -shared"}
    msg = _build_check.failure_message(
        "build/_C.so", ["it defines libstdc++'s own symbols"], "/usr/lib/libstdc++.so.6", env
    )
    assert "build/_C.so" in msg and "it defines libstdc++'s own symbols" in msg
    assert "link a static libstdc++" in msg and "CXX=/opt/gcc13/g++" in msg
    assert 'CC=gcc CXX=g++ LDSHARED="gcc -shared"' in msg


def test_non_elf_files_are_not_judged(tmp_path):
    (tmp_path / "x.dylib").write_bytes(b"\xcf\xfa\xed\xfe" + bytes(60))
    assert _build_check.libstdcxx_problems(tmp_path / "x.dylib") == []
    (tmp_path / "bad.so").write_bytes(b"\x7fELF\x02\x01" + bytes(10))
    with pytest.raises(_build_check.ElfError):
        _build_check.read_elf(tmp_path / "bad.so")
