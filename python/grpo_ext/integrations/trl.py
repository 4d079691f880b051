"""TRL's own ``GRPOTrainer`` with its loss and its per-token log-prob passes computed by grpo_ext.

Two ways in, with the same effect:

- :class:`GRPOExtTrainer`: a drop-in subclass of ``trl.GRPOTrainer`` (same constructor, same ``trl.GRPOConfig``);
- :func:`patch`: switches an already built ``trl.GRPOTrainer`` (or a subclass of it) over; :func:`unpatch` undoes it.

What changes, and what does not:

- **the loss**: ``_compute_loss`` calls :func:`grpo_ext.grpo_loss` (one fused forward for the policy term, the KL,
  the aggregation and the metrics; backward is one scale). Every TRL option that shapes the loss is mapped onto the
  spec's parameters (``spec/grpo-math.md``), so the loss and its gradients equal TRL's: ``loss_type``, ``epsilon``,
  ``epsilon_high`` (the cispo cap included), ``delta``, ``beta``, ``use_bias_correction_kl`` (TRL's default True is
  passed explicitly: grpo_ext's own default is False), ``importance_sampling_level``, ``max_completion_length``,
  ``sapo_temperature_*``, the dapo/cispo ``num_items_in_batch`` normalizer, gradient accumulation (as
  ``loss_scale``), the vLLM importance-sampling correction, ``off_policy_mask_threshold`` and
  ``top_entropy_quantile`` (all three as ``is_weights``), tool masks and the MoE router auxiliary loss;
- **the log-prob passes** (policy, old policy and reference): TRL 1.16 computes them inside the model's forward
  (``add_fused_lm_head``), projecting the hidden states through the LM head in tiles. The patched trainer keeps that
  forward (PEFT, multimodal inputs, FSDP, ``cast_lm_head_to_fp32``, logit scaling and soft-capping all stay TRL's)
  and swaps only the tile math for :func:`grpo_ext.selective_log_softmax`, in row chunks whose logits are
  recomputed in the backward, so the ``[N, V]`` logits are never all held at once;
- **the metrics** keep TRL's names and reductions (``kl``, ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``).

Not supported (a clear error when the trainer is built or patched): ``loss_type="vespo"`` (no grpo_ext kernel) and
TRL's entropy bonus (``entropy_coef != 0`` or ``use_adaptive_entropy``). The differences from TRL are listed in the
README ("Using grpo_ext from TRL").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

try:
    import trl
    import trl.trainer.utils as _trl_utils
except ImportError as exc:  # pragma: no cover - CI installs trl
    raise ImportError(
        "grpo_ext.integrations.trl needs TRL: pip install 'trl==1.16.0' (the version this integration is tested with)"
    ) from exc
from packaging.version import InvalidVersion, Version

from .. import ops
from ..reference import LOSS_TYPES

__all__ = [
    "SUPPORTED_LOSS_TYPES",
    "TESTED_TRL_VERSION",
    "GRPOExtTrainer",
    "check_trl_version",
    "is_patched",
    "patch",
    "unpatch",
]

#: The TRL release this integration is tested against; any 1.16.x is accepted (it relies on TRL internals).
TESTED_TRL_VERSION = "1.16.0"
_SUPPORTED_RELEASE = (1, 16)

#: TRL loss types grpo_ext computes (TRL's ``vespo`` has no grpo_ext kernel).
SUPPORTED_LOSS_TYPES: tuple[str, ...] = LOSS_TYPES

#: Logits elements (rows x vocabulary) projected at once in the log-prob pass; bounds the extra memory to about
#: 256 MiB of float32 per chunk in the forward and twice that in the backward.
LOGITS_CHUNK_ELEMENTS = 1 << 26

# TRL's per-token outputs of the fused LM head that GRPO uses; the others (log_sum_sq_probs, ...) are not computed.
_LOG_PROB_OUTPUTS = ("log_probs", "entropy")
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
_PATCH_MARK = "_grpo_ext_patched"
# Loss types whose term clips the ratio; TRL logs clip_ratio/* for these only.
_CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def check_trl_version(version: str | None = None) -> None:
    """Raises unless ``version`` (default: the installed TRL's) is a release this integration supports.

    Args:
        version: a TRL version string, e.g. ``"1.16.0"``; None reads ``trl.__version__``.

    Raises:
        RuntimeError: naming the version found and the one to install.
    """
    found = trl.__version__ if version is None else version
    try:
        release = Version(found).release[:2]
    except InvalidVersion:
        release = None
    if release != _SUPPORTED_RELEASE:
        supported = ".".join(map(str, _SUPPORTED_RELEASE))
        raise RuntimeError(
            f"grpo_ext.integrations.trl supports trl {supported}.x (it hooks TRL internals that change between "
            f"releases), found trl {found}: pip install 'trl=={TESTED_TRL_VERSION}'"
        )
    if not hasattr(_trl_utils, "_ChunkedLogProbFunction"):
        raise RuntimeError(
            f"trl {found} has no trl.trainer.utils._ChunkedLogProbFunction, which grpo_ext.integrations.trl "
            f"replaces: pip install 'trl=={TESTED_TRL_VERSION}'"
        )


def _check_config(args: Any) -> None:
    """Raises ValueError naming the ``trl.GRPOConfig`` field grpo_ext cannot honour."""
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(
            f"GRPOConfig.loss_type={args.loss_type!r} is not supported by grpo_ext.integrations.trl (supported: "
            f"{', '.join(SUPPORTED_LOSS_TYPES)}); train with the unpatched trl.GRPOTrainer for it"
        )
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        raise ValueError(
            f"GRPOConfig.entropy_coef={args.entropy_coef} / use_adaptive_entropy={args.use_adaptive_entropy}: TRL's "
            "entropy bonus is not supported by grpo_ext.integrations.trl; set entropy_coef=0.0 and "
            "use_adaptive_entropy=False, or train with the unpatched trl.GRPOTrainer"
        )


# ---------------------------------------------------------------------------------------------------------------
# log-prob pass: the tile math of TRL's fused LM head, through grpo_ext.selective_log_softmax
# ---------------------------------------------------------------------------------------------------------------


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    # The projection runs in the autocast dtype when autocast is on, as TRL's fused head does.
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def _project(hidden: Tensor, weight: Tensor, bias: Tensor | None, logit_scale: float, softcap: float | None) -> Tensor:
    """LM-head logits of a row chunk, before the temperature.

    Args:
        hidden: ``[n, H]`` in the compute dtype.
        weight: ``[V, H]`` in the compute dtype.
        bias: ``[V]`` or None.
        logit_scale: multiplies the logits (1.0 for most models).
        softcap: ``softcap * tanh(z / softcap)`` after the scale (Gemma-style soft-capping), or None.

    Returns:
        ``[n, V]`` logits, in the compute dtype when no scale or cap applies, else float32.
    """
    logits = torch.addmm(bias, hidden, weight.t()) if bias is not None else hidden @ weight.t()
    if logit_scale == 1.0 and softcap is None:
        return logits
    logits = logits.float() * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _rows_per_chunk(vocab_size: int) -> int:
    return max(1, LOGITS_CHUNK_ELEMENTS // max(vocab_size, 1))


class _GrpoExtLogProbs(torch.autograd.Function):
    """Stands in for TRL's ``ChunkedLogProbFunction`` (same arguments, same five outputs) while the pass runs.

    Forward: per row chunk, the LM-head logits and :func:`grpo_ext.selective_log_softmax` (log-prob of the label,
    entropy when asked), with no graph kept. Backward: each chunk's logits are recomputed, the grpo_ext backward
    turns them into ``d/dlogits``, and the two gradient products are accumulated in float32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = ("log_probs",),
    ) -> tuple[Tensor, Tensor | None, None, None, None]:
        """Per-token log-probs (and entropy) of ``hidden @ weight.T + bias``.

        Args:
            ctx: autograd context.
            hidden: ``[N, H]`` hidden states (any float dtype).
            weight: ``[V, H]`` LM-head weight.
            bias: ``[V]`` LM-head bias or None.
            targets: ``[N]`` int64 label ids in ``[0, V)``.
            temperature: the logits are divided by it (> 0).
            chunk_size: TRL's vocabulary tile width; unused (grpo_ext reads whole rows).
            final_logit_softcapping: soft-cap of the scaled logits, or None.
            logit_scale: multiplies the logits before the cap.
            outputs: TRL's requested per-token fields; only ``log_probs`` and ``entropy`` are supported.

        Returns:
            ``(log_probs [N], entropy [N] or None, None, None, None)``, float32 (float64 for float64 inputs).
        """
        unsupported = sorted(set(outputs) - set(_LOG_PROB_OUTPUTS))
        if unsupported:
            raise ValueError(
                f"outputs={outputs!r}: grpo_ext.integrations.trl computes only {_LOG_PROB_OUTPUTS}, not {unsupported}"
            )
        ctx.set_materialize_grads(False)  # entropy is often logged only; a None gradient skips its term
        want_entropy = "entropy" in outputs
        dtype = _compute_dtype(hidden)
        ctx.compute_dtype, ctx.temperature = dtype, float(temperature)
        ctx.softcap, ctx.logit_scale, ctx.want_entropy = final_logit_softcapping, float(logit_scale), want_entropy
        ctx.save_for_backward(hidden, weight, bias, targets)

        logps_chunks: list[Tensor] = []
        entropy_chunks: list[Tensor] = []
        rows = _rows_per_chunk(weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            weight_c = weight.to(dtype)
            bias_c = None if bias is None else bias.to(dtype)
            for start in range(0, hidden.shape[0], rows):
                logits = _project(
                    hidden[start : start + rows].to(dtype), weight_c, bias_c, ctx.logit_scale, ctx.softcap
                )
                chunk = ops.selective_log_softmax(
                    logits, targets[start : start + rows], temperature=ctx.temperature, return_entropy=want_entropy
                )
                logps_chunks.append(chunk.logps)
                if want_entropy:
                    entropy_chunks.append(chunk.entropy)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if not logps_chunks:  # no row to score (every label ignored): empty outputs, still part of the graph
            empty = hidden.new_zeros((0,), dtype=out_dtype)
            return empty, (empty.clone() if want_entropy else None), None, None, None
        logps = torch.cat(logps_chunks)
        entropy = torch.cat(entropy_chunks) if want_entropy else None
        return logps, entropy, None, None, None

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor | None, grad_entropy: Tensor | None, *unused: Any) -> tuple:
        hidden, weight, bias, targets = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if not ctx.want_entropy:
            grad_entropy = None
        nothing = (None,) * 9
        if (grad_logps is None and grad_entropy is None) or not (need_hidden or need_weight or need_bias):
            return nothing
        dtype = ctx.compute_dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias else None
        rows = _rows_per_chunk(weight.shape[0])
        # Under DeepSpeed ZeRO-3 the head is partitioned again by now: gather it for the recomputation.
        with _trl_utils.maybe_gather_lm_head_ctx(weight, bias), torch.autocast(hidden.device.type, enabled=False):
            weight_c = weight.to(dtype)
            bias_c = None if bias is None else bias.to(dtype)
            weight_acc = weight_c.to(acc) if need_hidden else None  # once, not per chunk
            for start in range(0, hidden.shape[0], rows):
                stop = start + rows
                hidden_c = hidden[start:stop].to(dtype)
                raw = _project(hidden_c, weight_c, bias_c, 1.0, None).detach().requires_grad_(True)
                with torch.enable_grad():
                    logits = raw if ctx.logit_scale == 1.0 and ctx.softcap is None else None
                    if logits is None:  # the scale / cap is differentiated by autograd, from the raw logits
                        logits = raw.float() * ctx.logit_scale
                        if ctx.softcap is not None:
                            logits = ctx.softcap * torch.tanh(logits / ctx.softcap)
                    chunk = ops.selective_log_softmax(
                        logits,
                        targets[start:stop],
                        temperature=ctx.temperature,
                        return_entropy=grad_entropy is not None,
                    )
                    terms, seeds = [], []
                    if grad_logps is not None:
                        terms.append(chunk.logps)
                        seeds.append(grad_logps[start:stop].to(chunk.logps.dtype))
                    if grad_entropy is not None:
                        terms.append(chunk.entropy)
                        seeds.append(grad_entropy[start:stop].to(chunk.entropy.dtype))
                    (grad_raw,) = torch.autograd.grad(terms, raw, seeds)
                grad_raw = grad_raw.to(acc)
                if grad_hidden is not None:
                    grad_hidden[start:stop].addmm_(grad_raw, weight_acc)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_raw.t(), hidden_c.to(acc))
                if grad_bias is not None:
                    grad_bias += grad_raw.sum(dim=0)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            *nothing[3:],
        )


@contextlib.contextmanager
def _log_probs_through_grpo_ext() -> Iterator[None]:
    """While open, TRL's fused LM head computes its per-token log-probs and entropy with grpo_ext.

    TRL 1.16's ``add_fused_lm_head`` forward looks ``_ChunkedLogProbFunction`` up in ``trl.trainer.utils`` at call
    time; swapping that one name keeps the rest of the forward (backbone, PEFT, multimodal inputs, FSDP gathers,
    label masking) TRL's own, and is undone on exit, so other TRL trainers in the process are unaffected.
    """
    previous = _trl_utils._ChunkedLogProbFunction
    _trl_utils._ChunkedLogProbFunction = _GrpoExtLogProbs
    try:
        yield
    finally:
        _trl_utils._ChunkedLogProbFunction = previous


# ---------------------------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _forwarded_input_names() -> tuple[str, ...]:
    params = inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies).parameters
    return tuple(name for name in params if name not in _BUILT_ARGUMENTS)


def _global_mean(trainer: trl.GRPOTrainer, local_sum: Tensor, local_count: Tensor) -> float:
    """``sum / max(count, 1)`` over every process (TRL's reduction of its mean metrics)."""
    totals = trainer.accelerator.reduce(torch.stack([local_sum.float(), local_count.float()]), reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def _is_weights(trainer: trl.GRPOTrainer, inputs: dict, logps: Tensor, old_logps: Tensor | None, entropies: Tensor,
                mask: Tensor, advantages: Tensor) -> Tensor | None:  # fmt: skip
    """TRL's factors on the policy term only, multiplied into grpo_ext's ``is_weights`` (``[B, T]`` or ``[B, 1]``).

    TRL multiplies its per-token policy loss, before adding the KL, by the high-entropy token mask
    (``top_entropy_quantile``), the DeepSeek-V3.2 off-policy sequence mask (``off_policy_mask_threshold``) and the
    vLLM importance-sampling ratio; none of them is differentiated, which is what ``is_weights`` means in the spec.
    """
    factors: list[Tensor] = []
    if trainer.top_entropy_quantile < 1.0:
        factors.append(trainer.get_high_entropy_mask(entropies.detach(), mask, 1 - trainer.top_entropy_quantile))
    if trainer.off_policy_mask_threshold is not None:
        old = logps.detach() if old_logps is None else old_logps
        rows_advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
        factors.append(
            trainer.get_off_policy_mask(
                advantages=rows_advantages,
                per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask,
                off_policy_threshold=trainer.off_policy_mask_threshold,
            )
        )
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        factors.append(inputs["importance_sampling_ratio"])
    weights = None
    for factor in factors:
        factor = factor.detach().to(torch.float32)
        weights = factor if weights is None else weights * factor
    return weights


def _log_metrics(trainer: trl.GRPOTrainer, mode: str, metrics: dict[str, Tensor], logps: Tensor,
                 old_logps: Tensor | None, entropies: Tensor, mask: Tensor, advantages: Tensor) -> None:  # fmt: skip
    """Appends TRL's loss metrics, under TRL's names and cross-process reductions, to ``trainer._metrics[mode]``.

    The means come from grpo_ext's fused metrics (local mean times local count, summed over processes);
    ``clip_ratio/low_min`` and ``clip_ratio/high_max`` (extremes over rows) are computed here from the detached ratio.
    """
    log = trainer._metrics[mode]
    maskf = mask.to(torch.float32)
    token_count = maskf.sum()
    rows_advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    sequence = trainer.importance_sampling_level == "sequence"
    # With one ratio and one advantage per row, TRL counts clip shares over rows (spec section 7).
    row_shares = sequence and rows_advantages.shape[1] == 1
    share_count = torch.tensor(float(mask.shape[0]), device=mask.device) if row_shares else token_count

    def share(name: str) -> float:
        return _global_mean(trainer, metrics[name] * share_count, share_count)

    if trainer.beta != 0.0:
        log["kl"].append(_global_mean(trainer, metrics["kl"] * token_count, token_count))
    log["entropy"].append(_global_mean(trainer, (entropies.detach() * maskf).sum(), token_count))
    if trainer.loss_type == "cispo":
        log["cispo_clip_ratio"].append(share("cispo_clip_ratio"))
        return
    if trainer.loss_type not in _CLIP_FAMILY:  # TRL logs no clip metric for sapo
        return
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        log[name].append(share(name))

    with torch.no_grad():
        current = logps.detach()
        log_ratio = current - (current if old_logps is None else old_logps)
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


def _compute_loss(trainer: trl.GRPOTrainer, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` contract, with the loss computed by :func:`grpo_ext.grpo_loss`.

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
    logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
        model,
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([prompt_mask, completion_mask], dim=1),
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=trainer.aux_loss_enabled,
        **forwarded,
    )
    advantages = inputs["advantages"]
    old_logps = inputs.get("old_per_token_logps")
    mode = "train" if trainer.model.training else "eval"
    # TRL averages micro-batches by scaling each loss (HF's own scaling is off); eval neither splits nor accumulates.
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1

    num_items, loss_scale = None, 1.0
    if trainer.loss_type in ("dapo", "cispo"):
        # TRL's denominator: the generation batch's token count per process, rescaled to one accumulation window.
        num_items = torch.as_tensor(inputs["num_items_in_batch"], dtype=torch.float32, device=logps.device)
        num_items = num_items.clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            num_items = num_items * accumulation / trainer.args.steps_per_generation
    else:
        loss_scale = 1.0 / accumulation

    out = ops.grpo_loss(
        logps,
        advantages,
        mask,
        old_logps=old_logps,
        ref_logps=inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
        is_weights=_is_weights(trainer, inputs, logps, old_logps, entropies, mask, advantages),
        loss_type=trainer.loss_type,
        epsilon=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,  # resolved by TRL (None -> epsilon), also as cispo's cap
        delta=trainer.args.delta,
        beta=trainer.beta,
        kl_estimator="k3",  # TRL's only estimator
        use_bias_correction_kl=trainer.args.use_bias_correction_kl,
        importance_sampling_level=trainer.importance_sampling_level,
        max_completion_length=trainer.max_completion_length,
        num_items_in_batch=num_items,
        sapo_temperature_pos=trainer.args.sapo_temperature_pos,
        sapo_temperature_neg=trainer.args.sapo_temperature_neg,
        loss_scale=loss_scale,
    )
    loss = out.loss
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accumulation
        trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    _log_metrics(trainer, mode, out.metrics, logps, old_logps, entropies, mask, advantages)
    return loss


# ---------------------------------------------------------------------------------------------------------------
# the two ways in
# ---------------------------------------------------------------------------------------------------------------


class GRPOExtTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss and log-prob passes run on grpo_ext; same constructor and ``trl.GRPOConfig``.

    Raises:
        RuntimeError: the installed TRL is not a supported release (see :func:`check_trl_version`).
        ValueError: ``args`` asks for something grpo_ext does not compute (``loss_type="vespo"``, the entropy bonus),
            before the model is loaded when ``args`` is given.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_trl_version()
        try:
            config = (
                inspect.signature(trl.GRPOTrainer.__init__).bind_partial(self, *args, **kwargs).arguments.get("args")
            )
        except TypeError:
            config = None  # let TRL's constructor report the bad call
        if config is not None:
            _check_config(config)
        super().__init__(*args, **kwargs)
        _check_config(self.args)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        with _log_probs_through_grpo_ext():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        return _compute_loss(self, model, inputs)


def patch(trainer: trl.GRPOTrainer) -> trl.GRPOTrainer:
    """Makes an existing ``trl.GRPOTrainer`` compute its loss and log-prob passes with grpo_ext, in place.

    Only this instance changes (its ``_compute_loss`` and ``_get_per_token_logps_and_entropies``); a subclass's own
    ``_get_per_token_logps_and_entropies`` is kept and wrapped. Patching twice is a no-op.

    Args:
        trainer: a ``trl.GRPOTrainer`` (or subclass) instance.

    Returns:
        The same trainer.

    Raises:
        TypeError: ``trainer`` is not a ``trl.GRPOTrainer``.
        RuntimeError: the installed TRL is not a supported release.
        ValueError: its config asks for something grpo_ext does not compute (``loss_type="vespo"``, entropy bonus).
    """
    if not isinstance(trainer, trl.GRPOTrainer):
        raise TypeError(f"trainer must be a trl.GRPOTrainer, got {type(trainer).__name__}")
    check_trl_version()
    _check_config(trainer.args)
    if is_patched(trainer):
        return trainer
    original = trainer._get_per_token_logps_and_entropies

    @functools.wraps(original)
    def per_token_logps_and_entropies(*args: Any, **kwargs: Any):
        with _log_probs_through_grpo_ext():
            return original(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    trainer._compute_loss = types.MethodType(_compute_loss, trainer)
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
    return trainer


def is_patched(trainer: trl.GRPOTrainer) -> bool:
    """Whether ``trainer`` computes its loss with grpo_ext (a ``GRPOExtTrainer`` or a patched instance)."""
    return isinstance(trainer, GRPOExtTrainer) or bool(trainer.__dict__.get(_PATCH_MARK, False))
