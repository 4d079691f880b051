"""The row kernels' sections of ``KERNELS.md`` (``kernel_report.py`` appends them): each logits kernel's unrolled
loops on the detailed architecture (static instructions per element, issue time and loads in flight at H100 rates),
and the small-block layout's blocks per SM and bytes in flight at each shape of its table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gpu_archs as gpu
import sass_loops

if TYPE_CHECKING:
    from kernel_report import Kernel

# The row kernels of the logits ops (their loops stream [rows, V]), and what an H100 gives them.
ROW_LOOP_KERNELS = ("selective_log_softmax_forward_kernel", "selective_log_softmax_backward_kernel",
                    "grpo_loss_from_logits_kernel", "grpo_loss_from_logits_small_block_kernel",
                    "grpo_loss_from_logits_lone_block_kernel",
                    "grpo_loss_from_logits_full_occupancy_kernel")  # fmt: skip
VECTORS_IN_FLIGHT = 2  # vector_io.cuh kRowUnroll: 16-byte loads each thread issues before using the first


def element_width(name: str) -> int:
    """Elements per 16-byte vector of a row kernel, from its logits' type (the second template argument, as
    short_name spells it)."""
    logits_type = name.split("<", 1)[1].split(",")[1].strip(" >")
    return {"bf16": 8, "fp16": 8, "__nv_bfloat16": 8, "__half": 8, "float": 4, "double": 2}[logits_type]


def loop_kind(loop: sass_loops.Loop) -> str:
    """What a row loop does: reads statistics, or writes the gradient (global stores); with the soft cap's tanh (its
    reciprocal, MUFU.RCP) where the kernel picks the cap at run time; a gradient loop with the entropy bonus's term
    (its d clamped to the lowest float: FMNMX with -3.4e38)."""
    gradient = any(op.startswith("STG") for op in loop.opcodes)
    kind = "gradient" if gradient else "statistics"
    if any(op.startswith("MUFU.RCP") for op in loop.opcodes):
        kind += ", soft cap"
    pairs = zip(loop.opcodes, loop.operands, strict=True)
    lowest_clamp = any(op.startswith("FMNMX") and "3.40282" in rest for op, rest in pairs)
    return kind + (", entropy bonus" if gradient and lowest_clamp else "")


def row_loop_section(kernels: list[Kernel]) -> str:
    """The row kernels' unrolled loops on DETAIL_ARCH (float32, bf16): static instructions per element by kind,
    their issue time at H100 rates, and the bytes each SM keeps in flight against what the bandwidth needs."""
    rows = [
        "| kernel | loop | instr / element | MUFU / el. | branches / el. | 16-byte loads, stores | issue ms per 1e9 "
        "elements | loads in flight per SM |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for k in kernels:
        if k.arch != gpu.DETAIL_ARCH or not k.name.startswith(ROW_LOOP_KERNELS) or element_width(k.name) not in (4, 8):
            continue
        if "fp16" in k.name:  # as bf16's
            continue
        width = element_width(k.name)
        most = max((loop.wide_loads for loop in k.row_loops), default=0)
        threads_per_sm = k.occupancy * gpu.ARCHS[k.arch]["threads"]
        in_flight = threads_per_sm * VECTORS_IN_FLIGHT * 16
        for loop in (loop for loop in k.row_loops if loop.wide_loads == most):
            elements = loop.wide_loads * width
            kinds = loop.by_kind()
            stores = sum(op.startswith(sass_loops.WIDE_STORES) for op in loop.opcodes)
            per_element = len(loop.opcodes) / elements
            rows.append(
                f"| `{k.name}` | {loop_kind(loop)} | {per_element:.1f} | {kinds.get('MUFU', 0) / elements:.2f} | "
                f"{kinds.get('branch', 0) / elements:.2f} | {loop.wide_loads}, {stores} | "
                f"{per_element * 1e9 / gpu.H100_ISSUE_RATE * 1e3:.3f} | {in_flight / 1024:.0f} KiB |"
            )
    head = (
        f"## Row loops on {gpu.DETAIL_ARCH}: instructions per element\n\n"
        "Each row kernel's unrolled loops (innermost loops with the most 16-byte accesses: statistics, then gradient; "
        "a loop per soft-cap branch where the kernel picks it at run time), read from the SASS by "
        "`benchmarks/sass_loops.py`. Static counts: an instruction behind a branch that is rarely taken (a max update, "
        "the other store path) counts, so the executed figure is lower. Issue time: static instructions per element "
        "x 1e9 elements at an H100's 33.8e12 lane-instructions per second (132 SMs x 4 x 32 x 1.98 GHz); one read of "
        "1e9 bf16 elements at 3.0 TB/s takes 0.67 ms, so a loop whose issue time is near or above its bytes' time is "
        "short of instructions, not of bandwidth. Loads in flight: threads per SM at the theoretical occupancy (one "
        f"block for the single-read kernel) x {VECTORS_IN_FLIGHT} vectors x 16 B, against the "
        f"{gpu.H100_IN_FLIGHT_NEEDED / 1024:.0f} KiB per SM that 3 TB/s at about 1 us of latency needs (Little's law). "
        "Calibration on the H100 (RESULTS.md, 2026-11-26): the selective forward's loop at 44 static (about 29 "
        "executed) instructions per bf16 element predicted about 1.1 ms of issue for 8192 x 151936 and ran 1.42 ms "
        "at 91% SM throughput (instruction-bound); at 16 it ran 0.835 ms, 1.01x one read (memory-bound). Liger's "
        "kernels, counted the same way: `benchmarks/liger_kernel_report.py`.\n\n"
    )
    return head + "\n".join(rows) + "\n"


# The small-block layout (csrc/cuda/grpo_loss_from_logits_single_read.cuh, small_block_layout) on an H100: the
# kernel's launch bounds, and the shapes of benchmarks/NOTES.md's layout table.
SMALL_BLOCK_THREADS, SMALL_BLOCKS_PER_SM, SMALL_MAX_CLUSTER = 256, 4, 16
SMALL_BLOCK_SHAPES = [(vocab, dtype) for vocab in (32000, 128256, 151936, 262144) for dtype in ("bf16", "float")]


def small_block_layout(vocab: int, element: int, static: int) -> tuple[int, int, int] | None:
    """(cluster blocks, blocks per SM, slice) that small_block_layout picks on an H100 for a row of ``vocab``
    elements of ``element`` bytes (the kernel's ``static`` shared memory), or None (the two-read pass)."""
    width = 16 // element
    for per_sm in range(SMALL_BLOCKS_PER_SM, 1, -1):
        share = min(gpu.H100_SHARED_PER_SM // per_sm - gpu.SMEM_RESERVED_PER_BLOCK, gpu.H100_SHARED_PER_BLOCK)
        per_block = ((share - static) // element - width) // width * width
        blocks = -(-vocab // per_block) if per_block >= width else SMALL_MAX_CLUSTER + 1
        if blocks <= SMALL_MAX_CLUSTER:
            return blocks, per_sm, (-(-vocab // blocks) + width - 1) // width * width
    return None


def small_block_section(kernels: list[Kernel]) -> str:
    """The small-block kernel at each shape of the layout table on DETAIL_ARCH: the blocks per SM that its registers,
    threads and shared memory allow at the chosen part size, and the bytes each SM keeps in flight in each phase."""
    found = {k.name: k for k in kernels if k.arch == gpu.DETAIL_ARCH and "small_block_kernel" in k.name}
    rows = [
        "| V | dtype | cluster | part (KiB) | regs | spills | blocks / SM: regs, threads, smem -> resident | "
        "loads in flight / SM: all staging, one merging | stores in flight / SM, one block writing |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- |",
    ]
    limits = gpu.ARCHS[gpu.DETAIL_ARCH]
    for vocab, dtype in SMALL_BLOCK_SHAPES:
        k = found.get(f"grpo_loss_from_logits_small_block_kernel<float, {dtype}>")
        if k is None:
            continue
        element = 2 if dtype == "bf16" else 4
        layout = small_block_layout(vocab, element, k.smem)
        if layout is None:
            rows.append(f"| {vocab} | {dtype} | - | - | {k.registers} | - | over 16 blocks: two-read | - | - |")
            continue
        blocks, per_sm, slice_ = layout
        threads = SMALL_BLOCK_THREADS
        dynamic = (slice_ + 16 // element) * element
        by_regs = limits["regs"] // (threads // 32 * (-(-k.registers * 32 // 256) * 256))
        by_threads = limits["threads"] // threads
        by_smem = limits["smem"] // (dynamic + k.smem + gpu.SMEM_RESERVED_PER_BLOCK)
        resident = min(by_regs, by_threads, by_smem, limits["blocks"])
        staging = slice_ * element  # cp.async: the block's whole part in flight at once (stage_row)
        storing = threads * VECTORS_IN_FLIGHT * 16  # the gradient loop's stores, through registers
        rows.append(
            f"| {vocab} | {dtype} | {blocks} | {slice_ * element / 1024:.1f} | {k.registers} | "
            f"{k.spill_stores}/{k.spill_loads} B | {by_regs}, {by_threads}, {by_smem} -> {resident} "
            f"(layout: {per_sm}) | {resident * staging / 1024:.0f} KiB, "
            f"{(resident - 1) * staging / 1024:.0f} KiB | "
            f"{storing / 1024:.0f} KiB |"
        )
    head = (
        f"## The small-block layout on {gpu.DETAIL_ARCH}: blocks per SM and bytes in flight\n\n"
        "`grpo_loss_from_logits_small_block_kernel` (`GRPO_EXT_LOGITS_SINGLE_READ=small-blocks`) at the cluster and "
        "part size `small_block_layout` picks on an H100 (228 KiB of shared memory per SM, 1 KiB reserved per "
        f"block, clusters of up to {SMALL_MAX_CLUSTER}). Blocks per SM: what the registers (at "
        f"{SMALL_BLOCK_THREADS} threads), the threads and the shared memory (part + alignment vector + static + 1 KiB) "
        "each allow, and the least of them. Bytes in flight: a block stages its whole part at once (cp.async, "
        "`stage_row`), has none outstanding while it merges the cluster's states (pushed into each block's inbox, "
        f"counted on its mbarrier) and finishes the row, and its threads keep {VECTORS_IN_FLIGHT} 16-byte stores "
        "each while it writes the gradient from shared memory; "
        f"against the {gpu.H100_IN_FLIGHT_NEEDED / 1024:.0f} KiB per SM that 3 TB/s at about 1 us of latency needs.\n\n"
    )
    return head + "\n".join(rows) + "\n"
