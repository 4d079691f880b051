"""Builds cuda_emu's driver (the CUDA kernel headers on the CPU) with the system g++, AddressSanitizer and UBSan.

The kernel headers and the host plans (``csrc/plan/*.h``) are compiled as they are, from a copy of ``csrc/`` in
which two things are rewritten: each ``__shared__`` declaration becomes a reference to per-block heap storage
(``::cuda_emu::shared``, see runtime.h), on the same line, so that ASan sees an access past a shared array and the
harness can poison it; and ``plan/stable_api.h``, where the plans meet torch, is replaced by ``stable_api_emu.h``,
which offers the same names over the driver's tensors. Each copied file starts with a ``#line`` directive naming the
original, so that reports point into ``csrc/``. The kernels' ``__launch_bounds__`` are read from the same headers into
a table the launch checks.

The result is cached under ``build/cuda_emu/<hash of every input>/``: a second build with the same sources is free.
``python tests/cuda_emu/build.py`` builds and prints the driver's path.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SOURCES = ("runtime.cpp", "shared_memory.cpp", "driver.cpp", "traffic.cpp", "ops_advantages.cpp", "ops_loss.cpp",
           "ops_logits.cpp", "ops_selftest.cpp")  # fmt: skip
# The translation units holding kernels: the traffic build instruments their memory accesses (traffic.cpp).
KERNEL_SOURCES = tuple(name for name in SOURCES if name.startswith("ops_"))
# Kernel headers of the harness itself, compiled (and rewritten) like csrc's.
HARNESS_KERNELS = ("selftest_kernels.cuh",)
# csrc/plan/stable_api.h's stand-in in the copy of csrc/ (the plans over the driver's tensors instead of torch's).
STABLE_API = "plan/stable_api.h"
STABLE_API_STAND_IN = "stable_api_emu.h"
HARNESS_FILES = (*SOURCES, *HARNESS_KERNELS, "runtime.h", "shared_memory.h", "half_types.h", "driver.h", "plans.h",
                 STABLE_API_STAND_IN, "include/cuda_runtime.h", "include/cuda_bf16.h", "include/cuda_fp16.h",
                 "include/cooperative_groups.h", "build.py")  # fmt: skip
CXX = os.environ.get("CXX", "g++")
SANITIZE = ["-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all"]
# The traffic build: no sanitizer runtime; every load and store of the kernel sources calls traffic.cpp. -O0 there:
# at -O1 GCC splits a 16-byte vector into scalars and sinks the load of an element whose value a branch does not use,
# which a GPU's vector load still moves.
TRAFFIC = ["-DCUDA_EMU_TRAFFIC=1"]
COUNT_ACCESSES = ["-O0", "-fsanitize=kernel-address", "--param", "asan-instrumentation-with-call-threshold=0",
                  "--param", "asan-stack=0", "--param", "asan-globals=0"]  # fmt: skip
VARIANTS = ("sanitize", "traffic")
# -ffp-contract=off: no FMA contraction on the host, whatever the target (nvcc contracts; the tolerances cover it).
CXXFLAGS = ["-std=c++20", "-O1", "-g", "-fno-omit-frame-pointer", "-ffp-contract=off", "-Wall", "-Wextra",
            "-Wno-unused-parameter", "-Wno-unknown-pragmas", "-Werror"]  # fmt: skip

_SHARED = re.compile(r"__shared__\s+([^;{}]*);")
_DECLARATOR = re.compile(r"(\w+)\s*((?:\[[^\[\]]+\]\s*)*)")
# The first argument (max threads per block); a second one (min blocks per SM) is for the compiler's registers only.
# The name of every ``__global__`` function of a source, with or without ``__launch_bounds__`` (whose minimum blocks
# an SM, which the emulator does not use, may be an expression with one level of parentheses): also read by the
# suite's kernel coverage (conftest.py) and tests/test_kernel_report.py.
KERNEL_NAME = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))+\)\s*(?://[^\n]*\n\s*)?)?(\w+)")
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\(\s*(\d+)\s*(?:,(?:[^()]|\([^()]*\))*)?\)\s*(?://[^\n]*\n\s*)?(\w+)")


class BuildError(RuntimeError):
    """The headers could not be prepared or compiled."""


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside (), [] and <>."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def rewrite_shared(text: str, label: str) -> str:
    """Each ``__shared__ T a[N], b;`` of ``text`` as ``auto& a = ::cuda_emu::shared<T[N]>("label:line:a"); ...``.

    Raises:
        BuildError: on a declaration this rewrite does not understand (extern, an initializer, several lines).
    """

    def replace(match: re.Match) -> str:
        declaration = match.group(1)
        line = text.count("\n", 0, match.start()) + 1
        if text[max(0, match.start() - 8) : match.start()].strip() == "extern":
            # Dynamic shared memory: only csrc/cuda/cluster.cuh declares it, in code the harness replaces (runtime.h
            # defines GRPO_CLUSTER_API); left as written, it is a compile error wherever the harness would see it.
            return match.group(0)
        if "\n" in match.group(0) or "=" in declaration:
            raise BuildError(f"{label}:{line}: cannot rewrite the __shared__ declaration {match.group(0)!r}")
        parts = _split_top_level(declaration)
        first = re.fullmatch(r"(.+?)\s+(\w+\s*(?:\[[^\[\]]+\]\s*)*)", parts[0].strip())
        if first is None:
            raise BuildError(f"{label}:{line}: cannot rewrite the __shared__ declaration {match.group(0)!r}")
        type_name, declarators = first.group(1), [first.group(2), *parts[1:]]
        out = []
        for declarator in declarators:
            parsed = _DECLARATOR.fullmatch(declarator.strip())
            if parsed is None:
                raise BuildError(f"{label}:{line}: cannot rewrite the __shared__ declarator {declarator!r}")
            name, dims = parsed.group(1), re.sub(r"\s+", " ", parsed.group(2).strip())
            out.append(f'auto& {name} = ::cuda_emu::shared<{type_name}{dims}>("{label}:{line}:{name}");')
        return " ".join(out)

    return _SHARED.sub(replace, text)


def launch_bounds(texts: dict[str, str]) -> dict[str, int]:
    """``{kernel name: __launch_bounds__}`` of every kernel in ``texts`` (file label -> source)."""
    bounds: dict[str, int] = {}
    for label, text in texts.items():
        found = _LAUNCH_BOUNDS.findall(text)
        if len(found) != text.count("__launch_bounds__("):
            raise BuildError(f"{label}: a __launch_bounds__ whose argument is not a number (the harness reads them)")
        for bound, name in found:
            if bounds.setdefault(name, int(bound)) != int(bound):
                raise BuildError(f"{name} has two different __launch_bounds__")
    return bounds


def _inputs(csrc: Path) -> dict[str, bytes]:
    headers = sorted([*csrc.glob("*.h"), *csrc.glob("cuda/*.cuh"), *csrc.glob("plan/*.h")])
    files = {f"csrc/{p.relative_to(csrc)}": p.read_bytes() for p in headers}
    files.update({f"harness/{name}": (HERE / name).read_bytes() for name in HARNESS_FILES})
    return files


def _compiler_version() -> str:
    try:
        return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"the C++ compiler {CXX!r} is not usable: {e}") from e


def _flags(variant: str, source: str) -> list[str]:
    if variant == "sanitize":
        return SANITIZE
    return TRAFFIC + (COUNT_ACCESSES if source in KERNEL_SOURCES else [])


def build(csrc: Path | None = None, out_root: Path | None = None, jobs: int | None = None,
          variant: str = "sanitize") -> Path:  # fmt: skip
    """Builds (or finds in the cache) the driver for the kernel headers under ``csrc``; returns its path.

    Args:
        csrc: a ``csrc/`` tree (default: the repository's; the mutation check passes mutated copies).
        out_root: cache directory (default: ``$GRPO_EMU_BUILD``, else ``build/cuda_emu`` in the repository).
        jobs: parallel compiler processes (default: the CPU count).
        variant: ``"sanitize"`` (ASan and UBSan) or ``"traffic"`` (no sanitizer; counts the bytes each launch reads
            and writes in each tensor, traffic.cpp).
    """
    if variant not in VARIANTS:
        raise BuildError(f"variant must be one of {VARIANTS}, got {variant!r}")
    csrc = Path(csrc or REPO / "csrc").resolve()
    out_root = Path(out_root or os.environ.get("GRPO_EMU_BUILD") or REPO / "build" / "cuda_emu")
    files = _inputs(csrc)
    digest = hashlib.sha256(_compiler_version().encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    digest.update(" ".join([variant, *CXXFLAGS, *_flags(variant, SOURCES[0]), *_flags(variant, SOURCES[-1])]).encode())
    target = out_root / digest.hexdigest()[:16]
    exe = target / "cuda_emu_driver"
    if exe.exists():
        return exe
    out_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tmp-", dir=out_root))
    try:
        texts = {}
        sources = {name.removeprefix("csrc/"): (csrc / name.removeprefix("csrc/"), data) for name, data in
                   files.items() if name.startswith("csrc/")}  # fmt: skip
        sources.update({f"harness/{name}": (HERE / name, (HERE / name).read_bytes()) for name in HARNESS_KERNELS})
        sources[STABLE_API] = (HERE / STABLE_API_STAND_IN, (HERE / STABLE_API_STAND_IN).read_bytes())
        for rel, (origin, data) in sources.items():
            text = data.decode()
            texts[rel] = text
            dest = work / "src" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f'#line 1 "{origin}"\n' + rewrite_shared(text, rel))
        table = "".join(f'{{"{name}", {bound}}},\n' for name, bound in sorted(launch_bounds(texts).items()))
        (work / "gen").mkdir()
        (work / "gen" / "launch_bounds.inc").write_text(table)
        include = ["-I", str(HERE / "include"), "-I", str(HERE), "-I", str(work / "src"), "-I", str(work / "gen")]

        def compile_one(source: str) -> Path:
            obj = work / (Path(source).stem + ".o")
            cmd = [CXX, *CXXFLAGS, *_flags(variant, source), *include, "-c", str(HERE / source), "-o", str(obj)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise BuildError(f"compiling {source} failed:\n{result.stderr[-6000:]}")
            return obj

        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, SOURCES))
        link = [CXX, *(SANITIZE if variant == "sanitize" else []), *(str(o) for o in objects), "-o",
                str(work / "cuda_emu_driver")]
        result = subprocess.run(link, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"linking the driver failed:\n{result.stderr[-6000:]}")
        try:
            work.rename(target)
        except OSError:  # built meanwhile by another process: keep that one
            if not exe.exists():
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return exe


if __name__ == "__main__":
    variant = os.environ.get("CUDA_EMU_VARIANT", "sanitize")  # or "traffic"
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None, variant=variant))
