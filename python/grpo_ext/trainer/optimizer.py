"""GRPOTrainer's optimizer: AdamW over the trainable parameters and its learning-rate schedule, stepped with the
global step."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from .config import GRPOConfig


def build_optimizer(model: torch.nn.Module, config: GRPOConfig) -> tuple[torch.optim.AdamW, Any]:
    """AdamW over ``model``'s trainable parameters and the learning-rate schedule of ``config``.

    The schedule is a ``transformers`` LambdaLR over ``max_steps`` with ``warmup_steps`` (or ``warmup_ratio``) of
    warm-up; a resumed run moves it to the checkpoint's step (:meth:`CheckpointManager.load`).

    AdamW is torch's fused kernel where every parameter allows it (transformers' default optimizer on torch >= 2.8,
    so what TRL users get): torch's default on the CPU updates one parameter at a time with a temporary the size of
    each, which made the step's optimizer 2-3x slower than TRL's and its peak one embedding matrix higher
    (benchmarks/RESULTS.md, "The step as TRL ships it"). Elsewhere (a device or dtype the fused kernel refuses) the
    default implementation.
    """
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    options = {
        "lr": config.learning_rate, "betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_epsilon,
        "weight_decay": config.weight_decay,
    }  # fmt: skip
    try:
        optimizer = torch.optim.AdamW(params, fused=True, **options)
    except RuntimeError:  # torch names the parameter's device or dtype that the fused kernel does not take
        optimizer = torch.optim.AdamW(params, **options)
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * config.max_steps)
    return optimizer, get_scheduler(
        config.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=config.max_steps
    )


def scheduler_step(lr_scheduler: Any) -> None:
    """``lr_scheduler.step()``, also where no ``optimizer.step()`` came first (a resume, a skipped step), which torch
    would warn about: the schedule follows the global step, whether or not the step updated the model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`", category=UserWarning)
        lr_scheduler.step()
