"""The link folder that lets the release wheel's libraries load on an older Linux than the one that built them
(CMakeLists.txt, GRPO_EXT_GLIBC_FLOOR; ``make wheel`` sets 2.28, the floor of torch's own manylinux_2_28 wheels).

A shared library asks for the symbol versions of the glibc and libstdc++ it was linked against. Linked on Debian 12
(glibc 2.36, GCC 12), its ``pthread_create`` is ``pthread_create@GLIBC_2.34``, its ``exp`` is ``exp@GLIBC_2.29``,
and a default-constructed ``std::ostringstream`` is ``GLIBCXX_3.4.26``: none of these load on RHEL 8 or Ubuntu 20.04,
where torch's wheels do. This script writes one ``-L`` folder that fixes both:

- **glibc**: link stubs of the floor's release (libraries holding that release's symbols and versions, no code),
  which zig (the ``ziglang`` package) writes for any glibc release. Linked against them, every reference takes a
  version the floor has, and a symbol the floor lacks fails the link (the libraries link with --no-undefined).
  ``libc.so`` is a linker script, as glibc's own, naming the stub libc plus libpthread, libdl, librt and the dynamic
  loader where referenced (glibc 2.34 merged those into libc; before it they are libraries of their own), and the
  host's ``libc_nonshared.a``; ``libm.so``, ``libpthread.so``, ``libdl.so`` and ``librt.so`` are the stubs.
- **libstdc++**: ``libstdc++_floor.a``, the host libstdc++'s objects that define the string streams' default
  constructors (GLIBCXX_3.4.26) and C++20 ``str()`` (GLIBCXX_3.4.29), which torch's stable-ABI headers and
  ``grpo_ext::fail`` use. Linked into each library with their symbols kept local, they stand in for the newer
  libstdc++; everything else, the exception runtime included, still comes from the system's libstdc++.so, so an
  exception thrown here is caught by torch's copy of the runtime that threw it (the way manylinux's
  ``libstdc++_nonshared.a`` works; a fully static libstdc++ would give the process two exception runtimes).

``auditwheel repair --plat manylinux_<floor>`` then checks the result symbol by symbol (``make wheel``).

Usage: ``python cmake/manylinux_floor.py --glibc 2.28 --out DIR`` (x86_64 Linux, gcc); prints DIR.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The stub files zig writes for glibc, by the soname each stands for.
GLIBC_STUBS = {
    "libc.so.6": "libc.so.6",
    "libm.so.6": "libm.so.6",
    "libpthread.so.0": "libpthread.so.0",
    "libdl.so.2": "libdl.so.2",
    "librt.so.1": "librt.so.1",
    "ld-linux-x86-64.so.2": "libld.so.2",  # zig's file name for the dynamic loader's stub
}
# Members of the host's libstdc++.a: the C++11 and the C++20 explicit instantiations of the string streams.
LIBSTDCXX_OBJECTS = ("sstream-inst.o", "lt5-sstream-inst.o")


def fail(message: str) -> None:
    raise SystemExit(f"manylinux_floor: {message}")


def host_file(name: str) -> Path:
    """A file of the host toolchain's link path (gcc -print-file-name)."""
    found = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
    path = Path(found.stdout.strip())
    if not path.is_absolute() or not path.exists():
        fail(f"gcc does not find {name}")
    return path.resolve()


def zig_glibc_stubs(glibc: str, work: Path) -> Path:
    """Has zig link an empty library for glibc `glibc`; returns the folder of the stubs it wrote for that link."""
    source = work / "empty.c"
    source.write_text("int grpo_ext_glibc_stub_probe(void) { return 0; }\n")
    env = dict(os.environ, ZIG_GLOBAL_CACHE_DIR=str(work / "zig-cache"), ZIG_LOCAL_CACHE_DIR=str(work / "zig-local"))
    command = [sys.executable, "-m", "ziglang", "cc", "-target", f"x86_64-linux-gnu.{glibc}", "-shared"]
    command += ["-o", str(work / "probe.so"), str(source), "-lm", "-lpthread", "-ldl", "-lrt"]
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        fail(f"zig could not link for glibc {glibc} (is the ziglang package installed?):\n{run.stderr.strip()}")
    folders = {p.parent for p in (work / "zig-cache").rglob("libc.so.6")}
    if len(folders) != 1:
        fail(f"expected one folder of glibc stubs in zig's cache, found {sorted(map(str, folders))}")
    return folders.pop()


def write_glibc_stubs(glibc: str, out: Path) -> None:
    stubs = out / "stubs"
    stubs.mkdir()
    with tempfile.TemporaryDirectory() as tmp:
        found = zig_glibc_stubs(glibc, Path(tmp))
        for soname, zig_name in GLIBC_STUBS.items():
            if not (found / zig_name).exists():
                fail(f"zig wrote no {zig_name} (the stub of {soname}) in {found}")
            shutil.copy2(found / zig_name, stubs / soname)
    merged = " ".join(str(stubs / name) for name in ("libpthread.so.0", "libdl.so.2", "librt.so.1"))
    (out / "libc.so").write_text(
        f"/* glibc {glibc} link stubs (cmake/manylinux_floor.py) */\n"
        f"GROUP ( {stubs / 'libc.so.6'} {host_file('libc_nonshared.a')} "
        f"AS_NEEDED ( {merged} {stubs / 'ld-linux-x86-64.so.2'} ) )\n"
    )
    for soname in ("libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"):
        (out / (soname.split(".so")[0] + ".so")).symlink_to(stubs / soname)


def write_libstdcxx_floor(out: Path) -> None:
    archive = host_file("libstdc++.a")
    members = subprocess.run(["ar", "t", str(archive)], capture_output=True, text=True, check=True).stdout.split()
    missing = [m for m in LIBSTDCXX_OBJECTS if members.count(m) != 1]
    if missing:
        fail(f"{archive} does not hold exactly one of each of {missing}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["ar", "x", str(archive), *LIBSTDCXX_OBJECTS], cwd=tmp, check=True)
        subprocess.run(["ar", "rcs", str(out / "libstdc++_floor.a"), *LIBSTDCXX_OBJECTS], cwd=tmp, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glibc", required=True, help="the oldest glibc to run on, e.g. 2.28")
    parser.add_argument("--out", required=True, type=Path, help="the -L folder to write")
    args = parser.parse_args()
    if not re.fullmatch(r"2\.\d+", args.glibc):
        fail(f"--glibc must be a glibc release such as 2.28, got {args.glibc!r}")
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_glibc_stubs(args.glibc, out)
    write_libstdcxx_floor(out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
