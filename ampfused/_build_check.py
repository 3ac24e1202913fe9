"""Keep one C++ runtime in the process: link torch's libstdc++, then check the built extension.

A compiler driver whose library path holds a static ``libstdc++.a`` and no shared ``libstdc++.so``
(for example a wrapper that adds ``-B<prefix>/``) links a private copy of the C++ runtime into the
extension. torch uses the shared ``libstdc++.so.6``; with two runtimes in one process, the first
error message that formats an integer (``c10::str`` inside ``TORCH_CHECK``) crashes or comes out
cut short. setup.py therefore

1. puts the shared libstdc++ that torch loaded on the link line (:func:`loaded_libstdcxx`), so
   the driver's implicit ``-lstdc++`` finds every symbol already defined and pulls nothing from a
   static archive, and
2. inspects the linked shared object (:func:`libstdcxx_problems`) and stops the build with
   :func:`failure_message` if it still carries its own copy.

tests/test_build.py runs the same check on the built extension. This module is pure Python and
imports neither torch nor ampfused: setup.py loads it by file path before the package exists.
"""

from __future__ import annotations

import os
import re
import shlex
import struct
from collections.abc import Iterable, Mapping

# Symbols only libstdc++ / libsupc++ define.  An extension that defines one of them (strongly)
# carries its own copy of the runtime; its own code never defines these.
PRIVATE_RUNTIME_NAMES = frozenset(
    {
        "__gxx_personality_v0",
        "__cxa_throw",
        "__cxa_rethrow",
        "__cxa_begin_catch",
        "__cxa_end_catch",
        "__cxa_allocate_exception",
        "__cxa_guard_acquire",
    }
)
# std::locale and std::ios_base::Init members: non-inline, defined in libstdc++ itself.
PRIVATE_RUNTIME_PREFIXES = ("_ZNSt6locale", "_ZNKSt6locale", "_ZNSt8ios_base4Init")
# Defined in every shared object or naming a symbol version, so never a sign of a copy.
_NOT_RUNTIME_RE = re.compile(r"^(GLIBCXX_|CXXABI_|_init$|_fini$|__bss_start$|_edata$|_end$)")

_LIBSTDCXX_RE = re.compile(r"^libstdc\+\+\.so(\.\d+)*$")

# ELF constants (System V gABI).
_SHT_SYMTAB, _SHT_DYNAMIC, _SHT_DYNSYM = 2, 6, 11
_DT_NULL, _DT_NEEDED = 0, 1
_STB_WEAK = 2
_SHN_UNDEF = 0


class ElfError(ValueError):
    """The file is not an ELF shared object this module can read."""


class ElfSymbols:
    """What the check needs from a shared object: DT_NEEDED and the defined symbols.

    ``strong`` holds defined symbols of LOCAL, GLOBAL or GNU_UNIQUE binding; ``weak`` the defined
    WEAK ones (inline functions and template instances any C++ object may emit).  (A plain class,
    not a dataclass: setup.py executes this file without registering it in ``sys.modules``.)
    """

    def __init__(self) -> None:
        self.needed: list[str] = []
        self.strong: set[str] = set()
        self.weak: set[str] = set()


def _cstr(blob: bytes, offset: int) -> str:
    end = blob.find(b"\0", offset)
    return blob[offset : end if end >= 0 else len(blob)].decode("utf-8", "replace")


def read_elf(path: str | os.PathLike[str]) -> ElfSymbols:
    """Read DT_NEEDED and the defined symbols (.dynsym and .symtab) of an ELF file.

    Raises:
        ElfError: the file is not ELF, or its section headers are missing or malformed.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        raise ElfError(f"{os.fspath(path)} is not an ELF file")
    cls, enc = data[4], data[5]
    if cls not in (1, 2) or enc not in (1, 2):
        raise ElfError(f"{os.fspath(path)}: unknown ELF class {cls} / data encoding {enc}")
    e = "<" if enc == 1 else ">"
    is64 = cls == 2
    try:
        if is64:
            (shoff,) = struct.unpack_from(e + "Q", data, 0x28)
            shentsize, shnum = struct.unpack_from(e + "HH", data, 0x3A)
            sh_fmt, sym_fmt = e + "IIQQQQIIQQ", e + "IBBHQQ"
        else:
            (shoff,) = struct.unpack_from(e + "I", data, 0x20)
            shentsize, shnum = struct.unpack_from(e + "HH", data, 0x2E)
            sh_fmt, sym_fmt = e + "IIIIIIIIII", e + "IIIBBH"
        if shoff == 0 or shnum == 0:
            raise ElfError(f"{os.fspath(path)} has no section headers")
        # (type, offset, size, link, entsize) per section
        sections = []
        for i in range(shnum):
            sh = struct.unpack_from(sh_fmt, data, shoff + i * shentsize)
            sections.append((sh[1], sh[4], sh[5], sh[6], sh[9]))

        def blob(index: int) -> bytes:
            _, off, size, _, _ = sections[index]
            return data[off : off + size]

        out = ElfSymbols()
        for stype, off, size, link, entsize in sections:
            if stype == _SHT_DYNAMIC:
                strtab = blob(link)
                step = 16 if is64 else 8
                tag_fmt = e + ("qQ" if is64 else "iI")
                for pos in range(off, off + size, step):
                    tag, val = struct.unpack_from(tag_fmt, data, pos)
                    if tag == _DT_NULL:
                        break
                    if tag == _DT_NEEDED:
                        out.needed.append(_cstr(strtab, val))
            elif stype in (_SHT_SYMTAB, _SHT_DYNSYM):
                strtab = blob(link)
                entsize = entsize or struct.calcsize(sym_fmt)
                for pos in range(off + entsize, off + size, entsize):  # entry 0 is null
                    sym = struct.unpack_from(sym_fmt, data, pos)
                    if is64:
                        name, info, shndx = sym[0], sym[1], sym[3]
                    else:
                        name, info, shndx = sym[0], sym[3], sym[5]
                    if shndx == _SHN_UNDEF or name == 0:
                        continue
                    (out.weak if info >> 4 == _STB_WEAK else out.strong).add(_cstr(strtab, name))
        return out
    except (struct.error, IndexError) as exc:
        raise ElfError(f"{os.fspath(path)}: malformed ELF ({exc})") from exc


def is_elf(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def private_runtime_symbols(syms: ElfSymbols, runtime: ElfSymbols | None = None) -> list[str]:
    """The symbols of libstdc++ itself that ``syms`` defines (strongly).

    Those are the libstdc++-only names above and, given the shared libstdc++ the process runs on
    (``runtime``), every symbol both define strongly: that also catches a partial copy, pulled
    from a static archive for the few symbols an older shared libstdc++ lacks.  Exact names
    first, then sorted.
    """
    found = {
        s
        for s in syms.strong
        if s in PRIVATE_RUNTIME_NAMES or s.startswith(PRIVATE_RUNTIME_PREFIXES)
    }
    if runtime is not None:
        found |= {s for s in syms.strong & runtime.strong if not _NOT_RUNTIME_RE.match(s)}
    # "name.cold" and similar are local clones of a function already listed
    return sorted(
        (s for s in found if "." not in s), key=lambda s: (s not in PRIVATE_RUNTIME_NAMES, s)
    )


def libstdcxx_problems(
    path: str | os.PathLike[str], runtime: str | os.PathLike[str] | None = None
) -> list[str]:
    """Why the C++ shared object at ``path`` would bring a second libstdc++ into the process.

    Returns an empty list when it depends on the shared ``libstdc++.so.*`` and defines none of
    libstdc++'s own symbols, and for files that are not ELF (macOS, Windows: not applicable).
    ``runtime``: the shared libstdc++ torch loaded (:func:`loaded_libstdcxx`), if known; every
    symbol it defines then counts as libstdc++'s own.

    Raises:
        ElfError: an ELF file this module cannot read.
    """
    if not is_elf(path):
        return []
    syms = read_elf(path)
    problems = []
    if not any(_LIBSTDCXX_RE.match(n) for n in syms.needed):
        problems.append(
            "it does not depend on the shared libstdc++ (no NEEDED libstdc++.so.6; it needs "
            + (", ".join(syms.needed) or "nothing")
            + ")"
        )
    own = private_runtime_symbols(syms, read_elf(runtime) if runtime else None)
    if own:
        shown = ", ".join(own[:4]) + (", ..." if len(own) > 4 else "")
        problems.append(
            f"it defines {len(own)} of libstdc++'s own symbols ({shown})"
            + (f", compared with {runtime}" if runtime else "")
        )
    return problems


def loaded_libstdcxx(maps: str | os.PathLike[str] = "/proc/self/maps") -> str | None:
    """The shared libstdc++ mapped into this process (torch's, once torch is imported).

    Returns its real path, or None where there is none or no ``/proc`` (not Linux).
    """
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6:
            mapped = parts[5].strip()
            if _LIBSTDCXX_RE.match(os.path.basename(mapped)) and os.path.exists(mapped):
                return os.path.realpath(mapped)
    return None


def failure_message(
    so_path: str,
    problems: Iterable[str],
    torch_libstdcxx: str | None,
    env: Mapping[str, str] = os.environ,
) -> str:
    """The message that stops the build: what is wrong, the cause, and the fix."""
    tools = " ".join(
        f"{k}={shlex.quote(env[k])}" for k in ("CC", "CXX", "LDSHARED", "LDCXXSHARED") if k in env
    )
    linked = (
        f"torch's shared libstdc++ ({torch_libstdcxx}) was on the link line, and the linker "
        "still took a static one"
        if torch_libstdcxx
        else "the libstdc++ torch uses could not be found (no /proc/self/maps entry), so it was "
        "not put on the link line"
    )
    lines = [
        f"ampfused: the extension just linked ({so_path}) carries its own copy of libstdc++:",
        *(f"  - {p}" for p in problems),
        "torch uses the shared libstdc++; with two C++ runtimes in one process the first error "
        "message that formats a number crashes. The extension was deleted; nothing is installed.",
        "Cause: the compilers link a static libstdc++ (their library path holds libstdc++.a and "
        f"no libstdc++.so, e.g. a wrapper adding -B<prefix>/): {tools or 'default compilers'}; "
        f"{linked}.",
        "Fix: build with the system's compilers, e.g.",
        '  CC=gcc CXX=g++ LDSHARED="gcc -shared" LDCXXSHARED="g++ -shared" '
        "pip install --no-build-isolation .",
    ]
    return "\n".join(lines)
