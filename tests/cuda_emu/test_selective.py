"""selective_log_softmax's kernels on the emulated device, driven by their launchers: the forward and the backward
from the forward's row statistics (as the autograd function chains them), V from 1 to 50257 (never a multiple of a
block or vector width), every float dtype, temperature != 1, logit_scale and logit_softcap, strided rows, -inf and
NaN logits, confident tokens, rows whose upstream gradients are exactly 0 (an exactly zero gradient whatever their
logits hold), and an id outside the vocabulary (a device assert). The cases are the CUDA tests'
(tests/test_selective_log_softmax.py) and more; rows far from zero and bf16 rows masked with -1e4 are in
test_logits.py, beside the fused pass they share."""

from __future__ import annotations

import pytest
import torch

from test_selective_log_softmax import make_logits, poisoned_logits

from .checks import LOGITS_GRAD, check_op

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
VOCABS = [1, 7, 33, 1000, 4099, 50257]
#: (logit_scale, logit_softcap) beyond the default: the scale alone, the cap alone, both (0: no cap).
LOGIT_CASES = [(0.6, 0.0), (1.0, 4.0), (1.7, 2.5)]


def softmax_round_trip(emu, logits, ids, temperature: float, *, entropy: bool = True, grad_entropy: bool = True,
                       logit: tuple[float, float] = (1.0, 0.0)):  # fmt: skip
    """The forward, then the backward from the forward's row statistics (as the autograd function chains them).

    ``logit``: (logit_scale, logit_softcap), 0 for no cap (docs/math.md section 2).
    """
    logps, _, row_stats = check_op(emu, "selective_log_softmax_forward", logits, ids, temperature, *logit, entropy)
    rows = logits.shape[0]
    g = torch.Generator().manual_seed(rows)
    grad_logps = torch.randn(rows, generator=g, dtype=logps.dtype)
    grad_ent = torch.randn(rows, generator=g, dtype=logps.dtype) if grad_entropy else None
    check_op(emu, "selective_log_softmax_backward", grad_logps, grad_ent, logits, ids, row_stats, temperature, *logit)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_vocabularies(emu, vocab, temperature):
    logits, ids = make_logits(6 if vocab < 10000 else 3, vocab, seed=vocab)
    softmax_round_trip(emu, logits.float(), ids, temperature)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [33, 4099])
def test_selective_log_softmax_dtypes(emu, dtype, vocab):
    logits, ids = make_logits(5, vocab, seed=3)
    softmax_round_trip(emu, logits.to(dtype), ids.int() if dtype == torch.float16 else ids, 0.9,
                       grad_entropy=dtype != torch.bfloat16)  # fmt: skip


def test_selective_log_softmax_strided_infinite_and_nan_logits(emu):
    logits, ids = make_logits(12, 33, seed=5)
    logits[2, :5] = float("-inf")  # masked vocabulary entries
    ids[2] = 10
    logits[7, 4] = float("nan")  # a NaN logit: the row's outputs are NaN, as torch's
    wide = torch.zeros(12, 66, dtype=torch.float64)
    wide[:, ::2] = logits
    for view in (wide[:, ::2], wide.float()[:, ::2], logits.t().contiguous().t()):  # vocab stride 2; row stride 1
        assert not view.is_contiguous()
        softmax_round_trip(emu, view, ids, 1.0)
    softmax_round_trip(emu, logits.float(), ids, 1.3, entropy=False, grad_entropy=False)


def test_selective_log_softmax_confident_tokens(emu):
    g = torch.Generator().manual_seed(4)
    logits = 30.0 + 0.5 * torch.randn(8, 1000, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 1000, (8,), generator=g)
    logits[torch.arange(8), ids] += torch.linspace(14.0, 20.0, 8, dtype=torch.float64)
    softmax_round_trip(emu, logits.float(), ids, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("logit", [(1.0, 0.0), (1.7, 2.5)])
def test_selective_log_softmax_zero_upstream_rows_get_exactly_zero_gradient(emu, dtype, logit):
    """docs/math.md, "Non-finite inputs": a row whose log-prob and entropy gradients are both exactly 0 gets an
    exactly zero gradient whatever its logits hold (NaN, +-inf, at the chosen token or elsewhere; issue 31); a -inf
    chosen logit with an upstream gradient gets d logp / dz = 1 there, not 0 * inf. Contiguous and strided rows."""
    logits, ids = poisoned_logits(33, seed=31)
    g = torch.Generator().manual_seed(31)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    grad_logps = torch.randn(9, generator=g, dtype=acc)
    grad_logps[:7] = 0.0
    grad_logps[3] = -0.0
    grad_ent = torch.randn(9, generator=g, dtype=acc)
    grad_ent[2:7] = 0.0  # rows 0 and 1 (-inf only) keep an entropy gradient: finite
    wide = torch.zeros(9, 66, dtype=dtype)
    wide[:, ::2] = logits.to(dtype)
    for x in (logits.to(dtype), wide[:, ::2]):
        for entropy_grad, inert in ((grad_ent, slice(2, 7)), (None, slice(0, 7))):
            _, _, row_stats = check_op(emu, "selective_log_softmax_forward", x, ids, 0.8, *logit, True)
            (grad,) = check_op(emu, "selective_log_softmax_backward", grad_logps, entropy_grad, x, ids, row_stats, 0.8,
                               *logit, tol=LOGITS_GRAD)  # fmt: skip
            assert torch.isfinite(grad.double()).all()
            assert torch.equal(grad[inert], torch.zeros_like(grad[inert]))


def test_selective_log_softmax_id_outside_the_vocabulary_is_a_device_assert(emu):
    from .client import EmuError

    logits, ids = make_logits(4, 9, seed=1)
    ids[2] = 9
    with pytest.raises(EmuError, match="device assert failed: id >= 0 && id < vocab"):
        emu.selective_log_softmax_forward(logits.float(), ids, 1.0, 1.0, 0.0, True)


@pytest.mark.parametrize("logit", LOGIT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_log_softmax_logit_scale_and_softcap(emu, dtype, logit):
    logits, ids = make_logits(5, 4099, seed=13)
    softmax_round_trip(emu, logits.to(dtype), ids, 0.8, logit=logit)
