"""grpo_loss_from_hidden's kept rows (issue 31 item 2): only the tokens the masks keep go through the LM head, with
the same results as the path that projects every row (bit for bit where the math is the same) and as the float64
reference; the default chunk from the weight gradient's size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import grpo_ext
from conftest import DEVICES, assert_close
from grpo_ext import reference
from grpo_ext.ops.grpo_loss_from_hidden import default_chunk_size, hidden_loss, one_chunk_rows
from grpo_ext.validation.options import LOSS_TYPES
from test_grpo_loss_from_hidden import make_problem, run


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # fake tensors: the CUDA rule needs no GPU
def test_default_chunk_holds_as_many_logits_as_the_weight_gradient(device):
    """One rule on CPU and CUDA (issue 31): a chunk's logits may take the float32 [V, H] weight gradient's size, at
    least 256 MiB, the largest power of two of rows that fits, never more than the rows; flat in N."""

    def chosen(rows: int, vocab: int, size: int, dtype: torch.dtype) -> int:
        with FakeTensorMode():  # shapes, dtype and device only: no memory, no GPU
            hidden = torch.empty(rows, size, dtype=dtype, device=device)
            weight = torch.empty(vocab, size, dtype=dtype, device=device)
            assert hidden.device.type == device
            return default_chunk_size(hidden, weight)

    cases = [(8192, 151936, 4096, torch.bfloat16), (65536, 151936, 4096, torch.bfloat16),
             (10**6, 151936, 512, torch.float32), (10**6, 32000, 64, torch.float32), (100, 32000, 64, torch.float32),
             (3000, 1000, 64, torch.float16)]  # fmt: skip
    for rows, vocab, size, dtype in cases:
        chunk = chosen(rows, vocab, size, dtype)
        logit_bytes = vocab * torch.empty((), dtype=dtype).element_size()
        budget = max(256 << 20, vocab * size * 4)
        assert chunk == rows or (chunk * logit_bytes <= budget < 2 * chunk * logit_bytes), (rows, vocab, size, chunk)
        assert chunk == rows or (chunk < rows and chunk & (chunk - 1) == 0)  # a power of two below the rows
    # the H100 case of issue 31 (one chunk: 48.6 ms instead of 256 MiB chunks' 70.4 ms), flat in N beyond it
    assert chosen(8192, 151936, 4096, torch.bfloat16) == chosen(65536, 151936, 4096, torch.bfloat16) == 8192
    assert chosen(10**6, 151936, 512, torch.float32) == 512  # a chunk of float32 logits = the weight gradient
    assert chosen(10**6, 32000, 64, torch.float32) == 2048  # the 256 MiB floor
    assert chosen(100, 32000, 64, torch.float32) == 100


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_one_chunk_where_it_peaks_no_higher(device):
    """With a weight gradient, every row goes in one chunk up to the rule's chunk + H rows (a half-width compute
    weight, or a master weight of twice the compute width): past the chunk, the chunked path holds a [V, H] buffer
    in the compute dtype that one chunk does not (the cast, or the narrowed accumulator). float32 GEMMs on a float32
    weight save nothing, and nor does a frozen weight."""

    def chosen(rows: int, weight_dtype: torch.dtype, compute: torch.dtype, weight_grad: bool, size: int = 896) -> int:
        with FakeTensorMode():
            hidden = torch.empty(rows, size, dtype=compute, device=device)
            weight = torch.empty(151936, size, dtype=weight_dtype, device=device)
            return default_chunk_size(hidden, weight, weight_grad=weight_grad)

    for weight_dtype in (torch.bfloat16, torch.float32):  # a bf16 weight; a float32 master weight under bf16 GEMMs
        assert chosen(1024 + 896, weight_dtype, torch.bfloat16, True) == 1024 + 896
        assert chosen(1024 + 897, weight_dtype, torch.bfloat16, True) == 1024
        assert chosen(1024 + 896, weight_dtype, torch.bfloat16, False) == 1024  # no gradient, no saving
        assert chosen(8192, weight_dtype, torch.bfloat16, True) == 1024  # the 0.5B step at T 1024: still chunked
    assert chosen(513, torch.float32, torch.float32, True, size=512) == 512  # float32 throughout: nothing saved
    # grad mode and requires_grad when not told
    with FakeTensorMode():
        hidden = torch.empty(1024 + 896, 896, dtype=torch.bfloat16, device=device)
        weight = torch.empty(151936, 896, dtype=torch.bfloat16, device=device, requires_grad=True)
        assert default_chunk_size(hidden, weight) == 1024 + 896
        with torch.no_grad():
            assert default_chunk_size(hidden, weight) == 1024


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_one_chunk_peak_is_no_higher_than_the_chunked_one(device, weight_dtype, monkeypatch):
    """The claim behind the rule above, measured: the default's one chunk (chunk + H/2 rows) against the rule's
    chunk forced, bf16 GEMMs, a bf16 or float32 master weight: the same gradients (to bf16 rounding of the order)
    and a peak no higher (CPU: the profiler's allocation trace; CUDA: the allocator's peak)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import memory_sites

    # the rule without its 256 MiB floor, so that a small head has several chunks: 128 rows of V 4096 here
    monkeypatch.setattr(grpo_ext.ops.lm_head, "hidden_chunk_budget", lambda vocab, size: vocab * size * 4)
    batch, length, size, vocab = 11, 16, 64, 4096  # 176 rows = 128 + 48
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(batch, length, size, generator=g).to(device)
    weight = (0.3 * torch.randn(vocab, size, generator=g)).to(device, weight_dtype)
    ids = torch.randint(0, vocab, (batch, length), generator=g).to(device)
    adv, mask = torch.randn(batch, generator=g).to(device), torch.ones(batch, length, device=device)
    assert default_chunk_size(hidden.to(torch.bfloat16), weight.requires_grad_(True)) == batch * length

    def peak_and_grads(chunk_size):
        h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)

        def step():
            loss = grpo_ext.grpo_loss_from_hidden(h, w, ids, adv, mask, compute_dtype=torch.bfloat16,
                                                  chunk_size=chunk_size).loss  # fmt: skip
            loss.backward()

        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base, (h.grad, w.grad)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        trace = memory_sites.profiler_trace(prof)
        return memory_sites.peak_sites({"device_traces": [trace]})["peak_bytes"], (h.grad, w.grad)

    for chunk_size in (None, 128):  # warm-up: cuBLAS's workspace, allocated at a handle's first GEMM, stays
        peak_and_grads(chunk_size)
    one, one_grads = peak_and_grads(None)
    chunked, chunked_grads = peak_and_grads(128)
    for a, b in zip(one_grads, chunked_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
    assert one <= chunked, (one, chunked)


@pytest.mark.parametrize(("kept", "projections"), [(176, 1), (192, 1), (200, 2)])
@pytest.mark.parametrize("compiled", [False, True])
def test_one_chunk_counts_the_kept_rows(kept, projections, compiled, monkeypatch):
    """Without chunk_size, the one-chunk limit (the rule's chunk + H: 128 + 64 here) applies to the rows the masks
    keep, not to B x T (352): a padded batch whose kept rows fit goes in one chunk; a chunk_size given is kept. The
    same under torch.compile (the opaque op counts the kept rows as the eager path does)."""
    monkeypatch.setattr(grpo_ext.ops.lm_head, "hidden_chunk_budget", lambda vocab, size: vocab * size * 4)
    calls = []
    project = hidden_module().project
    monkeypatch.setattr(hidden_module(), "project", lambda *a: calls.append(a[0].shape[0]) or project(*a))
    batch, length, size, vocab = 11, 32, 64, 4096
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(batch, length, size, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, size, generator=g)).to(torch.bfloat16).requires_grad_(True)
    ids, adv = torch.randint(0, vocab, (batch, length), generator=g), torch.randn(batch, generator=g)
    mask = (torch.arange(batch * length) < kept).reshape(batch, length).float()
    assert one_chunk_rows(hidden.to(torch.bfloat16), weight) == 192
    losses = []
    for chunk_size in (None, 128):
        calls.clear()

        def loss(hidden, weight, chunk_size=chunk_size):
            return grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, mask, compute_dtype=torch.bfloat16,
                                                  chunk_size=chunk_size)  # fmt: skip

        if compiled:
            torch._dynamo.reset()
            loss = torch.compile(loss, backend="aot_eager", fullgraph=False)
        out = loss(hidden, weight)
        out.loss.backward()
        losses.append(out.loss.detach())
        assert sum(calls) == kept and len(calls) == (projections if chunk_size is None else -(-kept // 128))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_one_chunk_of_logits_alive_at_a_time(level, monkeypatch):
    """Each chunk's logits are freed before the next chunk's are projected (sequence-level losses: in both passes):
    rebinding the name kept two chunks alive at each projection, one chunk of logits above the peak."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import memory_sites

    batch, length, size, vocab, chunk = 8, 32, 16, 2000, 64
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(batch, length, size, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, size, generator=g)).requires_grad_(True)
    ids, adv = torch.randint(0, vocab, (batch, length), generator=g), torch.randn(batch, generator=g)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                with_stack=True) as prof:  # fmt: skip
        out = grpo_ext.grpo_loss_from_hidden(hidden, weight, ids, adv, torch.ones(batch, length), chunk_size=chunk,
                                             importance_sampling_level=level)  # fmt: skip
    alive, most, projected = set(), 0, 0
    for event in memory_sites.profiler_trace(prof):
        if event["action"] == "alloc" and any(f["name"].startswith("project") for f in event["frames"]):
            alive.add(event["addr"])
            projected += 1
        elif event["action"] == "free_completed":
            alive.discard(event["addr"])
        most = max(most, len(alive))
    assert projected == batch * length // chunk * (2 if level == "sequence" else 1) and most == 1
    assert torch.isfinite(out.loss)


def hidden_module():
    """The module grpo_ext.ops.grpo_loss_from_hidden (its name is shadowed by the function in grpo_ext.ops)."""
    return sys.modules["grpo_ext.ops.grpo_loss_from_hidden"]


def call_leaves(args: tuple, ref_head, **kwargs):
    """hidden_loss on fresh leaves of (hidden, weight, bias), backward: (output, [grad hidden, weight, bias])."""
    hidden, weight, bias, *rest = args
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = hidden_loss(leaves[0], leaves[1], *rest, lm_head_bias=leaves[2], ref_head=ref_head, return_token_logps=True,
                      **kwargs)  # fmt: skip
    out.loss.backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gathered_rows_equal_a_compacted_input_bit_for_bit(loss_type, level, monkeypatch):
    """Masked rows cost no GEMM work and change no bit: each row keeps one run of L tokens (left and right padding),
    and the log-probs, entropies and every gradient equal, to the bit, the path without gathering on the manually
    compacted [B, L] input (the same rows in the same chunks: the same GEMMs and passes), with every per-token input
    (old, reference head, is_weights, policy_weights, entropy_weights) compacted alike and the normalizers unchanged
    (dr_grpo's T given explicitly)."""
    batch, length, size, vocab, kept_len = 5, 12, 16, 37, 5
    hidden, weight, bias, ids, adv, _, old, _ = make_problem(batch, length, size, vocab, seed=40)
    starts = torch.tensor([0, 3, 7, 2, 5])
    positions = starts.unsqueeze(1) + torch.arange(kept_len)  # [B, L] the kept tokens of each row
    mask = torch.zeros(batch, length, dtype=torch.bool).scatter_(1, positions, True)
    g = torch.Generator().manual_seed(41)
    per_token = {"old_logps": old, "is_weights": 0.5 + torch.rand(batch, length, generator=g, dtype=torch.float64),
                 "policy_weights": 0.5 + torch.rand(batch, length, generator=g, dtype=torch.float64),
                 "entropy_weights": (torch.rand(batch, length, generator=g) < 0.6).double()}  # fmt: skip
    ref_hidden = torch.randn(batch, length, size, generator=g, dtype=torch.float64)
    ref_weight = weight + 0.05

    def compact(t: Tensor) -> Tensor:
        return t.gather(1, positions if t.dim() == 2 else positions.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

    options = dict(beta=0.05, loss_type=loss_type, importance_sampling_level=level, temperature=0.8,
                   entropy_coef=0.01, chunk_size=4)  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        low = [t.to(dtype) for t in (hidden, weight, bias, ref_hidden, ref_weight)]
        inputs = {k: v.float() for k, v in per_token.items()}
        monkeypatch.setattr(hidden_module(), "_GATHER_KEPT_ROWS", True)
        got, grads = call_leaves((*low[:3], ids, adv.float(), mask), (low[3], low[4], None), **inputs, **options)
        monkeypatch.setattr(hidden_module(), "_GATHER_KEPT_ROWS", False)  # the path before gathering
        small, small_grads = call_leaves(
            (compact(low[0]), low[1], low[2], compact(ids), adv.float(), torch.ones(batch, kept_len, dtype=torch.bool)),
            (compact(low[3]), low[4], None), **{k: compact(v) for k, v in inputs.items()}, **options,
            max_completion_length=length,
        )  # fmt: skip
        # the loss and metrics reduce over [B, T] here and [B, L] there (another summation order): to float rounding
        assert_close(got.loss, small.loss, rtol=1e-6, atol=1e-7, msg=str(dtype))
        for name, value in small.metrics.items():
            assert_close(got.metrics[name], value, rtol=1e-6, atol=1e-7, msg=f"{name} {dtype}")
        pairs = [("logps", got.token_logps, small.token_logps), ("entropy", got.token_entropy, small.token_entropy),
                 ("grad hidden", grads[0], small_grads[0])]  # fmt: skip
        for name, a, b in pairs:
            assert torch.equal(compact(a), b), (name, dtype)
            assert (a[~mask] == 0).all(), (name, dtype)  # rows never read: exactly 0
        assert torch.equal(grads[1], small_grads[1]) and torch.equal(grads[2], small_grads[2]), dtype


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("max_segments", [128, 3])  # 3: runs bridged over short gaps (masked rows in the GEMMs)
def test_gathered_rows_match_ungathered_and_reference(loss_type, level, max_segments, monkeypatch):
    """A scattered mask (many runs), a dropped sample, NaN hidden states at the masked rows, every per-token input:
    the gathered op scores exactly the kept rows (or the bridged runs), matches itself without gathering and the
    float64 reference, and the masked rows' hidden gradient is exactly 0."""
    batch, length, size, vocab = 6, 9, 16, 37
    hidden, weight, bias, ids, adv, _, old, _ = make_problem(batch, length, size, vocab, seed=42)
    g = torch.Generator().manual_seed(43)
    mask = torch.rand(batch, length, generator=g) < 0.5
    mask[2] = True
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    kept = mask & (sample_mask != 0).unsqueeze(1)
    hidden = torch.where(kept.unsqueeze(-1), hidden, float("nan"))  # never read
    ref_weight = weight - 0.05
    ref_hidden = hidden.nan_to_num(0.5)
    options = dict(old_logps=old, is_weights=0.5 + torch.rand(batch, length, generator=g, dtype=torch.float64),
                   policy_weights=torch.rand(batch, 1, generator=g, dtype=torch.float64), sample_mask=sample_mask,
                   beta=0.05, loss_type=loss_type, importance_sampling_level=level, temperature=0.8,
                   entropy_coef=0.02, entropy_weights=torch.rand(batch, length, generator=g, dtype=torch.float64),
                   num_items_in_batch=17.0 if loss_type == "dapo" else None)  # fmt: skip
    args = (hidden, weight, bias, ids, adv, mask)
    monkeypatch.setattr(hidden_module(), "MAX_SEGMENTS", max_segments)
    projected = []
    real_project = hidden_module().project
    monkeypatch.setattr(hidden_module(), "project", lambda h, *a: projected.append(h.shape[0]) or real_project(h, *a))
    got, grads = call_leaves(args, (ref_hidden, ref_weight, None), **options, chunk_size=4)
    passes = 3 if level == "sequence" or loss_type == "vespo" else 2  # reference head, policy (and its second pass)
    if max_segments == 128:
        assert sum(projected) == passes * int(kept.sum())  # the masked rows cost no GEMM
    else:
        assert int(kept.sum()) * passes < sum(projected) < batch * length * passes
    monkeypatch.setattr(hidden_module(), "_GATHER_KEPT_ROWS", False)
    plain, plain_grads = call_leaves(args, (ref_hidden, ref_weight, None), **options, chunk_size=4)
    assert_close(got.loss, plain.loss, rtol=1e-13, atol=1e-15)
    for name, value in plain.metrics.items():
        assert_close(got.metrics[name], value, rtol=1e-13, atol=1e-15, msg=name)
    got_all, plain_all = (got.token_logps, got.token_entropy, *grads), (plain.token_logps, plain.token_entropy,
                                                                        *plain_grads)  # fmt: skip
    for a, b in zip(got_all, plain_all, strict=True):
        assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert (grads[0][~kept] == 0).all() and torch.isfinite(grads[0]).all()
    assert (got.token_logps[~kept] == 0).all() and (got.token_entropy[~kept] == 0).all()
    ref_logps = reference.selective_log_softmax(ref_hidden @ ref_weight.t(), ids, temperature=0.8).logps.detach()
    expected, expected_grads = run(reference, *args, ref_logps=ref_logps, **options)
    assert_close(got.loss, expected.loss, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, expected_grads, strict=True):
        assert_close(a, b, rtol=1e-9, atol=1e-12)
    for name, value in expected.metrics.items():
        assert_close(got.metrics[name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_no_kept_row_costs_no_gemm(monkeypatch):
    """Every token masked: no logits at all; the loss and its gradients (all 0) are the reference's."""
    hidden, weight, bias, ids, adv, mask, old, _ = make_problem(seed=44)
    mask = torch.zeros_like(mask)
    projected = []
    real_project = hidden_module().project
    monkeypatch.setattr(hidden_module(), "project", lambda h, *a: projected.append(h.shape[0]) or real_project(h, *a))
    got, grads = run(grpo_ext, hidden, weight, bias, ids, adv, mask, old_logps=old, chunk_size=3)
    assert projected == []
    expected, expected_grads = run(reference, hidden, weight, bias, ids, adv, mask, old_logps=old)
    assert_close(got.loss, expected.loss, rtol=0, atol=1e-15)
    for a, b in zip(grads, expected_grads, strict=True):
        assert (a == 0).all() and (b == 0).all()
