"""verl plug-in: grpo_ext's loss as a verl policy loss and its advantages as verl advantage estimators.

Importing this module registers, through verl 0.9.1's own registries (``verl/trainer/ppo/core_algos.py``):

- the policy loss ``"grpo_ext"`` (``actor_rollout_ref.actor.policy_loss.loss_mode=grpo_ext``): verl's vanilla
  dual-clip PPO loss (``clip_ratio_low``/``clip_ratio_high``, ``clip_ratio_c`` = grpo_ext's ``delta``), every
  ``loss_agg_mode`` and the rollout IS weights, computed by :func:`grpo_ext.grpo_loss`; it returns verl's metrics
  ``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower``;
- the advantage estimators ``"grpo_ext_grpo"`` (verl's ``grpo``, ``norm_adv_by_std_in_grpo`` included) and
  ``"grpo_ext_rloo"`` (verl's ``rloo``), computed by :func:`grpo_ext.group_advantages` on verl's ``uid``-grouped rows
  in any order.

verl loads it by itself: grpo_ext declares it under the ``verl.plugins`` entry point, which ``import verl`` loads
(``VERL_USE_EXTERNAL_PLUGINS``, default ``auto``). :func:`loss_options` maps an actor config onto grpo_ext's loss
options (the KL term too, ``kl_loss_type``) for callers of grpo_ext's fused losses.

Known differences, outside the mapped range: verl clamps the log-ratio to +-20 before ``exp`` (grpo_ext does not);
a micro-batch without any kept token gives 0 here, NaN in verl (in every ``loss_agg_mode``). Every ``kl_loss_type``
but ``full`` and ``abs+`` maps onto a grpo_ext ``kl_estimator`` (docs/math.md section 4), clamps included; the
policy loss ``grpo_ext`` takes those two as well, since verl adds the KL term itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import ops

__all__ = [
    "POLICY_LOSS_NAME",
    "compute_grpo_advantage",
    "compute_policy_loss",
    "compute_rloo_advantage",
    "group_index",
    "loss_options",
]  # fmt: skip

POLICY_LOSS_NAME = "grpo_ext"
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: verl's ``kl_loss_type`` -> grpo_ext's ``kl_estimator`` and ``kl_clamp`` (``low_var_kl`` clamps ref - logp at 20).
KL_LOSS_TYPES: dict[str, dict[str, Any]] = {
    "kl": {"kl_estimator": "k1"},
    "k1": {"kl_estimator": "k1"},
    "abs": {"kl_estimator": "abs"},
    "mse": {"kl_estimator": "k2"},
    "k2": {"kl_estimator": "k2"},
    "k2+": {"kl_estimator": "k2"},
    "low_var_kl": {"kl_estimator": "low_var_kl", "kl_clamp": 20.0},
    "k3": {"kl_estimator": "low_var_kl", "kl_clamp": 20.0},
    "k1+": {"kl_estimator": "k1+"},
    "kl+": {"kl_estimator": "k1+"},
    "mse+": {"kl_estimator": "k2"},  # k2's value and k2's gradient: k2
    "k3+": {"kl_estimator": "k3+", "kl_clamp": 20.0},
    "low_var_kl+": {"kl_estimator": "k3+", "kl_clamp": 20.0},
}


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


def loss_options(config: Any, loss_agg_mode: str, response_mask: Tensor, with_kl: bool = True) -> dict[str, Any]:
    """grpo_ext's loss options for a verl actor config (``ActorConfig`` or its DictConfig) and ``loss_agg_mode``.

    Args:
        config: verl's actor config: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``,
            ``loss_scale_factor``, ``global_batch_info`` (``dp_size``, ``batch_num_tokens``,
            ``global_batch_size``), and for the KL term ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        response_mask: ``[B, T]`` (its shape sets ``seq-mean-token-sum-norm``'s default horizon).
        with_kl: whether to map the KL term (False: the KL fields are neither read nor checked).

    Returns:
        Keyword options of :func:`grpo_ext.grpo_loss` (and the fused losses): ``loss_type``, ``epsilon``,
        ``epsilon_high``, ``delta``, ``num_items_in_batch``, ``loss_scale``, ``skip_empty_rows`` (``seq-mean-*``
        without ``global_batch_size``: verl's mean over the non-empty rows), and ``beta``/``kl_estimator``/
        ``kl_clamp`` when ``use_kl_loss`` (the caller passes ``ref_logps``).

    Raises:
        ValueError: ``clip_ratio_c`` at most ``1 + clip_ratio_high``, an unknown ``loss_agg_mode``, a ``dp_size``
            above 1 without the global count its mode divides by (verl's own errors), or a ``kl_loss_type``
            without a grpo_ext estimator (``full``, ``abs+``).
    """
    clip = _get(config, "clip_ratio", 0.2)
    low, high = _get(config, "clip_ratio_low", clip), _get(config, "clip_ratio_high", clip)
    dual_clip = _get(config, "clip_ratio_c", 3.0)
    if dual_clip <= 1 + high:
        raise ValueError(f"clip_ratio_c must exceed 1 + clip_ratio_high = {1 + high} (verl's dual clip bounds only "
                         f"negative advantages; grpo_ext's delta caps both signs), got {dual_clip}")  # fmt: skip
    info = dict(_get(config, "global_batch_info", {}))
    dp_size = info.get("dp_size") or 1
    options: dict[str, Any] = {"epsilon": float(low), "epsilon_high": float(high), "delta": float(dual_clip)}
    batch, length = response_mask.shape
    if loss_agg_mode == "token-mean":
        tokens = info.get("batch_num_tokens")
        if tokens is None and dp_size > 1:  # verl's agg_loss refuses it alike
            raise ValueError("global_batch_info.batch_num_tokens is required when dp_size > 1 (token-mean)")
        options.update(loss_type="dapo", num_items_in_batch=None if tokens is None else tokens / dp_size)
    elif loss_agg_mode == "token-sum":
        options.update(loss_type="dapo", num_items_in_batch=1.0, loss_scale=float(dp_size))
    elif loss_agg_mode in LOSS_AGG_MODES:
        sequences = info.get("global_batch_size")
        if sequences is None and dp_size > 1:  # verl's agg_loss refuses it alike
            raise ValueError(f"global_batch_info.global_batch_size is required when dp_size > 1 ({loss_agg_mode})")
        scale = 1.0
        if sequences is None:  # verl: the mean over the non-empty rows of the micro-batch
            options["skip_empty_rows"] = True
        else:
            scale = batch * dp_size / float(sequences)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            scale = scale / float(info.get("loss_scale_factor") or length)  # verl reads it from global_batch_info
        options.update(loss_type="grpo" if loss_agg_mode == "seq-mean-token-mean" else "luspo", loss_scale=scale)
    else:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if with_kl and _get(config, "use_kl_loss", False):
        kl_type = _get(config, "kl_loss_type", "low_var_kl")
        if kl_type not in KL_LOSS_TYPES:
            raise ValueError(f"kl_loss_type must be one of {sorted(KL_LOSS_TYPES)} for grpo_ext's fused KL term, got "
                             f"{kl_type!r} (verl's policy loss 'grpo_ext' takes any: verl adds the KL)")  # fmt: skip
        options.update(beta=float(_get(config, "kl_loss_coef", 0.001)), **KL_LOSS_TYPES[kl_type])
    return options


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's ``PolicyLossFn``: its vanilla dual-clip PPO loss, computed by :func:`grpo_ext.grpo_loss`.

    Args:
        old_log_prob: ``[B, T]`` log-probs of the policy that sampled (no gradient).
        log_prob: ``[B, T]`` current log-probs (the gradient flows into them).
        advantages: ``[B, T]`` token advantages (or ``[B]``).
        response_mask: ``[B, T]`` completion mask.
        loss_agg_mode: verl's aggregation (``LOSS_AGG_MODES``).
        config: verl's actor config (see :func:`loss_options`; its KL fields are ignored here: verl adds the KL).
        rollout_is_weights: ``[B, T]`` rollout importance-sampling weights or None.

    Returns:
        ``(pg_loss, metrics)`` with verl's metric names ``actor/pg_clipfrac``, ``actor/ppo_kl``,
        ``actor/pg_clipfrac_lower`` (floats, as verl returns them).
    """
    if config is None:
        raise ValueError("config (verl's actor config) is required")
    options = loss_options(config, loss_agg_mode, response_mask, with_kl=False)
    is_weights = None if rollout_is_weights is None else rollout_is_weights.detach()
    out = ops.grpo_loss(log_prob, advantages, response_mask, old_logps=old_log_prob.detach(),
                             is_weights=is_weights, **options)  # fmt: skip
    with torch.no_grad():  # verl's two metrics grpo_ext does not compute, with verl's definitions
        dtype = torch.promote_types(log_prob.dtype, torch.float32)
        mask = response_mask.to(dtype)
        tokens = mask.sum().clamp(min=1)
        neg_log_ratio = (old_log_prob - log_prob).to(dtype).clamp(-20.0, 20.0)
        ppo_kl = torch.where(mask != 0, neg_log_ratio * mask, 0.0).sum() / tokens  # padding's NaN stays out
        adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
        dual_clipped = (neg_log_ratio.neg().exp() > options["delta"]) & (adv < 0)
        clipfrac_lower = (dual_clipped * mask).sum() / tokens
    metrics = {
        "actor/pg_clipfrac": out.metrics["clip_ratio/region_mean"].item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": clipfrac_lower.item(),
    }
    return out.loss, metrics


def group_index(index: np.ndarray | list) -> tuple[Tensor, int]:
    """verl's ``uid`` per row as grpo_ext's ``group_ids`` (groups in any order, of any sizes).

    Args:
        index: ``[B]`` verl's ``uid`` per row (any hashable values, rows of a group anywhere).

    Returns:
        ``(group_ids, num_groups)``: ``[B]`` int64 ids in ``[0, num_groups)``, one per distinct ``uid``.
    """
    _, inverse = np.unique(np.asarray(index), return_inverse=True)
    inverse = inverse.reshape(-1)
    return torch.as_tensor(inverse, dtype=torch.int64), int(inverse.max()) + 1 if inverse.size else 0


def _grouped_advantages(token_level_rewards, response_mask, index, **options) -> tuple[Tensor, Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    group_ids, num_groups = group_index(index)
    advantages = ops.group_advantages(scores.float(), group_ids=group_ids.to(scores.device), num_groups=num_groups,
                                           singleton_groups="verl", **options).advantages  # fmt: skip
    advantages = advantages.to(scores.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_grpo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **unused,
) -> tuple[Tensor, Tensor]:
    """verl's ``grpo`` advantage estimator (outcome rewards), by :func:`grpo_ext.group_advantages`.

    Args:
        token_level_rewards: ``[B, T]``; a row's reward is its sum.
        response_mask: ``[B, T]``.
        index: ``[B]`` the ``uid`` of each row's prompt; groups may come in any order and differ in size.
        epsilon: added to the group std (verl's 1e-6).
        norm_adv_by_std_in_grpo: divide by the group std (GRPO) or not (Dr. GRPO); default: the config's, else True.
        config: verl's ``AlgoConfig`` (``norm_adv_by_std_in_grpo``).

    Returns:
        ``(advantages, returns)``, both ``[B, T]``: ``A_i * response_mask``.
    """
    if norm_adv_by_std_in_grpo is None:
        norm_adv_by_std_in_grpo = bool(_get(config, "norm_adv_by_std_in_grpo", True)) if config is not None else True
    scale = "group" if norm_adv_by_std_in_grpo else "none"
    return _grouped_advantages(token_level_rewards, response_mask, index, eps=epsilon, scale_rewards=scale,
                               baseline="mean", std_ddof=1)  # fmt: skip


def compute_rloo_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: np.ndarray, epsilon: float = 1e-6, config: Any = None,
    **unused,
) -> tuple[Tensor, Tensor]:
    """verl's ``rloo`` advantage estimator: ``A_i = r_i - mean of the other rows of the group`` (``A = r`` alone).

    Args and returns as :func:`compute_grpo_advantage`.
    """
    return _grouped_advantages(token_level_rewards, response_mask, index, scale_rewards="none",
                               baseline="leave_one_out")  # fmt: skip


def register() -> None:
    """Registers the policy loss and the two advantage estimators in verl's registries (idempotent)."""
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(POLICY_LOSS_NAME)(compute_policy_loss)
    core_algos.register_adv_est("grpo_ext_grpo")(compute_grpo_advantage)
    core_algos.register_adv_est("grpo_ext_rloo")(compute_rloo_advantage)


register()
