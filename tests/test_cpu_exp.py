"""The float exp of the CPU softmax rows (csrc/fast_math.h: host_expf_rows, used by cpu::row_softmax and the CPU
backward of selective_log_softmax) against float64 exp rounded to float32: at most 2 ulp.

Two views of it: the shipped kernel, whose backward writes exp((z - max) - log(sum)) itself when handed row
statistics max = log(sum) = E_p[z] - max = 0 and grad_logps = -1 (every float of (-100, 0] with a stride, the whole
range the rows use); and the function alone, compiled here with the build's flags (special values, overflow and
underflow, and its baseline and AVX2 copies writing the same bits).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import grpo_ext

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NEG_ZERO_BITS = 0x80000000
MINUS_100_BITS = 0xC2C80000  # -100.0f


def floats_between(first_bits: int, last_bits: int, stride: int) -> torch.Tensor:
    """The float32 values whose bit patterns (as unsigned) run from first_bits to last_bits by stride, both ends in."""
    bits = torch.arange(first_bits, last_bits + 1, stride, dtype=torch.int64)
    if int(bits[-1]) != last_bits:
        bits = torch.cat([bits, torch.tensor([last_bits])])
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def ulp_distance(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|got - round_to_float32(exp(x in float64))| in ulp (bit patterns of non-negative floats, subnormals too)."""
    want = torch.exp(x.double()).float()
    assert (got >= 0).all()
    return (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()


def kernel_exp(x: torch.Tensor, vocab: int = 4096) -> torch.Tensor:
    """exp(x) as the CPU backward of selective_log_softmax computes it: rows of x with zero row_stats (max, log(sum)),
    grad_logps = -1, no entropy gradient; column 0 holds each row's id (its entry is d logp / dz, not exp)."""
    n = x.numel()
    rows = -(-n // (vocab - 1))
    logits = torch.zeros(rows, vocab)
    flat = torch.cat([x, torch.full((rows * (vocab - 1) - n,), -1.0)])
    logits[:, 1:] = flat.view(rows, vocab - 1)
    ids = torch.zeros(rows, dtype=torch.int64)
    stats = torch.zeros(rows, 3)  # max = 0, log(sum) = 0, E_p[z] - max = 0
    grad = torch.ops.grpo_ext.selective_log_softmax_backward(-torch.ones(rows), None, logits, ids, stats, 1.0, 1.0, 0.0)
    return grad[:, 1:].reshape(-1)[:n]


def test_kernel_exp_within_2_ulp_over_the_rows_range():
    # Every 61st float of (-100, 0] (18 million values), every 7th of [-1, -0.5] and every 5th of (-100, -87]
    # (subnormal results below -87.34).
    x = torch.cat(
        [
            floats_between(NEG_ZERO_BITS, MINUS_100_BITS - 1, 61),
            floats_between(0xBF000000, 0xBF800000, 7),  # [-1, -0.5]
            floats_between(0xC2AE0000, MINUS_100_BITS - 1, 5),  # [-87, -100)
        ]
    )
    assert float(x.min()) > -100.0 and float(x.max()) == 0.0
    got = kernel_exp(x)
    dist = ulp_distance(got, x)
    worst = int(dist.argmax())
    assert int(dist.max()) <= 2, f"exp({float(x[worst])!r}) = {float(got[worst])!r}: {int(dist.max())} ulp"


def test_kernel_exp_cut_and_nan():
    # The rows' own rules around the exp: d <= -100 and -inf count exactly 0, NaN stays NaN.
    x = torch.tensor([-100.0, -1e30, float("-inf"), float("nan"), -99.99999, 0.0])
    got = kernel_exp(x, vocab=8)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.isnan(got[3])
    assert got[4] > 0 and got[5] == 1.0


def test_forward_matches_float64_on_rows_spanning_the_range():
    # Rows whose logits span [-100, 0] below their max (and a few beyond the cut): log-probs and entropy against
    # float64 log_softmax, on 1 and 2 threads alike (bitwise).
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 3001
    logits = -100.0 * torch.rand(rows, vocab, generator=g, dtype=torch.float64)
    logits[:, 0] = 0.0
    logits[::4, 1:40] = -120.0 - 50.0 * torch.rand(rows // 4, 39, generator=g, dtype=torch.float64)
    logits[1::4] *= 0.2  # p spread over many entries
    logits += 30.0 * torch.randn(rows, 1, generator=g, dtype=torch.float64)  # max not at 0
    ids = torch.randint(0, vocab, (rows,), generator=g)
    x = logits.float()
    ref = torch.log_softmax(x.double(), -1)
    ref_logps = ref.gather(1, ids.unsqueeze(1)).squeeze(1)
    ref_entropy = -(ref.exp() * ref).sum(-1)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(torch.ops.grpo_ext.selective_log_softmax_forward(x, ids, 1.0, 1.0, 0.0, True))
    finally:
        torch.set_num_threads(threads)
    logps, entropy, _ = results[0]
    torch.testing.assert_close(logps.double(), ref_logps, rtol=2e-6, atol=2e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=2e-6, atol=2e-5)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


CHECK_CPP = r"""
#include <cstdio>
#include <vector>
#include "fast_math.h"

// Each exp of the rows as a loop, compiled three times as csrc/cpu/row_utils.h compiles the softmax loops: baseline
// x86-64, AVX2 and AVX-512 (no FMA contraction there, as in row_utils.h).
#define EXP_LOOPS(suffix)                                                                    \
  void rows_##suffix(const float* x, float* y, long n) {                                     \
    for (long i = 0; i < n; ++i) y[i] = grpo_ext::host_expf_rows(x[i]);                      \
  }                                                                                          \
  void nonpositive_##suffix(const float* x, float* y, long n) {                              \
    for (long i = 0; i < n; ++i) y[i] = grpo_ext::host_expf_nonpositive(x[i]);               \
  }
EXP_LOOPS(baseline)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2")
EXP_LOOPS(avx2)
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#pragma GCC optimize("fp-contract=off")
EXP_LOOPS(avx512)
#pragma GCC pop_options
bool has(const char* isa) {
  return isa[4] == '2' ? __builtin_cpu_supports("avx2")
                       : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#else
EXP_LOOPS(avx2)
EXP_LOOPS(avx512)
bool has(const char*) { return false; }
#endif

using Loop = void (*)(const float*, float*, long);

// stdin: float32 values; stdout: host_expf_rows of each from the baseline, AVX2 and AVX-512 loops, then
// host_expf_nonpositive's three (a copy this CPU cannot run is the baseline's again).
int main() {
  std::vector<float> x;
  float buffer[4096];
  size_t got;
  while ((got = fread(buffer, sizeof(float), 4096, stdin)) > 0) x.insert(x.end(), buffer, buffer + got);
  std::vector<float> y(x.size());
  const Loop loops[6] = {rows_baseline,        has("avx2") ? rows_avx2 : rows_baseline,
                         has("avx512f") ? rows_avx512 : rows_baseline, nonpositive_baseline,
                         has("avx2") ? nonpositive_avx2 : nonpositive_baseline,
                         has("avx512f") ? nonpositive_avx512 : nonpositive_baseline};
  for (Loop loop : loops) {
    loop(x.data(), y.data(), long(x.size()));
    fwrite(y.data(), sizeof(float), y.size(), stdout);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def exp_program(tmp_path_factory) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path_factory.mktemp("cpu_exp")
    (folder / "check.cpp").write_text(CHECK_CPP)
    program = folder / "check"
    # CMakeLists.txt's flags for the CPU kernels (no -march: baseline x86-64, no FMA)
    subprocess.run([compiler, "-O3", "-std=gnu++20", "-fno-trapping-math", f"-I{CSRC}", str(folder / "check.cpp"),
                    "-o", str(program)], check=True)  # fmt: skip
    return program


def host_exps(program: Path, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """host_expf_rows(x) from its baseline, AVX2 and AVX-512 loops, then host_expf_nonpositive(x) from its three."""
    out = subprocess.run([str(program)], input=x.numpy().tobytes(), capture_output=True, check=True).stdout
    return torch.frombuffer(bytearray(out), dtype=torch.float32).view(6, x.numel()).unbind()


def host_exp(program: Path, x: torch.Tensor) -> torch.Tensor:
    """host_expf_rows(x), after checking that its three copies give the same bits."""
    baseline, avx2, avx512 = host_exps(program, x)[:3]
    assert torch.equal(baseline.view(torch.int32), avx2.view(torch.int32))
    assert torch.equal(baseline.view(torch.int32), avx512.view(torch.int32))
    return baseline


def test_host_expf_rows_special_values(exp_program):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([-inf, -1e30, -200.0, -104.0, -103.98, -103.9, -100.0, -87.5, 0.0, -0.0, 1e-40, 88.72,
                      88.7228, 88.723, 89.0, 200.0, inf, nan])  # fmt: skip
    baseline = host_exp(exp_program, x)
    assert baseline[:4].tolist() == [0.0, 0.0, 0.0, 0.0]  # exp(-104) < 2^-150 rounds to 0; -inf gives 0
    assert baseline[13:17].tolist() == [inf] * 4  # above log(FLT_MAX) = 88.72284
    assert torch.isnan(baseline[17])
    finite = torch.arange(4, 13)
    assert int(ulp_distance(baseline[finite], x[finite]).max()) <= 2


def test_host_expf_rows_dense_within_2_ulp(exp_program):
    # Every 199th float of [-104, 0] (underflow to subnormals and to 0 included) and of [0, 88.72] (up to the largest
    # finite result), every 7th of [-104, -87]; the baseline, AVX2 and AVX-512 loops agree bit for bit.
    x = torch.cat([floats_between(NEG_ZERO_BITS, 0xC2D00000, 199), floats_between(0, 0x42B17217, 199),
                   floats_between(0xC2AE0000, 0xC2D00000, 7)])  # fmt: skip
    baseline = host_exp(exp_program, x)
    assert torch.isfinite(baseline).all()
    dist = ulp_distance(baseline, x)
    worst = int(dist.argmax())
    assert int(dist.max()) <= 2, f"exp({float(x[worst])!r}) = {float(baseline[worst])!r}: {int(dist.max())} ulp"


def test_host_expf_nonpositive_is_host_expf_rows_above_the_cut(exp_program):
    # The softmax sums' exp (d = z - max in [-87, 0]): every 13th float of that range, bit for bit host_expf_rows
    # (so within its 2 ulp) in all three copies; NaN stays NaN (a NaN logit makes its row NaN).
    x = torch.cat([floats_between(NEG_ZERO_BITS, 0xC2AE0000, 13), torch.tensor([-87.0, -0.0, 0.0, float("nan")])])
    rows = host_exp(exp_program, x)
    for copy in host_exps(exp_program, x)[3:]:
        assert torch.equal(copy[:-1].view(torch.int32), rows[:-1].view(torch.int32))
        assert torch.isnan(copy[-1])


def test_forward_drops_terms_below_the_float_cut():
    # A float32 row's term counts 0 where d = z - max <= -87 (exp below float's normal range, as CUDA's __expf): its
    # gradient entry is exactly 0, while one just above the cut is not; -inf gives 0 too.
    logits = torch.tensor([[0.0, -86.5, -87.0, -87.5, float("-inf"), -1.0]], requires_grad=True)
    out = grpo_ext.grpo_loss_from_logits(logits.unsqueeze(0), torch.zeros(1, 1, dtype=torch.int64),
                                         torch.ones(1), torch.ones(1, 1))  # fmt: skip
    out.loss.backward()
    grad = logits.grad[0]
    assert grad[1] != 0 and grad[5] != 0
    assert grad[2:5].tolist() == [0.0, 0.0, 0.0]


VOCABS = (1, 15, 16, 17, 100, 1000)
# Reads the rows (5 per vocabulary in VOCABS, float32) and ids (int64) from stdin, drawn by the parent: torch's own
# random and math kernels differ between CPU capabilities, so the child computes nothing but the ops under test.
CAPABILITY_SCRIPT = """
import sys, torch, grpo_ext
torch.set_num_threads(1)
data = sys.stdin.buffer.read()
out, at = [], 0
for vocab in VOCABS:
    x = torch.frombuffer(bytearray(data[at : at + 20 * vocab]), dtype=torch.float32).view(5, vocab)
    ids = torch.frombuffer(bytearray(data[at + 20 * vocab : at + 20 * vocab + 40]), dtype=torch.int64)
    at += 20 * vocab + 40
    for dtype, cap in ((torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.float32, 4.0)):
        xs = x.to(dtype)
        logps, entropy, stats = torch.ops.grpo_ext.selective_log_softmax_forward(xs, ids, 0.7, 1.0, cap, True)
        grad = torch.ops.grpo_ext.selective_log_softmax_backward(torch.linspace(-1, 1, 5), torch.linspace(1, 2, 5),
                                                                 xs, ids, stats, 0.7, 1.0, cap)
        out += [logps, entropy, grad.float().view(-1)]
        for coef in (0.0, 0.1):
            leaf = xs.view(1, 5, vocab).clone().requires_grad_(True)
            res = grpo_ext.grpo_loss_from_logits(leaf, ids.view(1, 5), torch.ones(1), torch.ones(1, 5),
                                                 temperature=0.7, logit_softcap=cap or None, entropy_coef=coef)
            res.loss.backward()
            out += [res.loss.detach().view(1), leaf.grad.float().view(-1)]
sys.stdout.buffer.write(torch.cat(out).numpy().tobytes())
""".replace("VOCABS", repr(VOCABS))


def test_softmax_rows_same_bits_under_every_cpu_capability():
    # The shipped kernels' softmax loops (row_utils.h: baseline, AVX2 and AVX-512 copies, capped by
    # ATEN_CPU_CAPABILITY as torch's own are) and their elementwise row loops (logits_rows.h) give the same bits on one
    # machine: selective_log_softmax forward and backward, the fused pass with and without the entropy bonus, in
    # float32 and bfloat16, with and without a soft cap.
    import os
    import sys

    g = torch.Generator().manual_seed(3)
    rows = []
    for vocab in VOCABS:
        x = 3 * torch.randn(5, vocab, generator=g)
        if vocab > 1:
            x[0, 0] = float("-inf")
            x[1, 1] = x[1, 0] - 90.0  # below the cut
        rows += [x.numpy().tobytes(), torch.randint(0, vocab, (5,), generator=g).numpy().tobytes()]
    results = {}
    for capability in ("default", "avx2", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        done = subprocess.run([sys.executable, "-c", CAPABILITY_SCRIPT], input=b"".join(rows), env=env,
                              capture_output=True, check=True)  # fmt: skip
        results[capability] = torch.frombuffer(bytearray(done.stdout), dtype=torch.int32)
    assert results["default"].numel() > 0
    assert torch.equal(results["default"], results["avx2"])
    assert torch.equal(results["default"], results[None])
