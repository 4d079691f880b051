"""TRL 1.16's own kernels as peers of ``bench_floor.py`` (issue 38 item 3): its Triton log-prob + entropy kernel,
its ``add_fused_lm_head`` path run from given hidden states, and the loss ``GRPOTrainer`` computes from their
log-probs. Each returns ``(None, why)`` where TRL or its device cannot run it, so that the table gets an n/a row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import fused_loss
from harness import peers
from logits_inputs import TEMPERATURE
from trl_style import trl_style_loss

Step = Callable[[], Any]


TRL_INSTALL = "pip install trl==1.16.0"


def trl_triton_kernel(device: torch.device) -> tuple[Callable[..., tuple[Tensor, Tensor]] | None, str | None]:
    """TRL 1.16's Triton log-prob + entropy kernel (``trl.kernels.selective_log_softmax_and_entropy``), or
    ``(None, why)``: it needs a CUDA device (TRL's own entry point falls back to eager PyTorch elsewhere)."""
    if device.type != "cuda":
        return None, "TRL's Triton log-prob + entropy kernel needs a CUDA device"
    try:
        from trl.kernels import selective_log_softmax_and_entropy
    except Exception as exc:  # TRL missing, or its kernels without Triton
        return None, f"trl's Triton kernel unavailable ({peers.short_reason(exc)}); {TRL_INSTALL}"
    return selective_log_softmax_and_entropy, None


def trl_loss(logps: Tensor, entropy: Tensor, inputs: dict[str, Any], beta: float) -> tuple[Tensor, Tensor]:
    """The loss TRL 1.16's ``GRPOTrainer`` computes from its per-token log-probs at the benchmark's settings (dapo,
    ``beta`` against the ref log-probs: ``trl_style.trl_style_loss``, its metrics included), and its entropy metric
    (the kept tokens' mean, not differentiated): ``(loss, mean_entropy)``, both 0-dim float32."""
    mask = inputs["mask"]
    loss, _ = trl_style_loss(logps, inputs["old_logps"], inputs["ref_logps"], inputs["advantages"], mask,
                             loss_type=fused_loss.LOSS_TYPE, beta=beta)  # fmt: skip
    return loss, (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)


@functools.cache
def trl_head_class() -> type:
    """A ``transformers`` causal LM whose backbone hands back the hidden states it is given, and whose LM head is
    ``weight``: what TRL's ``add_fused_lm_head`` patches, so that its path runs from given hidden states."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutput

    class Backbone(torch.nn.Module):
        def forward(self, hidden_states: Tensor, **_: Any) -> BaseModelOutput:
            return BaseModelOutput(last_hidden_state=hidden_states)

    class HiddenStatesLM(PreTrainedModel):
        config_class = PretrainedConfig
        base_model_prefix = "backbone"  # add_fused_lm_head runs `model.base_model`, this module

        def __init__(self, weight: Tensor):
            super().__init__(PretrainedConfig())
            self.backbone = Backbone()
            self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            self.lm_head.weight = torch.nn.Parameter(weight)  # shares weight's storage

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

        def forward(self, hidden_states: Tensor, **_: Any) -> Any:  # replaced by add_fused_lm_head's forward
            raise NotImplementedError("call with fused_lm_head=True")

    return HiddenStatesLM


def trl_fused_head_step(hidden: Tensor, weight: Tensor, inputs: dict[str, Any],
                        beta: float) -> tuple[Step | None, str | None]:  # fmt: skip
    """TRL 1.16's ``add_fused_lm_head`` path from ``hidden`` (a leaf), or ``(None, why)``.

    The model is patched as ``GRPOTrainer`` patches it (``outputs=("log_probs", "entropy")``, the temperature) and
    called with ``fused_lm_head=True`` and the completion ids as pre-shifted labels (``shift_labels``; -100 where
    masked: the hidden states are already aligned with the ids). TRL's forward projects the kept positions only on
    a Triton device, every position elsewhere, in tiles of 4096 tokens x 32768 vocabulary entries
    (``trl.kernels.ChunkedLogProbFunction``); then :func:`trl_loss`. The step returns the loss, its gradients w.r.t.
    hidden and weight, and the per-token entropies.
    """
    try:
        from trl.trainer.utils import add_fused_lm_head

        model = trl_head_class()(weight.detach())
        add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    except Exception as exc:  # TRL or transformers missing, or an add_fused_lm_head of another shape
        return None, f"trl's add_fused_lm_head unavailable ({peers.short_reason(exc)}); {TRL_INSTALL}"
    leaves = (hidden, model.lm_head.weight)
    labels = inputs["ids"].masked_fill(inputs["mask"] == 0, -100)

    def step():
        out = model(hidden_states=hidden, shift_labels=labels, fused_lm_head=True)
        loss, _ = trl_loss(out.log_probs, out.entropy, inputs, beta)
        return (loss, *torch.autograd.grad(loss, leaves), out.entropy.detach())

    return step, None
