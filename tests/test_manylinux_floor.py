"""cmake/manylinux_floor.py: a library linked through its folder asks for no glibc or libstdc++ symbol version newer
than glibc 2.28's manylinux policy allows, where the same library linked plainly on this machine does, and it still
loads and gives the same results here; a glibc symbol newer than the floor fails the link instead of slipping in."""

from __future__ import annotations

import ctypes
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "cmake" / "manylinux_floor.py"
spec = importlib.util.spec_from_file_location("check_wheel", ROOT / "tests" / "wheel" / "check_wheel.py")
check_wheel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_wheel)

FLOOR_GLIBC = (2, 28)
FLOOR_GLIBCXX = (3, 4, 24)  # manylinux_2_28's libstdc++ (auditwheel's policy; GCC 8's is 3.4.25)

# What the kernels' libraries use from the C and C++ runtimes: string streams (torch's stable headers and
# grpo_ext::fail), exp and log, threads and their once-flags, dlsym, shm_open (the static CUDA runtime), and an
# exception thrown and caught.
SOURCE = r"""
#include <sys/mman.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

extern "C" double exp_plus_log(double x) { return std::exp(x) + std::log(x); }

// Cold, as grpo_ext::fail's error path is: GCC then calls the library's stream members instead of inlining them.
[[gnu::cold, gnu::noinline]] static std::string formatted(double x, long n) {
  std::ostringstream message;
  message << "x=" << x << " n=" << n;
  return message.str();
}

extern "C" int format_pair(double x, long n, char* out, int size) {
  std::string text = formatted(x, n);
  std::snprintf(out, size, "%s", text.c_str());
  return static_cast<int>(text.size());
}

extern "C" long threads_and_once(long n) {
  static std::once_flag once;
  long sum = 0;
  std::call_once(once, [&] { sum += 1; });
  auto shared = std::make_shared<long>(n);
  std::thread worker([&, shared] { sum += *shared; });
  worker.join();
  return sum;
}

extern "C" int finds_malloc() { return dlsym(RTLD_DEFAULT, "malloc") != nullptr; }

extern "C" int shared_memory_round_trip() {
  int fd = shm_open("/grpo_ext_floor_test", O_CREAT | O_RDWR, 0600);
  if (fd < 0) return -1;
  shm_unlink("/grpo_ext_floor_test");
  close(fd);
  return 1;
}

extern "C" int throws_and_catches(int fail) {
  try {
    if (fail) throw std::runtime_error("bad argument");
    return 0;
  } catch (const std::exception& e) {
    return static_cast<int>(std::strlen(e.what()));
  }
}
"""


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def floor(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("floor") / "manylinux-floor"
    made = run([sys.executable, str(SCRIPT), "--glibc", "2.28", "--out", str(out)], ROOT)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(out)
    return out


def compile_objects(tmp: Path, source: str) -> list[Path]:
    (tmp / "lib.cpp").write_text(source)
    objects = []
    for src in (tmp / "lib.cpp", ROOT / "csrc" / "manylinux_floor.cpp"):
        obj = tmp / (src.stem + ".o")
        compiled = run(["g++", "-std=c++20", "-O2", "-fPIC", "-c", str(src), "-o", str(obj)], tmp)
        assert compiled.returncode == 0, compiled.stderr
        objects.append(obj)
    return objects


def link(tmp: Path, objects: list[Path], name: str, floor: Path | None) -> subprocess.CompletedProcess:
    """As CMakeLists.txt links the libraries: --no-undefined, --as-needed, and with `floor` its folder."""
    command = ["g++", "-shared", "-o", str(tmp / name), *map(str, objects)]
    command += ["-Wl,--no-undefined", "-Wl,--as-needed"]
    if floor is not None:
        command += [f"-L{floor}", "-Wl,--exclude-libs,libstdc++_floor.a", str(floor / "libstdc++_floor.a")]
    return run([*command, "-lpthread", "-ldl", "-lrt"], tmp)


def test_the_floor_link_asks_for_no_newer_versions_and_runs_alike(floor, tmp_path):
    objects = compile_objects(tmp_path, SOURCE)
    for name, folder in (("host.so", None), ("floor.so", floor)):
        linked = link(tmp_path, objects, name, folder)
        assert linked.returncode == 0, linked.stderr

    host = check_wheel.symbol_versions(tmp_path / "host.so")
    # The control: linked plainly on a glibc >= 2.34 / GCC >= 11 machine, the same code asks for newer versions.
    assert host["GLIBC"] > FLOOR_GLIBC or host["GLIBCXX"] > FLOOR_GLIBCXX, host
    versions = check_wheel.symbol_versions(tmp_path / "floor.so")
    assert versions["GLIBC"] <= FLOOR_GLIBC, versions
    assert versions["GLIBCXX"] <= FLOOR_GLIBCXX, versions
    needed = run(["readelf", "-d", str(tmp_path / "floor.so")], tmp_path).stdout
    assert "libstdc++.so.6" in needed  # the exception runtime stays the system's: libstdc++ is not linked statically
    exported = run(["nm", "-D", "--defined-only", str(tmp_path / "floor.so")], tmp_path).stdout
    assert "basic_ostringstream" not in exported and "__libc_single_threaded" not in exported

    for name in ("host.so", "floor.so"):
        lib = ctypes.CDLL(str(tmp_path / name))
        lib.exp_plus_log.restype = ctypes.c_double
        lib.exp_plus_log.argtypes = [ctypes.c_double]
        assert lib.exp_plus_log(2.5) == pytest.approx(math.exp(2.5) + math.log(2.5), rel=1e-15)
        buffer = ctypes.create_string_buffer(64)
        assert lib.format_pair(ctypes.c_double(0.25), ctypes.c_long(7), buffer, 64) == len("x=0.25 n=7")
        assert buffer.value == b"x=0.25 n=7"
        lib.threads_and_once.restype = ctypes.c_long
        assert lib.threads_and_once(ctypes.c_long(41)) == 42
        assert lib.finds_malloc() == 1
        assert lib.shared_memory_round_trip() == 1
        assert lib.throws_and_catches(1) == len("bad argument")
        assert lib.throws_and_catches(0) == 0


def test_a_glibc_symbol_newer_than_the_floor_fails_the_link(floor, tmp_path):
    # arc4random is glibc 2.36's: it links here plainly, and not against 2.28's stubs.
    source = "#include <stdlib.h>\nextern \"C\" unsigned draw() { return arc4random(); }\n"
    objects = compile_objects(tmp_path, source)
    assert link(tmp_path, objects, "host.so", None).returncode == 0
    linked = link(tmp_path, objects, "floor.so", floor)
    assert linked.returncode != 0
    assert "undefined reference to `arc4random'" in linked.stderr


def test_bad_floors_are_refused_by_name(tmp_path):
    refused = run([sys.executable, str(SCRIPT), "--glibc", "2.28.1", "--out", str(tmp_path / "x")], ROOT)
    assert refused.returncode != 0
    assert "--glibc must be a glibc release such as 2.28, got '2.28.1'" in refused.stderr


def test_the_folder_holds_the_stubs_and_the_linker_script(floor):
    script = (floor / "libc.so").read_text()
    assert "GROUP (" in script and str(floor / "stubs" / "libc.so.6") in script
    for soname in ("libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2"):
        assert str(floor / "stubs" / soname) in script
    for name in ("libm.so", "libpthread.so", "libdl.so", "librt.so"):
        assert (floor / name).resolve().parent == floor / "stubs"
    members = run(["ar", "t", str(floor / "libstdc++_floor.a")], floor).stdout.split()
    assert sorted(members) == ["lt5-sstream-inst.o", "sstream-inst.o"]
