"""benchmarks/kernel_report.py reads every CUDA kernel of the build from the compiler's output (no GPU needed)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import grpo_ext

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
    kernels = report.collect(grpo_ext._C.__file__)
    declared = set()
    for header in (ROOT / "csrc" / "cuda").glob("*.cuh"):
        declared |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\(\d+\)\s+)?(\w+)", header.read_text()))
    reported = {k.name.split("<")[0] for k in kernels}
    assert declared and declared == reported
    for k in kernels:
        assert k.registers > 0 and k.max_threads in (32, 64, 128, 256, 512, 1024), k
        assert 0 < k.occupancy <= 1, k
    table = report.markdown(kernels, grpo_ext._C.__file__)
    assert table.count("\n| `") == len(kernels)


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
