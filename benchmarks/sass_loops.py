"""Instructions per element in a streaming kernel's hot loop, read from ``cuobjdump -sass`` (no GPU needed).

A row kernel's main loop is the one whose body holds its 16-byte loads (``LDG.E.128``, or ``LDS.128`` for a row
staged in shared memory): this script finds every loop of a function (a backward branch and its target), picks the
loop with the most such loads, and counts its static instructions by kind. Per element = instructions / (wide loads
x elements per 16 bytes). Static counts: a branch skipped at run time still counts, so the executed figure is lower
where the body holds rarely taken blocks (the count of ``BRA`` and ``BSSY`` shows how many).

Usage::

    cuobjdump -sass some.cubin > some.sass
    python benchmarks/sass_loops.py some.sass --kernel selective_log_softmax_forward_kernelIf13__nv_bfloat16 --width 8
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")
WIDE_LOADS = ("LDG.E.128", "LDG.E.ENL2.128", "LDS.128", "LDG.E.128.CONSTANT", "LDG.E.EL.128")
WIDE_STORES = ("STG.E.128", "STS.128")
KINDS = {
    "MUFU": ("MUFU",),
    "FP32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK"),
    "packed/half": ("HFMA2", "HADD2", "HMUL2", "F2FP", "PRMT", "F2F"),
    "integer": ("IMAD", "IADD3", "LEA", "ISETP", "SHF", "LOP3", "IABS", "SEL", "MOV", "IMNMX", "ULDC", "R2UR", "S2R"),
    "branch": ("BRA", "BSSY", "BSYNC", "WARPSYNC", "BAR", "EXIT", "CALL", "RET"),
    "memory": ("LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "SHFL", "ATOM", "RED"),
}


@dataclass
class Loop:
    start: int  # address of the loop's first instruction (the branch target)
    end: int  # address of its backward branch
    opcodes: list[str]
    operands: list[str] = dataclasses.field(default_factory=list)  # each instruction's operands, as printed

    @property
    def wide_loads(self) -> int:
        return sum(op.startswith(WIDE_LOADS) for op in self.opcodes)

    def by_kind(self) -> dict[str, int]:
        counts: collections.Counter[str] = collections.Counter()
        for op in self.opcodes:
            base = op.split(".")[0]
            kind = next((k for k, prefixes in KINDS.items() if base in prefixes or base.startswith(prefixes)), "other")
            counts[kind] += 1
        return dict(counts)


def functions(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """Function name -> its instructions as ``(address, opcode, operands)``."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = line.split("Function :", 1)[1].strip()
            out[current] = []
            continue
        match = INSTRUCTION.search(line)
        if current and match:
            out[current].append((int(match.group(1), 16), match.group(3), match.group(4)))
    return out


def loops(instructions: list[tuple[int, str, str]]) -> list[Loop]:
    """Every backward branch's loop, innermost first is not implied: overlapping loops are all listed."""
    found = []
    for address, opcode, operands in instructions:
        if opcode.startswith("BRA"):
            target = BRANCH_TARGET.search(operands)
            if target and int(target.group(1), 16) < address:
                start = int(target.group(1), 16)
                body = [(op, rest) for a, op, rest in instructions if start <= a <= address]
                found.append(Loop(start, address, [op for op, _ in body], [rest for _, rest in body]))
    return found


def hot_loop(instructions: list[tuple[int, str, str]]) -> Loop | None:
    """The row loop: of the innermost loops with 16-byte loads (no such loop inside them; the grid-stride row loop
    holds them all), the one with the most (the unrolled body rather than its remainder)."""
    candidates = [loop for loop in loops(instructions) if loop.wide_loads > 0]
    innermost = [
        loop for loop in candidates
        if not any(o is not loop and loop.start <= o.start and o.end <= loop.end for o in candidates)
    ]  # fmt: skip
    if not innermost:
        return None
    return min(innermost, key=lambda loop: (-loop.wide_loads, len(loop.opcodes)))


def row_loops(instructions: list[tuple[int, str, str]]) -> list[Loop]:
    """Every innermost loop with 16-byte loads, in address order: a kernel's passes over a row (statistics, then
    gradient), each with its unrolled body and its remainder."""
    candidates = [loop for loop in loops(instructions) if loop.wide_loads > 0]
    return sorted(
        (loop for loop in candidates
         if not any(o is not loop and loop.start <= o.start and o.end <= loop.end for o in candidates)),
        key=lambda loop: loop.start,
    )  # fmt: skip


def describe(loop: Loop, width: int) -> str:
    elements = loop.wide_loads * width
    stores = sum(op.startswith(WIDE_STORES) for op in loop.opcodes)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(loop.by_kind().items(), key=lambda kv: -kv[1]))
    return (f"{len(loop.opcodes)} instructions / {elements} elements = {len(loop.opcodes) / elements:.1f} per element"
            f" ({loop.wide_loads} 16-byte loads, {stores} stores; {kinds})")  # fmt: skip


def report(sass: str, kernel: str, width: int, every: bool = False) -> list[str]:
    """One line per function matching ``kernel``: its hot loop's (or, with ``every``, each row loop's) instructions
    per element and by kind."""
    lines = []
    for name, instructions in functions(sass).items():
        if kernel not in name:
            continue
        chosen = row_loops(instructions) if every else [hot_loop(instructions)]
        chosen = [loop for loop in chosen if loop is not None]
        if not chosen:
            lines.append(f"{name}: no loop with 16-byte loads")
        for loop in chosen:
            lines.append(f"{name} @{loop.start:#x}: {describe(loop, width)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sass", type=Path, help="the output of cuobjdump -sass")
    parser.add_argument("--kernel", required=True, help="a substring of the mangled kernel name")
    parser.add_argument("--width", type=int, required=True, help="elements per 16-byte load (8 for bf16, 4 float)")
    parser.add_argument("--every", action="store_true", help="every row loop, not only the hot one")
    args = parser.parse_args()
    print("\n".join(report(args.sass.read_text(), args.kernel, args.width, args.every)))


if __name__ == "__main__":
    main()
