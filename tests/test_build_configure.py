"""CMakeLists.txt's configure step: where a build from source (`pip install --no-build-isolation .`) looks for nvcc."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def configure(tmp_path: Path, **env: str) -> list[str]:
    """CMake's configure of the repository with the CPU kernels only (no compiler check of nvcc: seconds), in an
    environment holding only ``env``, the venv's tools and the system's; returns the ``grpo_ext:`` status lines."""
    tools = [str(Path(sys.executable).parent), "/usr/bin", "/bin"]
    base = {"HOME": str(tmp_path), "PATH": os.pathsep.join(tools), "GRPO_EXT_CUDA": "OFF"}
    cmake = shutil.which("cmake", path=base["PATH"])
    assert cmake, "cmake (pip's, in the venv) is a build requirement"
    result = subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path / "build"), "-G", "Ninja",
                             f"-DPython_EXECUTABLE={sys.executable}", "-DGRPO_EXT_CUDA=OFF"],
                            env={**base, **env}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("-- grpo_ext:")]


def fake_toolkit(folder: Path) -> Path:
    """A folder with an executable ``bin/nvcc`` (never run here: the configure takes the CPU kernels only)."""
    nvcc = folder / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\nexit 1\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.mark.parametrize("variable", ["CUDA_HOME", "CUDA_PATH"])
def test_nvcc_is_found_under_cuda_home(tmp_path, variable):
    """nvcc under $CUDA_HOME (or $CUDA_PATH) is taken, as torch.utils.cpp_extension takes it (an outside audit,
    2026-11-29: the README said so, but CMake looked only at PATH and CUDACXX, and a build with nvcc under $CUDA_HOME
    alone built the CPU library without a word)."""
    nvcc = fake_toolkit(tmp_path / "toolkit")
    assert f"-- grpo_ext: nvcc {nvcc}" in configure(tmp_path, **{variable: str(nvcc.parents[1])})


def test_cudacxx_comes_first(tmp_path):
    """$CUDACXX (CMake's own variable) is left to CMake: grpo_ext picks no nvcc of its own then."""
    nvcc = fake_toolkit(tmp_path / "toolkit")
    other = fake_toolkit(tmp_path / "other")
    lines = configure(tmp_path, CUDA_HOME=str(nvcc.parents[1]), CUDACXX=str(other))
    assert not [line for line in lines if "nvcc" in line], lines
