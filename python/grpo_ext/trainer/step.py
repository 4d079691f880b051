"""One optimizer step of :class:`~grpo_ext.trainer.trainer.GRPOTrainer`: gradient accumulation and the update.

:class:`OptimizerStepMixin` holds ``_training_step``: it draws ``gradient_accumulation_steps`` queued micro-batches,
counts the tokens entering the loss over all ranks, scales each micro-batch's loss (and the entropy bonus) so that the
ranks' averaged gradient is that of the global step, runs each micro-batch's forward and backward (the GRPO loss
itself comes from the trainer's ``_loss_options`` and ``_micro_batch_loss`` hooks) with the gradient all-reduce only on
the last one (``_grad_sync``), then clips, steps the optimizer and the schedule (skipping the update on a non-finite
loss or gradient norm) and returns the step's metrics, the same on every rank.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from ..validation.options import TOKEN_LEVEL_LOSS_TYPES
from . import distributed as dist_utils
from .guards import is_finite_step
from .metrics import StepMetrics
from .optimizer import scheduler_step


class OptimizerStepMixin:
    """The optimization part of :class:`~grpo_ext.trainer.trainer.GRPOTrainer` (see the module docstring)."""

    def _grad_sync(self, enabled: bool) -> AbstractContextManager:
        """Context of one micro-batch's forward and backward: gradients are reduced across ranks only if enabled."""
        if self.use_fsdp:
            self.model.set_requires_gradient_sync(enabled)
            return nullcontext()
        if enabled or self._train_model is self.model:
            return nullcontext()
        return self._train_model.no_sync()  # DDP: accumulate locally, all-reduce with the last micro-batch

    def _training_step(self) -> dict[str, float]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns its metrics.

        The metrics are those of the global step: summed over ranks, token-weighted (``kl``, clip ratios: each
        micro-batch's share weighted by its tokens, or rows for sequence-level ratios), the same on every rank.
        """
        cfg = self.config
        micro = [self._next_micro_batch() for _ in range(cfg.gradient_accumulation_steps)]
        use_sample_mask = cfg.beta != 0 and cfg.mask_zero_std_groups

        def kept_rows(mb: dict[str, Any]) -> Tensor | None:
            """``[B]`` bool: the rows of ``mb`` entering the loss, or None when zero-std rows are not masked."""
            return ~mb["zero_std"] if use_sample_mask else None

        def loss_tokens(mb: dict[str, Any]) -> Tensor:
            """The number of ``mb``'s tokens entering the loss (int64 scalar)."""
            mask = mb["completion_mask"]
            return (mask & kept_rows(mb).unsqueeze(1) if use_sample_mask else mask).sum()

        # Tokens entering the loss (masked zero-std rows excluded): this rank's per micro-batch, [M] int64, and the
        # whole step's on all ranks (one all-reduce, one host sync per step).
        counts = torch.stack([loss_tokens(mb) for mb in micro]).long()
        total_tokens = dist_utils.all_reduce_sum(counts.sum().reshape(1))
        counts_list = counts.tolist()
        step_tokens = max(int(total_tokens.item()), 1)

        # Loss scaling. DDP and FSDP average the gradients of the W ranks, so each rank's loss is W times its
        # share of the loss of the global step (M micro-batches on each of W ranks):
        # - grpo, sapo, luspo, dr_grpo: the op divides by the micro-batch's rows B (dr_grpo: B * max_completion_length),
        #   the same on every rank; the global denominator is M * W * B, so loss_scale = W / (M * W) = 1 / M.
        # - dapo, cispo: num_items_in_batch is the step's token count over all ranks and micro-batches; loss_scale = W.
        # - bnpo: the op divides by the micro-batch's own tokens n_k; loss_scale = W * n_k / N turns that into / N.
        num_micro, world = len(micro), self.world_size
        token_level = cfg.loss_type in TOKEN_LEVEL_LOSS_TYPES

        def scale_of(k: int) -> float:
            """``loss_scale`` of micro-batch ``k``."""
            if token_level:
                return float(world)
            if cfg.loss_type == "bnpo":
                return world * counts_list[k] / step_tokens
            return 1.0 / num_micro

        # The entropy bonus: entropy_coef times the mean entropy over the step's N kept tokens, so each token's entropy
        # weighs W * entropy_coef / N on its rank (the ranks' gradients are averaged, as for the loss).
        bonus_per_token = world * cfg.entropy_coef / step_tokens

        self._train_model.train()
        # sequence level: the clip ratios are shares of rows (docs/math.md section 7)
        per_row_ratios = cfg.importance_sampling_level == "sequence"
        sums = StepMetrics(per_row_ratios, self.device)
        for k, mb in enumerate(micro):
            options = self._loss_options(mb, kept_rows(mb), step_tokens if token_level else None, scale_of(k))
            with self._grad_sync(k == num_micro - 1):
                out, entropy = self._micro_batch_loss(mb, options, bonus_per_token * counts_list[k])
                out.loss.backward()
            sums.add(out, entropy, mb["completion_mask"].shape[0], counts_list[k])
        row_total = world * num_micro * micro[0]["completion_mask"].shape[0]
        metrics, loss_sum, entropy_mean = sums.reduce(step_tokens, row_total)

        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = dist_utils.clip_grad_norm(params, cfg.max_grad_norm, self.use_fsdp)
        learning_rate = self.lr_scheduler.get_last_lr()[0]
        loss = loss_sum / world
        # A non-finite loss or gradient norm (global numbers: every rank decides alike) skips the update, never a
        # NaN model; the schedule still follows the step.
        skipped = not is_finite_step(loss, grad_norm)
        if not skipped:
            self.optimizer.step()
        scheduler_step(self.lr_scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.record(self.global_step + 1, loss, grad_norm, skipped)

        if self.beta != 0:
            metrics["beta"] = self.beta
        if cfg.kl_target is not None and not skipped:
            self._update_beta(metrics["kl"])  # a global kl: beta stays the same on every rank
        metrics.update(loss=loss, grad_norm=grad_norm, learning_rate=learning_rate, entropy=entropy_mean)
        return metrics
