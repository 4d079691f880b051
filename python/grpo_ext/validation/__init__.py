"""Argument validation shared by every implementation of the ops (the kernels' wrappers and the reference).

Each ``validate_<op>_args`` raises a ``ValueError`` naming the bad argument and what was expected, without syncing
the host, and returns the arguments normalized; both implementations call it, so they fail alike. The checks live
in small modules by what they check, all importable from here:

- :mod:`grpo_ext.validation.values`: plain values (choices, numbers, flags) and the logits options;
- :mod:`grpo_ext.validation.tensors`: tensors (type, dtype, shape, device, NaN in a mask);
- :mod:`grpo_ext.validation.loss`: the loss options' ranges (also run by the trainer's ``GRPOConfig``),
  grpo_loss' arguments, and the cached per-call path of the kernels' wrappers;
- :mod:`grpo_ext.validation.advantages`: group_advantages' and process_advantages' arguments;
- :mod:`grpo_ext.validation.logits`: selective_log_softmax's arguments, and the fused losses' token rows against
  their ids and mask;
- :mod:`grpo_ext.validation.hidden`: grpo_loss_from_hidden's LM head and reference head.
"""

from __future__ import annotations

from .advantages import (
    reward_weights_tensor,
    validate_group_advantages_args,
    validate_process_advantages_args,
)
from .logits import check_ids_and_mask, check_rows_as_mask, validate_selective_log_softmax_args
from .loss import (
    resolve_fused_loss_args,
    resolve_grpo_loss_args,
    validate_grpo_loss_args,
    validate_loss_option_values,
)
from .tensors import (
    check_finite_mask,
    check_floating,
    check_integer,
    check_per_row,
    check_same_device,
    check_scalar_tensor_device,
    check_shape,
    check_tensor,
)
from .values import (
    check_bool,
    check_choice,
    check_compute_dtype,
    check_finite,
    check_finite_positive,
    check_int,
    check_non_negative,
    check_positive,
    check_real_number,
    validate_logit_options,
)

__all__ = [
    "check_bool",
    "check_choice",
    "check_compute_dtype",
    "check_finite",
    "check_finite_mask",
    "check_finite_positive",
    "check_floating",
    "check_ids_and_mask",
    "check_int",
    "check_integer",
    "check_non_negative",
    "check_per_row",
    "check_positive",
    "check_real_number",
    "check_rows_as_mask",
    "check_same_device",
    "check_scalar_tensor_device",
    "check_shape",
    "check_tensor",
    "resolve_fused_loss_args",
    "resolve_grpo_loss_args",
    "reward_weights_tensor",
    "validate_group_advantages_args",
    "validate_grpo_loss_args",
    "validate_logit_options",
    "validate_loss_option_values",
    "validate_process_advantages_args",
    "validate_selective_log_softmax_args",
]
