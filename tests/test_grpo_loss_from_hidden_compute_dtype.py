"""grpo_loss_from_hidden's ``compute_dtype``: a float32 master weight (and hidden states) under bf16/fp16 GEMMs, cast
inside the op (into the weight gradient's buffer when one chunk covers the rows), against casting first."""

from __future__ import annotations

import importlib

import pytest
import torch

import grpo_ext
from conftest import DEVICES, assert_close
from grpo_ext import reference
from grpo_ext.ops import lm_head
from grpo_ext.ops.grpo_loss_from_hidden import hidden_loss
from grpo_ext.validation.options import LossOptions

hidden_module = importlib.import_module("grpo_ext.ops.grpo_loss_from_hidden")  # the package exports the function


def make_problem(batch: int = 4, length: int = 6, size: int = 32, vocab: int = 97, *, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, size, generator=g)
    weight = 0.3 * torch.randn(vocab, size, generator=g)
    bias = 0.2 * torch.randn(vocab, generator=g)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.rand(batch, length, generator=g) < 0.8
    mask[0, 0] = True
    adv = torch.randn(batch, generator=g)
    old = -4.0 + 0.3 * torch.randn(batch, length, generator=g)
    return hidden, weight, bias, ids, adv, mask, old


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize(("wide", "narrow"), [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                              (torch.float64, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("count", [1, 2, 3, 17, 1000, 4097])
@pytest.mark.parametrize("tail", [1, 4, 64])
def test_widen_in_place_converts_every_element(monkeypatch, wide, narrow, count, tail):
    """The cast lands in the buffer's first half; every narrow product value comes back widened, in place."""
    monkeypatch.setattr(lm_head, "_WIDEN_TAIL", tail)
    g = torch.Generator().manual_seed(count)
    weight = torch.randn(count, generator=g, dtype=torch.float64).to(wide)
    shared = lm_head.shared_weight_gradient(weight, narrow)
    assert shared.grad.dtype == wide and shared.cast.dtype == shared.product.dtype == narrow
    assert torch.equal(shared.cast, weight.to(narrow))
    values = torch.randn(count, generator=g, dtype=torch.float64).to(narrow)
    shared.product.copy_(values)
    address = shared.grad.data_ptr()
    out = lm_head.widen_in_place(shared)
    assert out.data_ptr() == address
    assert torch.equal(out, values.to(wide))


@pytest.mark.parametrize(("wide", "narrow"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float64, torch.bfloat16)])  # fmt: skip
def test_no_shared_buffer_unless_half_the_width(wide, narrow):
    assert lm_head.shared_weight_gradient(torch.ones(4, 3, dtype=wide), narrow) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [None, 5])  # None: one chunk (the shared buffer); 5: float32 accumulation
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compute_dtype_against_casting_first(device, compute_dtype, chunk_size, level):
    """float32 leaves with ``compute_dtype``: every gradient in its leaf's dtype, the loss and hidden gradient those
    of casting first, the weight gradient bit for bit casting first's with one chunk, and with several (float32
    accumulation, no rounding to the compute dtype) within twice the error of casting first against float64."""
    hidden, weight, bias, ids, adv, mask, old = make_problem(seed=3 if level == "token" else 4)
    kwargs = dict(old_logps=old.to(device), importance_sampling_level=level, temperature=0.9, beta=0.0,
                  loss_type="dapo", chunk_size=chunk_size)  # fmt: skip
    ids, adv, mask = ids.to(device), adv.to(device), mask.to(device)
    masters = leaves(hidden.to(device), weight.to(device), bias.to(device))
    got = grpo_ext.grpo_loss_from_hidden(masters[0], masters[1], ids, adv, mask, lm_head_bias=masters[2],
                                         compute_dtype=compute_dtype, **kwargs)  # fmt: skip
    got.loss.backward()
    first = leaves(hidden.to(device), weight.to(device), bias.to(device))
    cast = [t.to(compute_dtype) for t in first]
    expected = grpo_ext.grpo_loss_from_hidden(cast[0], cast[1], ids, adv, mask, lm_head_bias=cast[2], **kwargs)
    expected.loss.backward()
    assert [t.grad.dtype for t in masters] == [torch.float32] * 3
    assert_close(got.loss, expected.loss, rtol=0, atol=0, msg="loss")
    assert_close(masters[0].grad, first[0].grad, rtol=0, atol=0, msg="grad hidden")
    if chunk_size is None:
        assert_close(masters[1].grad, first[1].grad, rtol=0, atol=0, msg="grad weight")
    else:
        low = [t.detach().to(compute_dtype) for t in (hidden, weight, bias)]
        truth_leaves = leaves(*[t.double() for t in low])
        truth = reference.grpo_loss_from_hidden(truth_leaves[0], truth_leaves[1], ids.cpu(), adv.double().cpu(),
                                                mask.cpu(), lm_head_bias=truth_leaves[2], old_logps=old.double(),
                                                importance_sampling_level=level, temperature=0.9)  # fmt: skip
        truth.loss.backward()
        err = (masters[1].grad.double().cpu() - truth_leaves[1].grad).abs().max().item()
        cast_err = (first[1].grad.double().cpu() - truth_leaves[1].grad).abs().max().item()
        assert err <= 2 * cast_err + 1e-7, (err, cast_err)
    assert_close(masters[2].grad, first[2].grad, rtol=1e-6, atol=1e-7, msg="grad bias")


def test_one_chunk_forms_the_weight_gradient_in_its_own_buffer(monkeypatch):
    """With one chunk, the gradient autograd receives is the buffer the cast weight was written into (no [V, H]
    temporary); with several chunks, or a weight already in the compute dtype, no such buffer is made."""
    made: list[int] = []
    shared_weight_gradient = lm_head.shared_weight_gradient

    def spy(weight, dtype):
        shared = shared_weight_gradient(weight, dtype)
        made.append(shared.grad.data_ptr())  # the address only: a held reference would make autograd copy
        return shared

    monkeypatch.setattr(hidden_module, "shared_weight_gradient", spy)
    hidden, weight, _, ids, adv, mask, old = make_problem(seed=5)
    for chunk_size, weight_dtype, calls in ((None, torch.float32, 1), (4, torch.float32, 0), (None, torch.bfloat16, 0)):
        made.clear()
        h, w = leaves(hidden, weight.to(weight_dtype))
        out = grpo_ext.grpo_loss_from_hidden(h, w, ids, adv, mask, old_logps=old, chunk_size=chunk_size,
                                             compute_dtype=torch.bfloat16)  # fmt: skip
        out.loss.backward()
        assert len(made) == calls, (chunk_size, weight_dtype)
        assert w.grad.dtype == weight_dtype
        if calls:
            assert w.grad.data_ptr() == made[0]


def test_frozen_weight_and_reference_head_under_compute_dtype():
    """A weight without grad (LoRA's base) is cast plainly; a reference head is cast to the compute dtype too."""
    hidden, weight, bias, ids, adv, mask, old = make_problem(seed=6)
    ref_hidden = hidden + 0.1
    ref_weight = weight * 0.9
    h = hidden.clone().requires_grad_(True)
    out = hidden_loss(h, weight, ids, adv, mask, lm_head_bias=bias, ref_head=(ref_hidden, ref_weight, None),
                      beta=0.04, old_logps=old, compute_dtype=torch.bfloat16)  # fmt: skip
    out.loss.backward()
    h_first = hidden.clone().requires_grad_(True)
    low = torch.bfloat16
    ref_low = (ref_hidden.to(low), ref_weight.to(low), None)
    expected = hidden_loss(h_first.to(low), weight.to(low), ids, adv, mask, lm_head_bias=bias.to(low),
                           ref_head=ref_low, beta=0.04, old_logps=old)  # fmt: skip
    expected.loss.backward()
    assert_close(out.loss, expected.loss, rtol=0, atol=0)
    assert_close(h.grad, h_first.grad, rtol=0, atol=0)
    assert_close(out.metrics["kl"], expected.metrics["kl"], rtol=0, atol=0)


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float16])
def test_the_reference_takes_compute_dtype(compute_dtype):
    """``reference.grpo_loss_from_hidden(..., compute_dtype=...)`` is the reference on the leaves cast first (as
    autocast does), each gradient back in its leaf's dtype; the op's loss and gradients are as near it as the
    reference in float32 is (the flash-attention rule: the kernel's error at most twice the reference's in the same
    dtype, plus a float32 rounding), with its per-token log-probs too."""
    hidden, weight, bias, ids, adv, mask, old = make_problem(seed=5)
    kwargs = dict(old_logps=old, beta=0.04, ref_logps=old - 0.1, temperature=0.9)

    def run(impl, tensors, **extra):
        out = impl.grpo_loss_from_hidden(tensors[0], tensors[1], ids, adv, mask, lm_head_bias=tensors[2], **kwargs,
                                         **extra)  # fmt: skip
        return out, torch.autograd.grad(out.loss, tensors)

    first = leaves(hidden, weight, bias)
    out, grads = run(reference, first, compute_dtype=compute_dtype, return_token_logps=True)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    cast = leaves(*(t.to(compute_dtype) for t in (hidden, weight, bias)))
    expected, expected_grads = run(reference, cast)
    assert torch.equal(out.loss, expected.loss)
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.equal(got, want.float())
    exact, exact_grads = run(reference, leaves(*(t.double() for t in (hidden, weight, bias))))
    fused, fused_grads = run(grpo_ext, leaves(hidden, weight, bias), compute_dtype=compute_dtype,
                             return_token_logps=True)  # fmt: skip
    for got, ref, want in zip((fused.loss, fused.token_logps, *fused_grads), (out.loss, out.token_logps, *grads),
                              (exact.loss, None, *exact_grads), strict=True):  # fmt: skip
        if want is None:  # the log-probs: the op's against the reference's, both in compute_dtype's GEMM
            assert_close(got, ref, rtol=2e-2, atol=2e-2)
            continue
        ref_error = (ref.double() - want).abs().max().item()
        assert (got.double() - want).abs().max().item() <= 2 * ref_error + 1e-5


def test_compute_dtype_errors():
    hidden, weight, bias, ids, adv, mask, _ = make_problem(seed=7)
    for bad in (torch.int32, "bfloat16", 16):
        with pytest.raises(ValueError, match="compute_dtype must be None or one of"):
            grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, compute_dtype=bad)
    with pytest.raises(ValueError, match=r"lm_head_weight must match hidden's dtype .*only with compute_dtype"):
        grpo_ext.grpo_loss_from_hidden(hidden.bfloat16(), weight, ids, adv, mask)
    with pytest.raises(ValueError, match="lm_head_bias must be a floating"):
        grpo_ext.grpo_loss_from_hidden(hidden.bfloat16(), weight.bfloat16(), ids, adv, mask, lm_head_bias=bias)
    with pytest.raises(ValueError, match="lm_head_weight must be floating"):
        grpo_ext.grpo_loss_from_hidden(hidden, weight.to(torch.int64), ids, adv, mask, compute_dtype=torch.float32)


def test_opcheck_with_a_master_weight():
    """The composite op (torch.compile's path) takes a weight of another dtype than the hidden states', with a
    chunk size and the one-chunk limit on the kept rows (6 here: every row in one chunk despite chunk_size 4)."""
    hidden, weight, bias, ids, adv, mask, old = make_problem(2, 3, 8, 11, seed=8)
    flat = hidden.reshape(6, 8).bfloat16().requires_grad_(True)
    w = weight.clone().requires_grad_(True)  # float32
    options = LossOptions(old_logps=old, epsilon_high=0.2, max_completion_length=3)
    for chunk_size, one_chunk in ((6, 0), (4, 0), (4, 6)):
        op_args = (flat, w, bias.bfloat16(), ids.reshape(-1), adv, mask, *options.op_args(), 0.9, 1.0, 0.0,
                   chunk_size, 0.0, None, one_chunk)  # fmt: skip
        torch.library.opcheck(torch.ops.grpo_ext.grpo_loss_from_hidden.default, op_args)
