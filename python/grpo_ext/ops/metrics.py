"""The metrics vector of the native loss ops, as TRL names its metrics (docs/math.md section 7)."""

from __future__ import annotations

from torch import Tensor

from ..validation.options import LOSS_TYPES, LossOptions

# Slots of the metrics vector the forward kernels return (csrc/grpo_loss_math.h, MetricSlot).
METRIC_KL, METRIC_LOW, METRIC_HIGH, METRIC_REGION, METRIC_CISPO, METRIC_VESPO_PHI = range(6)
NUM_METRICS = 6


def _metric_layout(has_kl: bool, loss_type: str) -> tuple[tuple[str, int], ...]:
    """``(TRL's name, slot)`` of each metric a call reports: which exist depends on ``beta != 0`` and the loss type."""
    layout = [("kl", METRIC_KL)] if has_kl else []
    if loss_type == "cispo":
        layout.append(("cispo_clip_ratio", METRIC_CISPO))
    elif loss_type == "vespo":  # TRL logs no clip share for vespo
        layout.append(("vespo/phi_seq_mean", METRIC_VESPO_PHI))
    else:
        layout += [("clip_ratio/low_mean", METRIC_LOW), ("clip_ratio/high_mean", METRIC_HIGH),
                   ("clip_ratio/region_mean", METRIC_REGION)]  # fmt: skip
    return tuple(layout)


# Every layout, built once (metrics_dict runs on every call, also under torch.compile).
_METRIC_LAYOUTS = {(has_kl, loss_type): _metric_layout(has_kl, loss_type)
                   for has_kl in (False, True) for loss_type in LOSS_TYPES}  # fmt: skip


def metrics_dict(metrics: Tensor, options: LossOptions, entropy: Tensor | None = None) -> dict[str, Tensor]:
    """The metrics vector as a dict under TRL's names (docs/math.md section 7).

    Args:
        metrics: ``[6]`` vector of the native forward (float32, float64 for float64 inputs).
        options: the options of the call (``beta`` and ``loss_type`` decide which metrics exist).
        entropy: 0-dim mean entropy over the kept tokens, for the losses from logits.

    Returns:
        ``kl`` (when ``beta != 0``), ``cispo_clip_ratio`` (cispo), ``vespo/phi_seq_mean`` (vespo) or
        ``clip_ratio/{low,high,region}_mean``, and ``entropy`` when given; 0-dim views of ``metrics``.
    """
    slots = metrics.unbind()  # one call for every 0-dim view
    out = {name: slots[slot] for name, slot in _METRIC_LAYOUTS[options.beta != 0, options.loss_type]}
    if entropy is not None:
        out["entropy"] = entropy
    return out
