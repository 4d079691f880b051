"""Loads grpo_ext's two native libraries (csrc/, built by CMakeLists.txt) into torch's dispatcher.

Both are on the LibTorch stable ABI and carry no Python C-API, so ``torch.ops.load_library`` loads them (nothing is
imported) and one binary serves every Python 3 and every torch from ``TORCH_MIN_VERSION`` on:

- ``_C.so``: every ``torch.ops.grpo_ext.*`` schema and the CPU kernels;
- ``_C_cuda.so``: the CUDA kernels, loaded when they were compiled and torch is a CUDA build.

The build's facts come from ``_build_config.py``, which CMake writes next to the libraries: it is read first, so
that a torch older than the binary's target gets one clear ImportError instead of a missing-symbol crash.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch

try:
    from . import _build_config as config
except ImportError as error:  # a source checkout that was never built
    raise ImportError(
        "grpo_ext's native libraries are not built: install the wheel, or build from source with `make build` "
        "(README: Install)"
    ) from error


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"grpo_ext cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


if _major_minor(torch.__version__) < _major_minor(config.TORCH_MIN_VERSION):
    raise ImportError(
        f"grpo_ext {config.VERSION} needs torch >= {config.TORCH_MIN_VERSION} (its binary is built for the LibTorch "
        f"stable ABI of torch {config.TORCH_MIN_VERSION} and newer), but this environment has torch "
        f"{torch.__version__}: pip install 'torch>={config.TORCH_MIN_VERSION}'"
    )

#: Where the libraries are: next to _build_config.py (site-packages, also for an editable install).
LIBRARY_DIR = Path(config.__file__).resolve().parent
CPU_LIBRARY = LIBRARY_DIR / "_C.so"
CUDA_LIBRARY = LIBRARY_DIR / "_C_cuda.so"

torch.ops.load_library(str(CPU_LIBRARY))
#: Whether the CUDA kernels are registered: compiled in, and torch is a CUDA build (a CPU-only torch has no
#: libtorch_cuda for them to link against, and runs the CPU kernels).
CUDA_LOADED = bool(config.CUDA_COMPILED and torch.version.cuda is not None)
if CUDA_LOADED:
    torch.ops.load_library(str(CUDA_LIBRARY))

_library = ctypes.CDLL(str(CPU_LIBRARY))  # the handle load_library opened: no second copy
_library.grpo_ext_loss_options_schema.restype = ctypes.c_char_p
#: "Tensor? old_logps, ..., bool skip_empty_rows, ": the loss options' schema fragment (csrc/plan/loss_options.h),
#: for the schemas of the composite ops defined in Python.
LOSS_OPTIONS_SCHEMA: str = _library.grpo_ext_loss_options_schema().decode()
