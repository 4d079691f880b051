"""The harness itself: each detector reports the bug it exists for, and the emulated intrinsics compute what CUDA's
do (selftest_kernels.cuh holds one kernel per bug)."""

from __future__ import annotations

import pytest
import torch

from .client import SCHEDULES, EmuDevice, EmuError
from .conftest import CSRC, SMALL_SHARED_PER_BLOCK


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
        ("dynamic_shared_overflow", 32, "heap-buffer-overflow"),
        ("dynamic_shared_over_48k", 32, "49168 bytes of dynamic shared memory, over the kernel's maximum of 49152"),
        ("static_plus_dynamic_over_48k", 32, "exceed 48 KiB, and GRPO_ALLOW_DYNAMIC_SHARED did not allow the kernel"),
        ("dynamic_shared_over_device", 32, "the device refuses the launch: 232464 bytes of dynamic shared memory"),
        ("shared_overflow", 32, "out of bounds for type 'float \\[32\\]'|heap-buffer-overflow"),
        ("global_overflow", 32, "heap-buffer-overflow"),
    ],
)
def test_each_bug_is_reported(emu, kernel, threads, message):
    with pytest.raises(EmuError, match=message):
        emu.selftest_bug(kernel, threads)


def test_a_correct_launch_passes(emu):
    assert torch.equal(emu.selftest_bug("bounded", 64), torch.ones(64))


def test_dynamic_shared_memory_starts_as_nan(emu):
    # fresh per block, 0xff bytes (NaN), 16-byte aligned (the kernel asserts it)
    out = emu.selftest_bug("dynamic_shared_unwritten", 64)
    assert torch.equal(out.view(torch.int32), torch.full((64,), -1, dtype=torch.int32))


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


# Thread-block clusters and dynamic shared memory (selftest_kernels.cuh: cluster_exchange_kernel and the cluster bugs).
H100_SHARED = 232448
INVALID_VALUE = 1  # cudaErrorInvalidValue


def cluster_expected(n: int, clusters: int, threads: int, words: int) -> tuple[torch.Tensor, ...]:
    """What cluster_exchange_kernel writes for ``clusters`` clusters of ``n`` blocks (its comment in
    selftest_kernels.cuh): each block reads its ring neighbours' dynamic shared memory and its next one's tag."""
    block = torch.arange(clusters * n)
    rank = block % n
    next_block, prev_block = block - rank + (rank + 1) % n, block - rank + (rank + n - 1) % n
    i = torch.arange(words)
    right = next_block[:, None] * 65536 + (words - 1 - i)[None, :]
    left = prev_block[:, None] * 65536 + i[None, :]
    out = torch.stack([right, left], dim=2)
    info = torch.stack([rank, torch.full_like(rank, n), next_block * 65536], dim=1)
    t = torch.arange(threads)
    warp_first = t // 32 * 32
    lanes = torch.clamp(threads - warp_first, max=32)
    # sum over t's warp of (t' + b): lanes * b + the sum of the warp's thread ids
    warp_ids = lanes * warp_first + lanes * (lanes - 1) // 2
    sums = lanes[None, :] * block[:, None] + warp_ids[None, :]
    return out.int(), info.int(), sums.int()


def run_cluster(device, n, clusters, threads, words, *, grid_clusters=None, launch="cluster", allow=-1):
    grid = (grid_clusters or clusters) * n
    return device.selftest_cluster(n, grid, threads, words, clusters, launch, allow)


@pytest.mark.parametrize(
    ("n", "clusters", "threads", "words", "allow"),
    [
        (1, 3, 64, 100, -1),
        (2, 3, 48, 37, -1),  # a partial warp in every block
        (4, 2, 64, 200, -1),
        (8, 2, 32, 65, -1),
        (2, 2, 64, 16384, 16384 * 4),  # 64 KiB per block: over 48 KiB, allowed
        (8, 1, 64, 200 * 1024 // 4, 200 * 1024),  # 200 KiB per block
    ],
)
def test_cluster_exchanges_shared_memory_under_every_schedule(emu, n, clusters, threads, words, allow):
    codes, out, info, sums = run_cluster(emu, n, clusters, threads, words, allow=allow)
    assert codes.tolist() == [0, 0, 0]
    expected = cluster_expected(n, clusters, threads, words)
    for got, want in zip((out, info, sums), expected, strict=True):
        assert torch.equal(got, want)


def test_grid_stride_over_clusters_with_a_smaller_grid(emu):
    # 5 clusters of 2 on a grid of 2 clusters: each cluster's blocks loop, reusing their shared memory
    codes, out, info, sums = run_cluster(emu, 2, 5, 64, 50, grid_clusters=2)
    assert codes.tolist() == [0, 0, 0]
    for got, want in zip((out, info, sums), cluster_expected(2, 5, 64, 50), strict=True):
        assert torch.equal(got, want)


def test_an_ordinary_launch_takes_dynamic_shared_memory(emu):
    # GRPO_LAUNCH with shared_bytes: a cluster of one block (rank 0 of 1, cluster_sync a block barrier)
    codes, out, info, sums = run_cluster(emu, 1, 3, 64, 300, launch="plain")
    assert codes.tolist() == [0, 0, 0]
    for got, want in zip((out, info, sums), cluster_expected(1, 3, 64, 300), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("n", "words", "allow", "codes"),
    [
        (2, H100_SHARED // 4 + 1, -1, [0, INVALID_VALUE, INVALID_VALUE]),  # dynamic shared over the device
        (2, 8, H100_SHARED + 1, [INVALID_VALUE, 0, INVALID_VALUE]),  # an allowance over the device: its error
        # stays pending through the (successful) launch
    ],
)
def test_cluster_launch_returns_what_the_device_refuses(emu, n, words, allow, codes):
    got, out, info, sums = run_cluster(emu, n, 1, 32, words, allow=allow)
    assert got.tolist() == codes  # {allow, launch, cudaGetLastError() after}: the error, then taken
    if codes[1] != 0:  # not launched: the outputs as allocated (0xff bytes)
        assert (out == -1).all() and (info == -1).all() and (sums == -1).all()


def test_device_limits_come_from_the_device(emu, emu_small_shared):
    assert emu.selftest_device_limits().tolist() == [H100_SHARED, 8]
    assert emu_small_shared.selftest_device_limits().tolist() == [SMALL_SHARED_PER_BLOCK, 8]


def test_small_shared_device_refuses_what_an_h100_runs(emu, emu_small_shared):
    codes, *_ = run_cluster(emu_small_shared, 2, 1, 32, 1024)  # 4 KiB of dynamic shared memory
    assert codes.tolist() == [0, INVALID_VALUE, INVALID_VALUE]
    codes, out, info, sums = run_cluster(emu_small_shared, 8, 1, 32, 500)  # 2000 bytes + the 4-byte tag
    assert codes.tolist() == [0, 0, 0]
    for got, want in zip((out, info, sums), cluster_expected(8, 1, 32, 500), strict=True):
        assert torch.equal(got, want)
    # its static tag on top of all the device's bytes as dynamic shared memory: over the device, known only in the
    # kernel
    with pytest.raises(EmuError, match=f"exceed the device's {SMALL_SHARED_PER_BLOCK} bytes per block"):
        run_cluster(emu_small_shared, 2, 1, 32, SMALL_SHARED_PER_BLOCK // 4)


@pytest.mark.parametrize(
    ("kernel", "blocks", "message"),
    [
        ("missing_final_cluster_sync", 2, "use-after-poison(.|\n)*after all of that block's threads had exited"),
        ("map_after_exit", 2, r"cluster_map_shared onto block \(\d,0,0\) \(rank \d\), whose threads have all exited"),
        ("divergent_cluster_sync", 2, "divergent cluster_sync: this thread is at .* while others of its cluster"),
        ("early_exit_cluster_sync", 2, r"divergent cluster_sync: block \(1,0,0\) thread \(\d+,0,0\) exited while"),
        ("mixed_barriers", 2, r"deadlock in the cluster of blocks \(0..1,0,0\): .* block 0 thread 0 at __syncthreads"),
        ("map_global", 2, "the pointer is not in this block's shared memory"),
        ("map_rank_out_of_range", 4, "cluster_map_shared to rank 4, but the cluster has 4 blocks"),
        ("grid_not_multiple", 2, r"grid.x \(3\) is not a multiple of the cluster size \(2\)"),
        ("dynamic_shared_over_48k", 1, "49168 bytes of dynamic shared memory, over the kernel's maximum of 49152"),
        ("pending_error", 2, "left a refused launch's error pending"),
    ],
)
def test_each_cluster_bug_is_reported(emu, kernel, blocks, message):
    with pytest.raises(EmuError, match=message):
        emu.selftest_cluster_bug(kernel, blocks, 32)


@pytest.mark.parametrize(("n", "clusters", "rounds"), [(3, 2, 3), (2, 3, 5), (6, 2, 4), (16, 1, 3)])
def test_mbarrier_pushes_land_before_the_phase_completes(emu, n, clusters, rounds):
    """Every block of a cluster pushes into every block's inbox for several rounds (both parities' slots, each
    mbarrier over several phases) and sums what landed once its phase completes: the same sums under every schedule,
    including the forward and reverse ones, where a push lands only when no thread can run."""
    out = emu.selftest_mbarrier(n, clusters, rounds, 0)
    block = torch.arange(clusters * n)
    first = block - block % n  # each cluster's first block
    cluster_sum = (first * n + n * (n - 1) // 2) * 1000  # sum of b * 1000 over the cluster's blocks b
    want = cluster_sum[None, :] + n * torch.arange(rounds)[:, None]
    assert torch.equal(out, want.float())


def test_a_push_in_a_one_block_cluster_is_reported(emu):
    """st.async into a one-block cluster's own shared memory is undefined in PTX (Triton's verifier refuses it): the
    single-read pass gives a row that fits one block a kernel that pushes nothing."""
    with pytest.raises(EmuError, match="cluster_push in a launch without a cluster of at least 2 blocks"):
        emu.selftest_mbarrier(1, 2, 3, 0)


@pytest.mark.parametrize(
    ("bug", "message"),
    [
        (1, "cluster_push on no mbarrier|before a cluster barrier followed its initialization"),
        (2, r"exited with phase \d+ of its mbarrier begun: .* bytes landed that no arrival announced"),
        # a read before the pushes landed (stale bytes), or the next arrival while the phase still awaits its bytes
        (3, "differs between the|mbarrier_arrive_expect_tx on a phase that has all of its arrivals"),
        # a block that exits with its last phase begun: its peers' pushes land after it, or never
        (4, r"after all of its threads exited|exited with phase \d+ of its mbarrier begun"),
    ],
)
def test_each_mbarrier_bug_is_reported(emu, bug, message):
    with pytest.raises(EmuError, match=message):
        emu.selftest_mbarrier(4, 2, 3, bug)


def test_a_cluster_of_zero_blocks_or_over_8_without_the_attribute_or_over_16_is_a_bug(emu):
    with pytest.raises(EmuError, match="a cluster of 0 blocks"):
        emu.selftest_cluster(0, 2, 32, 8, 1, "cluster", -1)
    with pytest.raises(EmuError, match="cluster of 9 blocks, over the portable 8 without GRPO_ALLOW_NONPORTABLE"):
        emu.selftest_cluster_bug("divergent_cluster_sync", 9, 32)
    with pytest.raises(EmuError, match="a cluster of 17 blocks, over CUDA's maximum of 16"):
        run_cluster(emu, 17, 1, 32, 8, launch="nonportable")


@pytest.mark.parametrize(("n", "clusters", "words"), [(16, 2, 65), (9, 1, 100), (13, 3, 40)])
def test_nonportable_clusters_of_up_to_16_exchange_shared_memory(emu, n, clusters, words):
    codes, out, info, sums = run_cluster(emu, n, clusters, 32, words, launch="nonportable")
    assert codes.tolist() == [0, 0, 0]
    for got, want in zip((out, info, sums), cluster_expected(n, clusters, 32, words), strict=True):
        assert torch.equal(got, want)


def test_a_device_refuses_clusters_over_its_limit_and_its_occupancy_query_says_0():
    """A device that takes clusters of 4 (portable and not): a cluster of 8 (valid anywhere) is refused, and the
    occupancy query counts 0 such clusters."""
    device = EmuDevice(CSRC, schedules=SCHEDULES[:1], max_cluster=4)
    try:
        codes, *_ = run_cluster(device, 8, 1, 32, 8)
        assert codes.tolist() == [0, INVALID_VALUE, INVALID_VALUE]
        assert device.selftest_active_clusters(8, 32, 64, False).tolist() == [0, 0]
        assert device.selftest_active_clusters(16, 32, 64, True).tolist() == [0, 0]
        assert device.selftest_active_clusters(4, 32, 64, False).tolist()[1] > 0
    finally:
        assert not device.close()


@pytest.mark.parametrize(
    ("n", "threads", "shared", "limits", "active"),
    [
        # an H100: 233472 bytes per SM, 1 KiB reserved per block, 2048 threads, 16 SMs a GPC, 8 GPCs
        (16, 256, 50 * 1024, {}, 8 * (16 * 4 // 16)),  # 4 blocks an SM (shared memory)
        (16, 1024, 10 * 1024, {}, 8 * (16 * 2 // 16)),  # 2 blocks an SM (threads)
        (16, 256, 200 * 1024, {}, 8 * (16 * 1 // 16)),  # 1 block an SM
        (16, 256, 200 * 1024, {"gpc_sms": 15}, 0),  # 16 blocks of one SM each: no GPC holds them
        (5, 256, 60 * 1024, {"gpc_sms": 4}, 8 * (4 * 3 // 5)),
        (16, 128, 5 * 1024, {"shared_per_sm": 64 * 1024}, 8 * (16 * 10 // 16)),
    ],
)
def test_the_occupancy_query_counts_clusters_from_shared_memory_threads_and_gpcs(n, threads, shared, limits, active):
    device = EmuDevice(CSRC, schedules=SCHEDULES[:1], **limits)
    try:
        assert device.selftest_active_clusters(n, threads, shared, n > 8).tolist() == [0, active]
    finally:
        assert not device.close()


def test_the_occupancy_query_checks_the_launch(emu):
    with pytest.raises(EmuError, match="over the portable 8 without GRPO_ALLOW_NONPORTABLE_CLUSTER"):
        emu.selftest_active_clusters(12, 32, 64, False)


def test_an_allowance_must_leave_room_for_static_shared_memory(emu):
    # GRPO_ALLOW_DYNAMIC_SHARED(the whole device) for a kernel with a 4-byte static tag: cudaFuncSetAttribute fails
    try:
        with pytest.raises(EmuError, match="plus the kernel's 4 bytes of __shared__ variables exceed the device's"):
            run_cluster(emu, 2, 1, 32, 1000, allow=H100_SHARED)
    finally:  # the allowance lasts for the driver process (as cudaFuncSetAttribute's): set a valid one back
        run_cluster(emu, 1, 1, 32, 8, allow=48 * 1024)


def test_every_mutation_still_applies():
    """mutate.py's planted bugs name text of the repository's csrc/ that must occur exactly once (kernels change; the
    check must not silently stop applying). The repository's, not GRPO_EMU_CSRC's: under mutate.py that is a mutant."""
    from .mutate import MUTATIONS, REPO

    stale = [m.what for m in MUTATIONS if (REPO / "csrc" / m.file).read_text().count(m.old) != 1]
    assert not stale, f"mutations whose text is not in csrc/ exactly once: {stale}"
