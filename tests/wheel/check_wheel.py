"""Checks a built grpo_ext wheel file before it is installed anywhere (``make wheel-smoke``).

- its tags: ``py3-none`` (no Python C-API in the libraries) and the ``manylinux_<floor>`` platform tag of
  ``--glibc`` (auditwheel), and no library asking for a newer glibc symbol version than that floor (``objdump -T``);
- its metadata: the torch it requires is the oldest torch the binary was built for;
- its CUDA library holds SASS for every architecture of ``--archs`` and the PTX of the ones marked ``+PTX``
  (``cuobjdump --list-elf/--list-ptx``);
- ``torch-abi-audit`` on every shared library in it: LibTorch stable ABI, 0 unstable symbols, and the oldest torch
  its stable-shim symbols need is not newer than the one the metadata promises.

Prints what it found (the closing note of the wheel issue quotes it) and exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def fail(message: str) -> None:
    raise SystemExit(f"check_wheel: {message}")


def find_cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton  # ships cuobjdump with its NVIDIA backend

    candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not candidate.exists():
        fail("cuobjdump not found (CUDA toolkit or triton)")
    return str(candidate)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])  # major.minor: what the ABI target names


def dotted(version: str) -> tuple[int, ...]:
    """"2.28" -> (2, 28): every part, as symbol versions compare."""
    return tuple(int(part) for part in version.split("."))


def symbol_versions(library: Path) -> dict[str, tuple[int, ...]]:
    """The newest version a shared library asks for, by prefix (GLIBC, GLIBCXX, CXXABI, GCC): objdump -T."""
    table = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True).stdout
    newest: dict[str, tuple[int, ...]] = {}
    for prefix, number in re.findall(r"\b(GLIBC|GLIBCXX|CXXABI|GCC)_(\d+(?:\.\d+)*)\b", table):
        newest[prefix] = max(newest.get(prefix, dotted(number)), dotted(number))
    return newest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--archs", required=True, help='TORCH_CUDA_ARCH_LIST of the build, e.g. "8.0 9.0+PTX"')
    parser.add_argument("--glibc", required=True, help="the oldest glibc the wheel promises, e.g. 2.28")
    args = parser.parse_args()

    name = args.wheel.name
    tags = name[: -len(".whl")].split("-")[-3:]
    platform_tag = f"manylinux_{args.glibc.replace('.', '_')}_x86_64"
    if tags != ["py3", "none", platform_tag]:
        fail(f"expected a py3-none-{platform_tag} wheel, got tags {'-'.join(tags)}")
    print(f"wheel: {name}, {args.wheel.stat().st_size / 2**20:.1f} MiB")

    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(args.wheel) as wheel:
        wheel.extractall(tmp)
        root = Path(tmp)
        metadata = next(root.glob("*.dist-info/METADATA"))
        requires = email.parser.Parser().parsestr(metadata.read_text()).get_all("Requires-Dist") or []
        torch_requirement = next((r for r in requires if re.match(r"torch\b", r)), None)
        config = (root / "grpo_ext" / "_build_config.py").read_text()
        torch_min = re.search(r'TORCH_MIN_VERSION = "([\d.]+)"', config).group(1)
        promised = re.fullmatch(rf"torch\s*>=\s*{re.escape(torch_min)}(\.0)?", torch_requirement or "")
        if promised is None:
            fail(f"the wheel requires {torch_requirement!r}, but its binary targets torch >= {torch_min}")
        print(f"metadata: Requires-Dist {torch_requirement}; binary built for torch >= {torch_min}")

        libraries = sorted(root.glob("grpo_ext/*.so"))
        cuda_library = root / "grpo_ext" / "_C_cuda.so"
        if {p.name for p in libraries} != {"_C.so", "_C_cuda.so"}:
            fail(f"expected _C.so and _C_cuda.so in grpo_ext/, got {[p.name for p in libraries]}")
        for library in libraries:
            newest = {prefix: ".".join(map(str, v)) for prefix, v in sorted(symbol_versions(library).items())}
            print(f"{library.name}: newest symbol versions " + ", ".join(f"{k}_{v}" for k, v in newest.items()))
            if dotted(newest.get("GLIBC", "0")) > dotted(args.glibc):
                fail(f"{library.name} asks for GLIBC_{newest['GLIBC']}, newer than {args.glibc}")
        cuobjdump = find_cuobjdump()
        elf = subprocess.run([cuobjdump, "--list-elf", str(cuda_library)], capture_output=True, text=True, check=True)
        ptx = subprocess.run([cuobjdump, "--list-ptx", str(cuda_library)], capture_output=True, text=True)
        sass_archs = sorted({int(a) for a in re.findall(r"\.sm_(\d+)\.cubin", elf.stdout)})
        ptx_archs = sorted({int(a) for a in re.findall(r"\.sm_(\d+)\.ptx", ptx.stdout)})
        wanted = args.archs.split()
        want_sass = sorted(int(a.replace("+PTX", "").replace(".", "")) for a in wanted)
        want_ptx = sorted(int(a.replace("+PTX", "").replace(".", "")) for a in wanted if a.endswith("+PTX"))
        print(f"_C_cuda.so: SASS sm_{', sm_'.join(map(str, sass_archs))}; PTX "
              f"{', '.join(f'compute_{a}' for a in ptx_archs) or 'none'}")  # fmt: skip
        if sass_archs != want_sass or ptx_archs != want_ptx:
            fail(f"expected SASS {want_sass} and PTX {want_ptx}")

        auditor = Path(sys.executable).parent / "torch-abi-audit"  # the console script of the torch-abi-audit package
        audit = subprocess.run([str(auditor), "--json", str(root / "grpo_ext")], capture_output=True, text=True)
        if audit.returncode not in (0, 1):
            fail(f"torch-abi-audit failed: {audit.stderr.strip()}")
        report = json.loads(audit.stdout)
        audited = {Path(lib["path"]).name: lib for lib in report["bundled_libs"] + report["extensions"]}
        if set(audited) != {p.name for p in libraries}:
            fail(f"torch-abi-audit inspected {sorted(audited)}, not every library {[p.name for p in libraries]}")
        for lib_name, lib in sorted(audited.items()):
            torch_verdict = lib["torch"]
            line = (f"torch-abi-audit {lib_name}: stable={torch_verdict['stable']}, "
                    f"unstable symbols={len(torch_verdict['unstable_symbols'])}, "
                    f"stable-shim calls={torch_verdict['stable_shim_count']}, "
                    f"min torch={torch_verdict['min_torch_version']}")  # fmt: skip
            print(line)
            if lib["error"] or not torch_verdict["stable"] or torch_verdict["unstable_symbols"]:
                fail(f"{lib_name} is not on the stable ABI: {torch_verdict['unstable_symbols'][:10]}, {lib['error']}")
            if version_tuple(torch_verdict["min_torch_version"]) > version_tuple(torch_min):
                fail(f"{lib_name} needs torch {torch_verdict['min_torch_version']}, newer than {torch_min} (promised)")
    print("check_wheel: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
