"""The loss options' public path, ``grpo_ext.ops.options``, kept for the users who import it.

The options and the value sets of every string option are defined once in :mod:`grpo_ext.validation.options`,
beside the checks and below the ops (the checks, the reference and the ops all import them from there); the native
ops' metrics vector is :mod:`grpo_ext.ops.metrics`. Both are re-exported here under their old names.
"""

from ..validation.options import *  # noqa: F403
from .metrics import (  # noqa: F401  # noqa: F401
    METRIC_CISPO,
    METRIC_HIGH,
    METRIC_KL,
    METRIC_LOW,
    METRIC_REGION,
    METRIC_VESPO_PHI,
    NUM_METRICS,
    metrics_dict,
)
