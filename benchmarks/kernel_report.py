"""Static report of every CUDA kernel of the built extension, for every GPU architecture it was compiled for:
registers, spills, shared memory, launch bounds, theoretical occupancy, and the width of every global load and store
inside loops, read from the compiler's output.

No GPU is needed: the CUDA library (``_C_cuda.so``) is taken apart with ``cuobjdump`` (PTX and SASS of each
architecture), and ``ptxas -v -arch=sm_XX`` is run again on each architecture's PTX for the resource usage the build
printed. ``make kernel-report`` builds a library for this (every architecture of the wheel, each with its PTX, which
the wheel itself carries for the newest only). A scalar load (``LDG.E``, 32 bits or less) inside a loop of a
bandwidth-bound kernel is what to look at first: 16-byte vector loads (``LDG.E.128``) move four times the bytes per
instruction.

Occupancy is the theoretical one per architecture (ARCHS: per SM 65536 registers allocated per warp in units of 256,
the architecture's shared memory with 1 KiB reserved per block, its threads and blocks per SM), for a block of the
kernel's ``__launch_bounds__`` size (its launcher's largest block).

Usage::

    python benchmarks/kernel_report.py --library build/kernel-report/_C_cuda.so --out benchmarks/KERNELS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_loops  # beside this file
from gpu_archs import ARCHS, DETAIL_ARCH, SMEM_RESERVED_PER_BLOCK
from row_kernels_report import row_loop_section, small_block_section

TOOLS = ("cuobjdump", "ptxas", "cu++filt")

# Kernels whose loops stream a [rows, V] logits tensor (or a [B, T] one): their loads are the bandwidth.
BANDWIDTH_BOUND = ("selective_log_softmax", "grpo_loss_from_logits_kernel", "grpo_loss_from_logits_small_block_kernel",
                   "grpo_loss_from_logits_lone_block_kernel", "grpo_loss_from_logits_full_occupancy_kernel",
                   "scale_rows", "grpo_loss_rows", "grpo_loss_backward")  # fmt: skip

# Kernels whose occupancy the launcher's dynamic shared memory sets, not the static figures of the table.
DYNAMIC_SHARED = {
    "grpo_loss_from_logits_small_block_kernel": "plus dynamic shared memory: its part of a row, 1/16 to 1/2 of the "
    "row (the small-block layout section below gives the blocks per SM at each shape)",
    "grpo_loss_from_logits_lone_block_kernel": "plus dynamic shared memory: its whole row (a row that fits one block "
    "of the small-block layout)",
}

# Bandwidth-bound kernels whose loops keep scalar loads on purpose, and why (printed in the note column instead of
# the flag). Keyed by the demangled name as the table shows it.
SCALAR_BY_DESIGN = {
    "grpo_loss_rows_kernel<double>": "scalar by design: float64 is the reference dtype (gradcheck), read one token at "
    "a time; 2-token 16-byte chunks took 164 registers (112-120 now); its spills on sm_80-90 (about 120 B) came "
    "with the sequence level's count of a row's kept tokens (a lone token's exact k3 gradient): the float32 kernel "
    "stays at 127 registers without, and no float64 loss is timed",
}


@dataclasses.dataclass
class Kernel:
    """One kernel instantiation and what the compiler says of it."""

    mangled: str
    arch: str = DETAIL_ARCH
    name: str = ""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0
    max_threads: int = 0
    loop_loads: dict[str, int] = dataclasses.field(default_factory=dict)
    loop_stores: dict[str, int] = dataclasses.field(default_factory=dict)
    row_loops: list[sass_loops.Loop] = dataclasses.field(default_factory=list)  # DETAIL_ARCH only

    @property
    def occupancy(self) -> float:
        """Active warps per SM over the architecture's most, for a block of ``max_threads`` threads."""
        if not self.max_threads or not self.registers:
            return 0.0
        limits = ARCHS[self.arch]
        warps = -(-self.max_threads // 32)
        regs_per_warp = -(-self.registers * 32 // 256) * 256
        by_regs = limits["regs"] // (warps * regs_per_warp)
        by_threads = limits["threads"] // (warps * 32)
        by_smem = limits["smem"] // (self.smem + SMEM_RESERVED_PER_BLOCK)
        blocks = min(by_regs, by_threads, by_smem, limits["blocks"])
        return blocks * warps / (limits["threads"] // 32)

    @property
    def bandwidth_bound(self) -> bool:
        return any(key in self.mangled for key in BANDWIDTH_BOUND)

    @property
    def scalar_loop_loads(self) -> bool:
        """A bandwidth-bound kernel whose loops load no 16-byte vector."""
        return self.bandwidth_bound and bool(self.loop_loads) and "128" not in self.loop_loads


def find_tool(name: str) -> str:
    """A CUDA tool from the toolkit (CUDA_HOME, PATH) or the copy triton ships."""
    candidates = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda-13.0")) / "bin" / name]
    if shutil.which(name):
        candidates.insert(0, Path(shutil.which(name)))
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    for path in candidates:
        if path.is_file():
            return str(path)
    raise SystemExit(f"kernel_report: {name} not found (looked in {', '.join(map(str, candidates))})")


def run(cmd: list[str], cwd: str | None = None) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=True)
    return result.stdout + result.stderr


def width_of(instruction: str) -> str:
    """Bits moved by one ``LDG``/``STG``: ``.128``/``.64`` as written, ``.U16``/``.U8``... by type, else 32."""
    for bits in ("128", "64"):
        if f".{bits}" in instruction:
            return bits
    match = re.search(r"\.[US](8|16)\b", instruction)
    return match.group(1) if match else "32"


def parse_ptxas(text: str, kernels: dict[tuple[str, str], Kernel], arch: str) -> None:
    """Registers, spills, stack and static shared memory from ``ptxas -v -arch=<arch>`` output."""
    current = None
    for line in text.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            current = kernels.setdefault((arch, m.group(1)), Kernel(m.group(1), arch))
        elif current and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                         line)):  # fmt: skip
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            current.registers = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current.smem = int(smem.group(1)) if smem else 0


def parse_max_threads(ptx: str, kernels: dict[tuple[str, str], Kernel], arch: str) -> None:
    """``__launch_bounds__`` (``.maxntid``) of every entry of a PTX file."""
    for m in re.finditer(r"\.entry\s+(\S+)\s*\((?:.|\n)*?\.maxntid\s+(\d+)", ptx):
        key = (arch, m.group(1))
        if key in kernels:
            kernels[key].max_threads = int(m.group(2))


def parse_sass(sass: str, kernels: dict[tuple[str, str], Kernel]) -> None:
    """Global loads/stores inside loops: between a backward branch's target and the branch (each architecture's
    code is a section of ``cuobjdump -sass`` that starts ``code for sm_XX``)."""
    arch = DETAIL_ARCH
    for section in re.split(r"\n\s*(?=code for sm_\d+)", sass):
        if m := re.match(r"code for (sm_\d+)", section):
            arch = m.group(1)
        parse_sass_functions(section, kernels, arch)


def parse_sass_functions(sass: str, kernels: dict[tuple[str, str], Kernel], arch: str) -> None:
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        if (arch, name) not in kernels:
            continue
        lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", block)
        address = [int(a, 16) for a, _ in lines]
        loops = []
        for addr, text in zip(address, (t for _, t in lines), strict=True):
            if (m := re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)) and m.group(1):
                target = int(m.group(1), 16)
                if target <= addr:
                    loops.append((target, addr))
        if arch == DETAIL_ARCH and kernels[(arch, name)].bandwidth_bound:
            instructions = [
                (int(m.group(1), 16), m.group(3), m.group(4)) for m in sass_loops.INSTRUCTION.finditer(block)
            ]
            kernels[(arch, name)].row_loops = sass_loops.row_loops(instructions)
        for addr, text in zip(address, (t for _, t in lines), strict=True):
            # LDGSTS: cp.async, a global load straight into shared memory (the single-read pass's staging)
            op = re.search(r"\b(LDGSTS|LDG|STG)(\.[A-Z0-9.]+)?", text)
            if op and any(lo <= addr <= hi for lo, hi in loops):
                kernel = kernels[(arch, name)]
                table = kernel.loop_stores if op.group(1) == "STG" else kernel.loop_loads
                bits = width_of(op.group(0))
                table[bits] = table.get(bits, 0) + 1


# Enum template arguments as c++filt prints them -> what they mean (csrc/logit_transform.h: SoftCap).
ENUM_ARGUMENTS = {"(grpo_ext::SoftCap)0": "no cap", "(grpo_ext::SoftCap)1": "softcap",
                  "(grpo_ext::SoftCap)2": "cap at run time"}  # fmt: skip


def short_name(plain: str) -> str:
    """``void grpo_ext::k<float, (grpo_ext::SoftCap)0>(args)`` -> ``k<float, no cap>``; a kernel that is no template
    demangles without its return type (``grpo_ext::k(args)`` -> ``k``)."""
    plain = re.sub(r"^(void )?grpo_ext::", "", plain)
    if plain.endswith(")"):  # drop the parameter list: from its matching "(" on
        depth = 0
        for i in range(len(plain) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(plain[i], 0)
            if depth == 0:
                plain = plain[:i]
                break
    for enum, meaning in ENUM_ARGUMENTS.items():
        plain = plain.replace(enum, meaning)
    return plain.replace("__nv_bfloat16", "bf16").replace("__half", "fp16")


def demangle(kernels: dict[tuple[str, str], Kernel], cxxfilt: str | None) -> None:
    names = sorted({mangled for _, mangled in kernels})
    text = run([cxxfilt, *names]) if cxxfilt else "\n".join(names)
    plain = dict(zip(names, text.strip().splitlines(), strict=True))
    for (_, mangled), kernel in kernels.items():
        kernel.name = short_name(plain[mangled])


def arch_order(arch: str) -> int:
    return int(arch.removeprefix("sm_"))


def collect(library: str) -> list[Kernel]:
    """Every kernel of the CUDA code in ``library`` (a built ``_C_cuda.so``), once per architecture with PTX."""
    library = str(Path(library).resolve())  # cuobjdump runs in a temporary folder
    cuobjdump, ptxas = find_tool("cuobjdump"), find_tool("ptxas")
    try:
        cxxfilt = find_tool("cu++filt")
    except SystemExit:
        cxxfilt = shutil.which("c++filt")
    kernels: dict[tuple[str, str], Kernel] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run([cuobjdump, "-xptx", "all", library], cwd=tmp)
        ptx_files = sorted(Path(tmp).glob("*.ptx"))
        if not ptx_files:
            raise SystemExit(f"kernel_report: {library} holds no CUDA code (a CPU-only build?)")
        for ptx in ptx_files:
            match = re.search(r"\.(sm_\d+)\.ptx$", ptx.name)
            arch = match.group(1) if match else DETAIL_ARCH
            if arch not in ARCHS:
                raise SystemExit(f"kernel_report: no occupancy limits for {arch} (add it to ARCHS)")
            parse_ptxas(run([ptxas, "-v", f"-arch={arch}", "-o", os.devnull, str(ptx)]), kernels, arch)
            parse_max_threads(ptx.read_text(), kernels, arch)
    parse_sass(run([cuobjdump, "-sass", library]), kernels)
    demangle(kernels, cxxfilt)
    return sorted(kernels.values(), key=lambda k: (k.name, arch_order(k.arch)))


def widths(table: dict[str, int]) -> str:
    return ", ".join(f"{count}x{bits}b" for bits, count in sorted(table.items(), key=lambda kv: -int(kv[0]))) or "-"


def markdown(kernels: list[Kernel], library: str) -> str:
    """The report: a table per kernel for DETAIL_ARCH (every column), then one line per kernel across the
    architectures (registers, spills, occupancy)."""
    archs = sorted({k.arch for k in kernels}, key=arch_order)
    detail_arch = DETAIL_ARCH if DETAIL_ARCH in archs else archs[-1]
    detail = [k for k in kernels if k.arch == detail_arch]
    rows = [
        "| kernel | regs | spill st/ld (B) | stack (B) | smem (B) | launch bound | occupancy | loop loads | "
        "loop stores | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in detail:
        notes = []
        if k.spill_stores or k.spill_loads:
            notes.append("**spills**")
        if k.scalar_loop_loads:
            notes.append(SCALAR_BY_DESIGN.get(k.name, "**scalar loads in a bandwidth-bound loop**"))
        notes += [note for kernel, note in DYNAMIC_SHARED.items() if k.name.startswith(kernel + "<")]
        rows.append(f"| `{k.name}` | {k.registers} | {k.spill_stores}/{k.spill_loads} | {k.stack} | {k.smem} | "
                    f"{k.max_threads} | {k.occupancy:.0%} | {widths(k.loop_loads)} | {widths(k.loop_stores)} | "
                    f"{'; '.join(notes)} |")  # fmt: skip
    by_name: dict[str, dict[str, Kernel]] = {}
    for k in kernels:
        by_name.setdefault(k.name, {})[k.arch] = k
    across = [
        "| kernel | " + " | ".join(f"{arch} ({ARCHS[arch]['gpu']})" for arch in archs) + " |",
        "| --- |" + " --- |" * len(archs),
    ]
    for name, per_arch in by_name.items():
        cells = []
        for arch in archs:
            k = per_arch.get(arch)
            if k is None:
                cells.append("-")
                continue
            spill = f", **spills {k.spill_stores}/{k.spill_loads} B**" if k.spill_stores or k.spill_loads else ""
            cells.append(f"{k.registers} regs, {k.occupancy:.0%}{spill}")
        across.append(f"| `{name}` | " + " | ".join(cells) + " |")
    spilled = {arch: sum(1 for k in kernels if k.arch == arch and (k.spill_stores or k.spill_loads)) for arch in archs}
    scalar = sum(1 for k in detail if k.scalar_loop_loads and k.name not in SCALAR_BY_DESIGN)
    head = (
        "# CUDA kernels: the compiler's view, per GPU architecture\n\n"
        f"Generated by `make kernel-report` (`python benchmarks/kernel_report.py`) from `{Path(library).name}` built "
        f"for {', '.join(archs)}; no GPU was used. Occupancy: theoretical, active warps over the architecture's "
        "most per SM, a block of the launch-bound size. Loop loads/stores: global `LDG`/`STG` instructions inside a "
        "loop of the SASS, by width (`128b` = 16-byte vectors; `LDGSTS`, cp.async into shared memory, counts as a "
        "load).\n\n"
        f"{len(detail)} kernel instantiations per architecture; with spills: "
        f"{', '.join(f'{n} on {arch}' for arch, n in spilled.items())}; {scalar} bandwidth-bound ones with only "
        f"scalar loads in their loops on {detail_arch} (besides the ones whose note says why).\n\n"
        f"## Every kernel on {detail_arch} ({ARCHS[detail_arch]['gpu']})\n\n"
    )
    return (head + "\n".join(rows) + "\n\n## Registers and occupancy on every architecture\n\n"
            + "\n".join(across) + "\n\n" + row_loop_section(kernels) + "\n"
            + small_block_section(kernels))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", help="the built _C_cuda.so (default: the installed grpo_ext's)")
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    parser.add_argument("--no-traffic", action="store_true",
                        help="leave out the counted memory traffic (traffic_report.py: about 3 minutes of CPU)")
    args = parser.parse_args()
    library = args.library
    if library is None:
        import grpo_ext

        if not grpo_ext.build_info()["cuda_compiled"]:
            raise SystemExit("kernel_report: this grpo_ext was built without CUDA kernels (GRPO_EXT_CUDA=ON to build)")
        library = str(grpo_ext._native.CUDA_LIBRARY)
    report = markdown(collect(library), library)
    if not args.no_traffic:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import traffic_report

        report += "\n" + traffic_report.markdown(traffic_report.measure())
        report += "\n" + traffic_report.advantage_grids()
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
