"""benchmarks/kernel_report.py reads every CUDA kernel of the build from the compiler's output (no GPU needed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import grpo_ext
from cuda_emu.build import KERNEL_NAME  # every kernel's name in a source, with or without launch bounds

ROOT = Path(__file__).resolve().parent.parent

needs_cuda_build = pytest.mark.skipif(not grpo_ext.build_info()["cuda_compiled"], reason="CUDA kernels not compiled")


def load_report():
    spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "benchmarks" / "kernel_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_report"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@needs_cuda_build
def test_every_kernel_is_reported_with_its_resources():
    report = load_report()
    kernels = report.collect(str(grpo_ext._native.CUDA_LIBRARY))
    declared = set()
    for header in (ROOT / "csrc" / "cuda").glob("*.cuh"):
        declared |= set(KERNEL_NAME.findall(header.read_text()))
    archs = {k.arch for k in kernels}
    built = {f"sm_{a.removesuffix('+PTX')}" for a in grpo_ext.build_info()["cuda_archs"].split()}
    assert archs and archs <= built, (archs, built)  # each architecture built with its PTX is reported
    for arch in archs:
        reported = {k.name.split("<")[0] for k in kernels if k.arch == arch}
        assert declared and declared == reported, arch
    for k in kernels:
        assert k.registers > 0 and k.max_threads in (32, 64, 128, 256, 512, 1024), k
        assert 0 < k.occupancy <= 1, k
    table = report.markdown(kernels, str(grpo_ext._native.CUDA_LIBRARY))
    detail = [k for k in kernels if k.arch == (report.DETAIL_ARCH if report.DETAIL_ARCH in archs else max(archs))]
    names = {k.name for k in kernels}
    resources, row_loops = table.split("## Row loops on", 1)
    assert resources.count("\n| `") == len(detail) + len(names)
    # every float32 and bf16 row kernel's loops, with instructions per element read from its SASS
    loop_kernels = sys.modules["row_kernels_report"].ROW_LOOP_KERNELS  # imported by kernel_report
    row_kernels = {k.name for k in detail if k.name.startswith(loop_kernels) and "double" not in k.name
                   and "fp16" not in k.name}  # fmt: skip
    assert row_kernels and all(f"| `{name}` | statistics" in row_loops or f"| `{name}` | gradient" in row_loops
                               for name in row_kernels)  # fmt: skip
    per_element = [float(line.split("|")[3]) for line in row_loops.splitlines() if line.startswith("| `")]
    assert all(3 < value < 400 for value in per_element), per_element


def test_occupancy_follows_each_architecture_limits():
    report = load_report()
    # 256 threads, 32 registers: threads cap it (8 blocks on 2048-thread SMs, 6 on 1536-thread ones): full either way
    assert report.Kernel("k", "sm_90", registers=32, max_threads=256).occupancy == 1.0
    assert report.Kernel("k", "sm_86", registers=32, max_threads=256).occupancy == 1.0
    # 1024 threads, 64 registers: one block by registers, 32 of 64 warps on sm_90 and 32 of 48 on sm_86
    assert report.Kernel("k", "sm_90", registers=64, max_threads=1024).occupancy == 0.5
    assert report.Kernel("k", "sm_86", registers=64, max_threads=1024).occupancy == 32 / 48
    # 64 KiB of static shared memory per 128-thread block: 3 blocks on sm_90 (228 KiB), 1 on sm_120 (100 KiB)
    assert report.Kernel("k", "sm_90", registers=32, max_threads=128, smem=64 * 1024).occupancy == 3 * 4 / 64
    assert report.Kernel("k", "sm_120", registers=32, max_threads=128, smem=64 * 1024).occupancy == 1 * 4 / 48


def test_load_widths_parse_sass_spelling():
    report = load_report()
    assert [report.width_of(op) for op in ("LDG.E.128", "LDG.E.64.CONSTANT", "LDG.E.U16", "LDG.E.S8", "LDG.E")] == [
        "128", "64", "16", "8", "32",
    ]  # fmt: skip


def test_names_drop_the_parameters_and_spell_enum_arguments():
    report = load_report()
    plain = ("void grpo_ext::selective_log_softmax_forward_kernel<float, __nv_bfloat16, (grpo_ext::SoftCap)0>"
             "(grpo_ext::StridedMatrix, long, grpo_ext::LogitTransform<float>, float*)")  # fmt: skip
    assert report.short_name(plain) == "selective_log_softmax_forward_kernel<float, bf16, no cap>"
    assert report.short_name("void grpo_ext::k<double, (grpo_ext::SoftCap)2>(double*)") == "k<double, cap at run time>"
    assert report.short_name("void grpo_ext::k<float, (grpo_ext::SoftCap)1>(float*)") == "k<float, softcap>"
