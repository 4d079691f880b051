"""The Python layer of the native ops: one module per op, named after it (wrapper, fake kernels, autograd).

Each public function validates its arguments (:mod:`grpo_ext.validation`), calls ``torch.ops.grpo_ext.<op>`` (a
hand-written CPU or CUDA kernel) and returns the result types of :mod:`grpo_ext.results`, as
:mod:`grpo_ext.reference` does. The math is docs/math.md; the layers are docs/architecture.md.
"""

from ..validation.options import LossOptions
from . import options  # the loss options' public path (defined in grpo_ext.validation.options)
from .group_advantages import group_advantages
from .grpo_loss import grpo_loss
from .grpo_loss_from_hidden import grpo_loss_from_hidden
from .grpo_loss_from_logits import grpo_loss_from_logits
from .process_advantages import process_advantages
from .selective_log_softmax import selective_log_softmax

#: Every native op of the TORCH_LIBRARY block in csrc/ops.cpp.
OP_NAMES = (
    "group_advantages",
    "process_advantages",
    "grpo_loss_forward",
    "grpo_loss_backward",
    "selective_log_softmax_forward",
    "selective_log_softmax_backward",
    "grpo_loss_from_logits_pass",
    "grpo_loss_from_logits_pass_",
    "scale_grad_",
    "grpo_loss_from_logits",
    "grpo_loss_from_logits_",
)

__all__ = [
    "OP_NAMES",
    "LossOptions",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_from_hidden",
    "grpo_loss_from_logits",
    "options",
    "process_advantages",
    "selective_log_softmax",
]
