"""Type stub of the native module (csrc/ops.cpp). The ops themselves are ``torch.ops.grpo_ext.*``."""

from typing import Any

#: "Tensor? old_logps, ..., float loss_scale, ": the loss options' schema fragment (csrc/plan/loss_options.h).
LOSS_OPTIONS_SCHEMA: str

def build_info() -> dict[str, Any]:
    """``version``, ``torch_version``, ``cuda_compiled``, ``cuda_version``, ``cuda_archs`` and ``cxx_compiler``."""
