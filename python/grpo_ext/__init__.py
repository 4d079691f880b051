"""grpo_ext: fused GRPO kernels for PyTorch.

The math of every op is docs/math.md (the project's contract); :mod:`grpo_ext.reference` is that page in plain
PyTorch. The ops run hand-written CPU and CUDA kernels registered as ``torch.ops.grpo_ext.*``; docs/architecture.md
maps each op to its files.
"""

import torch

from . import _native, nn, ops, reference
from .ops import (
    group_advantages,
    grpo_loss,
    grpo_loss_from_hidden,
    grpo_loss_from_logits,
    process_advantages,
    selective_log_softmax,
)
from .results import GroupAdvantages, GRPOLossOutput, GRPOLossTokenOutput, SelectiveLogSoftmax

# The version is pyproject.toml's, written next to the native libraries by CMake (SKBUILD_PROJECT_VERSION).
__version__: str = _native.config.VERSION


def build_info() -> dict:
    """How the native libraries were built, and what this process loaded.

    Returns:
        A dict with ``version``; ``torch_version`` (the torch whose headers it was compiled against),
        ``torch_min_version`` (the oldest torch the binary runs on: its LibTorch stable ABI target) and
        ``torch_runtime_version`` (the torch running now); ``cuda_compiled`` (whether the CUDA kernels were compiled),
        ``cuda_version`` (the toolkit), ``cuda_archs`` (SASS per architecture, e.g. "80 86 89 90 100 120+PTX": "+PTX"
        also carries that architecture's PTX for newer GPUs), ``cuda_kernels_registered`` (whether the dispatcher holds
        a CUDA kernel for every op); ``cxx_compiler``; ``libraries`` (the loaded files).
    """
    config = _native.config
    loaded = [_native.CPU_LIBRARY] + ([_native.CUDA_LIBRARY] if _native.CUDA_LOADED else [])
    return {
        "version": config.VERSION,
        "torch_version": config.TORCH_BUILD_VERSION,
        "torch_min_version": config.TORCH_MIN_VERSION,
        "torch_runtime_version": torch.__version__,
        "cuda_compiled": config.CUDA_COMPILED,
        "cuda_version": config.CUDA_VERSION,
        "cuda_archs": config.CUDA_ARCHS,
        "cuda_kernels_registered": all(
            torch._C._dispatch_has_kernel_for_dispatch_key(f"grpo_ext::{name}", "CUDA") for name in ops.OP_NAMES
        ),
        "cxx_compiler": config.CXX_COMPILER,
        "libraries": [str(path) for path in loaded],
    }


from .trainer import GRPOConfig  # noqa: E402  (light: no transformers until GRPOTrainer is used)


def __getattr__(name: str):
    # GRPOTrainer needs transformers and tqdm: import them only when the trainer is asked for.
    if name == "GRPOTrainer":
        from .trainer.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GRPOConfig",
    "GRPOLossOutput",
    "GRPOLossTokenOutput",
    "GRPOTrainer",
    "GroupAdvantages",
    "SelectiveLogSoftmax",
    "build_info",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_from_hidden",
    "grpo_loss_from_logits",
    "nn",
    "process_advantages",
    "reference",
    "selective_log_softmax",
]
