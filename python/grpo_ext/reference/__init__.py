"""grpo_ext.reference: plain-PyTorch reference of docs/math.md, used as the test oracle and as a CPU/GPU fallback.

Every function here is a direct, readable transcription of docs/math.md (sections 1 and 3-8).
Kernels (CPU or CUDA) must match these values *and* their autograd gradients. The gradients at ties and bounds are
part of the contract (docs/math.md section 8, "Bounds and ties"), so the reference states them itself rather than
inheriting a torch version's conventions: its ``clamp`` passes the gradient at the bounds, its ``minimum`` splits it
half/half at a tie, its ``absolute`` has the gradient ``sign(x)`` (``grpo_ext/reference/_common.py``).

Arithmetic runs in the input's dtype promoted to at least float32
(``torch.promote_types(x.dtype, torch.float32)``): float64 in gives float64 out, bf16/fp16/fp32 in gives float32.

One module per op, named after it; the argument checks they share with the kernels' wrappers are
:mod:`grpo_ext.validation`, so every implementation raises the same ``ValueError`` messages.
"""

from ..results import GroupAdvantages, GRPOLossOutput, SelectiveLogSoftmax
from ..validation.options import (
    BASELINES,
    CISPO_DEFAULT_CAP,
    CLIP_FAMILY_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    ZERO_STD_TOL,
)
from .group_advantages import group_advantages
from .grpo_loss import grpo_loss
from .grpo_loss_from_hidden import grpo_loss_from_hidden
from .grpo_loss_from_logits import grpo_loss_from_logits
from .process_advantages import process_advantages
from .selective_log_softmax import selective_log_softmax

__all__ = [
    "BASELINES",
    "CISPO_DEFAULT_CAP",
    "CLIP_FAMILY_LOSS_TYPES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_REWARDS",
    "ZERO_STD_TOL",
    "GRPOLossOutput",
    "GroupAdvantages",
    "SelectiveLogSoftmax",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_from_hidden",
    "grpo_loss_from_logits",
    "process_advantages",
    "selective_log_softmax",
]
