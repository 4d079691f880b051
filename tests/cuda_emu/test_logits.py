"""The fused logits kernels on the emulated device, driven by their launchers: the pass of grpo_loss_from_logits (its
row weights, the pass in a new tensor and in place, scale_grad_) and the whole op in one call (the pass(es), the loss,
the kept-entropy kernel, composed by csrc/plan/logits_loss.h as it is). V from 1 to 50257 (never a multiple of a
block or vector width), every float dtype, temperature != 1, logit_scale and logit_softcap, strided and 3-D logits
(strided rows with a new gradient too), masked rows holding NaN and padding ids, -inf and NaN logits, rows far from
zero and bf16 and fp16 rows masked with -1e4 whose real logits sit at odd (or even) indices (selective_log_softmax
too), chunked rows (row_offset), batches over 32 rows (the row-weights kernel's warp loop wraps), skip_empty_rows
over rows of zero, one and more kept tokens, every loss type at both importance levels, ratios that overflow. The
cases are the CUDA tests' (tests/test_grpo_loss_from_logits.py) and more. selective_log_softmax's own cases:
test_selective.py; the pass's layouts (the single-read kernel over clusters, the fallback, the run-time candidates):
test_logits_layouts.py."""

from __future__ import annotations

import pytest
import torch

from grpo_ext.validation import validate_grpo_loss_args
from grpo_ext.validation.options import LOSS_TYPES, LossOptions
from test_grpo_loss_from_logits import make_problem
from test_selective_log_softmax import make_logits

from .checks import LOGITS_GRAD, LOSS, LOSS_GRAD, VALUES, check_op
from .test_selective import DTYPES, LOGIT_CASES, VOCABS, softmax_round_trip


@pytest.mark.parametrize("shift", [-115.0, 115.0])
def test_rows_far_from_zero(emu, emu_small_shared, shift):
    """Every finite logit of a row below -100 (or above +100), float32 (issue 32 item 6): a thread's online softmax
    starts from an empty state whose max (0) is no logit's; a pass that took it for one would add exp(-115) = 0
    terms (or rescale from it). V=4099 (vector body and scalar tail), a row whose first entries are -inf (a thread's
    first vector all -inf); the selective op and the fused pass: single-read in one block (emu), two-read and
    single-read over a cluster of 6 (bf16) on emu_small_shared."""
    logits, ids = make_logits(6, 4099, seed=12)
    logits = logits + shift
    logits[1, :9] = float("-inf")
    ids[1] = 20
    softmax_round_trip(emu, logits.float(), ids, 0.7)
    logits, ids, adv, mask, old, ref = make_problem(2, 3, 4099, seed=12)
    logits[0, 1, :9] = float("-inf")
    ids[0, 1] = 20
    mask[0] = True
    for device, dtype in ((emu, torch.float32), (emu_small_shared, torch.float32), (emu_small_shared, torch.bfloat16)):
        args = pass_args((logits + shift).to(dtype), ids.reshape(-1), adv.float(), mask, temperature=0.9,
                         old_logps=old.float(), ref_logps=ref.float(), beta=0.1, loss_type="dapo")  # fmt: skip
        check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)


def test_rows_near_1e4_take_d_as_the_statistics_did(emu, emu_small_shared):
    """Logits near 1e4 at temperature 0.9: the fused pass's gradient loop must take d = z - max as its statistics
    took it (LogitTransform::d_with, one FMA of the raw logit); z rounded first moves d by up to 5e-4 there, and the
    gradient's softmax by as much (the H100's failure of 2026-11-26, when nvcc mixed the two in one row; mutations
    51-52). The three layouts of test_rows_far_from_zero."""
    logits, ids, adv, mask, old, ref = make_problem(2, 3, 4099, seed=13)
    mask[0] = True
    for device, dtype in ((emu, torch.float32), (emu_small_shared, torch.float32), (emu_small_shared, torch.bfloat16)):
        args = pass_args((logits + 1e4).to(dtype), ids.reshape(-1), adv.float(), mask, temperature=0.9,
                         old_logps=old.float(), ref_logps=ref.float(), beta=0.1, loss_type="dapo")  # fmt: skip
        check_op(device, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)


def pass_args(logits, ids, adv, mask, *, token_grad=None, row_offset=0, temperature=0.9, logit=(1.0, 0.0),
              entropy_coef=0.0, entropy_weights=None, compute_grad=True, **options):  # fmt: skip
    """grpo_loss_from_logits_pass' arguments; ``mask`` is the [B, T] completion mask the rows score; ``logit`` is
    (logit_scale, logit_softcap), 0 for no cap."""
    stand_in = torch.empty(mask.shape)
    resolved = validate_grpo_loss_args(stand_in, adv, mask, LossOptions(**options))
    return (logits, ids, row_offset, adv, mask, token_grad, *resolved.op_args(), temperature, *logit, entropy_coef,
            entropy_weights, compute_grad)  # fmt: skip


PASS_TOL = [VALUES, VALUES, LOGITS_GRAD]  # log-probs, entropy, gradient
PASS_NAMES = ("logps", "entropy", "grad_logits")


def loss_options(loss_type: str, level: str, old, ref, is_weights, sample_mask) -> dict:
    """The options of tests/test_grpo_loss_from_logits.py's test_matches_reference, and policy weights (a mask)."""
    return dict(
        policy_weights=(torch.arange(is_weights.numel()).reshape(is_weights.shape) % 5 != 2).to(is_weights.dtype),
        old_logps=old,
        ref_logps=ref,
        beta=0.05,
        loss_type=loss_type,
        importance_sampling_level=level,
        is_weights=is_weights,
        sample_mask=sample_mask,
        epsilon_high=1.2 if loss_type == "cispo" else 0.28,
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_logits_pass_every_loss(emu, loss_type, level):
    """The pass as grpo_loss_from_logits chains it: token level in one pass; sequence level and vespo as log-probs,
    the [B, T] loss op's d loss / d logp, then a pass with those per-token gradients."""
    case = LOSS_TYPES.index(loss_type) * 2 + (level == "sequence")
    dtype = DTYPES[case % len(DTYPES)]
    logits, ids, adv, mask, old, ref = make_problem(seed=LOSS_TYPES.index(loss_type))
    g = torch.Generator().manual_seed(5)
    is_weights = 0.5 + torch.rand(4, 6, generator=g, dtype=torch.float64)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    options = loss_options(loss_type, level, old.to(acc), ref.to(acc), is_weights.to(acc),
                           torch.tensor([True, True, False, True]))  # fmt: skip
    x, flat_ids, adv = logits.to(dtype), ids.reshape(-1), adv.to(acc)
    if not LossOptions(**options).gradient_needs_whole_rows:
        check_op(emu, "grpo_loss_from_logits_pass", *pass_args(x, flat_ids, adv, mask, **options), tol=PASS_TOL,
                 names=PASS_NAMES)  # fmt: skip
        return
    logps, _, _ = check_op(emu, "grpo_loss_from_logits_pass", *pass_args(x, flat_ids, adv, mask, compute_grad=False,
                                                                          **options), tol=PASS_TOL)  # fmt: skip
    resolved = validate_grpo_loss_args(logps.view(4, 6), adv, mask, LossOptions(**options))
    _, _, grad_raw, grad_scale = check_op(emu, "grpo_loss_forward", logps.view(4, 6), adv, mask,
                                          *resolved.op_args(), True, tol=[LOSS, LOSS, LOSS_GRAD, LOSS])  # fmt: skip
    token_grad = (grad_raw * grad_scale).reshape(-1)
    check_op(emu, "grpo_loss_from_logits_pass", *pass_args(x, flat_ids, adv, mask, token_grad=token_grad, **options),
             tol=PASS_TOL, names=PASS_NAMES)  # fmt: skip


LOGITS_LOSS_TOL = [LOSS, LOSS, VALUES, LOGITS_GRAD, VALUES, VALUES]  # loss, metrics, mean entropy, grad, logps, H
LOGITS_LOSS_NAMES = ("loss", "metrics", "entropy_mean", "grad_logits", "logps", "entropy")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_logits_loss_whole_op(emu, loss_type, level):
    """grpo_loss_from_logits in one call (plan/logits_loss.h over this device's pass, loss forward and kept-entropy
    kernel): every loss type at both levels (one pass, or two around the loss' d loss / d logp), the entropy bonus
    with and without weights, a sample mask, the gradient in a new tensor, over the logits, and not at all."""
    case = LOSS_TYPES.index(loss_type) * 2 + (level == "sequence")
    dtype = DTYPES[case % len(DTYPES)]
    logits, ids, adv, mask, old, ref = make_problem(seed=20 + case)
    g = torch.Generator().manual_seed(case)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    is_weights = (0.5 + torch.rand(4, 6, generator=g, dtype=torch.float64)).to(acc)
    options = loss_options(loss_type, level, old.to(acc), ref.to(acc), is_weights, torch.tensor([True, True, False,
                                                                                                 True]))  # fmt: skip
    resolved = validate_grpo_loss_args(torch.empty(4, 6), adv.to(acc), mask, LossOptions(**options))
    weights = torch.rand(4, 6, generator=g, dtype=torch.float64).to(acc) if case % 3 == 0 else None
    x, flat_ids = logits.to(dtype), ids.reshape(-1)
    for entropy_coef, compute_grad in ((0.0, True), (0.03, True), (0.03, False)):
        args = (x, flat_ids, adv.to(acc), mask, *resolved.op_args(), 0.9, 1.0, 0.0, entropy_coef,
                weights if entropy_coef else None, compute_grad)  # fmt: skip
        check_op(emu, "grpo_loss_from_logits", *args, tol=LOGITS_LOSS_TOL, names=LOGITS_LOSS_NAMES)
    in_place = (x.clone(), *args[1:-1], True)
    check_op(emu, "grpo_loss_from_logits_", *in_place, tol=[LOSS, LOSS, VALUES, VALUES, VALUES, LOGITS_GRAD],
             names=LOGITS_LOSS_NAMES[:3] + LOGITS_LOSS_NAMES[4:] + ("logits (the gradient)",))  # fmt: skip


def test_logits_loss_more_rows_than_warps(emu):
    """40 rows of [B, T]: the kept-entropy kernel's warps take a second row each (1024 threads, 32 warps); the ids as
    [N] and as [B, T] (the op's own view)."""
    logits, ids, adv, mask, old, _ = make_problem(40, 3, 7, seed=41)
    weights = torch.rand(40, 3, generator=torch.Generator().manual_seed(2))
    resolved = validate_grpo_loss_args(torch.empty(40, 3), adv.float(), mask, LossOptions(old_logps=old.float()))
    for entropy_weights, op_ids in ((None, ids.reshape(-1)), (weights, ids)):  # the ids as [N], and as [B, T]
        args = (logits.float(), op_ids, adv.float(), mask, *resolved.op_args(), 1.0, 1.0, 0.0, 0.05,
                entropy_weights, True)  # fmt: skip
        check_op(emu, "grpo_loss_from_logits", *args, tol=LOGITS_LOSS_TOL, names=LOGITS_LOSS_NAMES)


def test_logits_loss_entropy_weights_at_masked_tokens_are_never_read(emu):
    """NaN in entropy_weights at masked tokens: the row-weights kernel's weighted total, the kept-entropy kernel's
    sums and each row's bonus weight read none of it (as the CPU kernels: the loss, the mean entropy and the gradient
    are those of weights 1 there)."""
    logits, ids, adv, mask, old, _ = make_problem(40, 3, 7, seed=42)
    weights = torch.rand(40, 3, generator=torch.Generator().manual_seed(3))
    resolved = validate_grpo_loss_args(torch.empty(40, 3), adv.float(), mask, LossOptions(old_logps=old.float()))
    outputs = []
    for stored in (1.0, float("nan")):
        args = (logits.float(), ids.reshape(-1), adv.float(), mask, *resolved.op_args(), 1.0, 1.0, 0.0, 0.05,
                weights.masked_fill(~mask.bool(), stored), True)  # fmt: skip
        outputs.append(check_op(emu, "grpo_loss_from_logits", *args, tol=LOGITS_LOSS_TOL, names=LOGITS_LOSS_NAMES))
    for clean, poisoned in zip(*outputs, strict=True):
        assert torch.equal(clean, poisoned)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "sapo", "cispo"])
def test_logits_loss_overflowing_ratio_gives_the_limit(emu, loss_type, level):
    """float32 ratios e^d with d near 400 at each row's first token (docs/math.md section 8, "An overflowing ratio"):
    with A = 1 (clipped or saturated) and A = 0 no 0 * inf = NaN reaches the logits' gradient; checked against the CPU
    op on float64 copies, where e^400 is finite and the gradient through rho exactly 0."""
    logits, ids, _, mask, old, _ = make_problem(seed=43)
    old[:, 0] = -400.0
    adv = torch.tensor([1.0, 0.0, 1.0, 0.0])
    resolved = validate_grpo_loss_args(torch.empty(4, 6), adv, mask, LossOptions(old_logps=old.float(),
                                       loss_type=loss_type, importance_sampling_level=level))  # fmt: skip
    args = (logits.float(), ids.reshape(-1), adv, mask, *resolved.op_args(), 0.9, 1.0, 0.0, 0.0, None, True)
    outputs = check_op(emu, "grpo_loss_from_logits", *args, tol=LOGITS_LOSS_TOL, names=LOGITS_LOSS_NAMES)
    assert not outputs[3].isnan().any()


@pytest.mark.parametrize("vocab", VOCABS)
def test_logits_pass_vocabularies(emu, vocab):
    logits, ids, adv, mask, old, ref = make_problem(2, 3, vocab, seed=vocab, per_token_adv=True)
    options = dict(old_logps=old.float(), ref_logps=ref.float(), beta=0.1, loss_type="dapo")
    args = pass_args(logits.float(), ids.reshape(-1), adv.float(), mask, temperature=0.7, **options)
    check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_pass_in_place_on_strided_rows(emu, dtype):
    """[B, T+1, V][:, :-1]: the gradient goes over each row of the view and nowhere between them."""
    logits, ids, adv, mask, old, _ = make_problem(seed=11)
    padded = torch.cat([logits, torch.randn(4, 1, 50, dtype=torch.float64)], dim=1).to(dtype)
    view = padded[:, :-1]
    assert not view.is_contiguous()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    args = pass_args(view, ids.reshape(-1), adv.to(acc), mask, old_logps=old.to(acc), loss_type="grpo")
    check_op(emu, "grpo_loss_from_logits_pass_", *args, tol=[VALUES, VALUES, LOGITS_GRAD],
             names=("logps", "entropy", "logits"))  # fmt: skip
    args = pass_args(logits.to(dtype).reshape(24, 50), ids.reshape(-1), adv.to(acc), mask, old_logps=old.to(acc))
    check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)


def test_logits_pass_masked_rows_nan_and_padding_ids(emu):
    logits, ids, adv, mask, old, _ = make_problem(seed=10)
    poisoned = logits.clone()
    poisoned[~mask] = float("nan")  # masked rows are never read
    padded_ids = ids.clone()
    padded_ids[~mask] = -100  # nor are their ids looked up
    for compute_grad in (True, False):
        args = pass_args(poisoned.float(), padded_ids.reshape(-1), adv.float(), mask, old_logps=old.float(),
                         compute_grad=compute_grad)  # fmt: skip
        check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
    nan_row = logits.clone()
    nan_row[1, 0, 3] = float("nan")  # an unmasked row: NaN, as the reference's
    args = pass_args(nan_row.float(), ids.reshape(-1), adv.float(), mask, old_logps=old.float())
    check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)


@pytest.mark.parametrize("logit", [(1.0, 0.0), (1.7, 2.5)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_logits_pass_zero_weight_tokens(emu, logit, level):
    """Kept tokens weighted 0 (policy and entropy-bonus weights; docs/math.md, "Non-finite inputs"): token [1, 2]
    holds logits the softmax sees as finite or -inf (uncapped: -inf at two other entries; capped: +-inf, the chosen
    one included) and gets an exactly zero gradient; token [1, 4] holds a NaN, which stays NaN (a NaN log-prob is
    never hidden by a weight)."""
    logits, ids, adv, mask, old, _ = make_problem(seed=50)
    mask[1, 2] = mask[1, 4] = True
    others = [(ids[1, 2].item() + k) % 50 for k in (1, 2)]
    if logit[1] == 0.0:
        logits[1, 2, others] = float("-inf")
    else:
        logits[1, 2, [ids[1, 2].item(), others[0]]] = float("inf")
        logits[1, 2, others[1]] = float("-inf")
    logits[1, 4, others[0]] = float("nan")
    weights = torch.ones(4, 6)
    weights[1, 2] = weights[1, 4] = 0.0
    flat, flat_ids = logits.float().reshape(24, 50), ids.reshape(-1)
    token_grad = None
    if level == "sequence":  # the loss op's per-token gradients, 0 at the zero-weight tokens as its weights make them
        token_grad = weights.reshape(-1) * torch.randn(24, generator=torch.Generator().manual_seed(50))
    args = pass_args(flat, flat_ids, adv.float(), mask, token_grad=token_grad, logit=logit, entropy_coef=0.4,
                     entropy_weights=weights, old_logps=old.float(), policy_weights=weights, loss_type="dapo",
                     importance_sampling_level=level)  # fmt: skip
    for op in ("grpo_loss_from_logits_pass", "grpo_loss_from_logits_pass_"):
        call_args = (args[0].clone(), *args[1:])
        logps, _, grad = check_op(emu, op, *call_args, tol=PASS_TOL, names=PASS_NAMES)
        assert torch.isfinite(logps[8]) and torch.equal(grad[8], torch.zeros(50))
        assert torch.isnan(logps[10])


def test_logits_pass_chunks_and_num_items(emu):
    """Rows [row_offset, row_offset + R) of the flattened problem, as the hidden-state loss chunks them; a tensor
    num_items_in_batch and loss_scale read by the row-weights kernel on the device."""
    logits, ids, adv, mask, old, ref = make_problem(seed=12)
    flat, flat_ids = logits.float().reshape(24, 50), ids.reshape(-1)
    for start, stop in ((0, 7), (7, 19), (19, 24)):
        for loss_type, num_items, scale in (("dapo", torch.tensor(37.0), 0.25), ("dapo", 37.0, torch.tensor(0.25)),
                                            ("grpo", None, 0.25), ("dr_grpo", None, torch.tensor(0.25))):
            args = pass_args(flat[start:stop], flat_ids[start:stop], adv.float(), mask, row_offset=start,
                             old_logps=old.float(), ref_logps=ref.float(), beta=0.1, loss_type=loss_type,
                             num_items_in_batch=num_items, max_completion_length=9, loss_scale=scale)  # fmt: skip
            check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)


@pytest.mark.parametrize(("batch", "length"), [(40, 3), (1030, 1)])
def test_logits_pass_many_rows_of_weights(emu, batch, length):
    """The row-weights kernel (one block of 1024 threads): 40 completions put rows 0 and 32 on warp 0; 1030 wrap its
    loops over the rows by thread."""
    logits, ids, adv, mask, old, _ = make_problem(batch, length, 7, seed=14)
    for loss_type in ("grpo", "bnpo", "sapo"):
        args = pass_args(logits.float(), ids.reshape(-1), adv.float(), mask, old_logps=old.float(), loss_type=loss_type)
        check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
    # the entropy bonus' weighted token total, summed by every thread over the same loops
    weights = (torch.arange(batch * length).reshape(batch, length) % 4 != 1).float()
    args = pass_args(logits.float(), ids.reshape(-1), adv.float(), mask, old_logps=old.float(), entropy_coef=0.5,
                     entropy_weights=weights)  # fmt: skip
    check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_grad(emu, dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 5, 600, generator=g, dtype=torch.float64) * 1e-3
    for grad in (base.to(dtype), base.to(dtype)[:, :4], base.to(dtype)[0]):  # 3-D; strided rows; 2-D
        for factor in (torch.tensor(2.5), torch.tensor(1.0)):  # 1.0: the kernel returns at once
            check_op(emu, "scale_grad_", grad.clone() if grad.is_contiguous() else grad, factor, tol=VALUES)




@pytest.mark.parametrize("logit", LOGIT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_pass_logit_scale_and_softcap(emu, dtype, logit):
    """The pass in a new tensor and in place, with the logits options (the gradient through the cap's tanh)."""
    logits, ids, adv, mask, old, ref = make_problem(seed=17)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    options = dict(old_logps=old.to(acc), ref_logps=ref.to(acc), beta=0.05, loss_type="dapo")
    args = pass_args(logits.to(dtype), ids.reshape(-1), adv.to(acc), mask, temperature=0.8, logit=logit, **options)
    check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
    check_op(emu, "grpo_loss_from_logits_pass_", *args, tol=[VALUES, VALUES, LOGITS_GRAD],
             names=("logps", "entropy", "logits"))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_logits_pass_entropy_bonus(emu, dtype, level):
    """The entropy bonus' gradient (docs/math.md section 5, "Entropy bonus"): its weight from the row-weights kernel
    (the last of its B + 1 outputs, also with per-token gradients), -inf logits (p = 0 adds 0), a dropped row, a
    chunk of rows (row_offset), in a new tensor and in place."""
    logits, ids, adv, mask, old, _ = make_problem(seed=40)
    logits[2, 1, (ids[2, 1] + 3) % 50] = float("-inf")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    options = dict(old_logps=old.to(acc), loss_type="grpo", importance_sampling_level=level, loss_scale=0.5,
                   sample_mask=torch.tensor([True, True, True, False]))  # fmt: skip
    token_grad = None
    if level == "sequence":
        token_grad = torch.randn(24, generator=torch.Generator().manual_seed(41), dtype=acc)
    flat, flat_ids = logits.to(dtype).reshape(24, 50), ids.reshape(-1)
    for start, stop in ((0, 24), (5, 17)):
        rows_grad = None if token_grad is None else token_grad[start:stop]
        weights = (torch.arange(24).reshape(4, 6) % 3 != 0).to(acc)  # the bonus' token weights (a third left out)
        weights[1, 2] = 0.25
        for coef, entropy_weights in ((0.3, None), (-1.5, None), (0.7, weights), (0.7, weights > 0)):
            args = pass_args(flat[start:stop], flat_ids[start:stop], adv.to(acc), mask, row_offset=start,
                             token_grad=rows_grad, logit=(1.2, 0.0), entropy_coef=coef, entropy_weights=entropy_weights,
                             **options)  # fmt: skip
            check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
            check_op(emu, "grpo_loss_from_logits_pass_", args[0].clone(), *args[1:], tol=[VALUES, VALUES, LOGITS_GRAD],
                     names=("logps", "entropy", "logits"))  # fmt: skip


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dr_grpo"])
def test_skip_empty_rows_with_one_token_rows(emu, loss_type, level):
    """skip_empty_rows for the loss types whose per-row means it changes: rows of no kept token (row 0; row 5,
    dropped by the sample mask), of one (rows 2 and 3: the first token, the last; a float mask weights row 3's 0.5)
    and longer ones. The row-weights kernel counts the rows with a kept token for the pass (token level), the loss
    kernel for the whole op (both levels); the whole op with the entropy bonus and loss_scale 0.5, as a number and as
    a tensor (read by the row-weights, loss and entropy kernels on the device)."""
    logits, ids, adv, mask, old, _ = make_problem(6, 5, 50, seed=60)
    mask[2:4] = False
    mask[2, 0] = mask[3, -1] = True
    mask[4, :2] = True
    sample_mask = torch.tensor([True, True, True, True, True, False])
    x, flat_ids = logits.float(), ids.reshape(-1)
    float_mask = mask.float()
    float_mask[3, -1] = 0.5
    options = dict(old_logps=old.float(), loss_type=loss_type, importance_sampling_level=level, sample_mask=sample_mask,
                   max_completion_length=7, loss_scale=0.5, skip_empty_rows=True)  # fmt: skip
    for row_mask in (mask, float_mask):
        if level == "token":
            check_op(emu, "grpo_loss_from_logits_pass", *pass_args(x, flat_ids, adv.float(), row_mask, **options),
                     tol=PASS_TOL, names=PASS_NAMES)  # fmt: skip
        for scale in (0.5, torch.tensor(0.5)):
            resolved = validate_grpo_loss_args(torch.empty(6, 5), adv.float(), row_mask,
                                               LossOptions(**{**options, "loss_scale": scale}))  # fmt: skip
            args = (x, flat_ids, adv.float(), row_mask, *resolved.op_args(), 0.9, 1.0, 0.0, 0.03, None, True)
            check_op(emu, "grpo_loss_from_logits", *args, tol=LOGITS_LOSS_TOL, names=LOGITS_LOSS_NAMES)


@pytest.mark.parametrize("lane", ["odd", "even"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_vocabulary_rows_low_precision(emu, dtype, lane):
    """Rows masked as a sampler masks them: every vocabulary entry -1e4 but a few real logits, all at odd (or all at
    even) indices, the chosen token and the row's max among them, V a multiple of the 8-element vectors (rows start
    on a 16-byte boundary): a vector's max (two elements per packed instruction) that dropped one lane of a pair
    would take -1e4 for the max and overflow. selective_log_softmax and the fused pass, checked by value."""
    rows, vocab = 6, 1000
    g = torch.Generator().manual_seed(61)
    logits = torch.full((rows, vocab), -1e4, dtype=torch.float64)
    parity = 1 if lane == "odd" else 0
    ids = torch.empty(rows, dtype=torch.int64)
    for r in range(rows):
        real = 2 * torch.randperm(vocab // 2, generator=g)[:5] + parity  # five indices of that parity
        logits[r, real] = 3.0 * torch.randn(5, generator=g, dtype=torch.float64)
        logits[r, real[0]] = logits[r, real].max() + 1.0 + r  # the max; the chosen token is the max in half the rows
        ids[r] = real[r % 2]
    assert (ids % 2 == parity).all() and (logits.argmax(1) % 2 == parity).all()
    x = logits.to(dtype)
    logps, _, _ = check_op(emu, "selective_log_softmax_forward", x, ids, 1.0, 1.0, 0.0, True)
    assert torch.isfinite(logps).all()
    softmax_round_trip(emu, x, ids, 0.8)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([0.7, -1.2])
    args = pass_args(x, ids, adv, mask, temperature=1.0, loss_type="grpo")
    logps, _, grad = check_op(emu, "grpo_loss_from_logits_pass", *args, tol=PASS_TOL, names=PASS_NAMES)
    assert torch.isfinite(logps).all() and torch.isfinite(grad.float()).all()


def test_logits_loss_strided_rows_new_gradient(emu):
    """The whole op on a ``logits[:, :-1]`` view (row stride V + 1, a NaN between the rows): the gradient
    in a new [N, V] tensor, V apart, at both levels (one pass, or two around the loss)."""
    logits, ids, adv, mask, old, _ = make_problem(seed=62)
    wide = torch.full((24, 51), float("nan"))
    wide[:, :-1] = logits.reshape(24, 50)
    x = wide[:, :-1]
    for level in ("token", "sequence"):
        options = LossOptions(old_logps=old.float(), loss_type="grpo", importance_sampling_level=level)
        resolved = validate_grpo_loss_args(torch.empty(4, 6), adv.float(), mask, options)
        args = (x, ids.reshape(-1), adv.float(), mask, *resolved.op_args(), 0.9, 1.0, 0.0, 0.02, None, True)
        check_op(emu, "grpo_loss_from_logits", *args, tol=LOGITS_LOSS_TOL, names=LOGITS_LOSS_NAMES)
