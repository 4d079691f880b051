"""TRL's ``GRPOTrainer._compute_loss`` with the loss computed by grpo_ext: from the hidden states through
:func:`grpo_ext.grpo_loss_from_hidden` (``logps_backend="fused"``), or from log-probs through :func:`grpo_ext.grpo_loss`
(see the package docstring).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Any

import torch
import trl
import trl.trainer.utils as _trl_utils
from torch import Tensor

from ... import ops
from ...validation.options import CLIP_FAMILY_LOSS_TYPES, TOKEN_LEVEL_LOSS_TYPES
from . import compat
from .fused import FusedLossRequest, fused_loss_request, tied_lookup_during

# Arguments of TRL's `_get_per_token_logps_and_entropies` that `_compute_loss` does not build itself: they are
# forwarded from `inputs` by name (pixel_values, image_grid_thw, ...), so multimodal batches keep working.
_BUILT_ARGUMENTS = frozenset(
    {
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    }
)


@functools.cache
def _forwarded_input_names() -> tuple[str, ...]:
    # TRL 1.14's method takes (model, *args, **kwargs) on to _full_logits_logps, which names the fields.
    names: list[str] = []
    methods = [trl.GRPOTrainer._get_per_token_logps_and_entropies]
    if hasattr(trl.GRPOTrainer, "_full_logits_logps"):
        methods.append(trl.GRPOTrainer._full_logits_logps)
    for method in methods:
        for name, param in inspect.signature(method).parameters.items():
            named = param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            if named and name not in _BUILT_ARGUMENTS and name not in names:
                names.append(name)
    return tuple(names)


def _global_mean(trainer: trl.GRPOTrainer, local_sum: Tensor, local_count: Tensor) -> float:
    """``sum / max(count, 1)`` over every process (TRL's reduction of its mean metrics)."""
    totals = trainer.accelerator.reduce(torch.stack([local_sum.float(), local_count.float()]), reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def _high_entropy_mask(trainer: trl.GRPOTrainer, entropies: Tensor | None, mask: Tensor) -> Tensor | None:
    """TRL's ``[B, T]`` mask of the tokens above the ``1 - top_entropy_quantile`` entropy quantile over every
    process (None when ``top_entropy_quantile`` is 1)."""
    if trainer.top_entropy_quantile >= 1.0:
        return None
    return trainer.get_high_entropy_mask(entropies.detach(), mask, 1 - trainer.top_entropy_quantile)


def _policy_weights(trainer: trl.GRPOTrainer, inputs: dict, logps: Tensor | None, old_logps: Tensor | None,
                    entropy_mask: Tensor | None, mask: Tensor,
                    advantages: Tensor) -> dict[str, Tensor | None]:  # fmt: skip
    """TRL's factors on the policy term only, as grpo_ext's ``is_weights`` and ``policy_weights`` options.

    TRL multiplies its per-token policy loss, before adding the KL, by the high-entropy token mask
    (``top_entropy_quantile``), the DeepSeek-V3.2 off-policy sequence mask (``off_policy_mask_threshold``) and the
    vLLM importance-sampling ratio; none of them is differentiated. Their product is ``is_weights`` (docs/math.md
    section 3), except for vespo, where the vLLM ratio enters the sequence weight (``is_weights``) and the two masks
    multiply the term after it (``policy_weights``), as in TRL. The masks need the current ``logps`` / entropies
    (``entropy_mask``, :func:`_high_entropy_mask`): on the fused path they come from a no-grad chunked pass over the
    completion rows inside the forward, before the loss (:class:`.fused.FusedLossRequest`'s ``token_weights``).
    """
    masks: list[Tensor] = []
    if entropy_mask is not None:
        masks.append(entropy_mask)
    if trainer.off_policy_mask_threshold is not None:
        old = logps.detach() if old_logps is None else old_logps
        rows_advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
        masks.append(
            trainer.get_off_policy_mask(
                advantages=rows_advantages,
                per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask,
                off_policy_threshold=trainer.off_policy_mask_threshold,
            )
        )
    ratios = []
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        ratios.append(inputs["importance_sampling_ratio"])
    if trainer.loss_type == "vespo":
        return {"is_weights": _product(ratios), "policy_weights": _product(masks)}
    return {"is_weights": _product(masks + ratios), "policy_weights": None}


def _product(factors: list[Tensor]) -> Tensor | None:
    """The detached float32 product of ``factors`` (broadcast), or None for none."""
    weights = None
    for factor in factors:
        factor = factor.detach().to(torch.float32)
        weights = factor if weights is None else weights * factor
    return weights


def _log_metrics(trainer: trl.GRPOTrainer, mode: str, metrics: dict[str, Tensor], logps: Tensor | None,
                 old_logps: Tensor | None, entropy_sum: Tensor, mask: Tensor, advantages: Tensor) -> None:  # fmt: skip
    """Appends TRL's loss metrics, under TRL's names and cross-process reductions, to ``trainer._metrics[mode]``.

    The means come from grpo_ext's fused metrics (local mean times local count, summed over processes; the entropy
    from ``entropy_sum``, its local sum over the kept tokens); ``clip_ratio/low_min`` and ``clip_ratio/high_max``
    (extremes over rows) are computed here from the detached ratio (``logps`` may be None when ``old_logps`` is:
    the ratio is then 1).
    """
    log = trainer._metrics[mode]
    maskf = mask.to(torch.float32)
    token_count = maskf.sum()
    rows_advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    sequence = trainer.importance_sampling_level == "sequence"
    # With one ratio and one advantage per row, TRL counts clip shares over rows (docs/math.md section 7).
    row_shares = sequence and rows_advantages.shape[1] == 1
    share_count = torch.tensor(float(mask.shape[0]), device=mask.device) if row_shares else token_count

    def share(name: str) -> float:
        return _global_mean(trainer, metrics[name] * share_count, share_count)

    if trainer.beta != 0.0:
        log["kl"].append(_global_mean(trainer, metrics["kl"] * token_count, token_count))
    log["entropy"].append(_global_mean(trainer, entropy_sum, token_count))
    if trainer.loss_type == "cispo":
        log["cispo_clip_ratio"].append(share("cispo_clip_ratio"))
        return
    if trainer.loss_type == "vespo":  # a mean over rows with one advantage per row, as TRL's phi_seq [B, 1]
        per_row = rows_advantages.shape[1] == 1
        phi_count = torch.tensor(float(mask.shape[0]), device=mask.device) if per_row else token_count
        log["vespo/phi_seq_mean"].append(_global_mean(trainer, metrics["vespo/phi_seq_mean"] * phi_count, phi_count))
        return
    if trainer.loss_type not in CLIP_FAMILY_LOSS_TYPES:  # TRL logs no clip metric for sapo
        return
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        log[name].append(share(name))

    with torch.no_grad():
        if old_logps is None:
            log_ratio = torch.zeros(mask.shape, device=mask.device)
        else:
            log_ratio = logps.detach() - old_logps
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)  # padding never reaches a ratio, even if NaN
        if sequence:
            log_ratio = log_ratio.sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(log_ratio)
        low = ((ratio < 1 - trainer.epsilon_low) & (rows_advantages < 0)).float()
        high = ((ratio > 1 + trainer.epsilon_high) & (rows_advantages > 0)).float()

        def per_row(flags: Tensor) -> Tensor:  # NaN for a row with no tokens, which nanmin / nanmax skip
            return flags.squeeze(1) if flags.shape[1] == 1 else (flags * maskf).sum(-1) / maskf.sum(-1)

        log["clip_ratio/low_min"].append(_trl_utils.nanmin(trainer.accelerator.gather(per_row(low))).item())
        log["clip_ratio/high_max"].append(_trl_utils.nanmax(trainer.accelerator.gather(per_row(high))).item())


def _loss_options(trainer: trl.GRPOTrainer, inputs: dict[str, Any], mode: str, accumulation: int) -> dict[str, Any]:
    """TRL's loss settings as keyword arguments of grpo_ext's losses (all but the log-probs and ``is_weights``)."""
    num_items, loss_scale = None, 1.0
    if trainer.loss_type in TOKEN_LEVEL_LOSS_TYPES:
        # TRL's denominator: the generation batch's token count per process, rescaled to one accumulation window.
        device = inputs["completion_mask"].device
        num_items = torch.as_tensor(inputs["num_items_in_batch"], dtype=torch.float32, device=device)
        num_items = num_items.clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            num_items = num_items * accumulation / trainer.args.steps_per_generation
    else:
        loss_scale = 1.0 / accumulation
    return dict(
        old_logps=inputs.get("old_per_token_logps"),
        ref_logps=inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
        loss_type=trainer.loss_type,
        epsilon=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,  # resolved by TRL (None -> epsilon), also as cispo's cap
        beta=trainer.beta,
        kl_estimator="k3",  # TRL's only estimator
        importance_sampling_level=trainer.importance_sampling_level,
        max_completion_length=trainer.max_completion_length,
        num_items_in_batch=num_items,
        loss_scale=loss_scale,
        **config_loss_options(trainer.args),
    )


#: GRPOConfig fields that reach grpo_ext's loss options under their own names, as they are.
_TRL_LOSS_FIELDS = (
    "use_bias_correction_kl",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)


def config_loss_options(args: Any) -> dict[str, Any]:
    """The loss options read off a ``trl.GRPOConfig`` as they are: :data:`_TRL_LOSS_FIELDS`, and ``delta`` where TRL
    applies it (the clip-family loss types only: sapo, cispo and vespo ignore it)."""
    delta = args.delta if args.loss_type in CLIP_FAMILY_LOSS_TYPES else None
    return {"delta": delta, **{name: getattr(args, name) for name in _TRL_LOSS_FIELDS}}


def _entropy_bonus_coef(trainer: trl.GRPOTrainer) -> float | None:
    """The coefficient TRL applies to this micro-batch's mean entropy (None: the bonus is off).

    TRL's rule: the static ``entropy_coef``; with ``use_adaptive_entropy`` the coefficient the last optimizer step
    left, applied only when that step's entropy over every process was at most ``entropy_target`` (no bonus before
    the first step's measurement).
    """
    if not trainer._entropy_bonus_enabled:
        return None
    if trainer.use_adaptive_entropy:
        return trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    return trainer.entropy_coef


def _update_entropy_control(trainer: trl.GRPOTrainer, mode: str, entropy_sum: Tensor, token_count: Tensor) -> None:
    """TRL's adaptive entropy control (Skywork-OR1) and its ``entropy_coef`` metric, after a micro-batch's loss.

    The window's entropy sum and token count are accumulated over its micro-batches; at the optimizer step they are
    summed over the processes, and the coefficient moves by ``entropy_coef_delta`` toward more bonus when the mean
    entropy is at most ``entropy_target`` (less otherwise), within ``[entropy_coef_min, entropy_coef_max]``. The
    state (``entropy_coef``, ``_last_world_entropy``) is TRL's own, so its checkpoints save and restore it.
    """
    sync = trainer.accelerator.sync_gradients
    if trainer.use_adaptive_entropy and mode == "train":
        stats = torch.stack([entropy_sum.detach().float(), token_count.detach().float()])
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if sync:
            totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            args = trainer.args
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    if mode == "train" and sync:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)


def _needs_token_values(trainer: trl.GRPOTrainer) -> bool:
    """Whether the loss' weights need the current per-token log-probs or entropies (TRL's two masks)."""
    return trainer.top_entropy_quantile < 1.0 or trainer.off_policy_mask_threshold is not None


def _warn_fallback(trainer: trl.GRPOTrainer, reason: str) -> None:
    """One warning per trainer and reason: the loss takes the log-prob path (``logps_backend='plain'``)."""
    warned = trainer.__dict__.setdefault("_grpo_ext_fallbacks", set())
    if reason not in warned:
        warned.add(reason)
        warnings.warn(f"grpo_ext.integrations.trl: the loss falls back to the log-prob path: {reason}", stacklevel=3)


def _compute_loss(trainer: trl.GRPOTrainer, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` contract, with the loss computed by grpo_ext.

    With ``trainer.logps_backend == "fused"`` (the default) the loss is :func:`grpo_ext.grpo_loss_from_hidden` on
    the hidden states TRL's fused LM head receives (see :mod:`.fused`), so no logits beyond one chunk exist;
    settings it cannot express fall back, with a warning naming them, to the log-prob pass and
    :func:`grpo_ext.grpo_loss` (what ``"plain"`` always does).

    Args:
        trainer: the (patched) TRL trainer; its attributes and ``args`` give every loss option.
        model: the model to score the batch with (TRL passes the wrapped training model).
        inputs: TRL's batch: ``prompt_ids``/``prompt_mask`` ``[B, P]``, ``completion_ids``/``completion_mask``
            ``[B, T]``, ``advantages`` ``[B]`` (or ``[B, T]``), ``num_items_in_batch`` (0-dim), and when present
            ``old_per_token_logps``, ``ref_per_token_logps``, ``sampling_per_token_logps``,
            ``importance_sampling_ratio`` (``[B, T]`` or ``[B, 1]``), ``tool_mask`` ``[B, T]`` and multimodal fields.

    Returns:
        The 0-dim float32 loss, scaled for gradient accumulation exactly as TRL scales it.
    """
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    forwarded = {name: inputs.get(name) for name in _forwarded_input_names()}
    advantages = inputs["advantages"]
    mode = "train" if trainer.model.training else "eval"
    # TRL averages micro-batches by scaling each loss (HF's own scaling is off); eval neither splits nor accumulates.
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    options = _loss_options(trainer, inputs, mode, accumulation)
    old_logps = options["old_logps"]
    # TRL subtracts coef * (mean entropy) / accumulation whatever the loss type: grpo_ext's bonus is scaled by
    # loss_scale, so the fused loss takes coef / (accumulation * loss_scale) (docs/math.md section 5, "Entropy bonus").
    bonus_coef = _entropy_bonus_coef(trainer)

    request = None
    fused = getattr(trainer, "logps_backend", "fused") == "fused"
    refusal = compat.fused_path_refusal(trainer) if fused else None  # TRL 1.14's full-logits path
    if refusal is not None:
        _warn_fallback(trainer, refusal)
    elif fused:  # no TRL 1.15/1.16 option keeps the loss off the fused path
        token_weights = None
        if _needs_token_values(trainer):  # weights from a no-grad pass inside the forward, before the loss
            def token_weights(logps: Tensor, entropies: Tensor) -> dict[str, Tensor | None]:
                entropy_mask = _high_entropy_mask(trainer, entropies, mask)
                weights = _policy_weights(trainer, inputs, logps, old_logps, entropy_mask, mask, advantages)
                if bonus_coef is not None:  # TRL's bonus averages over the tokens its policy term keeps
                    weights["entropy_weights"] = entropy_mask
                return weights

            weights = {}  # set by token_weights inside the forward
        else:
            weights = _policy_weights(trainer, inputs, None, old_logps, None, mask, advantages)
        request = FusedLossRequest(
            completion_ids, completion_mask, prompt_ids.size(1) + completion_ids.size(1),
            dict(advantages=advantages, completion_mask=mask, **weights, **options,
                 entropy_coef=0.0 if bonus_coef is None else bonus_coef / (accumulation * options["loss_scale"])),
            want_logps=old_logps is not None and trainer.loss_type in CLIP_FAMILY_LOSS_TYPES,
            token_weights=token_weights,
        )  # fmt: skip
    with contextlib.ExitStack() as fused_forward:
        if request is not None:
            fused_forward.enter_context(fused_loss_request(request))
            fused_forward.enter_context(tied_lookup_during(trainer.accelerator.unwrap_model(model), request))
        logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=trainer.aux_loss_enabled,
            **forwarded,
        )
    if request is not None and request.refusal is None:
        if request.output is None:
            raise RuntimeError(
                "grpo_ext.integrations.trl: the model's forward never reached TRL's fused LM head, so the fused loss "
                "was not computed; use logps_backend='plain'"
            )
        out = request.output
        logps = request.logps
        entropy_sum = out.metrics["entropy"] * mask.sum()
        loss = out.loss
        # The fused loss has the bonus in it (with its gradient); TRL's policy_loss metric is the loss without it.
        bonus_sum, bonus_count = entropy_sum, mask.sum()
        bonus_weights = request.loss_options.get("entropy_weights")
        if bonus_weights is not None:  # the high-entropy tokens' mean
            bonus_weights = mask.to(request.token_entropy.dtype) * bonus_weights.to(request.token_entropy.dtype)
            bonus_sum, bonus_count = (request.token_entropy * bonus_weights).sum(), bonus_weights.sum()
        policy_loss = out.loss.detach()
        if bonus_coef is not None:
            policy_loss = policy_loss + bonus_coef * (bonus_sum / bonus_count.clamp(min=1.0)) / accumulation
    else:
        if request is not None:
            _warn_fallback(trainer, request.refusal)
        entropy_mask = _high_entropy_mask(trainer, entropies, mask)
        out = ops.grpo_loss(
            logps, advantages, mask,
            **_policy_weights(trainer, inputs, logps, old_logps, entropy_mask, mask, advantages), **options,
        )  # fmt: skip
        entropy_sum = (entropies.detach() * mask).sum()
        loss = out.loss
        policy_loss = out.loss.detach()
        if bonus_coef is not None:
            # TRL's bonus acts on the tokens its policy term keeps (the high-entropy ones with top_entropy_quantile),
            # differentiated through the log-prob pass' entropy output.
            bonus_mask = mask.to(entropies.dtype)
            if entropy_mask is not None:
                bonus_mask = bonus_mask * entropy_mask
            bonus_sum, bonus_count = (entropies * bonus_mask).sum(), bonus_mask.sum()
            loss = loss - bonus_coef * (bonus_sum / bonus_count.clamp(min=1.0)) / accumulation
    if bonus_coef is not None:
        # TRL's policy_loss is before its division by the accumulation steps (grpo_ext's loss_scale there)
        trainer._metrics[mode]["policy_loss"].append(
            trainer.accelerator.gather(policy_loss / options["loss_scale"]).nanmean().item()
        )
        _update_entropy_control(trainer, mode, bonus_sum, bonus_count)
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accumulation
        trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    _log_metrics(trainer, mode, out.metrics, logps, old_logps, entropy_sum, mask, advantages)
    return loss
