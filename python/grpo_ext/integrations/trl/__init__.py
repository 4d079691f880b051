"""TRL's own ``GRPOTrainer`` with its loss and its per-token log-prob passes computed by grpo_ext.

Two ways in, with the same effect:

- :class:`GRPOExtTrainer`: a drop-in subclass of ``trl.GRPOTrainer`` (same constructor, same ``trl.GRPOConfig``);
- :func:`patch`: switches an already built ``trl.GRPOTrainer`` (or a subclass of it) over; :func:`unpatch` undoes it.

What changes, and what does not:

- **the loss** (``logps_backend="fused"``, the default): ``_compute_loss`` runs TRL's fused-LM-head forward and, where
  TRL's forward hands the hidden states and the LM head's weight to its chunked log-prob function, computes the whole
  loss with :func:`grpo_ext.grpo_loss_from_hidden` on the completion rows (each chunk's logits exist once, the
  gradients for the hidden states and the head are formed in that pass), so no ``[B, T, V]`` logits and no per-token
  log-prob graph exist (:mod:`.fused`). ``top_entropy_quantile < 1`` and ``off_policy_mask_threshold`` need per-token
  values before the loss: a no-grad chunked pass over the completion rows, inside the forward, gives them. A model
  whose forward hands the head rows that do not map onto the completion tokens falls back, with a one-line warning
  naming the reason, to the log-prob pass below and :func:`grpo_ext.grpo_loss`; a model's ``logit_scale`` and
  ``final_logit_softcapping`` go through the kernels' logits options. ``logps_backend="plain"`` (a ``GRPOExtTrainer``
  / :func:`patch` argument, or the trainer's ``logps_backend`` attribute) always takes that path. Both map every TRL
  option that shapes the loss onto the parameters of docs/math.md, so the loss and its gradients equal TRL's:
  ``loss_type``, ``epsilon``, ``epsilon_high`` (the cispo cap included), ``delta``, ``beta``,
  ``use_bias_correction_kl`` (TRL's default True is passed explicitly: grpo_ext's own default is False),
  ``importance_sampling_level``, ``max_completion_length``, ``sapo_temperature_*``, ``vespo_k_*``/``vespo_lambda_*``,
  the dapo/cispo/vespo ``num_items_in_batch`` normalizer, gradient accumulation (as ``loss_scale``), TRL's entropy
  bonus (``entropy_coef``, fused into the kernels' pass on the fused path, and its adaptive control
  ``use_adaptive_entropy``, TRL's update between optimizer steps), the vLLM importance-sampling correction,
  ``off_policy_mask_threshold`` and ``top_entropy_quantile`` (all three as ``is_weights``; for vespo the vLLM ratio
  enters its sequence weight, as in TRL, and the two masks are ``policy_weights``), tool masks and the MoE router
  auxiliary loss;
- **the log-prob passes** (policy, old policy and reference): TRL 1.15/1.16 compute them inside the model's forward
  (``add_fused_lm_head``; 1.14 in ``GRPOTrainer._chunked_logps``), projecting the hidden states through the LM head
  in tiles. The patched trainer keeps that forward (PEFT, multimodal inputs, FSDP, ``cast_lm_head_to_fp32``, logit
  scaling and soft-capping all stay TRL's) and swaps only the tile math for :func:`grpo_ext.selective_log_softmax`,
  in row chunks whose logits are recomputed in the backward, so the ``[N, V]`` logits are never all held at once;
- **the metrics** keep TRL's names and reductions (``kl``, ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``,
  ``vespo/phi_seq_mean``), but for two cases the README lists: the clip metrics test the uncapped ratio (they
  differ where ``delta <= 1 + epsilon_high``), and a micro-batch of one token column averages over its kept tokens.

Every TRL loss option is supported; a loss type TRL does not have, an option value grpo_ext's losses refuse
(``delta <= 1``, a negative ``beta`` or ``epsilon_high``) and a subclass's VESPO ``get_gamma_weights`` are refused
when the trainer is built or patched; ``delta`` reaches the clip-family losses only, as in TRL.

**TRL releases**: 1.14.x, 1.15.x and 1.16.x (:func:`check_trl_version` refuses any other, naming the range, and an
installed release lacking an internal the integration hooks, naming that internal). The loss code is the same in all
three; what differs is how TRL scores log-probs (:mod:`.compat`): 1.15 and 1.16 through ``add_fused_lm_head`` as
above; 1.14 from the model's full logits unless ``GRPOConfig.use_liger_kernel=True`` (its chunked LM-head path,
where the loss is fused as above), so with its default config, or an MoE model with a router loss, the loss takes
the log-prob path (TRL's full logits through :func:`grpo_ext.selective_log_softmax`, then
:func:`grpo_ext.grpo_loss`) with a one-line warning saying why.
The differences from TRL are listed in the README ("Using grpo_ext from TRL").
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from typing import Any

import torch
from torch import Tensor

try:
    import trl
except ImportError as exc:  # pragma: no cover - CI installs trl
    raise ImportError(
        "grpo_ext.integrations.trl needs TRL 1.14.x to 1.16.x: pip install 'trl==1.16.0' (the version the main test "
        "environment pins)"
    ) from exc

from ...validation.loss import validate_loss_option_values
from ...validation.options import LOSS_TYPES, LossOptions
from . import compat
from .fused import GrpoExtHead, _log_probs_through_grpo_ext  # noqa: F401  (the tests reach the first here)
from .log_probs import _GrpoExtLogProbs  # noqa: F401  (the tests reach it here)
from .loss import _compute_loss, config_loss_options

__all__ = [
    "LOGPS_BACKENDS",
    "SUPPORTED_LOSS_TYPES",
    "SUPPORTED_TRL_VERSIONS",
    "TESTED_TRL_VERSION",
    "GRPOExtTrainer",
    "check_trl_version",
    "is_patched",
    "patch",
    "unpatch",
]

#: The TRL release the main test environment pins; 1.14.x, 1.15.x and 1.16.x are accepted (the integration hooks TRL
#: internals that change between releases: :mod:`.compat`), and ``make test`` runs the parity tests under 1.14.0 and
#: 1.15.0 too.
TESTED_TRL_VERSION = "1.16.0"
SUPPORTED_TRL_VERSIONS = ">=1.14.0,<1.17"

#: TRL loss types grpo_ext computes: all of TRL 1.14-1.16's (the same eight in each).
SUPPORTED_LOSS_TYPES: tuple[str, ...] = LOSS_TYPES


#: How the patched loss gets the policy's log-probs: ``"fused"`` (from the hidden states, inside the loss; the
#: default) or ``"plain"`` (TRL's log-prob pass on grpo_ext, then :func:`grpo_ext.grpo_loss`).
LOGPS_BACKENDS: tuple[str, ...] = ("fused", "plain")

_PATCH_MARK = "_grpo_ext_patched"


def _check_backend(logps_backend: str) -> str:
    if logps_backend not in LOGPS_BACKENDS:
        raise ValueError(f"logps_backend must be one of {LOGPS_BACKENDS}, got {logps_backend!r}")
    return logps_backend


def check_trl_version(version: str | None = None) -> None:
    """Raises unless ``version`` (default: the installed TRL's) is a release this integration supports.

    Without ``version``, also checks that the installed TRL has every internal the integration hooks in that release
    (:func:`.compat.required_internals`).

    Args:
        version: a TRL version string, e.g. ``"1.15.0"``; None reads ``trl.__version__``.

    Raises:
        RuntimeError: naming the version found and the supported range, or the missing internal.
    """
    found = trl.__version__ if version is None else version
    if not compat.is_supported(found):
        raise RuntimeError(
            f"grpo_ext.integrations.trl supports trl 1.14.x to 1.16.x (it hooks TRL internals that change between "
            f"releases), found trl {found}: pip install 'trl{SUPPORTED_TRL_VERSIONS}'"
        )
    if version is None:
        missing = compat.missing_internal()
        if missing is not None:
            raise RuntimeError(
                f"trl {found} has no {missing.path}, which grpo_ext.integrations.trl {missing.use}: "
                f"pip install 'trl=={TESTED_TRL_VERSION}'"
            )


def _check_config(args: Any) -> None:
    """Raises ValueError naming the ``trl.GRPOConfig`` field grpo_ext cannot honour.

    The loss options are checked here, when the trainer is built or patched, by the ranges grpo_ext's losses
    accept (docs/math.md), rather than at the first step after a generation: TRL itself takes some values the
    kernels refuse (``delta <= 1``, a negative ``beta`` or ``epsilon_high``).
    """
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(
            f"GRPOConfig.loss_type={args.loss_type!r} is not supported by grpo_ext.integrations.trl (supported: "
            f"{', '.join(SUPPORTED_LOSS_TYPES)}); train with the unpatched trl.GRPOTrainer for it"
        )
    options = LossOptions(
        loss_type=args.loss_type,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,  # TRL's resolution
        beta=args.beta,
        importance_sampling_level=args.importance_sampling_level,
        **config_loss_options(args),
    )
    try:
        validate_loss_option_values(options)
    except ValueError as err:
        raise ValueError(f"GRPOConfig.{err} (grpo_ext.integrations.trl computes the loss with grpo_ext, which refuses "
                         "it; train with the unpatched trl.GRPOTrainer for it)") from None  # fmt: skip


def _check_hooks(trainer: Any, loss_type: str) -> None:
    """Raises ValueError where ``trainer`` (an instance or a class) overrides a ``trl.GRPOTrainer`` hook of the loss
    that grpo_ext cannot call.

    TRL's loss calls three overridable hooks: grpo_ext's calls ``get_high_entropy_mask`` and ``get_off_policy_mask``
    too, but computes VESPO's ``get_gamma_weights`` inside its kernels, so an override would be ignored.
    """
    if loss_type == "vespo" and getattr(trainer, "get_gamma_weights", None) is not getattr(
        trl.GRPOTrainer, "get_gamma_weights", None
    ):
        name = trainer.__name__ if isinstance(trainer, type) else type(trainer).__name__
        raise ValueError(
            f"{name} overrides get_gamma_weights, which grpo_ext.integrations.trl cannot call (its kernels compute "
            "VESPO's gamma weights, docs/math.md section 3): train with the unpatched trl.GRPOTrainer for it"
        )


class GRPOExtTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss and log-prob passes run on grpo_ext; same constructor and ``trl.GRPOConfig``.

    One more keyword argument: ``logps_backend`` (``"fused"``, the default, or ``"plain"``; see
    :data:`LOGPS_BACKENDS`), kept as the ``logps_backend`` attribute, which may be changed between steps.

    Raises:
        RuntimeError: the installed TRL is not a supported release (see :func:`check_trl_version`).
        ValueError: ``args`` asks for a loss type grpo_ext does not compute, before the model is loaded when
            ``args`` is given.
    """

    def __init__(self, *args: Any, logps_backend: str = "fused", **kwargs: Any) -> None:
        check_trl_version()
        self.logps_backend = _check_backend(logps_backend)
        try:
            config = (
                inspect.signature(trl.GRPOTrainer.__init__).bind_partial(self, *args, **kwargs).arguments.get("args")
            )
        except TypeError:
            config = None  # let TRL's constructor report the bad call
        if config is not None:
            _check_config(config)
            _check_hooks(type(self), config.loss_type)
        super().__init__(*args, **kwargs)
        _check_config(self.args)
        _check_hooks(self, self.args.loss_type)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        with _log_probs_through_grpo_ext():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        return _compute_loss(self, model, inputs)


def patch(trainer: trl.GRPOTrainer, logps_backend: str = "fused") -> trl.GRPOTrainer:
    """Makes an existing ``trl.GRPOTrainer`` compute its loss and log-prob passes with grpo_ext, in place.

    Only this instance changes (its ``_compute_loss`` and ``_get_per_token_logps_and_entropies``); a subclass's own
    ``_get_per_token_logps_and_entropies`` is kept and wrapped. A subclass's own ``_compute_loss`` is kept too, with a
    warning: its loss stays its own, and grpo_ext computes the log-prob passes it calls. Patching twice is a no-op.

    Args:
        trainer: a ``trl.GRPOTrainer`` (or subclass) instance.
        logps_backend: ``"fused"`` or ``"plain"`` (:data:`LOGPS_BACKENDS`), set as ``trainer.logps_backend`` (also
            on a trainer patched before).

    Returns:
        The same trainer.

    Raises:
        TypeError: ``trainer`` is not a ``trl.GRPOTrainer``.
        RuntimeError: the installed TRL is not a supported release.
        ValueError: its config asks for a loss type grpo_ext does not compute or an option value grpo_ext refuses,
            its class overrides VESPO's ``get_gamma_weights`` with ``loss_type="vespo"``, or ``logps_backend`` is
            not one of :data:`LOGPS_BACKENDS`.
    """
    if not isinstance(trainer, trl.GRPOTrainer):
        raise TypeError(f"trainer must be a trl.GRPOTrainer, got {type(trainer).__name__}")
    check_trl_version()
    _check_config(trainer.args)
    _check_hooks(trainer, trainer.args.loss_type)
    _check_backend(logps_backend)
    if is_patched(trainer):
        trainer.logps_backend = logps_backend
        return trainer
    original = trainer._get_per_token_logps_and_entropies

    @functools.wraps(original)
    def per_token_logps_and_entropies(*args: Any, **kwargs: Any):
        with _log_probs_through_grpo_ext():
            return original(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    if type(trainer)._compute_loss is trl.GRPOTrainer._compute_loss:
        trainer._compute_loss = types.MethodType(_compute_loss, trainer)
    else:  # replacing a subclass's loss would drop what it adds, silently
        warnings.warn(
            f"grpo_ext.integrations.trl.patch: {type(trainer).__name__}._compute_loss is kept (the loss stays the "
            "subclass's own); grpo_ext computes only the log-prob passes it calls",
            stacklevel=2,
        )
    trainer.logps_backend = logps_backend
    setattr(trainer, _PATCH_MARK, True)
    return trainer


def unpatch(trainer: trl.GRPOTrainer) -> trl.GRPOTrainer:
    """Undoes :func:`patch` on ``trainer`` (a no-op on an unpatched one; a ``GRPOExtTrainer`` stays as it is).

    Args:
        trainer: a trainer passed to :func:`patch` before.

    Returns:
        The same trainer.
    """
    if trainer.__dict__.pop(_PATCH_MARK, False):
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
        trainer.__dict__.pop("_compute_loss", None)
        trainer.__dict__.pop("logps_backend", None)
    return trainer


def is_patched(trainer: trl.GRPOTrainer) -> bool:
    """Whether ``trainer`` computes its loss with grpo_ext (a ``GRPOExtTrainer`` or a patched instance)."""
    return isinstance(trainer, GRPOExtTrainer) or bool(trainer.__dict__.get(_PATCH_MARK, False))
