"""grpo_ext.grpo_loss_from_logits at its edges (docs/math.md sections 2 and 8): masked rows never read (NaN or a
padding id there changes nothing), a kept NaN row stays NaN, bad ids and arguments as errors that name them, the
gradient at an exact clip bound; the kernels and the float64 reference alike."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close
from grpo_ext import reference
from grpo_ext.validation.options import LossOptions
from test_grpo_loss_from_logits import make_problem, run


@pytest.mark.parametrize("device", DEVICES)
def test_masked_rows_never_read_and_get_zero_gradient(device):
    logits, ids, adv, mask, old, _ = make_problem(seed=10)
    poisoned = logits.clone()
    poisoned[~mask] = float("nan")  # a masked row is never read, so its NaN cannot reach the loss
    expected, expected_grad = run(reference, logits, ids, adv, mask, old_logps=old)
    got, grad = run(grpo_ext, poisoned.float().to(device), ids.to(device), adv.float().to(device), mask.to(device),
                    old_logps=old.float().to(device))  # fmt: skip
    assert torch.isfinite(got.loss)
    assert_close(got.loss, expected.loss, rtol=2e-5, atol=2e-6)
    assert torch.count_nonzero(grad[~mask.to(device)]) == 0
    assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_rows_may_hold_padding_ids_and_unmasked_nan_propagates(device):
    logits, ids, adv, mask, old, _ = make_problem(seed=15)
    padded = ids.clone()
    padded[~mask] = -100  # a common padding id; masked rows are never read, so it is never looked up
    expected, expected_grad = run(reference, logits, ids, adv, mask, old_logps=old)
    got, grad = run(grpo_ext, logits.float().to(device), padded.to(device), adv.float().to(device), mask.to(device),
                    old_logps=old.float().to(device))  # fmt: skip
    assert_close(got.loss, expected.loss, rtol=2e-5, atol=2e-6)
    assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)
    # the reference takes them too (an outside audit, 2026-11-29: its gather raised "index -100 is out of bounds")
    padded_ref, padded_ref_grad = run(reference, logits, padded, adv, mask, old_logps=old)
    assert torch.equal(padded_ref.loss, expected.loss) and torch.equal(padded_ref_grad, expected_grad)
    if device == "cpu":  # in a row that counts it is an error (on CUDA a device-side assert, fatal to the context)
        padded[mask] = -100
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            run(grpo_ext, logits.float(), padded, adv.float(), mask)
    poisoned = logits.clone()
    poisoned[1, 0, 3] = float("nan")  # an unmasked row: the loss is NaN, as the reference's (never silently finite)
    assert torch.isnan(run(reference, poisoned, ids, adv, mask, old_logps=old)[0].loss)
    got, _ = run(grpo_ext, poisoned.float().to(device), ids.to(device), adv.float().to(device), mask.to(device),
                 old_logps=old.float().to(device))  # fmt: skip
    assert torch.isnan(got.loss)


def test_errors():
    logits, ids, adv, mask, *_ = make_problem(seed=14)
    with pytest.raises(ValueError, match="logits must have shape"):
        grpo_ext.grpo_loss_from_logits(logits[0, 0], ids, adv, mask)
    with pytest.raises(ValueError, match="completion_ids must have shape"):
        grpo_ext.grpo_loss_from_logits(logits, ids[:, :3], adv, mask)
    with pytest.raises(ValueError, match="logits must have shape \\[B, T, V\\] with"):
        grpo_ext.grpo_loss_from_logits(logits[:, :5], ids, adv, mask)
    with pytest.raises(ValueError, match="temperature"):
        grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, temperature=0)
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="logit_scale must be finite and > 0"):
            grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, logit_scale=bad)
        with pytest.raises(ValueError, match="logit_softcap must be finite and > 0"):
            grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, logit_softcap=bad)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logps is required"):
        grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, beta=0.1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, epsilon_hi=0.3)
    bad_ids = ids.clone()
    bad_ids[2, 1] = 50
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        grpo_ext.grpo_loss_from_logits(logits, bad_ids, adv, mask)


def test_native_op_needs_one_logits_row_per_token():
    # The op itself (below the Python checks): fewer logits rows than B*T tokens is an error naming both counts, not a
    # loss over rows that were never written.
    from grpo_ext.validation.loss import validate_grpo_loss_args
    from grpo_ext.validation.options import LogitOptions

    mask, adv = torch.ones(2, 3), torch.ones(2)
    option_args = validate_grpo_loss_args(torch.zeros(2, 3), adv, mask, LossOptions()).op_args()
    logits, ids = torch.randn(5, 7), torch.zeros(5, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"one row per token of completion_mask \(B\*T=6\), got 5 rows"):
        torch.ops.grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, *option_args, *LogitOptions().op_args(), 0.0,
                                                 None, False)  # fmt: skip


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inplace", "sequence"])
def test_bad_id_error_names_the_first_kept_row(mode):
    # The row loop notes bad ids as it goes (the in-place pass checks them all before writing): either way the error
    # names the first kept row with one, whatever row a thread met first, and a masked row's id is never looked at.
    logits, ids, adv, mask, old, _ = make_problem(batch=4, length=6, vocab=50, seed=21)
    mask[2] = True
    mask[3, 0] = False
    bad = ids.clone()
    bad[3, 0] = -7  # masked: ignored
    bad[3, 4] = 50  # kept, later
    bad[2, 5] = 51  # kept, first (row 2 * 6 + 5 = 17)
    x = logits.float().clone()
    kwargs = dict(old_logps=old.float(), importance_sampling_level="sequence" if mode == "sequence" else "token")
    with pytest.raises(RuntimeError, match=r"ids\[17\]=51 is outside the vocabulary \[0, 50\)"):
        if mode == "no_grad":
            with torch.no_grad():
                grpo_ext.grpo_loss_from_logits(x, bad, adv.float(), mask, **kwargs)
        elif mode == "inplace":
            head = x.clone().requires_grad_(True)
            grpo_ext.grpo_loss_from_logits(head * 1.0, bad, adv.float(), mask, inplace_grad=True, **kwargs)
        else:
            grpo_ext.grpo_loss_from_logits(x.requires_grad_(True), bad, adv.float(), mask, **kwargs)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reference_never_reads_masked_rows_and_keeps_nan_rows_nan(level):
    """The reference (a documented fallback) follows the contract as the kernels do: NaN logits in masked rows give
    a zero gradient there and change nothing; a kept NaN row makes the loss and the entropy NaN (not 0)."""
    logits, ids, adv, mask, old, _ = make_problem(seed=16)
    kwargs = dict(old_logps=old, importance_sampling_level=level)
    clean, clean_grad = run(reference, logits, ids, adv, mask, **kwargs)
    masked_nan = logits.clone()
    masked_nan[~mask] = float("nan")
    for impl in (reference, grpo_ext):
        got, grad = run(impl, masked_nan, ids, adv, mask, **kwargs)
        assert torch.isfinite(grad).all() and torch.count_nonzero(grad[~mask]) == 0, impl.__name__
        assert_close(got.loss, clean.loss, rtol=1e-12, atol=1e-12)
        assert_close(got.metrics["entropy"], clean.metrics["entropy"], rtol=1e-12, atol=1e-12)
        assert_close(grad, clean_grad, rtol=1e-10, atol=1e-12)
    kept_nan = logits.clone()
    kept_nan[1, 2, 7] = float("nan")  # row 1 is fully kept
    for impl in (reference, grpo_ext):
        got, _ = run(impl, kept_nan, ids, adv, mask, **kwargs)
        assert torch.isnan(got.loss) and torch.isnan(got.metrics["entropy"]), impl.__name__


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bf16"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("clip", [dict(epsilon=0.0), dict(epsilon_high=0.0)], ids=["epsilon_0", "epsilon_high_0"])
def test_gradient_passes_at_an_exact_clip_bound(clip, level, dtype):
    """On-policy rho = 1 exactly is a clip bound when epsilon or epsilon_high is 0 (docs/math.md section 8, "Bounds and
    ties"): the whole gradient passes, d loss / d l = -A / (B * T) per token (full mask), through the softmax as
    (onehot - softmax(x)) / temperature, in the kernel and the reference alike."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64).to(dtype)
    ids = torch.tensor([[0, 3, 4], [2, 2, 1]])
    adv = torch.tensor([1.0, -0.5], dtype=dtype)
    mask = torch.ones(2, 3)
    kwargs = dict(clip, importance_sampling_level=level, temperature=0.5)
    exact = logits.double()
    softmax = torch.softmax(exact / 0.5, dim=-1)
    onehot = torch.nn.functional.one_hot(ids, 5).double()
    expected = -adv.double()[:, None, None] / 6 * (onehot - softmax) / 0.5
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-4)
    _, ref_grad = run(reference, logits, ids, adv, mask, **kwargs)
    _, grad = run(grpo_ext, logits, ids, adv, mask, **kwargs)
    assert_close(ref_grad, expected, **tol, msg="reference gradient")
    assert_close(grad, expected, **tol, msg="kernel gradient")
