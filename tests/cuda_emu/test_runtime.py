"""The harness itself: each detector reports the bug it exists for, and the emulated intrinsics compute what CUDA's
do (selftest_kernels.cuh holds one kernel per bug)."""

from __future__ import annotations

import pytest
import torch

from .client import EmuError


@pytest.mark.parametrize(
    ("kernel", "threads", "message"),
    [
        ("divergent_barrier", 32, "divergent __syncthreads"),
        ("early_exit_barrier", 32, "exited while other threads of its block wait"),
        ("deadlock", 32, "deadlock"),
        ("shuffle_outside_mask", 32, "outside the mask"),
        ("lane_not_in_mask", 32, "does not name it"),
        ("missing_barrier", 64, "differs between the forward and"),
        ("device_assert", 32, "device assert failed: threadIdx.x < 8"),
        ("bounded", 128, r"exceed the kernel's __launch_bounds__\(64\)"),
        ("bounded", 2048, "invalid block"),
        ("dynamic_shared", 32, "dynamic shared memory"),
        ("shared_overflow", 32, "out of bounds for type 'float \\[32\\]'|heap-buffer-overflow"),
        ("global_overflow", 32, "heap-buffer-overflow"),
    ],
)
def test_each_bug_is_reported(emu, kernel, threads, message):
    with pytest.raises(EmuError, match=message):
        emu.selftest_bug(kernel, threads)


def test_a_correct_launch_passes(emu):
    assert torch.equal(emu.selftest_bug("bounded", 64), torch.ones(64))


@pytest.mark.parametrize("threads", [32, 96])
def test_warp_intrinsics(emu, threads):
    got = emu.selftest_warp_intrinsics(threads)
    lane = torch.arange(threads) % 32
    expected = torch.stack(
        [
            torch.full((threads,), 496),  # butterfly sum of the lane ids
            torch.where(lane % 8 >= 3, lane - 3, lane),  # up 3, width 8
            torch.where(lane % 16 + 5 < 16, lane + 5, lane),  # down 5, width 16
            10 * ((lane & ~3) + ((lane + 7) & 3)),  # idx lane + 7, width 4
            torch.full((threads,), sum(1 << i for i in range(0, 32, 3))).to(torch.int32),  # ballot lane % 3 == 0
            torch.ones(threads, dtype=torch.int64),  # any lane == 31
            torch.zeros(threads, dtype=torch.int64),  # all lanes < 31
            torch.where(lane < 16, lane ^ 1, -1),  # xor 1 over the lower half-warp
        ],
        dim=1,
    ).to(torch.int32)
    assert torch.equal(got, expected)


def test_bf16_and_fp16_conversions_round_to_nearest_even_as_torch(emu):
    g = torch.Generator().manual_seed(0)
    # float16 subnormals and the ties around them, the largest normals, and where rounding overflows to infinity
    f16_tiny = torch.tensor([2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25, 65504.0, 65519.0])
    f16_tiny = torch.cat([f16_tiny, torch.tensor([65520.0])])
    edges = torch.cat([f16_tiny, -f16_tiny, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1.0, 3e38])])
    ties = torch.tensor([1.0 + k * 2.0**-8 for k in range(1, 8, 2)] + [1.0 + k * 2.0**-11 for k in range(1, 8, 2)])
    values = torch.cat([edges, ties, torch.randn(4000, generator=g) * torch.logspace(-9, 5, 4000)]).float()
    bf16, f16, back = emu.selftest_convert(values)
    assert torch.equal(bf16.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(f16.view(torch.int16), values.to(torch.float16).view(torch.int16))
    assert torch.equal(back[:, 0], bf16.float()) and torch.equal(back[:, 1], f16.float())
    nan_bf16, nan_f16, _ = emu.selftest_convert(torch.tensor([float("nan")]))
    assert torch.isnan(nan_bf16).all() and torch.isnan(nan_f16).all()
