"""The entropy bonus (``entropy_coef``; docs/math.md section 5, "Entropy bonus") of grpo_loss_from_logits,
grpo_loss_from_hidden and FusedLinearGRPOLoss, against the float64 reference that differentiates the materialized
softmax's entropy with autograd."""

from __future__ import annotations

import pytest
import torch

import grpo_ext
from conftest import DEVICES, HAS_CUDA, NO_CUDA, assert_close, cast_kwargs
from grpo_ext import reference
from grpo_ext.nn import FusedLinearGRPOLoss
from grpo_ext.validation.options import LOSS_TYPES, LossOptions
from test_grpo_loss_from_logits import make_problem

COEF = 0.37


def problem_kwargs(loss_type: str, level: str, old, ref, *, seed: int = 5) -> dict:
    """Every option that shapes the loss or the kept tokens: old/ref log-probs, KL, IS and policy weights, a dropped
    row, the logits options and a loss scale."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        old_logps=old, ref_logps=ref, beta=0.05, loss_type=loss_type, importance_sampling_level=level,
        is_weights=0.5 + torch.rand(4, 6, generator=g, dtype=torch.float64),
        policy_weights=(torch.rand(4, 6, generator=g) > 0.3).to(torch.float64),
        sample_mask=torch.tensor([True, True, False, True]), temperature=0.9, logit_scale=1.3, loss_scale=0.5,
        epsilon_high=1.2 if loss_type == "cispo" else 0.28,
    )  # fmt: skip


def run_logits(impl, logits, ids, adv, mask, **kwargs):
    x = logits.detach().clone().requires_grad_(True)
    out = impl.grpo_loss_from_logits(x, ids, adv, mask, **kwargs)
    out.loss.backward()
    return out, x.grad


def neg_inf_logits(logits, ids, mask):
    """``logits`` with -inf at one vocabulary entry of each kept row (never the chosen one): p = 0 there, and the
    entropy's gradient (p_v (z_v - E[z])) must be 0, not 0 * inf."""
    out = logits.clone()
    banned = (ids + 1) % logits.shape[-1]
    out.scatter_(-1, banned.unsqueeze(-1), float("-inf"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_logits_matches_reference(device, loss_type, level, softcap):
    """Loss and d loss / d logits, for every loss type at both levels (one pass, or the two of sequence level and
    vespo), with and without the soft-cap, on logits with -inf entries; the bonus moves the gradient by more than
    the tolerance, so a kernel that ignored it would fail."""
    logits, ids, adv, mask, old, ref = make_problem(seed=LOSS_TYPES.index(loss_type))
    if softcap is None:
        logits = neg_inf_logits(logits, ids, mask)
    kwargs = problem_kwargs(loss_type, level, old, ref) | dict(logit_softcap=softcap)
    expected, expected_grad = run_logits(reference, logits, ids, adv, mask, entropy_coef=COEF, **kwargs)
    without, without_grad = run_logits(reference, logits, ids, adv, mask, **kwargs)
    assert_close(expected.loss, without.loss - COEF * 0.5 * without.metrics["entropy"], rtol=1e-12, atol=1e-12)
    assert (expected_grad - without_grad).abs().max() > 1e-3
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        got, grad = run_logits(grpo_ext, logits.to(device, dtype), ids.to(device), adv.to(device, dtype),
                               mask.to(device), entropy_coef=COEF, **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert torch.isfinite(grad).all()
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        assert_close(got.metrics["entropy"], expected.metrics["entropy"], rtol=tol, atol=tol, msg=f"entropy {dtype}")
        assert_close(grad, expected_grad, rtol=tol, atol=tol, msg=f"grad {dtype}")


def high_entropy_weights(logits, mask, dtype=torch.float64) -> torch.Tensor:
    """``[B, T]`` weights as TRL's high-entropy mask makes them (1 for the kept tokens whose entropy is at least the
    median, 0 otherwise; an unkept token 1, which the kernels must not count), plus a fractional one."""
    entropy = reference.selective_log_softmax(logits, logits.argmax(-1), temperature=0.9, return_entropy=True).entropy
    median = entropy[mask].median()
    weights = ((entropy >= median) | ~mask).to(dtype)
    weights[1, 1] = 0.5
    return weights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "token"), ("dapo", "sequence"), ("vespo", "token")])
def test_entropy_weights_match_reference(device, loss_type, level):
    """``entropy_weights``: the bonus' mean and its gradient over the weighted kept tokens only, through the logits
    and the hidden-state losses; metrics["entropy"] stays the unweighted mean."""
    logits, ids, adv, mask, old, ref = make_problem(seed=30)
    weights = high_entropy_weights(logits, mask)
    kwargs = problem_kwargs(loss_type, level, old, ref)
    expected, expected_grad = run_logits(reference, logits, ids, adv, mask, entropy_coef=COEF,
                                         entropy_weights=weights, **kwargs)  # fmt: skip
    unweighted, unweighted_grad = run_logits(reference, logits, ids, adv, mask, entropy_coef=COEF, **kwargs)
    assert (expected_grad - unweighted_grad).abs().max() > 1e-3  # the weights matter
    assert_close(expected.metrics["entropy"], unweighted.metrics["entropy"], rtol=0, atol=0)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        for bool_weights in (False, True):
            w = (weights > 0.75) if bool_weights else weights.to(dtype)
            want, want_grad = (expected, expected_grad)
            if bool_weights:
                want, want_grad = run_logits(reference, logits, ids, adv, mask, entropy_coef=COEF,
                                             entropy_weights=weights > 0.75, **kwargs)  # fmt: skip
            got, grad = run_logits(grpo_ext, logits.to(device, dtype), ids.to(device), adv.to(device, dtype),
                                   mask.to(device), entropy_coef=COEF, entropy_weights=w.to(device),
                                   **cast_kwargs(device, dtype, kwargs))  # fmt: skip
            assert_close(got.loss, want.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
            assert_close(got.metrics["entropy"], want.metrics["entropy"], rtol=tol, atol=tol, msg="entropy")
            assert_close(grad, want_grad, rtol=tol, atol=tol, msg=f"grad {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stored", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_entropy_weights_at_masked_tokens_are_never_read(device, stored):
    """NaN or inf in ``entropy_weights`` where the token is masked changes nothing (docs/math.md: masked positions
    are inert): the same loss, mean entropy and gradient as weights of 1 there, from the kernels (float32, float64)
    and the reference (an outside audit, 2026-11-28: the loss was NaN)."""
    logits, ids, adv, mask, old, ref = make_problem(seed=33)
    weights = high_entropy_weights(logits, mask)  # 1 at every masked token
    poisoned = weights.masked_fill(~mask, stored)
    kwargs = problem_kwargs("dapo", "token", old, ref)
    expected, expected_grad = run_logits(reference, logits, ids, adv, mask, entropy_coef=COEF,
                                         entropy_weights=weights, **kwargs)  # fmt: skip
    got, grad = run_logits(reference, logits, ids, adv, mask, entropy_coef=COEF, entropy_weights=poisoned, **kwargs)
    assert_close(got.loss, expected.loss, rtol=0, atol=0)
    assert_close(grad, expected_grad, rtol=0, atol=0)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        got, grad = run_logits(grpo_ext, logits.to(device, dtype), ids.to(device), adv.to(device, dtype),
                               mask.to(device), entropy_coef=COEF, entropy_weights=poisoned.to(device, dtype),
                               **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        assert_close(got.metrics["entropy"], expected.metrics["entropy"], rtol=tol, atol=tol, msg=f"entropy {dtype}")
        assert_close(grad, expected_grad, rtol=tol, atol=tol, msg=f"grad {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_entropy_weights_through_the_hidden_state_loss(device):
    _, ids, adv, mask, old, ref = make_problem(vocab=29, seed=31)
    g = torch.Generator().manual_seed(32)
    hidden = torch.randn(4, 6, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(29, 16, generator=g, dtype=torch.float64) / 2
    bias = torch.randn(29, generator=g, dtype=torch.float64)
    weights = high_entropy_weights(hidden @ weight.t() + bias, mask)
    kwargs = problem_kwargs("bnpo", "token", old, ref) | dict(entropy_coef=COEF, entropy_weights=weights)
    expected, expected_grads = run_hidden(reference, hidden, weight, bias, ids, adv, mask, **kwargs)
    got, grads = run_hidden(grpo_ext, hidden.to(device), weight.to(device), bias.to(device), ids.to(device),
                            adv.to(device), mask.to(device), chunk_size=5, **cast_kwargs(device, torch.float64, kwargs))
    assert_close(got.loss, expected.loss, rtol=1e-10, atol=1e-10)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        assert_close(actual, wanted, rtol=1e-10, atol=1e-10)


def weighted_masks(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``mask`` (bool ``[B, T]``) as masks whose kept values are not all 1 (docs/math.md, "Masks": a value weights
    its token in every sum): a float mask of 0.5 everywhere, one of mixed values (0.25 to 2), an integer one of 2."""
    mixed = mask.double() * torch.linspace(0.25, 2.0, mask.numel(), dtype=torch.float64).reshape(mask.shape)
    return {"half": mask * 0.5, "mixed": mixed, "int2": mask.long() * 2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mask_kind", ["half", "mixed", "int2"])
def test_weighted_masks_match_reference(device, loss_type, level, mask_kind):
    """A mask value other than 0 or 1 weights its token everywhere, in the native logits op as in the reference: the
    loss, every metric, the mean entropy (sum m H / max(sum m, 1): 0.5 everywhere gives the same mean as 1), the
    bonus and the gradient agree (issue 40: the op's entropy mean had summed H unweighted, 4.09 > log V)."""
    logits, ids, adv, mask, old, ref = make_problem(seed=40 + LOSS_TYPES.index(loss_type))
    m = weighted_masks(mask)[mask_kind]
    kwargs = problem_kwargs(loss_type, level, old, ref) | dict(entropy_coef=COEF)
    expected, expected_grad = run_logits(reference, logits, ids, adv, m, **kwargs)
    if mask_kind == "half":  # a uniform weight leaves the token means alone
        unit, _ = run_logits(reference, logits, ids, adv, mask, **kwargs)
        assert_close(expected.metrics["entropy"], unit.metrics["entropy"], rtol=1e-12, atol=1e-12)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        got, grad = run_logits(grpo_ext, logits.to(device, dtype), ids.to(device), adv.to(device, dtype),
                               m.to(device), **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        assert set(got.metrics) == set(expected.metrics)
        for name, value in expected.metrics.items():
            assert_close(got.metrics[name], value, rtol=tol, atol=tol, msg=f"metrics[{name!r}] {dtype}")
        assert_close(grad, expected_grad, rtol=tol, atol=tol, msg=f"grad {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_kind", ["mixed", "int2"])
def test_weighted_masks_through_the_hidden_state_loss(device, mask_kind):
    """The same rule through the chunked hidden-state loss (its bonus' normalizer is the whole batch's sum m)."""
    _, ids, adv, mask, old, ref = make_problem(vocab=29, seed=33)
    g = torch.Generator().manual_seed(34)
    hidden = torch.randn(4, 6, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(29, 16, generator=g, dtype=torch.float64) / 2
    bias = torch.randn(29, generator=g, dtype=torch.float64)
    m = weighted_masks(mask)[mask_kind]
    kwargs = problem_kwargs("grpo", "token", old, ref) | dict(entropy_coef=COEF)
    expected, expected_grads = run_hidden(reference, hidden, weight, bias, ids, adv, m, **kwargs)
    got, grads = run_hidden(grpo_ext, hidden.to(device), weight.to(device), bias.to(device), ids.to(device),
                            adv.to(device), m.to(device), chunk_size=5, **cast_kwargs(device, torch.float64, kwargs))
    assert_close(got.loss, expected.loss, rtol=1e-10, atol=1e-10)
    assert_close(got.metrics["entropy"], expected.metrics["entropy"], rtol=1e-10, atol=1e-10)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        assert_close(actual, wanted, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coef", [COEF, -0.2])
def test_logits_in_place_and_bf16(device, coef):
    """In place (the gradient over the logits) equals the new-buffer gradient; in bfloat16 the kernel's error is at
    most twice the reference's own in bfloat16 (flash-attention's rule), plus a rounding floor."""
    logits, ids, adv, mask, old, ref = make_problem(seed=3)
    kwargs = problem_kwargs("dapo", "token", old, ref)
    _, expected_grad = run_logits(reference, logits, ids, adv, mask, entropy_coef=coef, **kwargs)
    x32 = logits.to(device, torch.float32)
    kw32 = cast_kwargs(device, torch.float32, kwargs)
    _, grad = run_logits(grpo_ext, x32, ids.to(device), adv.to(device, torch.float32), mask.to(device),
                         entropy_coef=coef, **kw32)  # fmt: skip
    source = (x32 * 1.0).requires_grad_(False)
    leaf = source.clone().requires_grad_(True)
    produced = leaf * 1.0  # the in-place gradient goes over an op's output, not a leaf
    out = grpo_ext.grpo_loss_from_logits(produced, ids.to(device), adv.to(device, torch.float32), mask.to(device),
                                         entropy_coef=coef, inplace_grad=True, **kw32)  # fmt: skip
    out.loss.backward()
    assert_close(leaf.grad, grad, rtol=0, atol=0, msg="in place")

    bf16 = cast_kwargs(device, torch.bfloat16, kwargs)
    _, grad_bf16 = run_logits(grpo_ext, logits.to(device, torch.bfloat16), ids.to(device),
                              adv.to(device, torch.bfloat16), mask.to(device), entropy_coef=coef, **bf16)  # fmt: skip
    _, ref_bf16 = run_logits(reference, logits.to(torch.bfloat16), ids, adv.to(torch.bfloat16), mask,
                             entropy_coef=coef, **cast_kwargs("cpu", torch.bfloat16, kwargs))  # fmt: skip
    kernel_error = (grad_bf16.double().cpu() - expected_grad).abs().max()
    reference_error = (ref_bf16.double() - expected_grad).abs().max()
    assert kernel_error <= 2 * reference_error + 1e-4, (kernel_error, reference_error)


def run_hidden(impl, hidden, weight, bias, ids, adv, mask, **kwargs):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    b = bias.detach().clone().requires_grad_(True)
    out = impl.grpo_loss_from_hidden(h, w, ids, adv, mask, lm_head_bias=b, **kwargs)
    out.loss.backward()
    return out, (h.grad, w.grad, b.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "token"), ("dapo", "sequence"), ("vespo", "token")])
@pytest.mark.parametrize("chunk_size", [1, 5, None])
def test_hidden_matches_reference(device, loss_type, level, chunk_size):
    """The chunked hidden-state loss: the bonus' normalizer is the whole batch's kept tokens in every chunk."""
    _, ids, adv, mask, old, ref = make_problem(vocab=29, seed=7)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(4, 6, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(29, 16, generator=g, dtype=torch.float64) / 2
    bias = torch.randn(29, generator=g, dtype=torch.float64)
    kwargs = problem_kwargs(loss_type, level, old, ref) | dict(logit_softcap=5.0)
    expected, expected_grads = run_hidden(reference, hidden, weight, bias, ids, adv, mask, entropy_coef=COEF,
                                          **kwargs)  # fmt: skip
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 5e-5)):
        got, grads = run_hidden(grpo_ext, hidden.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype),
                                ids.to(device), adv.to(device, dtype), mask.to(device), entropy_coef=COEF,
                                chunk_size=chunk_size, **cast_kwargs(device, dtype, kwargs))  # fmt: skip
        assert_close(got.loss, expected.loss, rtol=tol, atol=tol, msg=f"loss {dtype}")
        for name, actual, wanted in zip(("hidden", "weight", "bias"), grads, expected_grads, strict=True):
            assert_close(actual, wanted, rtol=tol, atol=tol, msg=f"d/d{name} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_linear_module(device):
    """FusedLinearGRPOLoss(entropy_coef=...) is the hidden-state loss with the bonus."""
    _, ids, adv, mask, _, _ = make_problem(vocab=23, seed=9)
    g = torch.Generator().manual_seed(10)
    # Drawn on the CPU (the generator's device), then moved: the same numbers on every device.
    hidden = torch.randn(4, 6, 8, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    weight = torch.randn(23, 8, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    module = FusedLinearGRPOLoss(beta=0.0, loss_type="bnpo", temperature=0.8, entropy_coef=COEF)
    loss, _ = module(hidden, weight, ids.to(device), mask.to(device), adv.to(device))
    loss.backward()
    h, w = hidden.detach().cpu().requires_grad_(True), weight.detach().cpu().requires_grad_(True)
    expected = reference.grpo_loss_from_hidden(h, w, ids, adv, mask, loss_type="bnpo", temperature=0.8,
                                               epsilon_high=0.2, entropy_coef=COEF)  # fmt: skip
    expected.loss.backward()
    assert_close(loss, expected.loss, rtol=1e-10, atol=1e-10)
    assert_close(hidden.grad, h.grad, rtol=1e-10, atol=1e-10)
    assert_close(weight.grad, w.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_loss_scale_and_no_grad(device):
    """A 0-dim tensor loss_scale (on the CPU or the inputs' device) scales the bonus as a number does, in the logits
    loss and the chunked hidden-state loss (loss and gradients); without grad the loss still has the bonus."""
    logits, ids, adv, mask, old, _ = make_problem(vocab=29, seed=2)
    x, ids, adv, mask, old = (t.to(device) for t in (logits, ids, adv, mask, old))
    scales = (torch.tensor(0.25), torch.tensor(0.25, device=device))
    number = grpo_ext.grpo_loss_from_logits(x, ids, adv, mask, old_logps=old, loss_scale=0.25, entropy_coef=COEF)
    plain = grpo_ext.grpo_loss_from_logits(x, ids, adv, mask, old_logps=old, loss_scale=0.25)
    assert_close(number.loss, plain.loss - COEF * 0.25 * plain.metrics["entropy"], rtol=1e-12, atol=1e-12)
    for scale in scales:
        tensor = grpo_ext.grpo_loss_from_logits(x, ids, adv, mask, old_logps=old, loss_scale=scale, entropy_coef=COEF)
        assert_close(number.loss, tensor.loss, rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = (torch.randn(*shape, generator=g, dtype=torch.float64).to(device)
                            for shape in ((4, 6, 16), (29, 16), (29,)))  # fmt: skip
    options = dict(old_logps=old, loss_type="dapo", num_items_in_batch=17.0, entropy_coef=COEF, chunk_size=5)
    expected, expected_grads = run_hidden(grpo_ext, hidden, weight, bias, ids, adv, mask, loss_scale=0.25, **options)
    for scale in scales:
        got, grads = run_hidden(grpo_ext, hidden, weight, bias, ids, adv, mask, loss_scale=scale, **options)
        assert_close(got.loss, expected.loss, rtol=1e-12, atol=1e-12)
        for actual, wanted in zip(grads, expected_grads, strict=True):
            assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_device_tensor_numbers_never_sync_the_host():
    """loss_scale and num_items_in_batch as CUDA tensors: grpo_loss_from_logits (with the entropy bonus) and
    grpo_loss, forward and backward, run without a host sync (torch's sync debug mode raises on one: reading either
    value on the host would be one) and give what the same numbers give."""
    logits, ids, adv, mask, old, _ = make_problem(seed=3)
    logits, ids, adv, mask, old = (t.cuda() for t in (logits, ids, adv, mask, old))

    def run(scale: float | torch.Tensor, num_items: float | torch.Tensor) -> tuple:
        options = dict(old_logps=old, loss_type="dapo", loss_scale=scale, num_items_in_batch=num_items)
        x, logps = logits.clone().requires_grad_(True), old.clone().requires_grad_(True)
        fused = grpo_ext.grpo_loss_from_logits(x, ids, adv, mask, entropy_coef=COEF, **options)
        fused.loss.backward()
        plain = grpo_ext.grpo_loss(logps, adv, mask, **options)
        plain.loss.backward()
        return fused.loss.detach(), x.grad, plain.loss.detach(), logps.grad

    expected = run(0.25, 17.0)
    tensors = (torch.tensor(0.25, device="cuda"), torch.tensor(17.0, device="cuda"))
    run(*tensors)  # the first call's setup outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run(*tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for value, want in zip(got, expected, strict=True):
        assert_close(value, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_the_bonus(device):
    """The native pass and the composite ops with a nonzero entropy_coef (schemas, fakes, autograd registration)."""
    logits, ids, adv, mask, old, _ = make_problem(2, 3, 11, seed=13)
    x, ids, adv, mask, old = (t.to(device) for t in (logits, ids, adv, mask, old))
    flat_ids = ids.reshape(-1)
    options = LossOptions(old_logps=old, epsilon_high=0.2, max_completion_length=3)
    weights = torch.tensor([[1.0, 0.0, 1.0], [0.5, 1.0, 0.0]], dtype=torch.float64, device=device)
    for token_grad in (None, torch.randn(6, dtype=torch.float64, device=device)):
        args = (x, flat_ids, 0, adv, mask, token_grad, *options.op_args(), 0.9, 1.0, 0.0, COEF, weights, True)
        torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits_pass.default, args)
        torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits_pass_.default, (x.clone(), *args[1:]))
    for level in ("token", "sequence"):  # one pass, or two (the sequence-level gradient)
        level_args = options._replace(importance_sampling_level=level).op_args()
        op_args = (x.clone().requires_grad_(True), flat_ids, adv, mask, *level_args, 0.9, 1.0, 0.0, COEF, weights)
        torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits.default, (*op_args, True))
        torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_logits_.default, (x.clone(), *op_args[1:], True))
    g = torch.Generator().manual_seed(4)
    flat = torch.randn(6, 5, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    hidden_args = (flat, w, None, flat_ids, adv, mask, *options.op_args(), 0.9, 1.0, 0.0, 4, COEF, weights, 0)
    torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_hidden.default, hidden_args)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_equals_eager(device):
    """Under torch.compile the opaque composite ops carry entropy_coef: same loss and gradient as eager."""
    logits, ids, adv, mask, old, _ = make_problem(2, 3, 11, seed=15)
    x, ids, adv, mask, old = (t.to(device) for t in (logits, ids, adv, mask, old))

    def fn(t):
        return grpo_ext.grpo_loss_from_logits(t, ids, adv, mask, old_logps=old, entropy_coef=COEF).loss

    eager_x = x.clone().requires_grad_(True)
    fn(eager_x).backward()
    torch._dynamo.reset()
    compiled_x = x.clone().requires_grad_(True)
    loss = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(compiled_x)
    loss.backward()
    assert_close(loss, fn(x), rtol=1e-12, atol=1e-12)
    assert_close(compiled_x.grad, eager_x.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.1", True, None])
def test_bad_entropy_coef_is_named(bad):
    logits, ids, adv, mask, _, _ = make_problem(2, 3, 11, seed=1)
    with pytest.raises(ValueError, match="entropy_coef"):
        grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, entropy_coef=bad)
    hidden, weight = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="entropy_coef"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, entropy_coef=bad)


def test_bad_entropy_weights_are_named():
    logits, ids, adv, mask, _, _ = make_problem(2, 3, 11, seed=1)
    for bad in (torch.ones(2, 4), torch.ones(2, 3, dtype=torch.long), [[1.0] * 3] * 2):
        with pytest.raises(ValueError, match="entropy_weights"):
            grpo_ext.grpo_loss_from_logits(logits, ids, adv, mask, entropy_coef=0.1, entropy_weights=bad)


def test_grpo_loss_has_no_entropy_bonus():
    """grpo_loss receives log-probs and no entropy: the option is not one of its arguments."""
    logps = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="entropy_coef"):
        grpo_ext.grpo_loss(logps, torch.randn(2, dtype=torch.float64), torch.ones(2, 3), entropy_coef=0.1)
