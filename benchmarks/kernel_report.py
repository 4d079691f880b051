"""Static report of every CUDA kernel of the built extension: registers, spills, shared memory, launch bounds,
theoretical H100 occupancy, and the width of every global load and store inside loops, read from the compiler's output.

No GPU is needed: the sm_90 code of the installed ``grpo_ext._C`` is taken apart with ``cuobjdump`` (PTX and SASS),
and ``ptxas -v`` is run again on the PTX for the resource usage the build printed. A scalar load (``LDG.E``, 32 bits
or less) inside a loop of a bandwidth-bound kernel is what to look at first: 16-byte vector loads (``LDG.E.128``) move
four times the bytes per instruction.

Occupancy is the theoretical one on an H100 SXM (132 SMs; per SM 65536 registers allocated per warp in units of 256,
228 KiB of shared memory with 1 KiB reserved per block, 2048 threads, 32 blocks), for a block of the kernel's
``__launch_bounds__`` size (its launcher's largest block).

Usage::

    python benchmarks/kernel_report.py                      # print the table
    python benchmarks/kernel_report.py --out benchmarks/KERNELS.md
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

H100 = {"sms": 132, "regs": 65536, "smem": 228 * 1024, "smem_reserved": 1024, "threads": 2048, "blocks": 32}
TOOLS = ("cuobjdump", "ptxas", "cu++filt")

# Kernels whose loops stream a [rows, V] logits tensor (or a [B, T] one): their loads are the bandwidth.
BANDWIDTH_BOUND = ("selective_log_softmax", "grpo_loss_from_logits_kernel", "grpo_loss_from_logits_resident_kernel",
                   "scale_rows", "grpo_loss_rows", "grpo_loss_backward")  # fmt: skip

# Kernels whose occupancy the launcher's dynamic shared memory sets, not the static figures of the table.
DYNAMIC_SHARED = {
    "grpo_loss_from_logits_resident_kernel": "plus dynamic shared memory: its part of a row (up to 227 KiB; "
    "148 KiB at V=151936 bf16, one block per SM)",
}

# Bandwidth-bound kernels whose loops keep scalar loads on purpose, and why (printed in the note column instead of
# the flag). Keyed by the demangled name as the table shows it.
SCALAR_BY_DESIGN = {
    "grpo_loss_rows_kernel<double>": "scalar by design: float64 is the reference dtype (gradcheck), read one token at "
    "a time; 2-token 16-byte chunks took 164 registers (116 now)",
}


@dataclasses.dataclass
class Kernel:
    """One kernel instantiation and what the compiler says of it."""

    mangled: str
    name: str = ""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0
    max_threads: int = 0
    loop_loads: dict[str, int] = dataclasses.field(default_factory=dict)
    loop_stores: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def occupancy(self) -> float:
        """Active warps per SM over 64 for a block of ``max_threads`` threads."""
        if not self.max_threads or not self.registers:
            return 0.0
        warps = -(-self.max_threads // 32)
        regs_per_warp = -(-self.registers * 32 // 256) * 256
        by_regs = H100["regs"] // (warps * regs_per_warp)
        by_threads = H100["threads"] // (warps * 32)
        by_smem = H100["smem"] // (self.smem + H100["smem_reserved"])
        blocks = min(by_regs, by_threads, by_smem, H100["blocks"])
        return blocks * warps / 64

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


def parse_ptxas(text: str, kernels: dict[str, Kernel]) -> None:
    """Registers, spills, stack and static shared memory from ``ptxas -v`` output."""
    current = None
    for line in text.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            current = kernels.setdefault(m.group(1), Kernel(m.group(1)))
        elif current and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                         line)):  # fmt: skip
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            current.registers = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            current.smem = int(smem.group(1)) if smem else 0


def parse_max_threads(ptx: str, kernels: dict[str, Kernel]) -> None:
    """``__launch_bounds__`` (``.maxntid``) of every entry of a PTX file."""
    for m in re.finditer(r"\.entry\s+(\S+)\s*\((?:.|\n)*?\.maxntid\s+(\d+)", ptx):
        name = m.group(1)
        if name in kernels:
            kernels[name].max_threads = int(m.group(2))


def parse_sass(sass: str, kernels: dict[str, Kernel]) -> None:
    """Global loads/stores inside loops: between a backward branch's target and the branch."""
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        if name not in kernels:
            continue
        lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", block)
        address = [int(a, 16) for a, _ in lines]
        loops = []
        for addr, text in zip(address, (t for _, t in lines), strict=True):
            if (m := re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)) and m.group(1):
                target = int(m.group(1), 16)
                if target <= addr:
                    loops.append((target, addr))
        for addr, text in zip(address, (t for _, t in lines), strict=True):
            op = re.search(r"\b(LDG|STG)(\.[A-Z0-9.]+)?", text)
            if op and any(lo <= addr <= hi for lo, hi in loops):
                table = kernels[name].loop_loads if op.group(1) == "LDG" else kernels[name].loop_stores
                bits = width_of(op.group(0))
                table[bits] = table.get(bits, 0) + 1


# Enum template arguments as c++filt prints them -> what they mean (csrc/logit_transform.h: SoftCap).
ENUM_ARGUMENTS = {"(grpo_ext::SoftCap)0": "no cap", "(grpo_ext::SoftCap)1": "softcap",
                  "(grpo_ext::SoftCap)2": "cap at run time"}  # fmt: skip


def short_name(plain: str) -> str:
    """``void grpo_ext::k<float, (grpo_ext::SoftCap)0>(args)`` -> ``k<float, no cap>``."""
    plain = re.sub(r"^void grpo_ext::", "", plain)
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


def demangle(kernels: dict[str, Kernel], cxxfilt: str | None) -> None:
    names = list(kernels)
    text = run([cxxfilt, *names]) if cxxfilt else "\n".join(names)
    for mangled, plain in zip(names, text.strip().splitlines(), strict=True):
        kernels[mangled].name = short_name(plain)


def collect(library: str) -> list[Kernel]:
    """Every kernel of the CUDA code in ``library`` (a built ``_C`` module)."""
    cuobjdump, ptxas = find_tool("cuobjdump"), find_tool("ptxas")
    try:
        cxxfilt = find_tool("cu++filt")
    except SystemExit:
        cxxfilt = shutil.which("c++filt")
    kernels: dict[str, Kernel] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run([cuobjdump, "-xptx", "all", library], cwd=tmp)
        ptx_files = sorted(Path(tmp).glob("*.ptx"))
        if not ptx_files:
            raise SystemExit(f"kernel_report: {library} holds no CUDA code (a CPU-only build?)")
        for ptx in ptx_files:
            arch = re.search(r"\.(sm_\d+)\.ptx$", ptx.name)
            parse_ptxas(run([ptxas, "-v", f"-arch={arch.group(1) if arch else 'sm_90'}", "-o", os.devnull, str(ptx)]),
                        kernels)  # fmt: skip
            parse_max_threads(ptx.read_text(), kernels)
    parse_sass(run([cuobjdump, "-sass", library]), kernels)
    demangle(kernels, cxxfilt)
    return sorted(kernels.values(), key=lambda k: k.name)


def widths(table: dict[str, int]) -> str:
    return ", ".join(f"{count}x{bits}b" for bits, count in sorted(table.items(), key=lambda kv: -int(kv[0]))) or "-"


def markdown(kernels: list[Kernel], library: str) -> str:
    rows = [
        "| kernel | regs | spill st/ld (B) | stack (B) | smem (B) | launch bound | occupancy | loop loads | "
        "loop stores | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in kernels:
        notes = []
        if k.spill_stores or k.spill_loads:
            notes.append("**spills**")
        if k.scalar_loop_loads:
            notes.append(SCALAR_BY_DESIGN.get(k.name, "**scalar loads in a bandwidth-bound loop**"))
        notes += [note for kernel, note in DYNAMIC_SHARED.items() if k.name.startswith(kernel + "<")]
        rows.append(f"| `{k.name}` | {k.registers} | {k.spill_stores}/{k.spill_loads} | {k.stack} | {k.smem} | "
                    f"{k.max_threads} | {k.occupancy:.0%} | {widths(k.loop_loads)} | {widths(k.loop_stores)} | "
                    f"{'; '.join(notes)} |")  # fmt: skip
    spilled = sum(1 for k in kernels if k.spill_stores or k.spill_loads)
    scalar = sum(1 for k in kernels if k.scalar_loop_loads and k.name not in SCALAR_BY_DESIGN)
    head = (
        "# CUDA kernels: the compiler's view (sm_90)\n\n"
        f"Generated by `make kernel-report` (`python benchmarks/kernel_report.py`) from `{Path(library).name}`; no GPU "
        "was used. Occupancy: theoretical, H100 SXM, a block of the launch-bound size. Loop loads/stores: global "
        "`LDG`/`STG` instructions inside a loop of the SASS, by width (`128b` = 16-byte vectors).\n\n"
        f"{len(kernels)} kernel instantiations; {spilled} with spills; {scalar} bandwidth-bound ones with only "
        "scalar loads in their loops (besides the ones whose note says why).\n\n"
    )
    return head + "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", help="the built _C module (default: the installed grpo_ext's)")
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    parser.add_argument("--no-traffic", action="store_true",
                        help="leave out the counted memory traffic (traffic_report.py: about 3 minutes of CPU)")
    args = parser.parse_args()
    library = args.library
    if library is None:
        import grpo_ext

        if not grpo_ext.build_info()["cuda_compiled"]:
            raise SystemExit("kernel_report: this grpo_ext was built without CUDA kernels (GRPO_EXT_CUDA=ON to build)")
        library = grpo_ext._C.__file__
    report = markdown(collect(library), library)
    if not args.no_traffic:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import traffic_report

        report += "\n" + traffic_report.markdown(traffic_report.measure())
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
