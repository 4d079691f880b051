"""What differs, for grpo_ext.integrations.trl, between the TRL releases it supports (1.14.x to 1.16.x).

The loss (``GRPOTrainer._compute_loss``, its options and metrics) is the same code in all of them; how the per-token
log-probs are scored is not:

- **1.15 and 1.16**: ``GRPOTrainer`` installs ``trl.trainer.utils.add_fused_lm_head``, whose forward hands the
  hidden states to ``trl.trainer.utils._ChunkedLogProbFunction`` (nine arguments, ``outputs`` last; five outputs).
  1.16 passes only the labelled rows on Triton devices (``trl.trainer.utils._use_triton``) and every shifted position
  elsewhere; 1.15 always passes only the labelled rows (its head runs on Triton devices only).
- **1.14**: no fused LM head. ``GRPOTrainer._get_per_token_logps_and_entropies`` scores the batch from the model's
  full logits with ``selective_log_softmax_and_entropy`` (imported into ``trl.trainer.grpo_trainer``), except with
  ``GRPOConfig.use_liger_kernel=True`` and no MoE router loss, where ``_chunked_logps`` runs the backbone and hands
  the completion rows to its own ``_ChunkedLogProbFunction`` (``trl.trainer.grpo_trainer``'s name for the one in
  ``trl.trainer.utils``: eight arguments, two outputs). Only that chunked path reaches hidden states, so only there
  can the loss be fused; the full-logits path takes the log-prob path (:func:`fused_path_refusal`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import trl
from packaging.version import InvalidVersion, Version

#: The oldest and newest TRL release lines (major, minor) the integration supports.
OLDEST_RELEASE = (1, 14)
NEWEST_RELEASE = (1, 16)


def release_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string, or None when it is not a version."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return (*release, 0)[:2]


def is_supported(version: str) -> bool:
    """Whether ``version`` is in one of the supported release lines."""
    release = release_of(version)
    return release is not None and OLDEST_RELEASE <= release <= NEWEST_RELEASE


def has_fused_lm_head() -> bool:
    """Whether the installed TRL scores log-probs through ``add_fused_lm_head`` (1.15 on); 1.14 does not."""
    return release_of(trl.__version__) != (1, 14)


@dataclasses.dataclass(frozen=True)
class Internal:
    """A TRL name the integration hooks: ``owner.name``, and what the integration does with it."""

    owner: str
    name: str
    use: str

    @property
    def path(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"

    def resolve_owner(self) -> Any:
        module, _, cls = self.owner.partition(":")
        owner = importlib.import_module(module)
        return getattr(owner, cls) if cls else owner

    def exists(self) -> bool:
        try:
            return hasattr(self.resolve_owner(), self.name)
        except (ImportError, AttributeError):
            return False


_TRAINER = "trl:GRPOTrainer"
_COMMON = (
    Internal(_TRAINER, "_compute_loss", "replaces"),
    Internal(_TRAINER, "_get_per_token_logps_and_entropies", "wraps"),
    Internal(_TRAINER, "get_high_entropy_mask", "calls"),
    Internal(_TRAINER, "get_off_policy_mask", "calls"),
    Internal("trl.trainer.utils", "maybe_gather_lm_head_ctx", "calls"),
    Internal("trl.trainer.utils", "nanmin", "calls"),
    Internal("trl.trainer.utils", "nanmax", "calls"),
)
_FUSED_HEAD = (
    Internal("trl.trainer.utils", "add_fused_lm_head", "runs the fused loss inside the forward of"),
    Internal("trl.trainer.utils", "_ChunkedLogProbFunction", "replaces"),
)
_CHUNKED_LOGPS = (  # TRL 1.14
    Internal("trl.trainer.grpo_trainer", "_ChunkedLogProbFunction", "replaces"),
    Internal("trl.trainer.grpo_trainer", "selective_log_softmax_and_entropy", "replaces"),
    Internal("trl.trainer.grpo_trainer", "selective_log_softmax", "replaces"),
    Internal(_TRAINER, "_chunked_logps", "runs the fused loss inside"),
    Internal(_TRAINER, "_full_logits_logps", "reads the arguments of"),
)


def required_internals() -> tuple[Internal, ...]:
    """The TRL names the integration hooks in the installed release (the owner written ``module:Class``)."""
    if not has_fused_lm_head():
        return _COMMON + _CHUNKED_LOGPS
    if release_of(trl.__version__) == (1, 16):
        return _COMMON + _FUSED_HEAD + (Internal("trl.trainer.utils", "_use_triton", "reads the row layout from"),)
    return _COMMON + _FUSED_HEAD


def missing_internal() -> Internal | None:
    """The first internal of :func:`required_internals` the installed TRL lacks, or None."""
    return next((internal for internal in required_internals() if not internal.exists()), None)


def head_slot() -> tuple[Any, str]:
    """The module and name through which the installed TRL calls its chunked log-prob function."""
    module = "trl.trainer.utils" if has_fused_lm_head() else "trl.trainer.grpo_trainer"
    return importlib.import_module(module), "_ChunkedLogProbFunction"


def head_rows_are_compact(device: Any) -> bool:
    """Whether TRL hands its head only the labelled rows (else every shifted position of every sequence).

    1.16 decides by device (``_use_triton``); 1.15's fused head and 1.14's chunked path always do.
    """
    utils = importlib.import_module("trl.trainer.utils")
    if release_of(trl.__version__) == (1, 16):
        return utils._use_triton(device)
    return True


def fused_path_refusal(trainer: Any) -> str | None:
    """Why the installed TRL, as ``trainer`` is set, never hands hidden states to a chunked head (None: it does)."""
    if has_fused_lm_head():
        return None
    if not trainer.use_liger_kernel:
        return (
            f"trl {trl.__version__} scores the batch from the model's full logits unless "
            "GRPOConfig.use_liger_kernel=True (its chunked LM-head path, which the fused loss needs)"
        )
    if trainer.aux_loss_enabled:
        return f"trl {trl.__version__} scores an MoE model with a router aux loss from its full logits"
    return None
