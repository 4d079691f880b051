"""Hypothesis-drawn problems on the emulated device: every loss option at once (tests/test_properties.py's
``loss_problems``), through the loss kernels (grpo_loss_forward and its backward) and through the whole fused loss
from logits (grpo_loss_from_logits: the pass, the loss, the entropy kernel), in float64, against the CPU kernels on
the same inputs (which the rest of the suite checks against the reference)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from grpo_ext.validation import validate_grpo_loss_args
from grpo_ext.validation.options import LossOptions
from test_properties import loss_problems

from .checks import check_op
from .test_logits import LOGITS_LOSS_NAMES, LOGITS_LOSS_TOL
from .test_loss import run_forward_backward

# Each draw runs the kernels under the harness's four schedules: a few dozen draws keep the file to seconds.
EMULATED = settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@EMULATED
@given(problem=loss_problems(seq_len_max=40))
def test_random_options_on_the_loss_kernels(emu, problem):
    logps, advantages, mask, options = problem
    resolved = validate_grpo_loss_args(logps, advantages, mask, LossOptions(**options))
    run_forward_backward(emu, (logps, advantages, mask, *resolved.op_args(), True))


@EMULATED
@given(
    problem=loss_problems(seq_len_max=5),
    vocab=st.integers(1, 300),
    temperature=st.sampled_from([1.0, 0.7]),
    logit=st.sampled_from([(1.0, 0.0), (0.6, 0.0), (1.0, 3.0)]),
    entropy_coef=st.sampled_from([0.0, 0.1]),
)
def test_random_options_on_the_fused_logits_loss(emu, problem, vocab, temperature, logit, entropy_coef):
    _, advantages, mask, options = problem
    batch, seq_len = mask.shape
    g = torch.Generator().manual_seed(vocab * 7 + seq_len)
    logits = 3 * torch.randn(batch * seq_len, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (batch * seq_len,), generator=g)
    resolved = validate_grpo_loss_args(torch.empty(mask.shape), advantages, mask, LossOptions(**options))
    args = (logits, ids, advantages, mask, *resolved.op_args(), temperature, *logit, entropy_coef, None, True)
    check_op(emu, "grpo_loss_from_logits", *args, tol=LOGITS_LOSS_TOL, names=LOGITS_LOSS_NAMES)
