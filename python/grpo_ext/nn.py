"""``torch.nn`` modules: the fused LM-head GRPO loss with Liger-Kernel's ``LigerFusedLinearGRPOLoss`` interface.

A Liger user swaps one import::

    from grpo_ext.nn import FusedLinearGRPOLoss as LigerFusedLinearGRPOLoss

The constructor takes Liger's arguments (``beta``, ``compiled``, ``use_ref_model``, ``chunk_size``,
``epsilon_low``, ``epsilon_high``, ``loss_type``, ``max_completion_length``, ``importance_sampling_level``,
``sapo_temperature_pos``, ``sapo_temperature_neg``, ``temperature``; and grpo_ext's ``entropy_coef``),
``forward`` Liger's positional arguments, and it returns Liger's ``(loss, metrics)``. The computation is
:func:`grpo_ext.grpo_loss_from_hidden`; reference log-probs from ``ref_input``/``ref_weight`` are computed chunk by
chunk in the same pass, under no_grad.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .ops.grpo_loss_from_hidden import hidden_loss
from .ops.options import LossOptions, with_loss_options_doc
from .validation import check_bool, check_finite, check_non_negative

__all__ = ["FusedLinearGRPOLoss"]

#: Loss options the module sets itself: from forward's arguments, or from a constructor argument Liger names
#: otherwise (``epsilon_low``); ``**options`` may not pass them.
_SET_BY_MODULE = frozenset({"old_logps", "ref_logps", "sample_mask", "beta", "epsilon", "epsilon_high", "loss_type"})

#: The metric Liger's tuple holds in ``clip_ratio``'s place, by loss type (otherwise ``clip_ratio/region_mean``):
#: cispo's clip share, and vespo's mean weight ``phi`` (it clips nothing; TRL logs ``vespo/phi_seq_mean`` where it
#: logs the other loss types' clip ratios).
_CLIP_METRIC = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}


class FusedLinearGRPOLoss(torch.nn.Module):
    """Fused linear layer + GRPO loss, a drop-in for Liger-Kernel's ``LigerFusedLinearGRPOLoss``.

    Differences from Liger, all documented choices: ``chunk_size`` counts sequences as in Liger (a chunk is
    ``chunk_size * T`` kept token rows, or grpo_ext's automatic size when None); ``compiled`` is accepted and ignored
    (the kernels are native); ``max_completion_length`` defaults to ``T`` for ``dr_grpo`` instead of raising; with
    ``importance_sampling_level="sequence"`` the clip ratio is a share of rows, as TRL logs it (docs/math.md section 7);
    every grpo_ext loss type is taken, ``vespo`` (not in Liger) included, which returns its ``vespo/phi_seq_mean`` in
    the clip ratio's place (``forward``).

    Args:
        beta: KL coefficient (Liger's default 0.04).
        compiled: accepted for Liger compatibility; unused.
        use_ref_model: use the reference log-probs (``ref_per_token_logps`` or ``ref_input``/``ref_weight``) for the
            KL term; when False, or when no reference is given, the KL term is zero (as in Liger).
        chunk_size: sequences per chunk of the LM head: ``chunk_size * T`` kept token rows (the masked ones cost
            no GEMM work); None: grpo_ext's automatic chunk (``ops.lm_head.default_chunk_size``).
        epsilon_low: lower clip ``1 - epsilon_low`` (grpo_ext's ``epsilon``).
        epsilon_high: upper clip ``1 + epsilon_high``; for ``cispo`` the absolute ratio cap.
        loss_type: one of ``LOSS_TYPES`` (:mod:`grpo_ext.ops.options`), as :func:`grpo_ext.grpo_loss` takes it
            (default ``dapo``, Liger's).
        max_completion_length: ``dr_grpo``'s denominator.
        importance_sampling_level: ``token`` or ``sequence`` (GSPO).
        sapo_temperature_pos: SAPO temperature for positive advantages.
        sapo_temperature_neg: SAPO temperature for non-positive advantages.
        temperature: logits are divided by it (policy and reference alike).
        entropy_coef: the entropy bonus (TRL's ``entropy_coef``; not in Liger): ``loss - entropy_coef * H``, ``H``
            the mean entropy over the kept tokens, its gradient fused (docs/math.md section 5, "Entropy bonus").
        **options: the other loss options of :func:`grpo_ext.grpo_loss`, keywords only
            (:class:`~grpo_ext.ops.options.LossOptions`, each listed below from its definition there).
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int | None = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        entropy_coef: float = 0.0,
        **options,
    ) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(_FORWARDED_OPTIONS))
        if unknown:
            raise TypeError(f"FusedLinearGRPOLoss() got unexpected keyword argument(s) {unknown}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):  # fmt: skip
            raise ValueError(f"chunk_size must be None or a positive int (sequences per chunk), got {chunk_size!r}")
        # checked here, not only in forward: without a reference the loss never reads beta, and a bad one would pass
        self.beta = check_non_negative("beta", check_finite("beta", beta))
        self.compiled = check_bool("compiled", compiled)
        self.use_ref_model = check_bool("use_ref_model", use_ref_model)
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.entropy_coef = entropy_coef
        self.options = options

    def forward(
        self,
        _input: Tensor,
        lin_weight: Tensor,
        selected_token_ids: Tensor,
        attention_mask: Tensor,
        advantages: Tensor,
        bias: Tensor | None = None,
        ref_per_token_logps: Tensor | None = None,
        old_per_token_logps: Tensor | None = None,
        ref_input: Tensor | None = None,
        ref_weight: Tensor | None = None,
        ref_bias: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The loss of one batch (Liger's ``forward``).

        Args:
            _input: ``[B, T, H]`` policy hidden states (float32/bfloat16/float16), aligned with the ids.
            lin_weight: ``[V, H]`` LM-head weight.
            selected_token_ids: ``[B, T]`` int64 sampled ids.
            attention_mask: ``[B, T]`` completion mask.
            advantages: ``[B]`` (or ``[B, T]``).
            bias: ``[V]`` LM-head bias or None.
            ref_per_token_logps: ``[B, T]`` reference log-probs, or None.
            old_per_token_logps: ``[B, T]`` log-probs of the sampling policy, or None (on-policy).
            ref_input: ``[B, T, H']`` reference hidden states, used when ``ref_per_token_logps`` is None.
            ref_weight: ``[V, H']`` reference LM-head weight (with ``ref_input``).
            ref_bias: ``[V]`` reference LM-head bias or None.

        Returns:
            ``(loss, metrics)``: the 0-dim loss (gradients to ``_input``, ``lin_weight`` and ``bias``) and, as in
            Liger, ``(kl, clip_ratio)`` when ``beta != 0``, else ``(clip_ratio,)``: ``clip_ratio`` is
            ``clip_ratio/region_mean``, ``cispo_clip_ratio`` for cispo, and for vespo, which clips nothing, its
            ``vespo/phi_seq_mean``: the mean of VESPO's weight ``phi`` (docs/math.md sections 3 and 7), not a share.
        """
        if _input.dim() != 3:
            raise ValueError(f"_input must be [B, T, H] (Liger's layout), got {tuple(_input.shape)}")
        length = _input.shape[1]
        ref_head = None
        ref_logps = None
        for name, value in (("ref_per_token_logps", ref_per_token_logps), ("old_per_token_logps", old_per_token_logps)):
            if value is not None and not isinstance(value, Tensor):
                raise ValueError(f"{name} must be a [B, T] tensor or None, got {type(value).__name__}")
        if self.beta != 0 and self.use_ref_model:
            if ref_per_token_logps is not None:
                ref_logps = ref_per_token_logps.detach()
            elif ref_input is not None or ref_weight is not None:
                if ref_input is None or ref_weight is None:
                    raise ValueError("ref_input and ref_weight must be given together")
                ref_head = (ref_input, ref_weight, ref_bias)
        has_kl = ref_logps is not None or ref_head is not None
        out = hidden_loss(
            _input, lin_weight, selected_token_ids, advantages, attention_mask,
            lm_head_bias=bias, temperature=self.temperature, entropy_coef=self.entropy_coef,
            chunk_size=None if self.chunk_size is None else self.chunk_size * length, ref_head=ref_head,
            old_logps=None if old_per_token_logps is None else old_per_token_logps.detach(), ref_logps=ref_logps,
            beta=self.beta if has_kl else 0.0, epsilon=self.epsilon_low, epsilon_high=self.epsilon_high,
            loss_type=self.loss_type, max_completion_length=self.max_completion_length,
            importance_sampling_level=self.importance_sampling_level,
            sapo_temperature_pos=self.sapo_temperature_pos, sapo_temperature_neg=self.sapo_temperature_neg,
            **self.options,
        )  # fmt: skip
        metrics = out.metrics
        clip = metrics[_CLIP_METRIC.get(self.loss_type, "clip_ratio/region_mean")]
        if self.beta == 0:
            return out.loss, (clip,)
        kl = metrics["kl"] if has_kl else torch.zeros_like(clip)  # Liger: no reference, KL[pi || sg(pi)] = 0
        return out.loss, (kl, clip)


#: The loss options ``**options`` takes: every option neither set by the module nor a constructor argument of its own.
_FORWARDED_OPTIONS: tuple[str, ...] = tuple(
    name for name in LossOptions._fields
    if name not in _SET_BY_MODULE and name not in inspect.signature(FusedLinearGRPOLoss.__init__).parameters
)  # fmt: skip
FusedLinearGRPOLoss.__doc__ = with_loss_options_doc(FusedLinearGRPOLoss.__doc__, "FusedLinearGRPOLoss",
                                                    _FORWARDED_OPTIONS)  # fmt: skip
