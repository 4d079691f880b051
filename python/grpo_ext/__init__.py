"""grpo_ext: fused GRPO kernels for PyTorch.

The math of every op is docs/math.md (the project's contract); :mod:`grpo_ext.reference` is that page in plain
PyTorch. The ops run hand-written CPU and CUDA kernels registered as ``torch.ops.grpo_ext.*``; docs/architecture.md
maps each op to its files.
"""

import torch

from . import _C, nn, ops, reference  # ops before reference: the reference imports ops.options
from .ops import (
    group_advantages,
    grpo_loss,
    grpo_loss_from_hidden,
    grpo_loss_from_logits,
    process_advantages,
    selective_log_softmax,
)
from .results import GroupAdvantages, GRPOLossOutput, SelectiveLogSoftmax

# The version is pyproject.toml's, compiled into the native module by CMake (SKBUILD_PROJECT_VERSION).
__version__: str = _C.build_info()["version"]


def build_info() -> dict:
    """How the native module was built.

    Returns:
        A dict with ``version``, ``torch_version`` (the torch it was compiled against), ``torch_runtime_version``,
        ``cuda_compiled`` (whether the CUDA kernels were compiled in), ``cuda_version``, ``cuda_archs`` (e.g. "90"),
        ``cuda_kernels_registered`` (whether the dispatcher holds a CUDA kernel for every op) and ``cxx_compiler``.
    """
    info = dict(_C.build_info())
    info["torch_runtime_version"] = torch.__version__
    info["cuda_kernels_registered"] = all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"grpo_ext::{name}", "CUDA") for name in ops.OP_NAMES
    )
    return info


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
